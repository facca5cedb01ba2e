"""The coordinator process: wires the store, the service, the verifier, the trainer, the publisher
and the HTTP side (metrics, status, dashboard) together and runs them until stopped.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import gc
import json
import logging
import os
import resource
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from veriroll.coordinator import store as st
from veriroll.coordinator.config import CoordinatorConfig
from veriroll.coordinator.http import start_http
from veriroll.coordinator.limits import DescriptorBudget, release_freed_memory
from veriroll.coordinator.metrics import CoordinatorMetrics
from veriroll.coordinator.policy import PolicyStore
from veriroll.coordinator.publisher import ANNOUNCEMENT_KEY, start_publisher
from veriroll.coordinator.server import read_tls, start_server
from veriroll.coordinator.service import CoordinatorService, PolicyState
from veriroll.protos.config import ConfigError, load_config, resolve_path
from veriroll.protos.descriptors import raise_descriptor_limit
from veriroll.protos.errors import VerirollError
from veriroll.protos.identity import load_private_key
from veriroll.shardcast.relay import DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_TRANSFERS
from veriroll.shardcast.swarm.hints import PeerDirectory

log = logging.getLogger("veriroll.coordinator")

CONFIG_NAME = "coordinator.toml"
PORTS_NAME = "ports.json"
LOCK_NAME = "coordinator.lock"
STOP_WAIT_S = 6.0  # what the parts get to close after a stop signal (docker stop kills at 10 s)
MEMORY_RELEASE_EVERY_S = 5.0
TRAINER_POLL_S = 0.2  # how often a waiting trainer looks for fresh groups


def load_coordinator_config(base_dir: Path, overrides=()) -> CoordinatorConfig:
    path = base_dir / CONFIG_NAME
    if not path.exists():
        raise FileNotFoundError(f"{path} not found; create it with `veriroll coordinator init --dir {base_dir}`")
    return load_config(CoordinatorConfig, path, overrides=overrides, env_prefix="VERIROLL_COORDINATOR_")


class DirectoryInUse(VerirollError):
    """Another coordinator process serves this directory."""


class DirectoryLock:
    """An exclusive lock on ``DIR/coordinator.lock``, which holds its owner's pid, for as long as a coordinator
    serves DIR: a second one on the same state stops before it binds anything.

    The lock is the kernel's (``flock``), so it goes with its process: a lock file left by a coordinator
    that was killed is simply taken over.
    """

    def __init__(self, base_dir: Path):
        self.path = base_dir / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise DirectoryInUse(f"another coordinator (pid {holder}) is already running on {self.path.parent}; stop "
                                 f"it first (kill {holder}), or give this one another --dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the lock; the file stays, with a pid nobody holds
            self._fd = None


class CannotListen(VerirollError):
    """A port the coordinator is configured to listen on is taken or not allowed."""


_LISTEN_ERRORS = (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES)


async def _listening(what: str, setting: str, host: str, port: int, start):
    """Await ``start``, which binds ``host:port`` for ``what``; a failure to bind becomes :class:`CannotListen`
    naming the setting that moves it."""
    try:
        return await start
    except OSError as exc:
        if exc.errno not in _LISTEN_ERRORS:
            raise
        raise CannotListen(f"cannot listen on {host}:{port} for {what}: {exc.strerror or exc}; another coordinator or "
                           f"program may hold it: stop that, or set {setting} to a free port (0: any free one, "
                           "written to DIR/ports.json at every start)") from exc


@dataclass
class Coordinator:
    """A running coordinator and its parts (handy for tests and the testnet)."""

    base_dir: Path
    cfg: CoordinatorConfig
    db: st.Database
    service: CoordinatorService
    policy_store: PolicyStore
    grpc_port: int = 0
    http_port: int = 0
    tasks: list[asyncio.Task] = field(default_factory=list)
    closers: list = field(default_factory=list)
    server: object = None
    stopped: asyncio.Event = field(default_factory=asyncio.Event)
    lock: DirectoryLock | None = None
    verifier_pool: object = None  # a verifier_pool.VerifierPool when this process runs workers of the pool
    descriptors: DescriptorBudget | None = None  # each port's share of the descriptor limit (set at start)

    @property
    def address(self) -> str:
        return f"{self.cfg.server.host}:{self.grpc_port}"

    async def stop(self, grace: float = 2.0, *, wait_s: float = STOP_WAIT_S) -> bool:
        """Stop serving and close every part; True when every part closed, False when one was still busy
        after ``wait_s`` (a trainer step in flight) and was left behind.

        Calls in flight get ``grace`` seconds, then are cancelled (a node retries them). Whatever the store
        was handed is committed before it closes. A part left behind is safe to drop: nothing it has not
        committed was acknowledged, exactly as if the process had been killed there.
        """
        if self.stopped.is_set():
            return True
        self.stopped.set()
        if self.server is not None:
            await self.server.stop(grace)
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - shutting down
                pass
        all_closed = True
        deadline = time.monotonic() + wait_s
        for close in reversed(self.closers):
            res = close()
            if not asyncio.iscoroutine(res):
                continue
            closing = asyncio.ensure_future(res)
            done, _ = await asyncio.wait({closing}, timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                log.warning("%s still busy %.0f s after the stop signal: left behind", _name_of(close), wait_s)
                all_closed = False
            elif closing.exception() is not None:
                log.error("closing %s failed", _name_of(close), exc_info=closing.exception())
        self.service.close()
        self.service.metrics.registry.close()
        # The store commits what it was handed first; it waits on nothing but the database. Past the deadline
        # (at least 2 s of its own) it is a statement PostgreSQL has not answered: left behind as well.
        if not self.db.close(timeout=max(2.0, deadline - time.monotonic())):
            log.warning("the store still waits on the database %.0f s after the stop signal: left behind", wait_s)
            all_closed = False
        if self.lock is not None:
            self.lock.release()
        return all_closed


def _name_of(close) -> str:
    return getattr(close, "__qualname__", repr(close)).replace(".<locals>.close", "")


def build_verifier(cfg: CoordinatorConfig, policy_store: PolicyStore):
    """The trusted verifier, or ``None`` only when the operator set ``intake.verify = false``.

    Fails closed: the verifier is first-party, so it is imported unconditionally (even before
    ``intake.verify`` is looked at, so a broken install fails with verification off too); an
    ImportError propagates and the coordinator does not start. It is imported here rather than at the top of
    the module because it pulls in torch and the TOPLOC stack, which the operator subcommands that
    import this module (status, nodes, ...) do not need.
    """
    from veriroll.coordinator.verifier import TrustedVerifier

    if not cfg.intake.verify:
        log.warning("verification is OFF by configuration (intake.verify = false): submitted groups are checked "
                    "for shape only; never run an open network like this")
        return None
    return TrustedVerifier(policy_store, cfg, device=cfg.verifier.device)


def verification_state(cfg: CoordinatorConfig) -> str:
    """``"on"`` or ``"off"`` (``intake.verify = false``), as ``/api/status`` and ``coordinator status`` say it."""
    return "on" if cfg.intake.verify else "off"


async def start_coordinator(base_dir: str | Path, *, overrides=(), cfg: CoordinatorConfig | None = None) -> Coordinator:
    base = Path(base_dir).resolve()
    cfg = cfg or load_coordinator_config(base, overrides)
    from veriroll.coordinator.trainer.device import check_trainer_placement

    # Before anything is written (the lock file included): the trainer's device is on this machine and
    # the world size fits the batch, or the start is refused (ConfigError: `coordinator run` exits 2).
    check_trainer_placement(cfg)
    # Before anything is opened or bound: a second coordinator (or trainer) on DIR stops here. Edge and
    # verifier processes are meant to run several on one DIR (a shared PostgreSQL store): no lock.
    lock = DirectoryLock(base) if cfg.role not in ("edge", "verifier") else None
    if lock is not None:
        lock.acquire()
    try:
        return await _start(base, cfg, lock)
    except BaseException:
        if lock is not None:
            lock.release()  # released twice when coord.stop() ran: harmless
        raise


async def _start(base: Path, cfg: CoordinatorConfig, lock: DirectoryLock | None) -> Coordinator:
    policy_store = PolicyStore(resolve_path(base, cfg.checkpoints))
    verifier = build_verifier(cfg, policy_store)  # first: a broken install stops here, before anything is opened
    db = st.Database(st.database_target(base, cfg.database))
    version = db.run_sync(lambda c: st.kv_get(c, "policy_version", None))
    if version is None:
        version = policy_store.latest()
        db.run_sync(lambda c: st.kv_set(c, "policy_version", version))
    from veriroll.coordinator.environments import environment_kwargs, load_environment

    # An environment that runs model-written code proves its sandbox here, or refuses to start.
    env = load_environment(cfg.environment.name, **environment_kwargs(cfg))
    key = load_private_key(resolve_path(base, cfg.key))
    metrics = CoordinatorMetrics()
    policy = PolicyState(version=int(version), relays=list(cfg.shardcast.relays))
    # Edges sharing a PostgreSQL store share the swarm's directory through it (one process on SQLite: memory).
    shared = st.pg.is_url(str(db.path)) and cfg.role in ("all", "edge")
    exchange = (lambda *a, **kw: db.run(lambda c: st.exchange_swarm_directory(c, *a, **kw))) if shared else None
    peer_directory = PeerDirectory(key, exchange=exchange)
    service = CoordinatorService(
        cfg, db, environment=env, tokenizer=policy_store.tokenizer, vocab_size=policy_store.vocab_size,
        stop_token_ids=policy_store.stop_token_ids, coordinator_key=key.public, policy=policy,
        verifier=verifier, metrics=metrics, peer_directory=peer_directory,
    )
    coord = Coordinator(base, cfg, db, service, policy_store, lock=lock)
    if shared:
        coord.tasks.append(asyncio.create_task(peer_directory.share_forever(), name="veriroll-share-peer-directory"))
    try:
        await _start_parts(coord, key)
    except BaseException:
        await coord.stop()
        raise
    return coord


async def _start_parts(coord: Coordinator, key) -> None:
    """The parts of ``cfg.role``: 'all' runs every part in this process; 'edge' the gRPC and HTTP ports and
    the intake (the trainer and the publisher run elsewhere, against the same PostgreSQL store); 'trainer'
    the trainer and the publisher with its origin relay; 'verifier' workers of the verifier pool (and HTTP
    for its metrics)."""
    cfg, base = coord.cfg, coord.base_dir
    role = cfg.role
    if role != "all" and not st.pg.is_url(str(cfg.database)):
        raise ConfigError(f"role {role!r} shares its state with other processes: set database to a postgresql:// URL")
    if role == "verifier" and coord.service.verifier is None:
        raise ConfigError("role 'verifier' runs the verification stages: it cannot run with intake.verify = false")
    # Every port's connections from one descriptor limit, so that a flood of connections to one port cannot
    # take the descriptors the store, the checkpoints or another port need (limits.DescriptorBudget).
    host = cfg.server.host
    origin = cfg.shardcast.origin_port >= 0 and role in ("all", "trainer")
    coord.descriptors = budget = DescriptorBudget.plan(
        resource.getrlimit(resource.RLIMIT_NOFILE)[0], grpc=cfg.server.max_connections if role in ("all", "edge") else 0,
        http=cfg.server.http_max_connections, origin=(DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_TRANSFERS) if origin else None)
    if cfg.server.max_connections > budget.grpc_connections:
        log.warning("server.max_connections lowered from %d to %d: the descriptor limit is %d (raise it with ulimit -n "
                    "or LimitNOFILE=)", cfg.server.max_connections, budget.grpc_connections, budget.limit)
    if cfg.server.http_max_connections > budget.http_connections:
        log.warning("server.http_max_connections lowered from %d to %d: the descriptor limit is %d",
                    cfg.server.http_max_connections, budget.http_connections, budget.limit)
    log.info("%s", budget.summary())
    # Publisher and origin relay (shardcast) first, so GetPolicy can name them from the first call.
    if origin:
        await _listening("the origin relay", "shardcast.origin_port", host, cfg.shardcast.origin_port,
                         start_publisher(coord, key))
    if role in ("all", "edge"):
        tls = None
        if cfg.server.tls:
            tls = read_tls(resolve_path(base, cfg.server.tls_cert), resolve_path(base, cfg.server.tls_key))
        server, port, _ = await _listening("gRPC", "server.port", host, cfg.server.port,
                                           start_server(coord.service, host=host, port=cfg.server.port, tls=tls,
                                                        max_connections=budget.grpc_connections))
        coord.server, coord.grpc_port = server, port
    await _listening("HTTP (metrics, dashboard)", "server.http_port", host, cfg.server.http_port, start_http(coord))
    if role in ("edge", "verifier"):
        # The trainer of another process moves the policy on; this process follows what the store says.
        coord.tasks.append(asyncio.create_task(_follow_policy(coord), name="veriroll-follow-policy"))
    if role in ("all", "edge") and cfg.verifier.pool and coord.service.verifier is not None:
        from veriroll.coordinator.verifier_pool import VerdictWaiter

        coord.service.intake.use_verifier_pool(VerdictWaiter(coord.db, wait_s=cfg.verifier.wait_s,
                                                             clock=coord.service.clock))
    if role == "verifier" or (role == "all" and cfg.verifier.pool and coord.service.verifier is not None):
        _start_verifier_pool(coord)
    if cfg.trainer.enabled and role in ("all", "trainer"):
        await start_trainer(coord)
    if role != "verifier":
        coord.tasks.append(asyncio.create_task(_housekeeping(coord)))
    coord.tasks.append(asyncio.create_task(_release_memory_forever(), name="veriroll-release-memory"))
    ports = {"grpc": coord.grpc_port, "http": coord.http_port, "pid": os.getpid()}
    origin = getattr(coord, "origin_url", None)
    if origin:
        ports["origin"] = origin
    if role != "verifier":  # (a verifier serves no port a node or an operator's tool would look up)
        tmp = base / f"{PORTS_NAME}.{os.getpid()}.tmp"  # per process: edges on one DIR start side by side
        tmp.write_text(json.dumps(ports))
        tmp.replace(base / PORTS_NAME)
    log.info("coordinator (role %s) serving on %s (%s), policy version %d, verification %s", role,
             coord.address if coord.server is not None else "no gRPC port", "TLS" if cfg.server.tls else "plaintext",
             coord.service.policy.version, verification_state(cfg))


def _start_verifier_pool(coord: Coordinator) -> None:
    """``verifier.workers`` worker loops of the verifier pool in this process (docs/scaling.md)."""
    from veriroll.coordinator.verifier_pool import VerifierPool

    cfg = coord.cfg
    pool = VerifierPool(coord.db, coord.service.verifier, workers=cfg.verifier.workers,
                        claim_timeout_s=cfg.verifier.claim_timeout_s, keep_verdicts_s=cfg.leases.ttl_s,
                        metrics=coord.service.metrics)
    coord.tasks.extend(pool.start())
    coord.closers.append(pool.close)
    coord.verifier_pool = pool
    log.info("verifier pool: %d worker(s) in this process, claims held %g s", cfg.verifier.workers,
             cfg.verifier.claim_timeout_s)
    if cfg.verifier.claim_timeout_s >= cfg.leases.ttl_s:
        log.warning("verifier.claim_timeout_s (%g s) is not under leases.ttl_s (%g s): a group whose worker is killed "
                    "is taken up again only after its lease ended, and is lost", cfg.verifier.claim_timeout_s,
                    cfg.leases.ttl_s)


async def start_trainer(coord: Coordinator):
    """Resume the trainer of ``coord`` and keep it stepping in a worker thread until the coordinator stops;
    returns the :class:`Trainer`.

    After a step that publishes, the new version is announced on the event loop (:func:`_announce`):
    handed to shardcast where the coordinator has a publisher, then made current, so that nodes are told
    it (``coord.service.policy.version``) only once a relay serves it.
    """
    # Imported here (unconditionally when enabled) only because it is heavy; an ImportError propagates.
    from veriroll.coordinator.trainer import Trainer

    trainer = Trainer(coord.cfg, coord.db, coord.policy_store, metrics=coord.service.metrics,
                      policy=coord.service.policy, advances_policy=False)
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="veriroll-trainer")
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(pool, trainer.resume)
    coord.trainer = trainer
    await _announce_unannounced(coord, trainer)
    coord.tasks.append(asyncio.create_task(_train_forever(coord, trainer, pool), name="veriroll-trainer"))

    async def close() -> None:
        # Let a step in flight finish (and commit) before the store closes.
        await asyncio.to_thread(pool.shutdown, True)

    coord.closers.append(close)
    return trainer


async def _train_forever(coord: Coordinator, trainer, pool: ThreadPoolExecutor) -> None:
    loop = asyncio.get_running_loop()
    while True:
        try:
            outcome = await loop.run_in_executor(pool, trainer.step)
        except asyncio.CancelledError:
            raise
        except Exception:  # the coordinator keeps serving; the step was rolled back, or training stops
            if trainer.broken:
                log.exception("trainer stopped")
                return
            log.exception("trainer step failed and was rolled back to the last checkpoint; retrying in 5 s")
            # A step that failed after its commit left a version committed but not yet current.
            await _announce_unannounced(coord, trainer)
            await asyncio.sleep(5.0)
            continue
        if outcome.published is not None:
            await _announce(coord, trainer, outcome.published)
        if outcome.kind != "trained":
            await asyncio.sleep(TRAINER_POLL_S if outcome.kind == "waiting" else 1.0)


async def _announce_unannounced(coord: Coordinator, trainer) -> None:
    if trainer.unannounced is not None:
        await _announce(coord, trainer, trainer.unannounced)


async def _announce(coord: Coordinator, trainer, version: int) -> None:
    """Make a committed version current once shardcast holds it: published first (signed manifest, origin
    relay), then made current by the trainer, so nodes are never told a version no relay serves."""
    if hasattr(coord, "publish_version"):
        try:
            await coord.publish_version(version)
        except Exception:  # announced anyway: nodes get it from the disk-backed origin on retry
            log.exception("handing version %d to shardcast failed", version)
    trainer.make_current(version)


async def _follow_policy(coord: Coordinator, every_s: float = 1.0) -> None:
    """The policy of a process without the trainer (an edge, a verifier): the version the trainer committed,
    and where the publisher announced it."""
    while True:
        try:
            version, announced = await coord.db.run_read(
                lambda c: (int(st.kv_get(c, "policy_version", 0)), st.kv_get(c, ANNOUNCEMENT_KEY, None)))
            policy = coord.service.policy
            if announced:
                # With a publisher, a version is current once published (the trainer commits it first).
                version = int(announced.get("version", -1))
                if version >= policy.version:
                    policy.relays = list(announced.get("relays", policy.relays))
                    policy.manifest_path = announced.get("manifest_path", policy.manifest_path)
            if version > policy.version:
                policy.advance(version)
        except st.StoreUnavailable as exc:  # PostgreSQL restarting: one line a second, not a traceback
            log.warning("reading the policy version: the store is unavailable (%s)", exc)
        except Exception:  # keep following; one failed read must not freeze the edge's policy
            log.exception("reading the policy version from the store failed")
        await asyncio.sleep(every_s)


async def _housekeeping(coord: Coordinator) -> None:
    """Expire leases (their prompts return to the pool) and follow standing changes made elsewhere (the node
    cache), every second; drop old noted standing changes once a minute."""
    forgot_changes_at = -60_000
    while True:
        try:
            now = coord.service.clock()
            expired = await coord.db.run(lambda c, now=now: coord.service.expire_leases(c, now))
            if coord.service.door.shared_nonces:
                await coord.db.run(lambda c, now=now: st.forget_nonces(c, now))
            if expired:
                coord.service.metrics.leases_expired.inc(expired)
            await coord.service.ledger.follow_standing_changes()
            if now - forgot_changes_at >= 60_000:
                await coord.db.run(st.forget_standing_changes)
                forgot_changes_at = now
            # The gauges are not refreshed here: /metrics refreshes them when it is scraped, and their summary
            # counts whole tables (nodes, groups): every second on every edge it cost O(rows) for nothing.
        except st.StoreUnavailable as exc:  # PostgreSQL restarting: the store reconnects by itself
            log.warning("housekeeping: the store is unavailable (%s)", exc)
        except Exception:  # keep housekeeping alive; log and go on
            log.exception("housekeeping failed")
        await asyncio.sleep(1.0)


async def serve_forever(base_dir: str | Path, overrides=(), stop: asyncio.Event | None = None) -> int:
    """Run the coordinator in ``base_dir`` until SIGTERM or SIGINT (or ``stop`` is set), then stop it;
    returns the exit status.

    The signals are caught from the start: one during start-up cancels start-up at its next await (what
    was started is stopped again). Stopping waits for the store's commits and at most ``STOP_WAIT_S`` for
    any other part; a part still busy then (a trainer step) is dropped by leaving the process at once.
    """
    stop = stop or asyncio.Event()
    before, now = raise_descriptor_limit()
    if now != before:
        log.info("descriptor limit raised from %d to %d", before, now)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if stop.is_set():
        log.info("stop signal before start-up; not starting")
        return 0
    starting = asyncio.create_task(start_coordinator(base_dir, overrides=overrides), name="veriroll-start")
    stop_signal = asyncio.create_task(stop.wait())
    await asyncio.wait({starting, stop_signal}, return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():
        log.info("stop signal during start-up; stopping")
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        return 0
    if starting.exception() is not None:
        stop_signal.cancel()
        raise starting.exception()
    coord = starting.result()
    freeze_startup_objects()
    await stop_signal
    log.info("shutting down")
    if await coord.stop():
        log.info("stopped")
        return 0
    # A thread still runs a step of the left-behind part; the interpreter would wait for it at exit.
    log.warning("stopped; leaving the parts still busy behind")
    logging.shutdown()
    os._exit(0)


def freeze_startup_objects() -> int:
    """Move every object alive now (modules, the model, the tokenizer: ~400k of them) out of the cyclic
    collector's sight, for good; returns how many. They live as long as the process, yet each full
    collection scanned them all: ~180 ms with the tiny model loaded, a pause that every request in flight
    waited out (the fleet benchmark's submit p99). Later full collections scan only what came after."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


async def _release_memory_forever() -> None:
    """Hand freed heap back to the OS every few seconds, so that RSS falls again after a flood of large requests."""
    while await asyncio.to_thread(release_freed_memory):
        await asyncio.sleep(MEMORY_RELEASE_EVERY_S)
