"""The capacity planner: its arithmetic on hand-computed cases, its command line, its refusals."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest

from veriroll.cli.main import main
from veriroll.coordinator.plan import (
    DEFAULT_COSTS,
    Machine,
    PlanError,
    Workload,
    broadcast_time_s,
    load_costs,
    plan,
    staleness_distribution,
)

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def costs_with(**values: float) -> dict:
    costs = dict(DEFAULT_COSTS)
    for name, value in values.items():
        costs[name] = dataclasses.replace(costs[name], value=value)
    return costs


def small_workload(**changes) -> Workload:
    # 100 nodes, each making one 4 x 25-token group per second: 100 groups/s.
    w = Workload(model_params=1e11, nodes=100, tokens_per_sample=25, group_size=4, audit_fraction=0.5,
                 prompt_tokens=0, node_tokens_per_s=100.0, publish_every_s=60.0)
    return dataclasses.replace(w, **changes)


def test_staleness_spans_whole_and_partial_publish_intervals():
    assert staleness_distribution(30, 60) == {0: 0.5, 1: 0.5}
    assert staleness_distribution(120, 60) == {2: 1.0}
    dist = staleness_distribution(130, 60)
    assert set(dist) == {2, 3}
    assert dist[2] == pytest.approx(5 / 6) and dist[3] == pytest.approx(1 / 6)


def test_broadcast_time_is_stream_time_plus_one_shard_per_extra_level():
    costs = costs_with(relay_upload_bytes_per_s=160, relay_fanout=16, node_download_bytes_per_s=100, shard_bytes=100)
    # rate = min(160 / 16, 100) = 10 B/s; 256 nodes at fan-out 16: depth 2, 16 relays.
    seconds, depth, relays = broadcast_time_s(256, 1000, costs)
    assert (seconds, depth, relays) == (pytest.approx(1000 / 10 + 100 / 10), 2, 16)
    # Few enough nodes for the origin alone: one level, no relays.
    assert broadcast_time_s(10, 1000, costs) == (pytest.approx(100.0), 1, 0)


def test_plan_counts_edges_store_and_verifiers_by_hand():
    costs = costs_with(edge_s_per_group=0.01, edge_reference_tokens=100, store_commit_s=0.004, gpu_flops=2e14)
    p = plan(small_workload(), costs)
    assert p["groups_per_s"] == pytest.approx(100.0)
    assert p["generation_s_per_group"] == pytest.approx(1.0)
    assert p["edge_processes"] == 2  # 100 groups/s * 10 ms = 1.0 core, at 80% utilization
    assert p["store_writes_per_s"] == pytest.approx(200.0)
    assert p["store_commits_per_s"] == pytest.approx(200.0)
    # 100 groups/s * 100 tokens * 0.5 audited = 5,000 tokens/s at 2 * 1e11 / 2e14 = 1 ms each: 5 busy, 7 at 80%.
    assert p["audited_tokens_per_s"] == pytest.approx(5000.0)
    assert p["verify_s_per_token"] == pytest.approx(1e-3)
    assert p["verifier_devices"] == 7


def test_store_writers_far_from_the_store_need_edges_of_their_own_and_can_set_the_held_rate(capsys):
    """Each edge's one writer connection runs a round trip per statement: with PostgreSQL a network hop away,
    its wall time per group, not the edge's CPU, can decide how many edges the fleet needs."""
    costs = costs_with(edge_s_per_group=0.002, edge_reference_tokens=100, store_exec_s_per_group=0.001,
                       store_round_trips_per_group=3, store_s_per_round_trip=0.0, edge_s_per_heartbeat=0.0,
                       store_exec_s_per_heartbeat=0.0, store_round_trips_per_heartbeat=1)
    near = plan(small_workload(), costs)  # 100 groups/s: writers 1 ms per group, CPU 2 ms per group
    assert near["edge_writer_s_per_group"] == pytest.approx(0.001)
    assert near["edge_processes"] == 1 and near["bottleneck"] == "fleet"  # 0.2 cores, 0.1 writers busy
    far = plan(small_workload(store_rtt_s=0.003), costs)  # 1 + 3 * 3 = 10 ms per group, plus heartbeats
    heartbeats = 100 / 10.0 * 0.003  # 10 heartbeats/s, one 3 ms round trip each
    assert far["edge_writer_s_per_group"] == pytest.approx(0.010)
    assert far["edge_writers_busy"] == pytest.approx(100 * 0.010 + heartbeats)
    assert far["edge_processes"] == 2  # 1.03 writers busy, at 80%
    one = plan(small_workload(store_rtt_s=0.003), costs, Machine(edges=1))
    assert one["bottleneck"] == "edge_writers"
    assert one["predicted_groups_per_s"] == pytest.approx((1 - heartbeats) / 0.010)
    assert main(["plan", "--model-params", "1e11", "--nodes", "100", "--tokens-per-sample", "25", "--group-size",
                 "4", "--node-tokens-per-s", "100", "--store-rtt-ms", "5", "--edges", "1"]) == 0
    assert "set by the edges' store writers" in capsys.readouterr().out
    with pytest.raises(PlanError, match="--store-rtt-ms"):
        plan(small_workload(store_rtt_s=-0.001), costs)


