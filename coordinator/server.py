"""The gRPC edge: raw bytes in, reasons out as status codes.

Handlers are registered with no request deserializer, so the service receives the serialized request
and checks the signature over exactly those bytes before parsing (interceptors never see the body).
Every refusal, already counted by the service, sets the ``x-veriroll-reason`` trailer and aborts with
the reason's status code and a ``reason: message`` detail.
"""

from __future__ import annotations

import errno
import logging
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from veriroll.coordinator.service import CoordinatorService, Refusal
from veriroll.protos.envelope import REASON_TRAILER
from veriroll.protos.netaddr import peer_address
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
            # Stream-unary on our side (a unary client is unchanged): the handler runs on the headers alone
            # and reads the one request message itself, after the per-address and deadline checks and
            # under a time limit, instead of gRPC holding a call slot until a stalled body arrives.
            full_method(name): grpc.stream_unary_rpc_method_handler(
                self._make(name), request_deserializer=None, response_serializer=lambda m: m.SerializeToString())
            for name in METHODS
        }

    def service_name(self) -> str:
        return SERVICE

    def service(self, handler_call_details):
        return self._handlers.get(handler_call_details.method)

    def _make(self, name: str):
        svc = self.svc

        async def handle(_requests, context: grpc.aio.ServicerContext):
            start = time.perf_counter()

            async def read_body() -> bytes | None:
                # The first message (a unary client sends exactly one), read from the context rather than by
                # iterating the request stream: a stream left suspended after its first message keeps that
                # message alive until the loop closes it.
                body = await context.read()
                return None if body is grpc.aio.EOF else body

            try:
                try:
                    return await svc.call(name, read_body, context.invocation_metadata(),
                                          peer_address(context.peer()), has_deadline=context.time_remaining() is not None)
                except Refusal as refusal:  # counted by the service; here only mapped to a status code
                    reason, detail = refusal.reason, refusal.detail
                # Aborted outside the except block, so the abort does not chain the refusal: its traceback holds
                # the frames that served the request, body included, and gRPC keeps the abort in the call's
                # state, a reference cycle that only a full collection frees (rare in a process this big).
                context.set_trailing_metadata(((REASON_TRAILER, reason.value),))
                await context.abort(reason.code, f"{reason.value}: {detail}")
            finally:
                svc.metrics.request_latency.observe(time.perf_counter() - start, method=name)

        return handle


def server_options(service: CoordinatorService, max_connections: int = 0) -> list[tuple[str, int]]:
    """gRPC server arguments: the size cap enforced before buffering, a time limit on every connection, and
    (``max_connections`` > 0) how many connections may be open at once."""
    server = service.cfg.server
    quota = [("grpc.max_allowed_incoming_connections", max_connections)] if max_connections > 0 else []
    return [*quota,
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
        ("grpc.so_reuseport", int(server.reuse_port or service.cfg.role == "edge")),
    ]


async def start_server(service: CoordinatorService, *, host: str, port: int, tls: tuple[bytes, bytes] | None,
                       max_connections: int = 0) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """Start serving; returns the server, the bound port and the health servicer. Past ``max_connections``
    open at once (0: no cap of its own) gRPC closes new connections at accept, before TLS: they cost
    nothing but the accept, and are not counted (Python never sees them)."""
    server = grpc.aio.server(options=server_options(service, max_connections),
                             maximum_concurrent_rpcs=service.cfg.server.max_concurrent_rpcs)
    server.add_generic_rpc_handlers((_Edge(service),))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{host}:{port}"
    try:
        if tls is None:
            bound = server.add_insecure_port(address)
        else:
            key_pem, cert_pem = tls
            bound = server.add_secure_port(address, grpc.ssl_server_credentials([(key_pem, cert_pem)]))
    except RuntimeError:  # grpcio says "Failed to bind" without the cause
        bound = 0
    if bound == 0:
        raise OSError(errno.EADDRINUSE, f"{address} is in use, or not an address of this machine")
    await server.start()
    await health_servicer.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return server, bound, health_servicer


def read_tls(cert: Path, key: Path) -> tuple[bytes, bytes]:
    return key.read_bytes(), cert.read_bytes()
