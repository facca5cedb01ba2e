"""The operator's HTTP port against a running coordinator with real traffic: Prometheus text with stable
names, health, the JSON status API, relay polling, and the dashboard's assets."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import socket
import sys

import aiohttp
import pytest
from dashboard_data import make_traffic
from support import make_coordinator_dir, running_coordinator

from veriroll.coordinator import http as vhttp
from veriroll.coordinator.metrics import CoordinatorMetrics

# The operator contract (README "Metrics"): dashboards and alerts are built on these names.
STABLE_METRICS = {
    "veriroll_requests_total": "counter",
    "veriroll_rejections_total": "counter",
    "veriroll_accepted_groups_total": "counter",
    "veriroll_accepted_tokens_total": "counter",
    "veriroll_leases_issued_total": "counter",
    "veriroll_leases_expired_total": "counter",
    "veriroll_reward_errors_total": "counter",
    "veriroll_sandbox_kills_total": "counter",
    "veriroll_request_seconds": "histogram",
    "veriroll_verification_seconds": "histogram",
    "veriroll_queue_depth": "gauge",
    "veriroll_policy_version": "gauge",
    "veriroll_nodes": "gauge",
    "veriroll_trainer": "gauge",
    "veriroll_trainer_steps_total": "counter",
    "veriroll_relay_version": "gauge",
    "veriroll_relay_up": "gauge",
    "veriroll_open_leases": "gauge",
    "veriroll_trainer_staleness_samples": "gauge",
    "veriroll_store_writer_seconds_total": "counter",
    "veriroll_store_writer_ops_total": "counter",
    "veriroll_store_writer_batches_total": "counter",
    "veriroll_store_round_trips_total": "counter",
}


def run(coro):
    return asyncio.run(coro)


def sample(text: str, name: str, **labels) -> float | None:
    """The value of one Prometheus sample in ``text`` (labels must match exactly), or None."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = re.escape(name) + (r"\{" + re.escape(want) + r"\}" if labels else "") + r" (\S+)$"
    for line in text.splitlines():
        m = re.match(pattern, line)
        if m:
            return float(m.group(1))
    return None


async def get(port: int, path: str, session: aiohttp.ClientSession):
    async with session.get(f"http://127.0.0.1:{port}{path}") as r:
        return r.status, r.headers, await r.read()


@pytest.fixture()
def base(tmp_path):
    return make_coordinator_dir(tmp_path)


def test_metric_names_are_the_documented_ones():
    names = {name: m.kind for name, m in CoordinatorMetrics().registry.metrics.items()}
    assert names == STABLE_METRICS


def test_metrics_count_what_the_coordinator_accepted_and_refused(base):
    async def scenario():
        async with running_coordinator(base) as coord, aiohttp.ClientSession() as s:
            traffic = await make_traffic(coord)
            status, headers, body = await get(coord.http_port, "/metrics", s)
            assert status == 200 and headers["Content-Type"].startswith("text/plain")
            return traffic, body.decode()

    traffic, text = run(scenario())
    for name, kind in STABLE_METRICS.items():
        assert f"# TYPE {name} {kind}" in text
    assert sample(text, "veriroll_accepted_groups_total") == sum(traffic.accepted.values()) == 4
    assert sample(text, "veriroll_accepted_tokens_total") == sum(traffic.tokens.values())
    assert sample(text, "veriroll_rejections_total", reason="bad_logprobs") == 3
    assert sample(text, "veriroll_rejections_total", reason="wrong_group_size") == 1
    assert sample(text, "veriroll_rejections_total", reason="lease_unknown") == 1
    assert sample(text, "veriroll_nodes", standing="banned") == 1
    assert sample(text, "veriroll_nodes", standing="probation") == 2
    assert sample(text, "veriroll_queue_depth") == 4
    assert sample(text, "veriroll_open_leases") == 0
    assert sample(text, "veriroll_trainer", metric="reward") == pytest.approx(0.8)
    # The last trainer step's staleness histogram, as the trainer exports it.
    assert sample(text, "veriroll_trainer_staleness_samples", staleness="0") == 40 - 11
    assert sample(text, "veriroll_trainer_staleness_samples", staleness="2") == 4
    assert sample(text, "veriroll_request_seconds_count", method="SubmitGroup") == 9
    # The store's writer: every accepted group and issued lease was one of its ops; SQLite has no round trips.
    ops, batches = sample(text, "veriroll_store_writer_ops_total"), sample(text, "veriroll_store_writer_batches_total")
    assert ops >= sum(traffic.accepted.values()) + 1 and 1 <= batches <= ops
    wall, cpu = (sample(text, "veriroll_store_writer_seconds_total", clock=c) for c in ("wall", "cpu"))
    assert 0 < cpu <= wall * 1.05 + 0.01
    assert sample(text, "veriroll_store_round_trips_total") == 0