def test_group_commit_shares_one_commit_among_waiting_writes():
    p = plan(small_workload(), costs_with(store_commit_s=0.01))
    assert p["store_commits_per_s"] == pytest.approx(100.0)
    assert p["store_writes_per_commit"] == pytest.approx(2.0)
    assert p["store_writer_busy"] == pytest.approx(1.0)


def test_deltas_shrink_the_version_by_the_delta_ratio():
    costs = costs_with(bytes_per_param=2, delta_ratio=0.05)
    whole = plan(small_workload(deltas=False), costs)
    delta = plan(small_workload(deltas=True), costs)
    assert whole["version_bytes"] == pytest.approx(2e11)
    assert delta["version_bytes"] == pytest.approx(1e10)
    assert delta["broadcast_s_to_95pct"] < whole["broadcast_s_to_95pct"]


def test_default_node_rate_is_bandwidth_bound_decoding():
    w = small_workload(model_params=7e9, node_tokens_per_s=None)
    p = plan(w, costs_with(node_memory_bandwidth=1e12, bytes_per_param=2))
    assert p["node_tokens_per_s"] == pytest.approx(4 * 1e12 / 14e9)
    assert p["weights_fit_node_gpu"] is True
    assert plan(dataclasses.replace(w, model_params=32e9))["weights_fit_node_gpu"] is False


def test_cli_prints_every_figure(capsys):
    assert main(["plan", "--model-params", "7e9", "--nodes", "2000", "--tokens-per-sample", "2048",
                 "--group-size", "16", "--audit-fraction", "0.1"]) == 0
    out = capsys.readouterr().out
    for words in ("edge processes:", "transactions/s with group commit", "verifier gpus:", "to 95% of nodes",
                  "staleness at one version every 60 s", "assumed, not measured here:"):
        assert words in out


def test_cli_json_has_the_planned_keys_and_cost_sources(capsys):
    assert main(["plan", "--model-params", "7e9", "--nodes", "2000", "--tokens-per-sample", "2048",
                 "--group-size", "16", "--audit-fraction", "0.1", "--publish-every-s", "30", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    for key in ("edge_processes", "verifier_devices", "store_writes_per_s", "store_commits_per_s",
                "broadcast_s_to_95pct", "staleness", "groups_per_s", "trainer_gpus"):
        assert key in data
    assert sum(data["staleness"].values()) == pytest.approx(1.0)
    assert data["costs"]["edge_s_per_group"]["measured"] is True
    assert data["costs"]["gpu_flops"]["measured"] is False


def test_costs_file_replaces_a_default(tmp_path, capsys):
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"edge_s_per_group": {"value": 0.1, "source": "my run"}}))
    assert main(["plan", "--model-params", "1e9", "--nodes", "100", "--tokens-per-sample", "64",
                 "--group-size", "8", "--node-tokens-per-s", "512", "--costs", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    # 100 groups/s at 0.1 s of CPU each: 10 busy cores, 13 at 80%.
    assert data["edge_processes"] == 13
    assert data["costs"]["edge_s_per_group"]["source"] == "my run"


@pytest.mark.parametrize("flag, value, message", [
    ("--nodes", "-5", "--nodes must be > 0"),
    ("--group-size", "0", "--group-size must be > 0"),
    ("--audit-fraction", "1.5", "--audit-fraction must be within [0, 1]"),
    ("--publish-every-s", "0", "--publish-every-s must be > 0"),
    ("--node-tokens-per-s", "nan", "--node-tokens-per-s must be > 0"),
    ("--verifier-device", "tpu", "--verifier-device must be gpu or cpu"),
    ("--utilization", "0", "--utilization must be within (0, 1]"),
    ("--s-max", "-1", "--s-max must be >= 0"),
])
def test_bad_input_is_refused_with_its_name(flag, value, message, capsys):
    args = ["plan", "--model-params", "7e9", "--nodes", "10", "--tokens-per-sample", "64", "--group-size", "8"]
    with pytest.raises(SystemExit) as exc:
        main(args + [flag, value])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_zero_bandwidth_in_a_costs_file_is_refused(tmp_path):
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"relay_upload_bytes_per_s": 0}))
    with pytest.raises(PlanError, match="relay_upload_bytes_per_s must be > 0"):
        plan(small_workload(), load_costs(path))


