"""The Coordinator service's method table and a signing client stub.

Requests are serialized here, signed over their exact bytes, and sent with the raw-bytes
serializer, so what the server hashes is byte for byte what the client signed.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from veriroll.protos.envelope import REASON_TRAILER, sign_request
from veriroll.protos.identity import PrivateKey
from veriroll.protos.v1 import coordinator_pb2 as pb

SERVICE = "veriroll.v1.Coordinator"

METHODS: dict[str, tuple[type, type]] = {
    "Register": (pb.RegisterRequest, pb.RegisterResponse),
    "Heartbeat": (pb.HeartbeatRequest, pb.HeartbeatResponse),
    "LeaseWork": (pb.LeaseRequest, pb.LeaseResponse),
    "SubmitGroup": (pb.SubmitGroupRequest, pb.SubmitGroupResponse),
    "GetPolicy": (pb.PolicyRequest, pb.PolicyResponse),
    "GetLedger": (pb.LedgerRequest, pb.LedgerResponse),
}

# Client-side defaults: every call carries a deadline (the server refuses calls without one).
DEFAULT_TIMEOUT_S = {"SubmitGroup": 120.0}
DEFAULT_TIMEOUT = 15.0


def full_method(name: str) -> str:
    return f"/{SERVICE}/{name}"


def _identity(b: bytes) -> bytes:
    return b


@dataclass
class CallError(Exception):
    """A call the coordinator refused or could not answer, with its veriroll reason code."""

    code: grpc.StatusCode
    reason: str
    details: str

    def __str__(self) -> str:
        return f"{self.reason} ({self.code.name}): {self.details}"


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
    """Async client for the Coordinator service that signs every request with ``key``."""

    def __init__(self, channel: grpc.aio.Channel, key: PrivateKey, *, timeout: float | None = None):
        self.channel = channel
        self.key = key
        self.timeout = timeout
        self._calls = {
            name: channel.unary_unary(full_method(name), request_serializer=_identity,
                                      response_deserializer=resp.FromString)
            for name, (_, resp) in METHODS.items()
        }

    async def call_raw(self, name: str, body: bytes, *, timeout: float | None = None, metadata=None):
        """Send pre-serialized ``body`` (signed unless ``metadata`` is given) and return the response."""
        md = metadata if metadata is not None else sign_request(self.key, full_method(name), body)
        t = timeout or self.timeout or DEFAULT_TIMEOUT_S.get(name, DEFAULT_TIMEOUT)
        try:
            return await self._calls[name](body, metadata=md, timeout=t)
        except grpc.aio.AioRpcError as err:
            raise CallError(err.code(), reason_of(err), err.details() or "") from err

    async def call(self, name: str, request, *, timeout: float | None = None):
        return await self.call_raw(name, request.SerializeToString(), timeout=timeout)

    async def register(self, request: pb.RegisterRequest) -> pb.RegisterResponse:
        return await self.call("Register", request)

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