def test_healthz_answers_with_the_policy_version(base):
    async def scenario():
        async with running_coordinator(base) as coord, aiohttp.ClientSession() as s:
            return await get(coord.http_port, "/healthz", s)

    status, _, body = run(scenario())
    assert status == 200
    assert json.loads(body)["ok"] is True and json.loads(body)["policy_version"] == 0


def test_status_api_reports_nodes_rejections_throughput_and_trainer_history(base):
    async def scenario():
        async with running_coordinator(base) as coord, aiohttp.ClientSession() as s:
            traffic = await make_traffic(coord, spread_ms=5 * 60_000)
            status, headers, body = await get(coord.http_port, "/api/status", s)
            assert status == 200 and headers["Content-Type"].startswith("application/json")
            return traffic, json.loads(body)

    traffic, data = run(scenario())
    assert set(data) == {"time_ms", "verification", "summary", "policy", "nodes_by_standing", "nodes", "rejections",
                         "throughput", "staleness", "trainer", "trainer_history", "relays", "nodes_total", "sandbox"}
    assert data["sandbox"] is None  # arithmetic runs no model-written code (test_code_environment: the code env)
    assert data["nodes_total"] == 3
    assert data["verification"] == "off"  # the test directories run with intake.verify = false
    assert data["summary"]["accepted_groups"] == 4 and data["summary"]["nodes"] == 3
    assert data["nodes_by_standing"] == {"probation": 2, "trusted": 0, "banned": 1}
    by_name = {n["display_name"]: n for n in data["nodes"]}
    assert set(by_name) == set(traffic.nodes)
    for name, nid in traffic.nodes.items():
        node = by_name[name]
        assert node["node_id"] == nid
        assert node["accepted_groups"] == traffic.accepted[nid]
        assert node["credits"] == traffic.tokens[nid] == node["accepted_tokens"]
        assert node["rejections"] == traffic.rejected[nid]
        assert node["rejected"] == sum(traffic.rejected[nid].values())
    assert by_name["mallory"]["standing"] == "banned" and by_name["mallory"]["strikes"] == 3
    assert by_name["<b>bob</b>"]["strikes"] == 1

    timeline = data["rejections"]["timeline"]
    assert timeline["bucket_s"] == 10  # 5 minutes of history in at most 60 buckets
    assert len(timeline["buckets"]) >= 30
    steps = [b["t_ms"] for b in timeline["buckets"]]
    assert all(b - a == 10_000 for a, b in zip(steps, steps[1:], strict=False))
    totals: dict[str, int] = {}
    for b in timeline["buckets"]:
        for reason, n in b["counts"].items():
            totals[reason] = totals.get(reason, 0) + n
    assert totals == {"bad_logprobs": 3, "wrong_group_size": 1, "lease_unknown": 1}
    assert timeline["reasons"] == sorted(totals)
    assert data["rejections"]["by_reason"] == totals

    tput = data["throughput"]["buckets"]
    assert sum(b["groups"] for b in tput) == 4
    assert sum(b["tokens"] for b in tput) == sum(traffic.tokens.values())

    assert data["trainer_history"] == [{**h, "time_ms": int(h["time"] * 1000)} for h in traffic.history]
    assert data["staleness"]["source"] == "trainer" and data["staleness"]["steps"] == 12
    assert data["staleness"]["histogram"] == {"0": sum(40 - i for i in range(12)), "1": sum(20 + i for i in range(12)),
                                              "2": 48}
    assert data["trainer"]["reward"] == pytest.approx(0.8)
    assert data["policy"] == {"version": 0, "s_max": 2, "relays": []}