@pytest.mark.parametrize("content, message", [
    ('{"no_such_cost": 1}', "unknown cost 'no_such_cost'"),
    ('{"gpu_flops": -1}', "gpu_flops must be a finite number >= 0"),
    ('{"gpu_flops": "fast"}', "gpu_flops must be a finite number >= 0"),
    ("[1, 2]", "expected a JSON object"),
    ("{not json", "cannot read it as JSON"),
])
def test_malformed_costs_file_is_refused(tmp_path, content, message):
    path = tmp_path / "costs.json"
    path.write_text(content)
    with pytest.raises(PlanError, match=message.replace("[", r"\[").replace("(", r"\(")):
        load_costs(path)


def test_heartbeats_cost_edge_cpu_per_node_not_per_group():
    costs = costs_with(edge_s_per_group=0.005, edge_reference_tokens=100, edge_s_per_heartbeat=0.002)
    p = plan(small_workload(heartbeat_s=1.0), costs)
    # 100 nodes beating once a second at 2 ms: 0.2 cores; 100 groups/s at 5 ms: 0.5 cores.
    assert p["heartbeat_cores"] == pytest.approx(0.2)
    assert p["groups_per_s_one_edge"] == pytest.approx(0.8 / 0.005)
    assert p["edge_processes"] == 1  # 0.7 cores at 80%
    assert plan(small_workload(heartbeat_s=0.5), costs)["edge_processes"] == 2  # 0.9 cores


def test_groups_older_than_s_max_are_counted_as_refused():
    # 1 s of generation plus a broadcast of 1e10 bytes (5 nodes: one level) at min(1e9 / 10, 1e9) = 1e8 B/s:
    # 101 s; one version every 60 s: P(1) = 19/60, P(2) = 41/60.
    costs = costs_with(relay_upload_bytes_per_s=1e9, relay_fanout=10, node_download_bytes_per_s=1e9,
                       bytes_per_param=2, delta_ratio=0.05, shard_bytes=1)
    p = plan(small_workload(nodes=5), costs)
    assert p["staleness_span_s"] == pytest.approx(101.0)
    assert p["staleness"] == {"1": pytest.approx(19 / 60), "2": pytest.approx(41 / 60)}
    assert p["stale_refused_share"] == pytest.approx(0.0)
    assert plan(small_workload(nodes=5, s_max=1), costs)["stale_refused_share"] == pytest.approx(41 / 60)


def test_the_verifier_pool_adds_its_store_writes_per_audited_group(capsys):
    costs = costs_with(store_writes_per_audited_group=3)
    # 100 groups/s, half audited: 2 writes per group plus 3 per audited group = 200 + 150 writes/s.
    pooled = plan(small_workload(verifier_pool=True), costs)
    assert pooled["store_pool_writes_per_s"] == pytest.approx(150.0)
    assert pooled["store_writes_per_s"] == pytest.approx(350.0)
    assert plan(small_workload(), costs)["store_writes_per_s"] == pytest.approx(200.0)
    assert main(["plan", "--model-params", "7e9", "--nodes", "2000", "--tokens-per-sample", "2048",
                 "--group-size", "16", "--audit-fraction", "0.1", "--verifier-pool"]) == 0
    assert "of them the verifier pool's" in capsys.readouterr().out


def test_trainer_tokens_per_gpu_follow_its_flops_per_token():
    p = plan(small_workload(), costs_with(gpu_flops=8e14, trainer_flops_per_token_per_param=8))
    assert p["trainer_tokens_per_s_per_gpu"] == pytest.approx(8e14 / (8 * 1e11))


def busy_workload(**changes) -> Workload:
    # 1,000 nodes making one 4 x 25-token group every 2 s: 500 groups/s offered, no heartbeat cost below.
    return small_workload(nodes=1000, node_tokens_per_s=50.0, **changes)


