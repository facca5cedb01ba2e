"""``veriroll node doctor``: check everything a node needs before it runs, and say what to fix.

Checks, in order, each one a :class:`Check` with a status and, when it is not ``ok``, advice in plain
words:

1. ``key``: the private key file exists, only its owner can read it (0600), and it parses.
2. ``coordinator``: HOST:PORT (a port is required) accepts TCP connections.
3. ``tls``: the CA file loads, the coordinator's certificate is signed by it and names the host, and the
   port speaks gRPC (HTTP/2); with no CA, the coordinator must not be serving TLS.
4. ``signed call``: a signed Heartbeat (a Register, for a key the coordinator does not know yet)
   is answered: the signature, the key's standing and the whole gRPC path work.
5. ``clock``: this machine's clock against the coordinator's, from the answer's ``server_time_ms``
   (signed requests outside the coordinator's window are refused).
6. ``relay URL``: each relay (``--relay``, else the coordinator's list) answers ``/status``, holds a
   version whose manifest the coordinator signed, and how fast a sample of it downloads.
7. ``disk``: free space where checkpoints are cached.

A later check that depends on a failed one is skipped (``skip``), so the first failure is the one to
fix. The doctor passes (exit 0) only when no check fails; ``warn`` is shown but passes. ``node run`` and
``node credits`` run checks 1-3 (:func:`check_key`, :func:`coordinator_checks`) before their first call.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import ssl
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import quote

from veriroll.node.config import DEFAULT_GRPC_PORT, NodeConfig, default_key_path

OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"
CLOCK_OK_S = 5.0  # the agent warns beyond this too
CLOCK_FAIL_S = 30.0  # half the coordinator's default ±60 s window: drift a little more and requests fail
SLOW_RELAY_BPS = 1 << 20  # below 1 MiB/s a large checkpoint takes hours
DEFAULT_MIN_FREE = 1 << 30
DEFAULT_SAMPLE_BYTES = 8 << 20
CERT_EXPIRY_WARN_S = 14 * 86400
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])  # + an empty SETTINGS
NOT_GRPC_ADVICE = (f"check the port: it must be the coordinator's gRPC port ({DEFAULT_GRPC_PORT} unless its operator "
                   "changed it), not its dashboard or a relay port")
NTP_ADVICE = ("turn on automatic time sync: `sudo timedatectl set-ntp true` (Linux), System Settings > General > "
              "Date & Time > 'Set time automatically' (macOS), or Settings > Time > 'Sync now' (Windows)")


@dataclass
class Check:
    """One check's verdict. ``advice`` says what to do when the status is not ``ok``."""

    name: str
    status: str
    detail: str
    advice: str = ""
    data: dict = field(default_factory=dict)
    transient: bool = False  # a failure that may pass on its own (nothing answers yet): `node run` waits and retries

    @property
    def passed(self) -> bool:
        return self.status != FAIL


def split_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (or ``[v6]:PORT``) into its parts.

    A missing port is refused, not defaulted: gRPC would take 443, the coordinator's default is 50051, and
    an operator may use any other; a guess can only connect somewhere else, silently.
    """
    text = address.strip()
    host, sep, port = text.rpartition(":")
    if not sep or (":" in host and not host.startswith("[")) or (text.startswith("[") and text.endswith("]")):
        raise ValueError(f"coordinator address {address!r} has no port")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"coordinator address {address!r} must look like HOST:PORT")
    return host.strip("[]"), int(port)


def check_address(address: str) -> tuple[Check, tuple[str, int] | None]:
    """The ``coordinator`` check's verdict on the address itself, and its parts when it has them."""
    try:
        return Check("coordinator", OK, address), split_address(address)
    except ValueError as exc:
        host = address.strip().rstrip(":") or "HOST"
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return Check("coordinator", FAIL, str(exc),
                     f"pass --coordinator {host}:PORT with the gRPC port the operator gave you ({DEFAULT_GRPC_PORT} "
                     "unless they changed it); a missing port is not guessed"), None


