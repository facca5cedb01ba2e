"""``veriroll testnet``: the whole network on one machine, as separate processes on loopback.

Starts the coordinator (trainer, verifier, origin relay), a chain of relays, honest nodes and
adversarial nodes; trains until the target reward (or ``--steps``); shows a live table; writes a run
directory with every process's log, the metrics history, a reward-curve PNG and ``summary.json``; prints
a dozen lines for a person at the end (``--json``: the summary as one JSON line instead).

``--wan 'rtt=100ms,down=100mbit,up=20mbit'`` puts every host behind an emulated link
(``veriroll.deploy.wan``, one proxy process): the coordinator (its gRPC port and origin relay), each relay
and each node (``--wan-node 2=...`` gives node 2 its own). Every connection, node to coordinator, node
to relay, relay to upstream, goes through the links of both ends. ``--nat-nodes K`` marks K honest
nodes as behind NAT: nothing may connect to them, so they are never given out as relays or peers.

The summary reports how each version spread (``broadcast``: seconds from publishing until 50, 95 and
100 % of the honest nodes held it), the origin's bytes per version, the staleness histogram of the samples
trained on, and groups/s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from veriroll.coordinator import store as st
from veriroll.deploy.topology import TestnetConfig, load_topology
from veriroll.deploy.wan import parse_profile
from veriroll.shardcast.store import READY_NAME, is_ready

# Refusals an honest node can meet without doing anything wrong (a slow node, a restart, a full queue).
HONEST_PAYLOAD_KINDS = {"claimed-rewards", "replay"}
BENIGN_REASONS = {"lease_expired", "stale_version", "clock_skew", "rate_limited", "unavailable", "internal"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(address: str, timeout: float = 30) -> None:
    host, _, port = address.rpartition(":")
    deadline = time.time() + timeout
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            return
        except OSError:
            if time.time() > deadline:
                raise RuntimeError(f"nothing listens on {address}") from None
            time.sleep(0.1)


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path
    role: str
    node_id: str = ""
    adversary: str = ""
    behind_nat: bool = False


@dataclass
class WanPlan:
    """Which emulated link each host sits behind (``--wan``, ``--wan-node``) and how many nodes are behind NAT."""

    profile: str
    per_node: dict[int, str] = field(default_factory=dict)  # node number (1-based) → its own profile
    nat_nodes: int = 0

    def of_node(self, number: int) -> str:
        return self.per_node.get(number, self.profile)


def wan_spec(plan: WanPlan, grpc_port: int, origin_port: int, relay_ports: dict[str, int],
             upstreams: dict[str, str | list[str]], nodes: list[str], leaves: list[str],
             swarm_ports: dict[str, int] | None = None) -> dict:
    """The proxy's links and routes (``veriroll.deploy.wan``): a link per host, a route per (client, server).

    The coordinator's host carries its gRPC port and the origin relay. ``upstreams`` names what each relay
    mirrors from ('origin' or a relay, or a list of them: its upstream and fallbacks); ``leaves`` the relays
    nodes fetch from, in order. Routes listen on
    free ports chosen here. ``swarm_ports``: each serving node's libp2p port, reached by other nodes through
    a route over the serving node's link (route ``NODE->swarm``; the dialling node's own line is not applied
    to peer traffic: one route per serving node, whoever dials).
    """
    server_port = {"origin": origin_port, **relay_ports}
    host_of = {"origin": "coordinator", **{r: r for r in relay_ports}}
    links = {"coordinator": plan.profile, **{r: plan.profile for r in relay_ports},
             **{n: plan.of_node(i + 1) for i, n in enumerate(nodes)}}
    routes = [{"name": f"{r}->{up}", "listen": f"127.0.0.1:{free_port()}", "target": f"127.0.0.1:{server_port[up]}",
               "client": r, "server": host_of[up]}
              for r, ups in upstreams.items() for up in ([ups] if isinstance(ups, str) else ups)]
    for n in nodes:
        routes.append({"name": f"{n}->grpc", "listen": f"127.0.0.1:{free_port()}", "target": f"127.0.0.1:{grpc_port}",
                       "client": n, "server": "coordinator"})
        routes += [{"name": f"{n}->{r}", "listen": f"127.0.0.1:{free_port()}", "target": f"127.0.0.1:{relay_ports[r]}",
                    "client": n, "server": r} for r in leaves]
    for n, port in (swarm_ports or {}).items():
        routes.append({"name": f"{n}->swarm", "listen": f"127.0.0.1:{free_port()}", "target": f"127.0.0.1:{port}",
                       "server": n})
    return {"links": links, "routes": routes}


def route_address(spec: dict, name: str) -> str:
    return next(r["listen"] for r in spec["routes"] if r["name"] == name)


@dataclass
class Testnet:
    cfg: TestnetConfig
    run_dir: Path
    wan: WanPlan | None = None
    swarm: bool = False  # honest nodes not behind NAT serve each other shards over libp2p (node swarm_listen)
    procs: list[Proc] = field(default_factory=list)
    veriroll: str = str(Path(sys.executable).parent / "veriroll")

    @property
    def coord_dir(self) -> Path:
        return self.run_dir / "coordinator"

    def _env(self, threads: int) -> dict:
        return dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1",
                    TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")

    def spawn(self, name: str, args: list[str], role: str, threads: int = 1, program: list[str] | None = None,
              **extra) -> Proc:
        log = self.run_dir / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        fh = open(log, "ab")  # noqa: SIM115 - handed to the child, closed when we stop
        popen = subprocess.Popen([*(program or [self.veriroll]), *args], stdout=fh, stderr=subprocess.STDOUT,
                                 env=self._env(threads), start_new_session=True)
        proc = Proc(name, popen, log, role, **extra)
        self.procs.append(proc)
        return proc

    def init_coordinator(self, origin_port: int, relay_urls: list[str]) -> dict:
        sets = {"server.port": 0, "server.http_port": 0, "shardcast.origin_port": origin_port,
                "shardcast.relays": json.dumps(relay_urls), "shardcast.shard_bytes": 1 << 20,
                "trainer.max_steps": self.cfg.steps, "trainer.target_reward": 0.0 if self.cfg.steps else self.cfg.target_reward,
                # Every node of the local testnet connects from loopback: one address, many identities.
                "identity.exempt_networks": json.dumps(["127.0.0.0/8", "::1/128"]),
                "shardcast.max_transfers_per_address": 0, "shardcast.max_connections_per_address": 0,
                # Loopback bandwidth is free: a delta would cost the publisher seconds and save nothing.
                "shardcast.deltas": "false",
                **self.cfg.coordinator}
        args = [self.veriroll, "coordinator", "init", "--dir", str(self.coord_dir), "--preset", self.cfg.preset, "--json"]
        for k, v in sets.items():
            args += ["--set", f"{k}={v}"]
        out = subprocess.run(args, capture_output=True, text=True, env=self._env(1), check=False)
        if out.returncode != 0:
            raise RuntimeError(f"coordinator init failed:\n{out.stderr[-2000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])

    def wait_ports(self, proc: Proc, timeout: float = 300) -> dict:
        path = self.coord_dir / "ports.json"
        deadline = time.time() + timeout
        while time.time() < deadline:
            if path.exists():
                return json.loads(path.read_text())
            if proc.popen.poll() is not None:
                raise RuntimeError(f"coordinator exited with {proc.popen.returncode}; see {proc.log}")
            time.sleep(0.2)
        raise RuntimeError("coordinator did not start in time")

    def start(self) -> dict:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        origin_port = free_port()
        relay_ports = {r.name: free_port() for r in self.cfg.relays}
        urls = {"origin": f"http://127.0.0.1:{origin_port}"} | {n: f"http://127.0.0.1:{p}" for n, p in relay_ports.items()}
        leaf_names = [r.name for r in reversed(self.cfg.relay_order())]
        leaves = [urls[n] for n in leaf_names]
        info = self.init_coordinator(origin_port, leaves)
        coord = self.spawn("coordinator", ["coordinator", "run", "--dir", str(self.coord_dir)], "coordinator")
        ports = self.wait_ports(coord)
        pub = str(self.coord_dir / "coordinator.key.pub")
        kinds = [""] * self.cfg.honest_nodes + list(self.cfg.adversaries)
        names = [f"node-{i + 1}" + (f"-{kind}" if kind else "") for i, kind in enumerate(kinds)]
        sources_of = {r.name: [urls[u] for u in r.sources] for r in self.cfg.relays}
        grpc_of = {n: f"127.0.0.1:{ports['grpc']}" for n in names}
        relays_of = {n: leaves for n in names}
        nat = set(names[: min(self.wan.nat_nodes, self.cfg.honest_nodes)] if self.wan else [])
        # Behind NAT nothing can dial in, and this testnet starts no circuit relay (`relay run --swarm-listen`,
        # node `swarm_relays`; tests/shardcast/test_swarm.py runs one): NAT nodes run no
        # swarm (relays only).
        swarm_ports = {n: free_port() for n, kind in zip(names, kinds, strict=True) if not kind} if self.swarm else {}
        swarm_at = {n: f"/ip4/127.0.0.1/tcp/{p}" for n, p in swarm_ports.items()}
        if self.wan is not None:
            spec = wan_spec(self.wan, ports["grpc"], origin_port, relay_ports,
                            {r.name: r.sources for r in self.cfg.relays}, names, leaf_names,
                            {n: p for n, p in swarm_ports.items() if n not in nat})
            spec["nat"] = names[: min(self.wan.nat_nodes, self.cfg.honest_nodes)]
            (self.run_dir / "wan.json").write_text(json.dumps(spec, indent=1))
            self.spawn("wan", ["--spec", str(self.run_dir / "wan.json")], "wan",
                       program=[sys.executable, "-m", "veriroll.deploy.wan"])
            wait_listening(route_address(spec, spec["routes"][-1]["name"]))
            sources_of = {r.name: [f"http://{route_address(spec, f'{r.name}->{u}')}" for u in r.sources]
                          for r in self.cfg.relays}
            grpc_of = {n: route_address(spec, f"{n}->grpc") for n in names}
            relays_of = {n: [f"http://{route_address(spec, f'{n}->{r}')}" for r in leaf_names] for n in names}
            announce = {n: "/ip4/{}/tcp/{}".format(*route_address(spec, f"{n}->swarm").split(":"))
                        for n in swarm_ports if n not in nat}
        else:
            announce = {}
        for r in self.cfg.relay_order():
            self.spawn(r.name, ["relay", "run", "--store", str(self.run_dir / r.name), "--port", str(relay_ports[r.name]),
                                "--coordinator-key", pub, "--upstream", sources_of[r.name][0], "--poll-interval", "1",
                                *(a for url in sources_of[r.name][1:] for a in ("--fallback-upstream", url)),
                                # every node of the local testnet fetches from loopback: one address
                                "--max-transfers-per-address", "0", "--max-connections-per-address", "0"], "relay")
        from veriroll.protos.identity import write_keypair

        for name, kind in zip(names, kinds, strict=True):
            key = self.run_dir / name / "node.key"
            node_id = write_keypair(key, force=True).node_id
            args = ["node", "run", "--coordinator", grpc_of[name], "--ca", str(self.coord_dir / "tls" / "ca.crt"),
                    "--key", str(key), "--coordinator-key", pub, "--cache-dir", str(self.run_dir / name / "cache"),
                    "--threads", str(self.cfg.node_threads), "--display-name", name, "--heartbeat-s", "2",
                    "--status-file", str(self.run_dir / name / "status.json")]
            for url in relays_of[name]:
                args += ["--relay", url]
            if kind:
                args += ["--adversary", kind]
            if name in swarm_at and name not in nat:
                args += ["--set", f"swarm_listen={swarm_at[name]}"]
                if name in announce:  # over the WAN, other nodes dial it through its link
                    args += ["--set", f"swarm_announce=[\"{announce[name]}\"]"]
            self.spawn(name, args, "adversary" if kind else "node", threads=self.cfg.node_threads, node_id=node_id,
                       adversary=kind, behind_nat=name in nat)
        return {"ports": ports, "init": info, "relays": urls}

    def stop(self) -> None:
        """SIGTERM to every process (each in a session of its own, so its whole group), then up to 20 s for
        them to exit, SIGKILL past that. A stop signal meanwhile kills the rest at once: it must not cut this
        short, which would leave them running with nobody to stop them."""
        previous = _take_stop_signals(lambda _signum, _frame: self._kill_all())
        try:
            for p in reversed(self.procs):
                if p.popen.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.popen.pid, signal.SIGTERM)
            deadline = time.time() + 20
            for p in self.procs:
                try:
                    p.popen.wait(timeout=max(0.1, deadline - time.time()))
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.popen.pid, signal.SIGKILL)
                    p.popen.wait()
        finally:
            _restore_signals(previous)

    def _kill_all(self) -> None:
        for p in self.procs:
            if p.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.popen.pid, signal.SIGKILL)

    # --- observing ---------------------------------------------------------------------------------

    def broadcast_watch(self, origin_url: str = "") -> BroadcastWatch:
        # Honest nodes only: an adversary is banned sooner or later and stops fetching.
        nodes = {p.name: self.run_dir / p.name / "cache" for p in self.procs if p.role == "node"}
        return BroadcastWatch(self.coord_dir / "shardcast", nodes, origin_url)

    def snapshot(self) -> dict:
        """What the coordinator's database says now (read-only; the coordinator keeps writing)."""
        path = self.coord_dir / "state.db"
        if not path.exists():
            return {}
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
        conn.row_factory = sqlite3.Row
        try:
            snap = st.observer_snapshot(conn)
        except sqlite3.Error:
            return {}
        finally:
            conn.close()
        return {**snap, "history": snap["kv"].get("trainer_history") or []}

    def summary(self, snap: dict, wall_s: float, watch: BroadcastWatch | None = None) -> dict:
        by_node_name = {p.node_id: p for p in self.procs if p.node_id}
        rejections_by_reason: dict[str, int] = {}
        rejections_by_node: dict[str, dict[str, int]] = {}
        honest_rejected = 0
        for node_id, reasons in snap.get("rejections", {}).items():
            for reason, n in reasons.items():
                rejections_by_reason[reason] = rejections_by_reason.get(reason, 0) + n
            if node_id:
                proc = by_node_name.get(node_id)
                rejections_by_node[proc.name if proc else node_id] = dict(reasons)
                if proc is not None and not proc.adversary:
                    honest_rejected += sum(n for r, n in reasons.items() if r not in BENIGN_REASONS)
        # claimed-rewards and replay submit honest groups on purpose (the attack is in the wrapping), so
        # their accepted groups are no breach; every other adversary's accepted group would be one.
        adversarial_accepted = sum(n["accepted_groups"] for nid, n in snap.get("nodes", {}).items()
                                   if by_node_name.get(nid) is not None and by_node_name[nid].adversary
                                   and by_node_name[nid].adversary not in HONEST_PAYLOAD_KINDS)
        history = snap.get("history", [])
        final_reward = history[-1].get("reward_running", history[-1].get("reward")) if history else snap.get("recent_reward", 0.0)
        first_reward = history[0].get("reward") if history else None
        return {
            "steps": int(snap.get("kv", {}).get("trainer_step", 0)),
            "first_reward": None if first_reward is None else round(float(first_reward), 4),
            "final_reward": round(float(final_reward or 0.0), 4),
            "accepted_groups": int(snap.get("accepted_groups", 0)),
            "rejections_by_reason": rejections_by_reason,
            "rejections_by_node": rejections_by_node,
            "honest_rejected": honest_rejected,
            "adversarial_accepted": adversarial_accepted,
            "wall_s": round(wall_s, 1),
            "policy_version": int(snap.get("kv", {}).get("policy_version", 0)),
            "groups_per_s": round(int(snap.get("accepted_groups", 0)) / wall_s, 3) if wall_s > 0 else 0.0,
            "staleness_hist": staleness_histogram(history),
            "broadcast": watch.report() if watch else {},
            "origin_bytes_by_version": {str(v): n for v, n in sorted(watch.origin_bytes.items())} if watch else {},
            "wan": self.wan.profile if self.wan else None,
            "swarm": self.swarm,
            "wan_per_node": {str(k): v for k, v in self.wan.per_node.items()} if self.wan else {},
            "nat_nodes": [p.name for p in self.procs if p.behind_nat],
            "run_dir": str(self.run_dir),
        }

    def settle(self, watch: BroadcastWatch, limit_s: float) -> tuple[int, list[str], list[str]]:
        """Wait (at most ``limit_s``) until every honest node holds the last version published (fetched,
        checked, ready in its cache), and every adversary has had something judged (a refusal counted
        against it, or a group accepted): a run that stopped right after its last step would report
        nothing of how that version spread, nor of an adversary still loading its model when the honest
        nodes had given the trainer its groups (seen under load: a two-step run over before the forger
        submitted, its `adversarial_accepted` 0 for want of trying). Returns that version, the honest
        nodes still without it and the adversaries not judged yet.

        Held, not running: a node swaps a version in for a lease at it, and once training is done the
        coordinator stops leasing when its queue of groups is full, so a node may hold the last version
        and never run it."""
        deadline = time.time() + limit_s
        honest = sorted(p.name for p in self.procs if p.role == "node")
        adversaries = {p.node_id: p.name for p in self.procs if p.adversary and p.node_id}
        while True:
            watch.poll()
            snap = self.snapshot()
            # Read again each time: the last step's version is published just after the step is recorded.
            version = int(snap.get("kv", {}).get("policy_version", 0))
            held = watch.arrived.get(version, {})
            behind = [n for n in honest if n not in held]
            judged = set(snap.get("rejections", {})) | {
                node_id for node_id, node in snap.get("nodes", {}).items() if node.get("accepted_groups")}
            unjudged = sorted(name for node_id, name in adversaries.items() if node_id not in judged)
            if (not behind and not unjudged) or time.time() >= deadline or self.procs[0].popen.poll() is not None:
                return version, behind, unjudged
            time.sleep(1.0)

    def done(self, snap: dict) -> bool:
        kv = snap.get("kv", {})
        if kv.get("trainer_done"):
            return True
        return bool(self.cfg.steps) and int(kv.get("trainer_step", 0)) >= self.cfg.steps