def machine_costs(**values: float) -> dict:
    return costs_with(**{"edge_s_per_group": 0.005, "edge_reference_tokens": 100, "edge_s_per_heartbeat": 0.0,
                         "store_cpu_s_per_group": 0.002, "store_commit_s": 0.004, **values})


def test_a_dedicated_deployment_keeps_the_plan_and_holds_a_core_per_edge():
    costs = machine_costs()
    today = plan(busy_workload(), costs)
    dedicated = plan(busy_workload(), costs, Machine())
    assert {k: dedicated[k] for k in today} == today
    # 500 groups/s at 5 ms: 2.5 cores, 4 edges at 80%; four edges hold 4 / 5 ms = 800 groups/s.
    assert today["edge_processes"] == 4 and today["edges_deployed"] == 4
    assert today["groups_per_s_edges"] == pytest.approx(800.0)
    assert today["groups_per_s_host"] is None and today["groups_per_s_verifier"] is None
    assert (today["predicted_groups_per_s"], today["bottleneck"]) == (pytest.approx(500.0), "fleet")
    # Two edges: 2 / 5 ms = 400 groups/s, what scale.py's old min(offered, edges * one edge) gave.
    two = plan(busy_workload(), costs, Machine(edges=2))
    assert (two["predicted_groups_per_s"], two["bottleneck"]) == (pytest.approx(400.0), "edge_main_threads")
    assert two["predicted_groups_per_s"] == pytest.approx(2 * two["groups_per_s_one_edge"])


def test_shared_cores_bound_edges_that_share_them_with_the_store_and_other_load():
    # Two edges, PostgreSQL and 3 ms per group of other load on 2 cores: 2 / (5 + 2 + 3 ms) = 200 groups/s,
    # under the edges' own 400.
    p = plan(busy_workload(), machine_costs(),
             Machine(edges=2, cores=2, colocated=("store",), colocated_cpu_s_per_group=0.003))
    assert p["host_cpu_s_per_group"] == pytest.approx(0.010)
    assert p["groups_per_s_host"] == pytest.approx(200.0)
    assert (p["predicted_groups_per_s"], p["bottleneck"]) == (pytest.approx(200.0), "host_cpu")
    assert p["host_cores_busy"] == pytest.approx(500 * 0.010)
    # Without the store on the box: 2 / 8 ms = 250.
    assert plan(busy_workload(), machine_costs(), Machine(edges=2, cores=2, colocated_cpu_s_per_group=0.003)
                )["predicted_groups_per_s"] == pytest.approx(250.0)


def test_one_edge_on_a_roomy_host_is_bound_by_its_own_core():
    # 8 cores, 7 ms per group with the store: 1,143 groups/s; one edge holds 1 / 5 ms = 200.
    p = plan(busy_workload(), machine_costs(), Machine(edges=1, cores=8, colocated=("store",)))
    assert p["groups_per_s_host"] == pytest.approx(8 / 0.007)
    assert (p["predicted_groups_per_s"], p["bottleneck"]) == (pytest.approx(200.0), "edge_main_threads")


def test_heartbeats_take_their_cores_from_the_edges_and_the_host():
    costs = machine_costs(edge_s_per_heartbeat=0.001)
    # 1,000 nodes beating every 10 s at 1 ms: 0.1 cores.
    p = plan(busy_workload(heartbeat_s=10.0), costs, Machine(edges=2, cores=2))
    assert p["groups_per_s_edges"] == pytest.approx(1.9 / 0.005)
    assert p["groups_per_s_host"] == pytest.approx(1.9 / 0.005)


def test_a_cpu_verifier_on_the_edges_cores_costs_its_prefills():
    # Half of the groups audited, 100 tokens each, at 2 * 1e11 / 4e13 = 5 ms per token: 0.25 s per group.
    w = busy_workload(verifier_device="cpu")
    p = plan(w, machine_costs(cpu_verify_flops=4e13), Machine(edges=2, cores=2, colocated=("verifier",)))
    assert p["host_cpu_s_per_group"] == pytest.approx(0.005 + 0.25)
    assert p["bottleneck"] == "host_cpu"
    with pytest.raises(PlanError, match="--colocate verifier needs --verifier-device cpu"):
        plan(busy_workload(), machine_costs(), Machine(cores=2, colocated=("verifier",)))