# --- the checks ---------------------------------------------------------------------------------------


def missing_key_advice(path: Path) -> str:
    """What to do about a key file that is not there, without making a second identity by mistake."""
    default = default_key_path()
    if path == default:
        return f"create it with `veriroll keygen` (it writes {default}); then back it up: it is your node's identity"
    if default.exists():
        return (f"your key from `veriroll keygen` is {default}: leave out --key to use it (a new key elsewhere "
                "would start a second identity with no history)")
    return (f"point --key at the key you already have, or create a new one with `veriroll keygen` (it writes {default}, "
            "which every `veriroll node` command reads when --key is left out)")


def check_key(path: str | os.PathLike) -> Check:
    """The key file exists, is private to its owner, and holds an Ed25519 private key (not its ``.pub``)."""
    from veriroll.protos.identity import KeyFileError, load_private_key, load_public_key, public_path_for

    p = Path(path).expanduser()
    if not p.exists():
        return Check("key", FAIL, f"no key file at {p}", missing_key_advice(p))
    try:
        key = load_private_key(p, owner_only=True)
    except KeyFileError as exc:
        return Check("key", FAIL, str(exc), exc.fix or
                     "this file is not a veriroll node key: restore your key from its backup, or create a new one with "
                     "`veriroll keygen` (a new key starts a new history)")
    data = {"node_id": key.node_id, "path": str(p)}
    pub = public_path_for(p)
    if pub.exists():
        try:
            if load_public_key(pub).raw != key.public.raw:
                return Check("key", WARN, f"node id {key.node_id}, but {pub} belongs to another key",
                             f"remove {pub}; `veriroll keygen --show --out {p}` prints this key's id", data)
        except KeyFileError:
            pass
    return Check("key", OK, f"node id {key.node_id} ({p})", data=data)


async def check_reachable(host: str, port: int, timeout: float) -> Check:
    """A TCP connection to the coordinator opens. Refused, timed out or no route is ``transient``: the
    coordinator may be starting or the network coming up; a name that does not resolve is not."""
    where = f"{host}:{port}"
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except ConnectionRefusedError:
        return Check("coordinator", FAIL, f"nothing is listening on {where} (connection refused)",
                     "check that the coordinator is running and that the address and port are right (ask its operator)",
                     transient=True)
    except TimeoutError:
        return Check("coordinator", FAIL, f"no answer from {where} within {timeout:g}s",
                     "a firewall may be dropping the connection, or the host is down; check the address and your network",
                     transient=True)
    except socket.gaierror as exc:
        return Check("coordinator", FAIL, f"cannot resolve {host!r}: {exc.strerror or exc}",
                     "check the spelling of the host name and your DNS / network connection",
                     transient=exc.errno == socket.EAI_AGAIN)  # a resolver not answering yet, not a wrong name
    except OSError as exc:
        return Check("coordinator", FAIL, f"cannot connect to {where}: {exc.strerror or exc}",
                     "check your network connection and the coordinator address", transient=True)
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:
        pass
    return Check("coordinator", OK, f"{where} accepts connections")


def check_ca_file(ca: str) -> Check | None:
    """The ``tls`` verdict on the CA file alone (missing, not PEM), or None when it loads or none is given.

    Checked before the coordinator is reached: a wrong file is a mistake that no retry fixes.
    """
    if not ca:
        return None
    ca_path = Path(ca).expanduser()
    try:
        ssl.create_default_context(cafile=str(ca_path))
    except FileNotFoundError:
        return Check("tls", FAIL, f"CA file {ca_path} does not exist", "get ca.crt from the coordinator's operator "
                                                                        "and pass its path with --ca")
    except (ssl.SSLError, OSError, ValueError) as exc:
        return Check("tls", FAIL, f"{ca_path} is not a PEM CA certificate ({exc})",
                     "get the CA certificate (ca.crt, PEM) from the coordinator's operator and pass it with --ca")
    return None


