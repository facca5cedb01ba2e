"""The Coordinator service's method table and a signing client stub.

Requests are serialized here, signed over their exact bytes, and sent with the raw-bytes
serializer, so what the server hashes is byte for byte what the client signed.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

import grpc

from veriroll.protos.envelope import REASON_TRAILER, sign_request
from veriroll.protos.errors import VerirollError
from veriroll.protos.identity import PrivateKey
from veriroll.protos.pow import DEFAULT_MAX_BITS, Challenge, solve
from veriroll.protos.reasons import Reason, parse_reason
from veriroll.protos.v1 import coordinator_pb2 as pb

# Re-exported: the node and the coordinator import them from here.
from veriroll.protos.version import SOFTWARE_VERSION, UPGRADE_COMMAND  # noqa: F401

SERVICE = "veriroll.v1.Coordinator"


METHODS: dict[str, tuple[type, type]] = {
    "Register": (pb.RegisterRequest, pb.RegisterResponse),
    "Heartbeat": (pb.HeartbeatRequest, pb.HeartbeatResponse),
    "LeaseWork": (pb.LeaseRequest, pb.LeaseResponse),
    "SubmitGroup": (pb.SubmitGroupRequest, pb.SubmitGroupResponse),
    "GetPolicy": (pb.PolicyRequest, pb.PolicyResponse),
    "GetLedger": (pb.LedgerRequest, pb.LedgerResponse),
}

# Every call carries a deadline (the server refuses calls without one): the longer of the stub's timeout
# and the method's own, so a short general timeout never cuts off SubmitGroup while the group is verified.
DEFAULT_TIMEOUT_S = {"SubmitGroup": 120.0}
DEFAULT_TIMEOUT = 15.0
_POW_REFUSALS = (Reason.POW_REQUIRED, Reason.POW_INVALID)


def full_method(name: str) -> str:
    return f"/{SERVICE}/{name}"


def _identity(b: bytes) -> bytes:
    return b


@dataclass
class CallError(VerirollError):
    """A call the coordinator refused or could not answer, with its veriroll reason code.

    ``reason`` is the code as the wire spelled it (shown and counted as is); ``refusal`` is that code parsed,
    once, into the contract's enum: compare that. It is None when the call failed without a veriroll
    reason (``deadline_exceeded``: a gRPC status in lower case) or with one this release does not know.
    """

    code: grpc.StatusCode
    reason: str
    details: str
    refusal: Reason | None = field(init=False)

    def __post_init__(self) -> None:
        self.refusal = parse_reason(self.reason)

    @property
    def said(self) -> str:
        """The coordinator's words without the reason code they start with on the wire (``reason: ...``)."""
        return self.details.removeprefix(f"{self.reason}: ") if self.details != self.reason else ""

    def __str__(self) -> str:
        return f"{self.reason} ({self.code.name}): {self.said}"


def reason_of(err: grpc.aio.AioRpcError | grpc.RpcError, trailing=None) -> str:
    """The veriroll reason code carried by a failed call (trailer first, then the message prefix)."""
    try:
        trailing = trailing if trailing is not None else err.trailing_metadata()
    except Exception:  # noqa: BLE001 - a broken call may have no trailers at all
        trailing = None
    for key, value in trailing or ():
        if key == REASON_TRAILER:
            return value if isinstance(value, str) else value.decode()
    details = err.details() or ""
    head = details.split(":", 1)[0]
    if head and head.replace("_", "").isalpha() and head.islower():
        return head
    return err.code().name.lower()