def _ready_versions(directory: Path) -> dict[int, float]:
    """Versions held whole under ``directory`` (a store or a node's cache), with when they became ready."""
    found: dict[int, float] = {}
    try:
        entries = list(directory.iterdir())
    except OSError:
        return found
    for entry in entries:
        if entry.name[:1] == "v" and entry.name[1:].isdigit() and is_ready(entry):
            try:
                found[int(entry.name[1:])] = (entry / READY_NAME).stat().st_mtime
            except OSError:
                continue  # pruned between the listing and the look
    return found


class BroadcastWatch:
    """How each version spread: when it was ready at the origin and at each node, and the origin's bytes.

    Polled about once a second. Times are the ready markers' modification times, so they are exact
    even though the polling is not; a version a node skipped (it wanted a newer one) never reaches it.
    The origin's bytes are taken from its ``/status`` and put to the version that was newest while
    they were served: close to "per version" as long as versions do not overlap much.
    """

    def __init__(self, origin_store: Path, node_caches: dict[str, Path], origin_url: str = ""):
        self.origin_store = origin_store
        self.node_caches = node_caches
        self.origin_url = origin_url
        self.published: dict[int, float] = {}
        self.arrived: dict[int, dict[str, float]] = {}
        self.origin_bytes: dict[int, int] = {}
        self._served = 0

    def poll(self) -> None:
        for v, t in _ready_versions(self.origin_store).items():
            self.published.setdefault(v, t)
        for name, cache in self.node_caches.items():
            # A node keeps its versions in a folder per coordinator key under its cache.
            folders = [cache, *(d for d in (cache.iterdir() if cache.is_dir() else ()) if not d.name.startswith("v"))]
            for folder in folders:
                for v, t in _ready_versions(folder).items():
                    self.arrived.setdefault(v, {}).setdefault(name, t)
        if self.origin_url and self.published:
            try:
                with urllib.request.urlopen(f"{self.origin_url}/status", timeout=1) as resp:
                    served = int(json.loads(resp.read())["load"]["bytes_served_total"])
            except (OSError, ValueError, KeyError, TypeError):
                return
            newest = max(self.published)
            self.origin_bytes[newest] = self.origin_bytes.get(newest, 0) + max(0, served - self._served)
            self._served = served

    def report(self) -> dict:
        """Per version: nodes that hold it, and seconds from publishing until 50, 95 and 100 % of them did."""
        return {str(v): {"nodes": len(self.arrived.get(v, {})),
                         **reach_times(t0, list(self.arrived.get(v, {}).values()), len(self.node_caches))}
                for v, t0 in sorted(self.published.items()) if v > 0}