def _status_and_verifier(base, overrides=()):
    async def scenario():
        async with running_coordinator(base, overrides=overrides) as coord, aiohttp.ClientSession() as s:
            status, _, body = await get(coord.http_port, "/api/status", s)
            assert status == 200
            return json.loads(body), coord.service.verifier

    return run(scenario())


def test_verification_off_by_configuration_is_logged_and_shown_in_status(base, caplog):
    caplog.set_level(logging.WARNING, logger="veriroll.coordinator")
    data, verifier = _status_and_verifier(base, overrides=["intake.verify=false"])
    assert verifier is None
    assert data["verification"] == "off"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == "veriroll.coordinator"]
    assert any("verification is OFF by configuration (intake.verify = false)" in r.getMessage() for r in warnings)


def test_verification_on_runs_the_trusted_verifier_and_status_says_so(base, caplog):
    from veriroll.coordinator.verifier import TrustedVerifier

    caplog.set_level(logging.WARNING, logger="veriroll.coordinator")
    data, verifier = _status_and_verifier(base, overrides=["intake.verify=true"])
    assert isinstance(verifier, TrustedVerifier)
    assert data["verification"] == "on"
    assert not any("verification is OFF" in r.getMessage() for r in caplog.records)


def test_a_verifier_that_cannot_be_imported_stops_the_coordinator(base, monkeypatch):
    """Fail closed: no shape-only fallback, with verification on or off."""
    from veriroll.coordinator.app import start_coordinator

    monkeypatch.setitem(sys.modules, "veriroll.coordinator.verifier", None)  # import raises ImportError
    for verify in ("true", "false"):
        with pytest.raises(ImportError):
            run(start_coordinator(base, overrides=[f"intake.verify={verify}"]))
    assert not (base / "ports.json").exists()  # never got as far as serving


def test_staleness_falls_back_to_the_queue_before_the_trainer_steps(base):
    async def scenario():
        async with running_coordinator(base) as coord, aiohttp.ClientSession() as s:
            await make_traffic(coord, history_steps=0)
            _, _, body = await get(coord.http_port, "/api/status", s)
            return json.loads(body)

    data = run(scenario())
    assert data["trainer_history"] == []
    assert data["staleness"] == {"source": "queue", "steps": 0, "histogram": {"0": 4}}


def test_dashboard_page_and_assets_are_served_locally_with_a_strict_policy(base):
    async def scenario():
        async with running_coordinator(base) as coord, aiohttp.ClientSession() as s:
            out = {}
            for path in ("/", "/static/dashboard.js", "/static/dashboard.css", "/static/../http.py", "/static/nope.js"):
                out[path] = await get(coord.http_port, path, s)
            return out

    out = run(scenario())
    status, headers, body = out["/"]
    page = body.decode()
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert "script-src 'self'" in headers["Content-Security-Policy"]
    assert headers["X-Content-Type-Options"] == "nosniff"
    # No external network: every asset the page names is ours.
    refs = re.findall(r'(?:src|href)="([^"]+)"', page)
    assert refs and all(r.startswith("/") for r in refs), refs
    assert "<script>" not in page  # nothing inline: the policy forbids it
    assert out["/static/dashboard.js"][0] == 200
    assert "javascript" in out["/static/dashboard.js"][1]["Content-Type"]
    assert out["/static/dashboard.css"][0] == 200
    assert out["/static/../http.py"][0] in (403, 404)
    assert out["/static/nope.js"][0] == 404