class SignedStub:
    """Async client for the Coordinator service that signs every request with ``key``.

    ``timeout`` is the deadline of every call, ``method_timeouts`` raises it for slow methods (the longer
    one wins; ``DEFAULT_TIMEOUT_S`` gives SubmitGroup 120 s). ``max_pow_bits`` is the most proof of work
    :meth:`register` will do for a new key.
    """

    def __init__(self, channel: grpc.aio.Channel, key: PrivateKey, *, timeout: float | None = None,
                 method_timeouts: dict[str, float] | None = None, max_pow_bits: int = DEFAULT_MAX_BITS):
        self.channel = channel
        self.key = key
        self.timeout = timeout
        self.method_timeouts = {**DEFAULT_TIMEOUT_S, **(method_timeouts or {})}
        self.max_pow_bits = max_pow_bits
        self._calls = {
            name: channel.unary_unary(full_method(name), request_serializer=_identity,
                                      response_deserializer=resp.FromString)
            for name, (_, resp) in METHODS.items()
        }

    def deadline_s(self, name: str) -> float:
        """The deadline of a call of ``name``: the stub's timeout, or the method's own where that is longer."""
        return max(self.timeout or DEFAULT_TIMEOUT, self.method_timeouts.get(name, 0.0))

    async def call_raw(self, name: str, body: bytes, *, timeout: float | None = None, metadata=None,
                       now_ms: int | None = None):
        """Send pre-serialized ``body`` (signed at ``now_ms``, unless ``metadata`` is given) and return the response."""
        md = metadata if metadata is not None else sign_request(self.key, full_method(name), body, now_ms=now_ms)
        try:
            return await self._calls[name](body, metadata=md, timeout=timeout or self.deadline_s(name))
        except grpc.aio.AioRpcError as err:
            raise CallError(err.code(), reason_of(err), err.details() or "") from err

    async def call(self, name: str, request, *, timeout: float | None = None, now_ms: int | None = None):
        return await self.call_raw(name, request.SerializeToString(), timeout=timeout, now_ms=now_ms)

    async def register(self, request: pb.RegisterRequest) -> pb.RegisterResponse:
        """Register; if the coordinator asks this (new) key for proof of work, solve it and send Register once more.

        Solving runs in a worker thread that stops as soon as this call is cancelled. A challenge above
        ``max_pow_bits`` is not attempted: the refusal is raised with a note saying which setting allows it.
        """
        try:
            return await self.call("Register", request)
        except CallError as err:
            challenge = Challenge.from_detail(err.details) if err.refusal in _POW_REFUSALS else None
            if challenge is None:
                raise
            if challenge.bits > self.max_pow_bits:
                raise CallError(err.code, err.reason, f"{err.details}; this node does at most {self.max_pow_bits} "
                                                      "bits of proof of work (raise pow_max_bits)") from err
        ts_ms = int(time.time() * 1000)  # the proof is bound to the envelope's timestamp: sign at the same one
        nonce = await _solve_in_thread(challenge, self.key.public.raw, ts_ms)
        proven = pb.RegisterRequest()
        proven.CopyFrom(request)
        proven.pow_nonce, proven.pow_bits = nonce, challenge.bits
        return await self.call("Register", proven, now_ms=ts_ms)

    async def heartbeat(self, request: pb.HeartbeatRequest) -> pb.HeartbeatResponse:
        return await self.call("Heartbeat", request)

    async def lease_work(self, request: pb.LeaseRequest) -> pb.LeaseResponse:
        return await self.call("LeaseWork", request)

    async def submit_group(self, request: pb.SubmitGroupRequest) -> pb.SubmitGroupResponse:
        return await self.call("SubmitGroup", request)

    async def get_policy(self) -> pb.PolicyResponse:
        return await self.call("GetPolicy", pb.PolicyRequest())

    async def get_ledger(self) -> pb.LedgerResponse:
        return await self.call("GetLedger", pb.LedgerRequest())


async def _solve_in_thread(challenge: Challenge, node_key: bytes, ts_ms: int) -> int:
    """:func:`veriroll.protos.pow.solve` off the event loop; cancelling the caller stops the thread within ms."""
    cancel = threading.Event()
    try:
        nonce = await asyncio.to_thread(solve, challenge.coordinator_key, node_key, ts_ms, challenge.bits,
                                        cancelled=cancel.is_set)
    finally:
        cancel.set()
    if nonce is None:
        raise RuntimeError(f"no nonce reaches {challenge.bits} bits of proof of work")
    return nonce


def secure_channel(target: str, ca_pem: bytes | None, *, server_name: str | None = None) -> grpc.aio.Channel:
    """A channel to the coordinator: TLS with ``ca_pem`` as the trust root, plaintext when ``None``."""
    options = [
        ("grpc.keepalive_time_ms", 60_000),
        ("grpc.keepalive_timeout_ms", 20_000),
        ("grpc.max_receive_message_length", 16 * 1024 * 1024),
        ("grpc.max_send_message_length", 64 * 1024 * 1024),
        ("grpc.enable_retries", 0),
    ]
    if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    if ca_pem is None:
        return grpc.aio.insecure_channel(target, options=options)
    creds = grpc.ssl_channel_credentials(root_certificates=ca_pem)
    return grpc.aio.secure_channel(target, creds, options=options)