def reach_times(published: float, arrivals: list[float], nodes: int) -> dict[str, float | None]:
    """Seconds from ``published`` until 50, 95 and 100 % of ``nodes`` held a version (None: not that many did)."""
    delays = sorted(max(0.0, t - published) for t in arrivals)
    out: dict[str, float | None] = {}
    for pct in (50, 95, 100):
        needed = max(1, -(-pct * nodes // 100))
        out[f"to_{pct}pct_s"] = round(delays[needed - 1], 2) if nodes and len(delays) >= needed else None
    return out


def staleness_histogram(history: list[dict]) -> dict[str, int]:
    """Samples trained on, by staleness (trainer version - the version that generated them), over the run."""
    total: dict[int, int] = {}
    for step in history:
        for staleness, n in (step.get("staleness_hist") or {}).items():
            total[int(staleness)] = total.get(int(staleness), 0) + int(n)
    return {str(k): total[k] for k in sorted(total)}


def render_table(net: Testnet, snap: dict, elapsed: float):
    from rich.table import Table

    kv = snap.get("kv", {})
    history = snap.get("history", [])
    last = history[-1] if history else {}
    t = Table(title=f"veriroll testnet — {elapsed:.0f}s — version {kv.get('policy_version', 0)}, step {kv.get('trainer_step', 0)}, "
                    f"reward {last.get('reward', snap.get('recent_reward', 0.0)):.2f}, staleness {last.get('mean_staleness', 0)}")
    for col in ("process", "role", "state", "accepted", "rejected (by reason)", "standing"):
        t.add_column(col)
    nodes = snap.get("nodes", {})
    rej = snap.get("rejections", {})
    for p in net.procs:
        state = "running" if p.popen.poll() is None else f"exit {p.popen.returncode}"
        n = nodes.get(p.node_id, {})
        reasons = ", ".join(f"{k}:{v}" for k, v in sorted(rej.get(p.node_id, {}).items())) if p.node_id else ""
        t.add_row(p.name, p.role + (f" ({p.adversary})" if p.adversary else ""), state,
                  str(n.get("accepted_groups", "")), reasons, n.get("standing", ""))
    return t


def plot_rewards(history: list[dict], out: Path) -> Path | None:
    if not history:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h.get("step", i) for i, h in enumerate(history)]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [h.get("reward", 0.0) for h in history], label="batch reward")
    if any("reward_running" in h for h in history):
        ax.plot(steps, [h.get("reward_running", 0.0) for h in history], label="running mean")
    ax.set_xlabel("trainer step")
    ax.set_ylabel("mean reward")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""What stops a testnet run (SIGHUP: its terminal closed): the network is stopped, then the summary written.