@contextlib.asynccontextmanager
async def published_relay(tmp_path):
    """A shardcast origin relay holding version 1 of a small fake checkpoint."""
    from veriroll.protos.identity import write_keypair
    from veriroll.shardcast.publish import publish_checkpoint
    from veriroll.shardcast.relay import RelayServer

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    (ckpt / "model.safetensors").write_bytes(bytes(range(256)) * 1024)
    key = write_keypair(tmp_path / "relay-signer.key")
    publish_checkpoint(ckpt, tmp_path / "store", key, 1, shard_size=64 * 1024)
    async with RelayServer(tmp_path / "store", key.public, port=0) as relay:
        yield relay


def test_relays_are_polled_and_exported(tmp_path):
    async def scenario():
        async with published_relay(tmp_path) as relay:
            dead = "http://127.0.0.1:9"  # discard port: nothing listens
            base = make_coordinator_dir(tmp_path, {"shardcast.relays": [relay.url, dead]})
            async with running_coordinator(base) as coord, aiohttp.ClientSession() as s:
                for _ in range(100):
                    if len(coord.http_status.relays) == 2:
                        break
                    await asyncio.sleep(0.05)
                _, _, metrics = await get(coord.http_port, "/metrics", s)
                _, _, status = await get(coord.http_port, "/api/status", s)
                return relay.url, dead, metrics.decode(), json.loads(status)

    url, dead, text, data = run(scenario())
    assert sample(text, "veriroll_relay_version", relay=url) == 1
    assert sample(text, "veriroll_relay_up", relay=url) == 1
    assert sample(text, "veriroll_relay_version", relay=dead) == -1
    assert sample(text, "veriroll_relay_up", relay=dead) == 0
    relays = {r["url"]: r for r in data["relays"]}
    assert relays[url]["ok"] is True and relays[url]["versions"] == [1]
    assert relays[dead]["ok"] is False and relays[dead]["error"]


