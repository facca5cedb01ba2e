"""The relay: an aiohttp server that serves a store of signed checkpoint versions, and can mirror one.

Two modes, one server:

- **origin** (no upstreams): serves the store that ``publish`` writes into, picking up new versions
  as they are renamed into place (publish may run in another process).
- **mirror** (``upstreams`` given): every ``poll_interval`` seconds asks the upstream relays what they
  hold and fetches the newest ``keep`` versions with the same verified fetch a node uses (signature,
  every shard, every file; from the delta against a version it holds where there is one, keeping the
  delta to serve it in turn), into a hidden directory that is renamed into place once complete. Older
  versions are pruned. Mirrors can mirror mirrors: origin → relays → relays → nodes. ``fallbacks``
  (the origin, say) are mirrored from only for a version the upstreams have not listed for
  ``fallback_after`` seconds while a fallback has: an upstream that stopped answering, or one stuck
  behind its own, holds its subtree back that long and no longer.

**Streaming.** While a mirror fetches a version it already serves it, shard by shard: as soon as the
verified manifest is in, the version is listed under ``streaming`` in ``/status`` (not under
``versions``, which stays "held whole"), and each byte range is served once every shard (or delta
piece) under it is verified. A request for a range not verified yet waits for it, up to
``stream_wait`` seconds, then gets ``503`` with ``Retry-After`` (refusal ``not-yet``): it is coming, ask
again. So a tree of relays pipelines a version instead of adding one whole download per level.

Every version a relay lists has a manifest signed by the coordinator key it was started with; one under
``versions`` has files of the sizes the manifest says, and a relay serves no byte it has not verified.

URL scheme (all GET, HEAD too; JSON is UTF-8):

===================================  ==========================================================
``/status``                          ``{"service", "protocol", "role", "versions", "latest",
                                     "keep", "upstreams", "fallbacks", "load": {...}, "limits": {...},
                                     "mirror": {...}}``;
                                     ``load`` has ``active_transfers``, ``open_connections``,
                                     ``requests_total``, ``bytes_served_total``,
                                     ``busy_rejections_total``, ``send_timeouts_total``,
                                     ``rejections`` (by reason),
                                     ``per_address_rejections_total``, ``uptime_s``;
                                     ``limits`` has the limits below; ``streaming``: versions
                                     being mirrored and served as they arrive. Not cached.
``/versions``                        ``{"versions": [N, ...], "latest": N | null}``, oldest first.
``/versions/latest/manifest``        the signed manifest of the newest version held (header
                                     ``X-Shardcast-Version: N``). Not cached.
``/versions/{N}/manifest``           the signed manifest of version N, byte for byte as published.
``/versions/{N}/files/{name}``       the bytes of file ``name`` (as listed in the manifest; ``/``
                                     allowed) of version N. ``Range: bytes=a-b`` answers 206 with
                                     just those bytes: a shard is the range (offset, offset+size-1).
``/versions/{N}/delta``              the delta file of version N (its pieces end to end, as the
                                     manifest's ``delta`` lists them), ranges as for files; 404 where
                                     the version has no delta, or this relay does not hold it.
===================================  ==========================================================

Versioned responses are immutable (``Cache-Control: public, max-age=31536000, immutable``), so a
plain HTTP cache in front of a relay is safe. Unknown versions and files are 404.

Anyone may connect, so no client can take what the others need (``docs/relay.md`` for operators):

- **Connections.** At most ``max_connections`` in all and ``max_connections_per_address`` from one
  address (an IPv4 address, or an IPv6 /64: one subscriber's allocation). The relay accepts
  connections itself (aiohttp has no hook at accept) and closes one over either limit at once, before
  reading a byte of it.
- **Transfers.** At most ``max_transfers`` file downloads at once (beyond: 503) and
  ``max_transfers_per_address`` from one address (beyond: 429), refused before the file is opened.
  Refusals carry ``Retry-After`` and ``X-Shardcast-Refusal: <reason>``; ``/status`` counts every
  refusal by reason (``load.rejections``; the per-address ones also in
  ``load.per_address_rejections_total``).
- **Slow or silent clients.** A connection that has not sent a complete request head within
  ``idle_timeout`` seconds of being accepted or of its last answer is closed: that covers idle
  keep-alive connections and clients that send their headers a byte at a time. An answer that is not
  sent within ``send_grace + bytes / min_send_rate`` seconds is cut off and its connection dropped.
  Request lines and headers are bounded (``MAX_REQUEST_LINE``, ``MAX_HEADER_FIELD``, ``MAX_HEADERS``)
  and a request with a body is refused (400, connection closed): a relay takes GET and HEAD only.

Every transfer is its own task on one event loop, streamed with ``sendfile`` from the page cache, so a
silent client costs one socket and never delays another client; memory does not grow with file sizes.
``serve_relay`` stops on SIGTERM or SIGINT within seconds whatever is in flight (transfers are cut;
clients resume elsewhere or later).

Modules: ``server.py`` (``RelayServer``: state and lifecycle), ``config.py`` (``RelayConfig`` and the
``relay run`` flags), ``catalogue.py`` (the versions served), ``admission.py`` (connection and transfer
limits), ``routes.py`` (the URL scheme), ``mirror.py`` (the mirror's rounds).
"""

from .admission import MAX_HEADER_FIELD, MAX_HEADERS, MAX_REQUEST_LINE, Refusal, address_key
from .catalogue import HeldVersion, StreamingVersion
from .catalogue import _Coverage as _Coverage  # tests reach it here
from .config import (
    DEFAULT_FALLBACK_AFTER,
    DEFAULT_IDLE_TIMEOUT,
    DEFAULT_KEEP,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_CONNECTIONS_PER_ADDRESS,
    DEFAULT_MAX_TRANSFERS,
    DEFAULT_MAX_TRANSFERS_PER_ADDRESS,
    DEFAULT_MIN_SEND_RATE,
    DEFAULT_POLL_INTERVAL,
    DEFAULT_PORT,
    DEFAULT_SEND_GRACE,
    DEFAULT_STREAM_WAIT,
    RELAY_FLAGS,
    RelayConfig,
    RelayConfigError,
    add_relay_flags,
    relay_config_from_args,
)
from .routes import IMMUTABLE, PROTOCOL
from .server import RelayServer, serve_relay

__all__ = [
    "DEFAULT_FALLBACK_AFTER",
    "DEFAULT_IDLE_TIMEOUT",
    "DEFAULT_KEEP",
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_MAX_CONNECTIONS_PER_ADDRESS",
    "DEFAULT_MAX_TRANSFERS",
    "DEFAULT_MAX_TRANSFERS_PER_ADDRESS",
    "DEFAULT_MIN_SEND_RATE",
    "DEFAULT_POLL_INTERVAL",
    "DEFAULT_PORT",
    "DEFAULT_SEND_GRACE",
    "DEFAULT_STREAM_WAIT",
    "IMMUTABLE",
    "MAX_HEADERS",
    "MAX_HEADER_FIELD",
    "MAX_REQUEST_LINE",
    "PROTOCOL",
    "RELAY_FLAGS",
    "HeldVersion",
    "Refusal",
    "RelayConfig",
    "RelayConfigError",
    "RelayServer",
    "StreamingVersion",
    "add_relay_flags",
    "address_key",
    "relay_config_from_args",
    "serve_relay",
]
