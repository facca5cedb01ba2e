"""The gRPC edge: raw bytes in, signature checked over exactly those bytes, reasons out as status codes.

Handlers are registered with no request deserializer, so each one receives the serialized request
and hashes it before parsing (interceptors never see the body). Every refusal sets the
``x-veriroll-reason`` trailer, aborts with the reason's status code and a ``reason: message``
detail, and is counted.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from veriroll.coordinator.admission import peer_address
from veriroll.coordinator.service import CoordinatorService, Refusal
from veriroll.protos.envelope import REASON_TRAILER, EnvelopeError, parse_headers
from veriroll.protos.reasons import Reason
from veriroll.protos.service import METHODS, SERVICE, full_method

log = logging.getLogger("veriroll.coordinator.server")

# gRPC refuses a body longer than max_message_bytes plus this margin from its length prefix, before
# buffering it (RESOURCE_EXHAUSTED "Received message larger than max", no veriroll reason; seen only in
# gRPC's own failed-call count, exported as veriroll_grpc_calls{result="failed"}). A body within the
# margin reaches the edge, which refuses and counts it as message_too_large. Letting larger bodies
# through to count them cost memory: 36 concurrent 30 MiB bodies under the old 4x cap left 1.2 GB resident.
TRANSPORT_MARGIN_BYTES = 64 * 1024


class _Edge(grpc.GenericRpcHandler):
    def __init__(self, service: CoordinatorService):
        self.svc = service
        self._handlers = {
            full_method(name): grpc.unary_unary_rpc_method_handler(
                self._make(name), request_deserializer=None, response_serializer=lambda m: m.SerializeToString())
            for name in METHODS
        }

    def service_name(self) -> str:
        return SERVICE

    def service(self, handler_call_details):
        return self._handlers.get(handler_call_details.method)

    def _make(self, name: str):
        request_type = METHODS[name][0]
        method = full_method(name)
        svc = self.svc
        impl = {
            "Register": None,
            "Heartbeat": svc.heartbeat,
            "LeaseWork": svc.lease_work,
            "SubmitGroup": svc.submit_group,
            "GetPolicy": svc.get_policy,
            "GetLedger": svc.get_ledger,
        }[name]

        async def handle(body: bytes, context: grpc.aio.ServicerContext):
            start = time.perf_counter()
            node_id = ""
            try:
                if context.time_remaining() is None:
                    raise Refusal(Reason.DEADLINE_REQUIRED)
                if len(body) > svc.cfg.server.max_message_bytes:
                    raise Refusal(Reason.MESSAGE_TOO_LARGE,
                                  f"{len(body)} bytes > {svc.cfg.server.max_message_bytes} accepted")
                try:
                    headers = parse_headers(context.invocation_metadata())
                except EnvelopeError as exc:
                    raise Refusal(Reason(exc.reason), str(exc)) from exc
                node = await svc.admit(method, name, body, headers, peer_address(context.peer()))
                node_id = node.node_id if node else ""
                try:
                    request = request_type.FromString(body)
                except DecodeError as exc:
                    raise Refusal(Reason.MALFORMED, f"cannot parse {request_type.__name__}: {exc}") from exc
                if impl is None:
                    response = await svc.register(headers, request)
                else:
                    response = await impl(node, request)
                svc.metrics.requests.inc(method=name, result="ok")
                return response
            except Refusal as refusal:
                svc.metrics.requests.inc(method=name, result=refusal.reason.value)
                if name != "SubmitGroup" or refusal.reason not in _COUNTED_BY_INTAKE:
                    await svc.count_refusal(node_id, refusal.reason, refusal.detail)
                context.set_trailing_metadata(((REASON_TRAILER, refusal.reason.value),))
                await context.abort(refusal.reason.code, f"{refusal.reason.value}: {refusal.detail}")
            except grpc.aio.AbortError:
                raise
            except Exception:  # noqa: BLE001 - never crash the edge; nothing was accepted
                log.exception("internal error in %s", name)
                svc.metrics.requests.inc(method=name, result="internal")
                await svc.count_refusal(node_id, Reason.INTERNAL, f"internal error in {name}")
                context.set_trailing_metadata(((REASON_TRAILER, Reason.INTERNAL.value),))
                await context.abort(grpc.StatusCode.INTERNAL, f"internal: {Reason.INTERNAL.message}")
            finally:
                svc.metrics.request_latency.observe(time.perf_counter() - start, method=name)

        return handle


# SubmitGroup counts its own content rejections (with the lease attached); the edge counts the rest.
_COUNTED_BY_INTAKE = frozenset({
    Reason.LEASE_UNKNOWN, Reason.LEASE_NOT_YOURS, Reason.LEASE_EXPIRED, Reason.LEASE_USED,
    Reason.WRONG_GROUP_SIZE, Reason.VERSION_MISMATCH, Reason.TOO_LONG, Reason.TOKEN_OUT_OF_VOCAB,
    Reason.BAD_LOGPROBS, Reason.PROOF_TOO_LARGE, Reason.BAD_FINISH, Reason.STALE_VERSION,
    Reason.TOPLOC_FAILED, Reason.SAMPLING_FAILED, Reason.LOGPROB_MISMATCH,
})


def server_options(service: CoordinatorService) -> list[tuple[str, int]]:
    """gRPC server arguments: the size cap enforced before buffering, and a time limit on every connection."""
    server = service.cfg.server
    return [
        ("grpc.max_receive_message_length", server.max_message_bytes + TRANSPORT_MARGIN_BYTES),
        ("grpc.max_send_message_length", 16 * 1024 * 1024),
        # A connection that has not finished TLS and the HTTP/2 preface in time (a bare TCP connection, a
        # stalled handshake) is dropped; one with no call in flight for idle_timeout_s gets a GOAWAY.
        ("grpc.server_handshake_timeout_ms", int(server.handshake_timeout_s * 1000)),
        ("grpc.max_connection_idle_ms", int(server.idle_timeout_s * 1000)),
        # Keepalive enforcement: clients may ping at most every 30 s, two strikes and they are cut off.
        ("grpc.http2.min_ping_interval_without_data_ms", 30_000),
        ("grpc.http2.max_ping_strikes", 2),
        ("grpc.keepalive_time_ms", 120_000),
        ("grpc.keepalive_timeout_ms", 20_000),
        ("grpc.max_connection_age_ms", 60 * 60_000),
        ("grpc.max_connection_age_grace_ms", 60_000),
        ("grpc.so_reuseport", 0),
    ]


async def start_server(service: CoordinatorService, *, host: str, port: int, tls: tuple[bytes, bytes] | None
                       ) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """Start serving; returns the server, the bound port and the health servicer."""
    server = grpc.aio.server(options=server_options(service),
                             maximum_concurrent_rpcs=service.cfg.server.max_concurrent_rpcs)
    server.add_generic_rpc_handlers((_Edge(service),))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{host}:{port}"
    if tls is None:
        bound = server.add_insecure_port(address)
    else:
        key_pem, cert_pem = tls
        bound = server.add_secure_port(address, grpc.ssl_server_credentials([(key_pem, cert_pem)]))
    if bound == 0:
        raise OSError(f"cannot bind the coordinator to {address}")
    await server.start()
    await health_servicer.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return server, bound, health_servicer


def read_tls(cert: Path, key: Path) -> tuple[bytes, bytes]:
    return key.read_bytes(), cert.read_bytes()