async def check_tls(host: str, port: int, ca: str, server_name: str, timeout: float) -> Check:
    """The TLS handshake succeeds with ``ca`` as the only trust root, for the expected name, and the port
    speaks gRPC (ALPN h2). With no ``ca``: the port must speak plaintext gRPC, not TLS."""
    if not ca:
        return await _check_plaintext(host, port, timeout)
    problem = check_ca_file(ca)
    if problem is not None:
        return problem
    ca_path = Path(ca).expanduser()
    ctx = ssl.create_default_context(cafile=str(ca_path))
    ctx.set_alpn_protocols(["h2"])
    name = server_name or host
    try:
        _, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port, ssl=ctx, server_hostname=name, ssl_handshake_timeout=timeout), timeout)
    except ssl.SSLCertVerificationError as exc:
        if exc.verify_code == 62:  # X509_V_ERR_HOSTNAME_MISMATCH
            return Check("tls", FAIL, f"the coordinator's certificate is not valid for {name!r} ({exc.verify_message})",
                         "connect with the host name on the certificate, or pass --server-name with that name")
        return Check("tls", FAIL, f"the coordinator's certificate is not signed by the CA in {ca_path} "
                                  f"({exc.verify_message})",
                     "this CA is not the coordinator's (perhaps another coordinator's, or an old one): get the current "
                     "ca.crt from this coordinator's operator")
    except ssl.SSLError as exc:
        return Check("tls", FAIL, f"TLS handshake with {host}:{port} failed ({exc.reason or exc})",
                     NOT_GRPC_ADVICE + "; a coordinator that runs without TLS takes no --ca")
    except TimeoutError:
        return Check("tls", FAIL, f"TLS handshake with {host}:{port} did not complete within {timeout:g}s",
                     "the coordinator may be overloaded, or this is not its gRPC port: " + NOT_GRPC_ADVICE, transient=True)
    except OSError as exc:
        return Check("tls", FAIL, f"TLS handshake with {host}:{port} did not complete ({exc})",
                     NOT_GRPC_ADVICE + "; a coordinator that runs without TLS takes no --ca")
    cert = writer.get_extra_info("peercert") or {}
    alpn = writer.get_extra_info("ssl_object").selected_alpn_protocol()
    # Abort rather than close: a gRPC server need not answer TLS close_notify, and a graceful close
    # would wait for it (30 s by default).
    writer.transport.abort()
    if alpn != "h2":  # every gRPC server (and proxy in front of one) negotiates HTTP/2
        return Check("tls", FAIL, f"{host}:{port} serves TLS but not gRPC (it does not speak HTTP/2)", NOT_GRPC_ADVICE)
    not_after = cert.get("notAfter")
    data = {"not_after": not_after, "server_name": name}
    if not_after:
        left = ssl.cert_time_to_seconds(not_after) - time.time()
        if left < CERT_EXPIRY_WARN_S:
            return Check("tls", WARN, f"certificate for {name!r} expires in {left / 86400:.0f} days ({not_after})",
                         "tell the coordinator's operator: nodes stop connecting when it expires", data)
    return Check("tls", OK, f"certificate for {name!r} is signed by {ca_path.name}" +
                 (f", valid until {not_after}" if not_after else ""), data=data)