Its processes run in sessions of their own, so none of these reaches them but through :meth:`Testnet.stop`;
before, SIGTERM and SIGHUP ended the runner alone and left every process of the network running."""


def _take_stop_signals(handler) -> dict:
    """``handler`` for every stop signal (on the main thread; elsewhere nothing changes); the previous ones."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}


def _restore_signals(previous: dict) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def _interrupt(signum, _frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def run(cfg: TestnetConfig, run_dir: Path, *, live: bool, as_json: bool, wan: WanPlan | None = None,
        swarm: bool = False) -> int:
    net = Testnet(cfg, run_dir, wan=wan, swarm=swarm)
    t0 = time.time()
    status = 1
    snap: dict = {}
    watch: BroadcastWatch | None = None
    settled: dict = {}
    console_live = None
    previous = _take_stop_signals(_interrupt)  # SIGTERM and SIGHUP as Ctrl-C: the network is stopped first
    try:
        if not as_json:
            print(f"starting the testnet in {run_dir} (first start builds version 0: ~10-60 s)", file=sys.stderr)
        started = net.start()
        watch = net.broadcast_watch(started["relays"]["origin"])
        if live:
            from rich.live import Live

            console_live = Live(render_table(net, {}, 0), refresh_per_second=2, transient=False)
            console_live.start()
        last_line = 0.0
        while True:
            time.sleep(1.0)
            snap = net.snapshot() or snap
            watch.poll()
            elapsed = time.time() - t0
            if console_live is not None:
                console_live.update(render_table(net, snap, elapsed))
            elif not as_json and time.time() - last_line > 10:
                last_line = time.time()
                s = net.summary(snap, elapsed)
                print(f"[{elapsed:6.0f}s] step {s['steps']} version {s['policy_version']} reward {s['final_reward']:.2f} "
                      f"accepted {s['accepted_groups']} rejected {s['rejections_by_reason']}", file=sys.stderr, flush=True)
            coord = net.procs[0].popen
            if coord.poll() is not None:
                print(f"the coordinator exited with {coord.returncode}; see {net.procs[0].log}", file=sys.stderr)
                break
            if net.done(snap):
                status = 0
                if console_live is None and not as_json:
                    print(f"training done; waiting up to {cfg.settle_s:.0f}s for the nodes to hold the final version "
                          f"(and every adversary to be judged)", file=sys.stderr)
                settle_t0 = time.time()
                final, behind, unjudged = net.settle(watch, cfg.settle_s)
                snap = net.snapshot() or snap
                settled = {"final_version": final, "settle_s": round(time.time() - settle_t0, 1),
                           "nodes_behind": behind, "adversaries_unjudged": unjudged}
                if behind:
                    print(f"after {cfg.settle_s:.0f}s, {', '.join(behind)} did not hold version {final} yet",
                          file=sys.stderr)
                if unjudged:
                    print(f"after {cfg.settle_s:.0f}s, nothing of {', '.join(unjudged)} was judged yet",
                          file=sys.stderr)
                break
            if elapsed > cfg.timeout_s:
                print(f"timed out after {cfg.timeout_s:.0f}s", file=sys.stderr)
                break
    except KeyboardInterrupt as exc:
        print(f"interrupted ({exc or 'SIGINT'}); stopping the testnet", file=sys.stderr)
    finally:
        if console_live is not None:
            console_live.stop()
        net.stop()  # takes the stop signals itself: one meanwhile cannot cut it short
        _restore_signals(previous)
    if watch is not None:
        watch.poll()  # the versions that arrived in the last second
    summary = {**net.summary(snap, time.time() - t0, watch), **settled}
    (run_dir / "metrics.json").write_text(json.dumps({"summary": summary, "trainer_history": snap.get("history", [])}))
    png = plot_rewards(snap.get("history", []), run_dir / "reward_curve.png")
    summary["reward_curve"] = str(png) if png else None
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if as_json:
        print(json.dumps(summary))
    else:
        adversaries = sorted(p.name for p in net.procs if p.adversary)
        print(human_summary(summary, adversaries, run_dir))
    return status


def human_summary(summary: dict, adversaries: list[str], run_dir: Path) -> str:
    """What a person reads at the end of a run: a dozen lines; the whole record is ``summary.json``."""
    first = summary.get("first_reward")
    rejections = summary.get("rejections_by_reason") or {}
    by_node = summary.get("rejections_by_node") or {}
    unjudged = summary.get("adversaries_unjudged") or []
    to_95 = [v["to_95pct_s"] for v in (summary.get("broadcast") or {}).values() if v.get("to_95pct_s") is not None]
    lines = [
        f"veriroll testnet: {summary['steps']} steps in {summary['wall_s']:.0f} s, policy version {summary['policy_version']}",
        f"  reward         {'-' if first is None else f'{first:.2f}'} at the first step, {summary['final_reward']:.2f} at the last",
        f"  groups         {summary['accepted_groups']:,} accepted ({summary['groups_per_s']:.2f}/s)",
        "  rejections     " + (", ".join(f"{reason} {n:,}" for reason, n in sorted(rejections.items(), key=lambda kv: -kv[1]))
                              or "none"),
        f"  honest nodes   {summary['honest_rejected']:,} groups refused for a reason only dishonesty gives",
        f"  adversaries    {len(adversaries) - len(unjudged)} of {len(adversaries)} judged, {summary['adversarial_accepted']:,} "
        f"of their groups accepted" + "".join(f"; {name}: " + ", ".join(f"{r} {n}" for r, n in sorted(by_node[name].items()))
                                              for name in adversaries if by_node.get(name)),
        f"  broadcast      95% of nodes held a version {_p95(to_95)} after publishing ({len(to_95)} versions)"
        if to_95 else "  broadcast      no version reached 95% of the nodes",
        f"  staleness      {', '.join(f'{k}: {n:,}' for k, n in (summary.get('staleness_hist') or {}).items()) or '-'} samples",
        f"  run folder     {run_dir}",
        f"  reward plot    {summary.get('reward_curve') or '(matplotlib missing: none drawn)'}",
        f"  full summary   {run_dir / 'summary.json'} (--json prints it)",
    ]
    return "\n".join(lines)


def _p95(values: list[float]) -> str:
    ordered = sorted(values)
    return f"p95 {ordered[max(0, -(-95 * len(ordered) // 100) - 1)]:.1f} s, p50 {ordered[(len(ordered) - 1) // 2]:.1f} s"


# The network shape each model preset runs best as on a CPU machine, applied before --config's own
# values are overridden by flags. A 135M model is ~540 MB a version: fewer relays, bigger shards, fewer
# versions kept, and versions published every other step so the nodes spend their time generating.
PRESET_TOPOLOGY: dict[str, dict] = {
    "smollm2-arith": {
        "honest_nodes": 2, "adversaries": [], "timeout_s": 3600.0, "target_reward": 0.0, "settle_s": 600.0,
        "relays": [{"name": "relay-1", "upstream": "origin"}],
        "coordinator": {"shardcast.shard_bytes": 32 * 1024 * 1024, "shardcast.keep_versions": 2,
                        "trainer.publish_weights_every": 2, "intake.s_max": 2},
    },
}


def cmd_testnet(args) -> int:
    overrides = {}
    preset_coordinator: dict = {}
    if args.preset is not None:
        overrides["preset"] = args.preset
        for key, value in PRESET_TOPOLOGY.get(args.preset, {}).items():
            if key == "coordinator":
                preset_coordinator = dict(value)
            else:
                overrides[key] = value
    if args.steps is not None:
        overrides["steps"] = args.steps
    if args.honest is not None:
        overrides["honest_nodes"] = args.honest
    if args.adversary is not None:
        overrides["adversaries"] = [a for a in args.adversary if a and a != "none"]
    if args.timeout is not None:
        overrides["timeout_s"] = args.timeout
    cfg = load_topology(args.config, overrides)
    cfg.coordinator = {**cfg.coordinator, **preset_coordinator}
    run_dir = Path(args.dir) if args.dir else Path("runs") / time.strftime("testnet-%Y%m%d-%H%M%S")
    live = sys.stderr.isatty() and not args.json and not args.no_live
    return run(cfg, run_dir.resolve(), live=live, as_json=args.json, wan=wan_plan(args, cfg.honest_nodes),
               swarm=args.swarm)


def wan_plan(args, honest_nodes: int) -> WanPlan | None:
    """The ``--wan`` flags as a plan (None without ``--wan``); SystemExit with the reason on a bad profile."""
    if not args.wan:
        if args.wan_node or args.nat_nodes:
            raise SystemExit("--wan-node and --nat-nodes need --wan (the profile of every other host)")
        return None
    per_node = {}
    for item in args.wan_node or []:
        number, sep, profile = item.partition("=")
        if not sep or not number.strip().isdigit() or int(number) < 1:
            raise SystemExit(f"--wan-node {item!r}: expected NODE=PROFILE, e.g. 2=rtt=300ms,down=10mbit")
        per_node[int(number)] = profile
    try:
        for profile in [args.wan, *per_node.values()]:
            parse_profile(profile)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    nat = honest_nodes // 2 if args.nat_nodes is None else args.nat_nodes
    return WanPlan(args.wan, per_node, max(0, min(nat, honest_nodes)))


def register(subparsers) -> None:
    q = subparsers.add_parser("testnet", help="run the whole network locally: coordinator, relays, honest and adversarial nodes")
    q.add_argument("--config", help="topology TOML (default: deploy/testnet.toml shipped with veriroll)")
    q.add_argument("--preset", help="coordinator preset: tiny-arith (default), tiny-reverse, smollm2-arith (a real 135M model)")
    q.add_argument("--steps", type=int, help="train this many steps instead of until the target reward")
    q.add_argument("--honest", type=int, help="number of honest nodes")
    q.add_argument("--adversary", action="append", help="adversarial node of this KIND (repeatable; 'none' for none)")
    q.add_argument("--timeout", type=float, help="give up after this many seconds")
    q.add_argument("--dir", help="run directory (default runs/testnet-<time>)")
    q.add_argument("--json", action="store_true", help="print the final summary as one JSON line")
    q.add_argument("--no-live", action="store_true", help="plain progress lines instead of the live table")
    q.add_argument("--wan", help="put every host behind an emulated link, e.g. 'rtt=100ms,down=100mbit,up=20mbit'")
    q.add_argument("--wan-node", action="append", help="node NUMBER's own link: NUMBER=PROFILE (repeatable)")
    q.add_argument("--nat-nodes", type=int, help="with --wan: honest nodes behind NAT, never given out as relays or "
                                                 "peers (default: half of them)")
    q.add_argument("--swarm", action="store_true", help="honest nodes also serve each other shards over libp2p "
                                                         "(needs veriroll[swarm]; nodes behind NAT do not)")
    q.set_defaults(func=cmd_testnet)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="veriroll-testnet")
    sub = parser.add_subparsers(dest="cmd", required=True)
    register(sub)
    args = parser.parse_args(["testnet", *(argv or sys.argv[1:])])
    return args.func(args)