def test_configured_http_port_is_used_and_written_to_ports_json(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    base = make_coordinator_dir(tmp_path, {"server.http_port": port})

    async def scenario():
        async with running_coordinator(base) as coord:
            return coord.http_port, json.loads((base / "ports.json").read_text())

    http_port, ports = run(scenario())
    assert http_port == port == ports["http"]


def test_timeline_buckets_are_round_and_bounded():
    assert vhttp.bucket_size_s(0) == 10
    assert vhttp.bucket_size_s(600) == 10
    assert vhttp.bucket_size_s(601) == 30
    assert vhttp.bucket_size_s(86400) == 1800
    assert vhttp.bucket_size_s(400 * 86400) == 7 * 86400
    start, size = vhttp.timeline_bounds(123_456, 123_456 + 300_000)
    assert size == 10_000 and start == 120_000


def test_history_downsampling_keeps_the_newest_step():
    items = [{"step": i} for i in range(10_001)]
    out = vhttp.downsample(items, 2000)
    assert len(out) <= 2001 and out[0]["step"] == 0 and out[-1]["step"] == 10_000
    assert vhttp.downsample(items[:5], 2000) == items[:5]


def test_staleness_histogram_accepts_dicts_and_lists():
    hist = [{"staleness_hist": {"0": 3, "2": 1}}, {"staleness": [1, 1]}, {"staleness_hist": None}, {}]
    assert vhttp.staleness_from_history(hist) == {"0": 4, "1": 1, "2": 1}
    assert vhttp.staleness_from_history(hist, steps=2) == {}


def test_history_entries_get_milliseconds_for_the_time_axis():
    out = vhttp.normalize_history([{"step": 1, "time": 12.5}, {"step": 2, "time_ms": 7}, "junk", {"step": 3}])
    assert out == [{"step": 1, "time": 12.5, "time_ms": 12500}, {"step": 2, "time_ms": 7}, {"step": 3}]
    assert vhttp.normalize_history(None) == []


BAD_VALUES = ["nan", "NaN", "inf", "-inf", "Infinity", "-1", "0", "1e999", "9" * 400, "1e12", "abc", "", "0x10",
              "1;drop", "%00"]


def test_status_parameters_are_parsed_strictly_and_bad_ones_answer_400(base, caplog):
    """Issue 12: ``?window_s=nan`` answered 500 with a traceback. Every bad value is a 400 naming the parameter."""
    caplog.set_level(logging.DEBUG)

    async def scenario():
        answers = {}
        async with running_coordinator(base) as coord, aiohttp.ClientSession() as s:
            await make_traffic(coord)
            caplog.clear()
            for name in ("window_s", "points"):
                for value in BAD_VALUES + (["2.5", "2001"] if name == "points" else [str(366 * 86400)]):
                    answers[name, value] = await get(coord.http_port, f"/api/status?{name}={value}", s)
            answers["repeated"] = await get(coord.http_port, "/api/status?points=5&points=6", s)
            answers["good"] = await get(coord.http_port, "/api/status?window_s=0.5&points=1", s)
            answers["edges"] = await get(coord.http_port, f"/api/status?window_s={365 * 86400}&points=2000", s)
            answers["default"] = await get(coord.http_port, "/api/status?unrelated=nan", s)
        return answers

    answers = run(scenario())
    for key, (status, headers, body) in answers.items():
        if key in ("good", "edges", "default"):
            assert status == 200, (key, body[:300])
            continue
        assert status == 400 and headers["Content-Type"].startswith("application/json"), (key, status, body[:300])
        err = json.loads(body)
        name = "points" if key == "repeated" else key[0]
        assert err["parameter"] == name and name in err["error"], err
        assert err["allowed"] == ("an integer in [1, 2000]" if name == "points" else "a number in (0, 31536000]")
    good = json.loads(answers["good"][2])
    assert len(good["trainer_history"]) <= 1 and good["nodes_total"] == 3
    loud = [r for r in caplog.records if r.levelno > logging.INFO]
    assert not loud, [(r.name, r.getMessage()) for r in loud]


def test_status_lists_at_most_the_most_recent_nodes_with_a_total(base):
    """Issue 12: /api/status listed every node; it lists the MAX_LISTED_NODES most recently seen and counts all."""
    total = vhttp.MAX_LISTED_NODES + 50

    def fill(conn):
        conn.executemany("INSERT INTO nodes(node_id, public_key, registered_ms, last_seen_ms, hardware, standing, "
                         "display_name) VALUES(?, ?, 0, ?, ?, ?, ?)",
                         [(f"n{i:04d}", bytes([i % 256, i // 256]) * 16, 1000 + i,
                           json.dumps({"cpu": "c" * 100_000}),  # a row stored before the bounds existed
                           "banned" if i < 10 else "probation", "d" * 5000) for i in range(total)])

    async def scenario():
        async with running_coordinator(base) as coord, aiohttp.ClientSession() as s:
            await coord.db.run(fill)
            return await get(coord.http_port, "/api/status", s)

    status, _, body = run(scenario())
    assert status == 200 and len(body) < 200_000, len(body)
    data = json.loads(body)
    assert data["nodes_total"] == data["summary"]["nodes"] == total
    assert data["nodes_by_standing"] == {"probation": total - 10, "trusted": 0, "banned": 10}
    listed = [n["node_id"] for n in data["nodes"]]
    assert listed == [f"n{i:04d}" for i in range(total - 1, total - 1 - vhttp.MAX_LISTED_NODES, -1)]
    assert all(len(n["hardware"]["cpu"]) == 128 and len(n["display_name"]) == 64 for n in data["nodes"])