async def _check_plaintext(host: str, port: int, timeout: float) -> Check:
    """No CA given: the port must answer the HTTP/2 connection preface as a gRPC server does (with its own
    SETTINGS frame); one that does not but completes a TLS handshake is a TLS coordinator that needs ``--ca``."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (OSError, TimeoutError):
        return Check("tls", FAIL, f"{host}:{port} stopped accepting connections",
                     "check that the coordinator is running", transient=True)
    try:
        writer.write(H2_PREFACE)
        head = await asyncio.wait_for(reader.readexactly(9), timeout)
    except asyncio.IncompleteReadError as exc:
        head = exc.partial
    except OSError:
        head = b""
    except TimeoutError:
        return Check("tls", FAIL, f"{host}:{port} did not answer an HTTP/2 (gRPC) greeting within {timeout:g}s",
                     "the coordinator may be overloaded, or this is not its gRPC port: " + NOT_GRPC_ADVICE,
                     transient=True)
    finally:
        writer.transport.abort()
    if len(head) == 9 and head[3] == 4:  # a frame header: 3 bytes of length, then type 4 (SETTINGS)
        return Check("tls", WARN, "no CA given: the connection to the coordinator is plaintext (not encrypted, not "
                                  "authenticated)", "pass the coordinator's CA certificate with --ca FILE unless the "
                                                    "operator says the coordinator runs without TLS")
    if head.startswith(b"HTTP/"):
        return Check("tls", FAIL, f"{host}:{port} is a web server (it answers HTTP/1), not the coordinator's gRPC port",
                     NOT_GRPC_ADVICE)
    if await _speaks_tls(host, port, timeout):
        return Check("tls", FAIL, f"{host}:{port} serves TLS, and no CA certificate was given",
                     "pass the coordinator's CA certificate with --ca ca.crt (its operator hands it out with the "
                     "address)")
    return Check("tls", FAIL, f"{host}:{port} is not a gRPC server (its answer to an HTTP/2 greeting: "
                              f"{head[:16]!r})", NOT_GRPC_ADVICE)


async def _speaks_tls(host: str, port: int, timeout: float) -> bool:
    """Whether ``host:port`` completes a TLS handshake, whoever its certificate is from."""
    insecure = ssl.create_default_context()
    insecure.check_hostname = False
    insecure.verify_mode = ssl.CERT_NONE  # only asks "is this TLS?"; nothing is sent over it
    try:
        _, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port, ssl=insecure, ssl_handshake_timeout=timeout), timeout)
    except (ssl.SSLError, OSError, TimeoutError):
        return False
    writer.transport.abort()
    return True


@dataclass
class CallResult:
    call: Check
    clock: Check
    policy: object | None = None  # pb.PolicyInfo when the call went through


async def check_signed_call(cfg: NodeConfig, key, clock_offset_s: float, timeout: float) -> CallResult:
    """A signed Heartbeat (Register for an unknown key), and the clock skew its answer shows.

    ``clock_offset_s`` pretends this machine's clock is off by that much (tests, and "what if").
    """
    import grpc

    from veriroll.protos.envelope import sign_request
    from veriroll.protos.reasons import Reason
    from veriroll.protos.service import CallError, SignedStub, full_method, secure_channel
    from veriroll.protos.v1 import coordinator_pb2 as pb

    def local_ms() -> float:
        return time.time() * 1000 + clock_offset_s * 1000

    ca = Path(cfg.ca).expanduser().read_bytes() if cfg.ca else None
    channel = secure_channel(cfg.coordinator, ca, server_name=cfg.server_name or None)
    stub = SignedStub(channel, key, timeout=timeout)

    async def signed(name: str, request, now_ms: int | None = None):
        body = request.SerializeToString()
        md = sign_request(key, full_method(name), body, now_ms=int(local_ms()) if now_ms is None else now_ms)
        return await stub.call_raw(name, body, metadata=md, timeout=timeout)

    async def register(request) -> tuple:
        """Register, paying the proof of work a new key owes when the coordinator asks for it; returns the
        answer and when the answered request was sent (local ms: the clock check brackets that call)."""
        from veriroll.protos.pow import Challenge, solve

        sent = local_ms()
        try:
            return await signed("Register", request), sent
        except CallError as err:
            challenge = Challenge.from_detail(err.details) if err.refusal in (Reason.POW_REQUIRED, Reason.POW_INVALID) else None
            if challenge is None or challenge.bits > cfg.pow_max_bits:
                raise
        ts = int(local_ms())  # the proof is bound to the signed timestamp
        request.pow_nonce = await asyncio.to_thread(solve, challenge.coordinator_key, key.public.raw, ts, challenge.bits)
        request.pow_bits = challenge.bits
        sent = local_ms()
        return await signed("Register", request, now_ms=ts), sent

    registered = False
    try:
        t0 = local_ms()
        try:
            resp = await signed("Heartbeat", pb.HeartbeatRequest(loaded_version=-1))
        except CallError as err:
            if err.refusal is not Reason.UNKNOWN_KEY:
                raise
            from veriroll.node.agent import VERSION
            from veriroll.node.hardware import detect_hardware

            hw = detect_hardware(cfg.cache_dir)
            resp, t0 = await register(pb.RegisterRequest(
                public_key=key.public.raw, software_version=VERSION, display_name=cfg.display_name,
                hardware=pb.HardwareReport(cpu=hw.cpu, cpu_count=hw.cpu_count, ram_bytes=hw.ram_bytes,
                                           disk_free_bytes=hw.disk_free_bytes, os=hw.os)))
            registered = True
        t1 = local_ms()
        policy = None
        try:
            policy = (await signed("GetPolicy", pb.PolicyRequest())).policy
        except CallError:
            policy = None
    except CallError as err:
        if err.refusal is Reason.REPLAYED_NONCE and "restarted" in err.details:
            # The coordinator refuses anything signed before it started: our clock is behind its start.
            return CallResult(
                Check("signed call", OK, "the coordinator answered, but refused the request's timestamp"),
                Check("clock", WARN, "this machine's clock is behind the coordinator's: it signed a request with a "
                                     "time before the coordinator started", NTP_ADVICE, {"refused": True}))
        if err.refusal is Reason.CLOCK_SKEW:
            return CallResult(
                Check("signed call", OK, "the coordinator answered, but refused the request's timestamp"),
                Check("clock", FAIL, f"the coordinator refused this machine's clock: {err.said}", NTP_ADVICE,
                      {"refused": True}))
        skipped = Check("clock", SKIP, "no answer to measure the clock against")
        if err.refusal is Reason.BANNED:
            return CallResult(Check("signed call", FAIL, f"this key is banned by the coordinator: {err.said}",
                                    "see why with `veriroll node credits`; the operator can lift a ban "
                                    "(`veriroll coordinator unban`)"), skipped)
        if err.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return CallResult(Check("signed call", FAIL, f"the coordinator did not answer a signed call ({err.reason}: "
                                                         f"{err.said})",
                                    "the port answers but gRPC does not: check that HOST:PORT is the coordinator's "
                                    "gRPC port and that --ca / --server-name match its TLS"), skipped)
        return CallResult(Check("signed call", FAIL, f"the coordinator refused a signed call: {err}",
                                "if this persists, report it to the coordinator's operator with this message"), skipped)
    finally:
        await channel.close()

    rtt_ms = t1 - t0
    skew_s = (resp.server_time_ms - (t0 + t1) / 2) / 1000  # > 0: the coordinator's clock is ahead of ours
    data = {"skew_s": round(skew_s, 3), "rtt_ms": round(rtt_ms, 1)}
    how = f"{abs(skew_s):.1f}s {'behind' if skew_s > 0 else 'ahead of'} the coordinator (round trip {rtt_ms:.0f} ms)"
    if abs(skew_s) <= CLOCK_OK_S:
        clock = Check("clock", OK, f"this machine's clock is {how}", data=data)
    elif abs(skew_s) <= CLOCK_FAIL_S:
        clock = Check("clock", WARN, f"this machine's clock is {how}; signed requests still pass, but not for long "
                                     "if it drifts", NTP_ADVICE, data)
    else:
        clock = Check("clock", FAIL, f"this machine's clock is {how}; the coordinator refuses requests beyond its "
                                     "window (±60 s by default)", NTP_ADVICE, data)
    standing = getattr(resp, "standing", "")
    detail = ("registered this key with the coordinator" if registered else "signed Heartbeat answered") + \
             (f"; standing {standing}" if standing else "")
    call_data = {"registered": registered, "standing": standing,
                 "policy_version": int(policy.version) if policy is not None else None}
    return CallResult(Check("signed call", OK, detail, data=call_data), clock, policy)


async def check_relay(url: str, session, *, policy_version: int | None, coordinator_key, timeout: float,
                      sample_bytes: int = DEFAULT_SAMPLE_BYTES) -> Check:
    """A relay answers ``/status``, holds a coordinator-signed version, and serves a sample at some speed."""
    import aiohttp

    from veriroll.shardcast.errors import ManifestSignatureError, ShardcastError
    from veriroll.shardcast.fetch import normalize_relay_url

    url = normalize_relay_url(url)
    name = f"relay {url}"
    t = aiohttp.ClientTimeout(total=timeout)
    try:
        async with session.get(url + "/status", timeout=t) as r:
            if r.status != 200:
                raise ValueError(f"/status answered HTTP {r.status}")
            status = await r.json(content_type=None)
        versions = [int(v) for v in status.get("versions") or []]
    except (aiohttp.ClientError, TimeoutError, ValueError, TypeError) as exc:
        return Check(name, FAIL, f"cannot read {url}/status: {exc or type(exc).__name__}",
                     "check the relay URL (a shardcast relay answers GET /status) and your network; other relays, "
                     "or the coordinator's own list (leave out --relay), may work")
    if not versions:
        return Check(name, WARN, "the relay answers but holds no checkpoint version yet",
                     "wait for it to mirror one, or use another relay", {"versions": []})
    latest = max(versions)
    data: dict = {"versions": versions, "latest": latest}
    try:
        async with session.get(f"{url}/versions/{latest}/manifest", timeout=t) as r:
            if r.status != 200:
                raise ValueError(f"manifest of version {latest} answered HTTP {r.status}")
            raw = await r.read()
        if coordinator_key is not None:
            from veriroll.shardcast.manifest import verify_manifest

            manifest = verify_manifest(raw, coordinator_key, expect_version=latest)
            files = [(f.name, f.size) for f in manifest.files]
        else:
            import json

            body = json.loads(raw)["manifest"]
            files = [(f["name"], int(f["size"])) for f in body["files"]]
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError, ShardcastError) as exc:
        if isinstance(exc, ManifestSignatureError):
            return Check(name, FAIL, f"version {latest} on this relay is not signed by the coordinator's key",
                         "this relay serves checkpoints of another network (or tampered ones): do not use it", data)
        return Check(name, FAIL, f"cannot read the manifest of version {latest}: {exc}",
                     "the relay is broken or not a shardcast relay: use another one", data)
    data["checkpoint_bytes"] = total = sum(size for _, size in files)
    fname, fsize = max(files, key=lambda f: f[1])
    want = min(fsize, sample_bytes)
    got = 0
    start = time.perf_counter()
    if want > 0:
        try:
            headers = {"Range": f"bytes=0-{want - 1}"}
            async with session.get(f"{url}/versions/{latest}/files/{quote(fname)}", headers=headers,
                                   timeout=aiohttp.ClientTimeout(total=max(timeout, 60.0))) as r:
                if r.status not in (200, 206):
                    raise ValueError(f"download answered HTTP {r.status}")
                async for chunk in r.content.iter_chunked(1 << 16):
                    got += len(chunk)
                    if got >= want:
                        break
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            return Check(name, FAIL, f"downloading from the relay failed: {exc or type(exc).__name__}",
                         "the relay or the network in between is unreliable: use another relay", data)
    seconds = max(time.perf_counter() - start, 1e-6)
    bps = got / seconds
    data.update(sample_bytes=got, bytes_per_s=round(bps))
    speed = f"{bps / 1e6:.1f} MB/s" if bps >= 1e5 else f"{bps / 1e3:.0f} kB/s"
    eta = total / bps if bps > 0 else float("inf")
    detail = f"holds versions {versions[0]}..{latest}; downloaded {got / 1e6:.2f} MB at {speed}"
    if policy_version is not None and latest < policy_version:
        return Check(name, WARN, detail + f"; but the coordinator is at version {policy_version}",
                     "the relay is behind: it may still be mirroring; if it stays behind, use another relay", data)
    if got >= min(sample_bytes, 1 << 20) and bps < SLOW_RELAY_BPS:
        return Check(name, WARN, detail + f"; a full checkpoint ({total / 1e6:.0f} MB) takes ~{eta / 60:.0f} min",
                     "slow downloads delay every new policy version: try a relay closer to you, or check your "
                     "connection", data)
    return Check(name, OK, detail, data=data)


def check_disk(path: str | os.PathLike, need_bytes: int) -> Check:
    """Free space on the file system that will hold checkpoints."""
    p = Path(path).expanduser()
    probe = p
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError as exc:
        return Check("disk", FAIL, f"cannot read free space at {p}: {exc.strerror or exc}",
                     "check that the cache directory (--cache-dir) is on a mounted, readable disk")
    data = {"path": str(p), "free_bytes": free, "need_bytes": need_bytes}
    gib = 1 << 30
    if free < need_bytes:
        return Check("disk", FAIL, f"{free / gib:.1f} GiB free at {p}; checkpoints need about {need_bytes / gib:.1f} GiB",
                     "free some space there, or put the cache on a larger disk with --cache-dir", data)
    if free < 2 * need_bytes:
        return Check("disk", WARN, f"{free / gib:.1f} GiB free at {p}; checkpoints need about {need_bytes / gib:.1f} GiB",
                     "space is tight: the next versions may not fit", data)
    return Check("disk", OK, f"{free / gib:.1f} GiB free at {p}", data=data)


# --- the whole examination ------------------------------------------------------------------------------


async def coordinator_checks(cfg: NodeConfig, timeout_s: float) -> list[Check]:
    """The ``coordinator`` and ``tls`` checks: address, CA file, TCP, then TLS and gRPC on that port.

    A bad CA file is reported even when the coordinator cannot be reached: no retry would fix it.
    """
    reach, parts = check_address(cfg.coordinator)
    if parts is not None:
        reach = await check_reachable(*parts, timeout_s)
    if reach.status == OK:
        tls = await check_tls(*parts, cfg.ca, cfg.server_name, timeout_s)
    else:
        tls = check_ca_file(cfg.ca) or Check("tls", SKIP, "skipped: the coordinator is not reachable")
    return [reach, tls]


def offline_checks(cfg: NodeConfig) -> list[Check]:
    """Key, address and CA file: the mistakes found without the network, in a fraction of a second."""
    ca = check_ca_file(cfg.ca)
    return [check_key(cfg.key), check_address(cfg.coordinator)[0], *([ca] if ca else [])]


def first_failure(checks: list[Check]) -> Check | None:
    """The failure to report: the first that no retry fixes, else the first that may pass on its own."""
    failed = [c for c in checks if c.status == FAIL]
    return next((c for c in failed if not c.transient), failed[0] if failed else None)


def format_failure(check: Check) -> str:
    """A failed check in two lines, as the doctor prints it: what is wrong, then what to do."""
    return f"{check.name}: {check.detail}\n  → {check.advice}"


async def run_doctor(cfg: NodeConfig, *, clock_offset_s: float = 0.0, timeout_s: float = 5.0,
                     min_free_bytes: int = DEFAULT_MIN_FREE, sample_bytes: int = DEFAULT_SAMPLE_BYTES) -> list[Check]:
    """Every check for ``cfg`` (relays: ``cfg.relays``, else the coordinator's list), in order."""
    import aiohttp

    from veriroll.protos.identity import InvalidPublicKey, PublicKey, load_private_key, load_public_key

    checks: list[Check] = [check_key(cfg.key), *await coordinator_checks(cfg, timeout_s)]
    key_ok = checks[0].status != FAIL
    reachable = checks[1].status == OK
    skip = "skipped: the coordinator is not reachable"
    tls_ok = checks[2].status != FAIL
    policy = None
    if not reachable or not tls_ok or not key_ok:
        why = skip if not reachable else "skipped: TLS failed" if not tls_ok else "skipped: no usable key"
        checks += [Check("signed call", SKIP, why), Check("clock", SKIP, why)]
    else:
        result = await check_signed_call(cfg, load_private_key(Path(cfg.key).expanduser()), clock_offset_s, timeout_s)
        checks += [result.call, result.clock]
        policy = result.policy

    checkpoint_bytes = 0
    if cfg.checkpoint_dir:
        checks.append(Check("relays", SKIP, f"versions are read from {cfg.checkpoint_dir}, not relays"))
    else:
        relays = list(cfg.relays) or (list(policy.relays) if policy is not None else [])
        ckey = None
        if cfg.coordinator_key:
            ckey = load_public_key(Path(cfg.coordinator_key).expanduser())
        elif policy is not None and len(policy.coordinator_public_key) == 32:
            try:
                ckey = PublicKey(bytes(policy.coordinator_public_key))
            except InvalidPublicKey:  # small order or non-canonical: not a key to check manifests with
                ckey = None
        if not relays:
            checks.append(Check("relays", SKIP, "no relays given (--relay) and none learned from the coordinator"))
        async with aiohttp.ClientSession() as session:
            for url in relays:
                c = await check_relay(url, session, policy_version=int(policy.version) if policy is not None else None,
                                      coordinator_key=ckey, timeout=timeout_s, sample_bytes=sample_bytes)
                checks.append(c)
                checkpoint_bytes = max(checkpoint_bytes, int(c.data.get("checkpoint_bytes", 0)))
    # Room for the versions kept plus the one being fetched.
    need = max(min_free_bytes, (cfg.keep_versions + 1) * checkpoint_bytes)
    checks.append(check_disk(cfg.cache_dir, need))
    checks.append(check_torch_build())
    return checks


def check_torch_build() -> Check:
    """Whether the installed torch fits this machine (a CUDA build without a driver costs gigabytes for
    nothing; a CPU build leaves a GPU idle) and is the version veriroll is tested with; from package
    metadata, without importing torch."""
    from veriroll.node.install import installed_torch_fit

    torch, advice = installed_torch_fit()
    if advice:
        what, _, fix = advice.partition("; ")
        return Check("torch build", WARN, what, fix or advice)
    return Check("torch build", OK, f"torch {torch}, the tested build for this machine")


def report(checks: list[Check]) -> dict:
    """The JSON form: ``{"ok": bool, "checks": [{name, status, detail, advice, data}]}``."""
    return {"ok": all(c.passed for c in checks), "checks": [asdict(c) for c in checks]}


def format_report(checks: list[Check]) -> str:
    """Plain text, one line per check, advice indented under anything not ``ok``."""
    marks = {OK: "  ok ", WARN: " warn", FAIL: " FAIL", SKIP: " skip"}
    width = max(len(c.name) for c in checks)
    lines = []
    for c in checks:
        lines.append(f"{marks[c.status]}  {c.name:<{width}}  {c.detail}")
        if c.advice and c.status != OK:
            lines.append(f"{'':7}{'':<{width}}  → {c.advice}")
    failed = [c for c in checks if c.status == FAIL]
    lines.append("")
    lines.append("all checks passed" if not failed else
                 f"{len(failed)} problem{'s' if len(failed) > 1 else ''} to fix: {', '.join(c.name for c in failed)}")
    return "\n".join(lines)