def test_few_verifier_devices_or_a_slow_store_set_the_held_rate():
    # 100 tokens * 0.5 audited at 1 ms per token: 0.05 device-seconds per group; 10 devices hold 200/s.
    p = plan(busy_workload(), machine_costs(gpu_flops=2e14), Machine(verifier_devices=10))
    assert (p["predicted_groups_per_s"], p["bottleneck"]) == (pytest.approx(200.0), "verifier")
    # 2 writes per group, at most 8 writes per commit, 40 ms per commit: 100 groups/s.
    p = plan(busy_workload(), machine_costs(store_writes_per_commit_max=8, store_commit_s=0.04))
    assert (p["predicted_groups_per_s"], p["bottleneck"]) == (pytest.approx(100.0), "store_writes")


def test_cli_machine_flags_set_the_held_rate(capsys):
    args = ["plan", "--model-params", "1e9", "--nodes", "1000", "--tokens-per-sample", "64", "--group-size", "8",
            "--node-tokens-per-s", "256", "--audit-fraction", "0"]
    # 500 groups/s offered at the default 3.7 ms per edge and 1.3 ms of PostgreSQL per group.
    assert main([*args, "--edges", "2", "--cores", "2", "--colocate", "store", "--colocated-cpu-s-per-group",
                 "0.0015", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    per_group = DEFAULT_COSTS["edge_s_per_group"].value + DEFAULT_COSTS["store_cpu_s_per_group"].value + 0.0015
    heartbeat_cores = 1000 / 10 * DEFAULT_COSTS["edge_s_per_heartbeat"].value
    assert data["host_cpu_s_per_group"] == pytest.approx(per_group)
    assert data["predicted_groups_per_s"] == pytest.approx((2 - heartbeat_cores) / per_group)
    assert data["bottleneck"] == "host_cpu" and data["edges_deployed"] == 2 and data["host_cores"] == 2
    assert main([*args, "--edges", "2", "--cores", "1"]) == 0
    assert "set by the CPU of the host the edges share" in capsys.readouterr().out


@pytest.mark.parametrize("extra, message", [
    (["--cores", "0"], "--cores must be > 0"),
    (["--edges", "0"], "--edges must be >= 1"),
    (["--verifier-devices", "0"], "--verifier-devices must be >= 1"),
    (["--cores", "2", "--colocate", "trainer"], "--colocate: unknown part trainer"),
    (["--colocate", "store"], "--colocate and --colocated-cpu-s-per-group need --cores"),
    (["--cores", "2", "--colocated-cpu-s-per-group", "-1"], "--colocated-cpu-s-per-group must be >= 0"),
])
def test_bad_machine_flags_are_refused_with_their_name(extra, message, capsys):
    args = ["plan", "--model-params", "7e9", "--nodes", "10", "--tokens-per-sample", "64", "--group-size", "8"]
    with pytest.raises(SystemExit) as exc:
        main(args + extra)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def scale_benchmark():
    spec = importlib.util.spec_from_file_location("scale_benchmark", BENCHMARKS / "scale.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_scale_benchmark_predicts_from_the_unit_costs_of_its_own_run(monkeypatch):
    scale = scale_benchmark()
    monkeypatch.setattr(scale.os, "cpu_count", lambda: 2)
    args = argparse.Namespace(think_s=1.0, think_sigma=0.0, group_size=8, tokens=64, heartbeat_s=5.0)
    # 600 nodes at 1 s: 600 groups/s offered; the run held 200 on PostgreSQL with 2 edges at 1.0 cores
    # (5 ms per group), clients 0.3 cores (1.5 ms), PostgreSQL 0.3 (1.5 ms), other tenants 0.4 cores.
    run = {"nodes": 600, "submissions_per_s": 200.0, "heartbeats_per_s": 40.0, "client_cpu_cores": 0.3,
           "other_cores": 0.4,
           "coordinator": {"cpu_ms_per_group": 5.0, "cpu_cores": 1.0, "main_thread_cores": 0.6},
           "deployment": {"store": "postgresql", "roles": ["edge", "edge"], "store_cores": 0.3}}
    p = scale.deployment_plan(run, args, 2, 4.0, cores=scale.cores_left(run))
    assert p["groups_per_s"] == pytest.approx(600.0)
    assert p["host_cpu_s_per_group"] == pytest.approx(0.008)
    assert (p["predicted_groups_per_s"], p["bottleneck"]) == (pytest.approx(1.6 / 0.008), "host_cpu")
    # A core per edge, the same costs: 2 / 5 ms.
    assert scale.deployment_plan(run, args, 2, 4.0, cores=None)["predicted_groups_per_s"] == pytest.approx(400.0)
    figures = scale.deployment_figures(run | {"offered_submissions_per_s": 600.0, "held_fraction": 0.33,
                                              "latency": {}, "error_fraction": 0.0, "errors": {},
                                              "error_examples": {}, "unfinished_nodes": 0, "load_avg": 2.0},
                                       args, 2, 4.0)
    assert figures["predicted_ratio"] == pytest.approx(1.0)
    assert figures["predicted_idle_machine_groups_per_s"] == pytest.approx(250.0)  # 2 cores / 8 ms
    # The second edge's gain on the idle machine: 250 against one edge's 1 / 5 ms = 200.
    assert scale.edge_scaling_cpu_bound(run, args, 4.0) == pytest.approx(1.25)
    # Out of sample: a run that held 150 groups/s with 1.2 cores left to it, predicted from the costs above.
    other = dict(run, nodes=900, submissions_per_s=150.0, other_cores=0.8)
    assert scale.predicted_from(run, other, args, 2, 4.0) == {"predicted_groups_per_s": 150.0,
                                                            "predicted_ratio": 1.0}
    # Cores the hypervisor took (steal) are gone as other tenants' are: the same 1.2 cores left.
    stolen = dict(run, nodes=900, submissions_per_s=150.0, other_cores=0.3, steal_cores=0.5)
    assert scale.cores_left(stolen) == pytest.approx(1.2)
    assert scale.predicted_from(run, stolen, args, 2, 4.0) == {"predicted_groups_per_s": 150.0,
                                                             "predicted_ratio": 1.0}
    # The store writers' measured wall time per group (heartbeats' writes in it) replaces the default costs'
    # execution plus round trips: 12 ms a group on each of 2 writers holds 166.7 groups/s, under the host's 200.
    timed = dict(run, store_writer={"wall_ms_per_group": 12.0, "round_trips_per_group": 6.0})
    p = scale.deployment_plan(timed, args, 2, 4.0, cores=scale.cores_left(timed))
    assert p["edge_writer_s_per_group"] == pytest.approx(0.012)
    assert (p["predicted_groups_per_s"], p["bottleneck"]) == (pytest.approx(2 / 0.012), "edge_writers")
    # On SQLite the writer runs its statements itself: the same wall time, no round trips.
    sqlite = dict(timed, store_writer={"wall_ms_per_group": 12.0, "round_trips_per_group": None},
                  deployment={"store": "sqlite", "roles": ["all"], "store_cores": None})
    assert scale.deployment_plan(sqlite, args, 1, 4.0, cores=None)["edge_writer_s_per_group"] == pytest.approx(0.012)
    # What the default costs put it at, for comparison: execution and 50 us per round trip, 0.2 heartbeats a group.
    assert scale.default_writer_ms_per_group(run) == pytest.approx(0.5 + 2.2 * 0.05 + 0.2 * (0.07 + 1.1 * 0.05))


def test_the_scale_benchmark_reads_the_store_writers_work_over_its_window():
    scale = scale_benchmark()
    # Two edges' writers over a 10 s window in which 1,000 groups were accepted.
    before = [{"wall_s": 1.0, "cpu_s": 0.5, "ops": 100, "batches": 10, "round_trips": 400},
              {"wall_s": 2.0, "cpu_s": 1.0, "ops": 200, "batches": 20, "round_trips": 800}]
    after = [{"wall_s": 7.0, "cpu_s": 1.5, "ops": 1600, "batches": 110, "round_trips": 3400},
             {"wall_s": 6.0, "cpu_s": 2.0, "ops": 1700, "batches": 220, "round_trips": 3800}]
    assert scale.writer_figures(before, after, 10.0, 1000) == {
        "busy_fraction": 0.5, "wall_ms_per_group": 10.0, "cpu_ms_per_group": 2.0, "ops_per_group": 3.0,
        "ops_per_transaction": 10.0, "round_trips_per_group": 6.0}
    # SQLite: no round trips; nothing accepted or an edge that did not answer /metrics: no figures.
    sqlite = [{k: v for k, v in d.items() if k != "round_trips"} for d in (before[0], after[0])]
    assert scale.writer_figures([sqlite[0]], [sqlite[1]], 10.0, 1000)["round_trips_per_group"] is None
    assert scale.writer_figures(before, after, 10.0, 0) is None
    assert scale.writer_figures([before[0], {}], after, 10.0, 1000) is None
