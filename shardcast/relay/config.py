"""A relay's settings: one typed model, ``RelayConfig``, and the ``relay run`` flags mapped onto its fields.

``RELAY_FLAGS`` is the one place a flag meets its field: ``add_relay_flags`` adds them to a parser (help
and default from the field), ``relay_config_from_args`` builds the config from what was parsed. Flag names
are kept as they have always been (``--upstream`` fills ``upstreams``): scripts and compose files use them.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..fetch import normalize_relay_url

DEFAULT_PORT = 8470
DEFAULT_KEEP = 3
DEFAULT_POLL_INTERVAL = 5.0
DEFAULT_IDLE_TIMEOUT = 10.0  # also the header timeout: a request head must be complete by then
DEFAULT_MIN_SEND_RATE = 256 * 1024  # bytes/s a client must keep up, on average, to keep its download
DEFAULT_SEND_GRACE = 30.0
# How long a request for bytes a streaming mirror has not verified yet waits for them before a 503: under
# a fetch's read timeout (20 s by default), so the client hears "not yet" rather than silence, and long
# enough that a shard on its way is usually sent the moment it is verified.
DEFAULT_STREAM_WAIT = 10.0
DEFAULT_MAX_TRANSFERS = 512
DEFAULT_FALLBACK_AFTER = 15.0  # seconds a version may be on the fallback upstreams alone before a mirror takes it there
DEFAULT_MAX_CONNECTIONS = 2048
# A node downloads at most 2 shards from one relay at once (fetch.DEFAULT_PER_RELAY) over a few pooled
# connections: these leave room for several nodes behind one NAT, and none for one address to take
# more than a small share of the relay.
DEFAULT_MAX_TRANSFERS_PER_ADDRESS = 16
DEFAULT_MAX_CONNECTIONS_PER_ADDRESS = 64


class RelayConfig(BaseModel):
    """How a relay serves and mirrors. The store it serves and the key that signs what it serves are not
    settings but what the relay is for: ``RelayServer(store, key, config)``."""

    model_config = ConfigDict(extra="forbid")

    host: str = Field("127.0.0.1", description="address to bind")
    port: int = Field(DEFAULT_PORT, ge=0, le=65535, description="TCP port (0: any free port)")
    keep: int = Field(DEFAULT_KEEP, ge=1, description="versions to mirror and keep")
    upstreams: list[str] = Field(default_factory=list, description="relays to mirror (none: this relay is an "
                                 "origin, serving the store that publish writes into)")
    fallbacks: list[str] = Field(default_factory=list, description="relays to mirror a version from only when no "
                                 "upstream has listed it for fallback_after seconds while one of these has: an "
                                 "upstream that stopped answering or fell behind (e.g. the origin)")
    fallback_after: float = Field(DEFAULT_FALLBACK_AFTER, ge=0, description="seconds a version may be listed by the "
                                  "fallbacks alone before the mirror takes it from them")
    poll_interval: float = Field(DEFAULT_POLL_INTERVAL, gt=0, description="seconds between upstream polls")
    idle_timeout: float = Field(DEFAULT_IDLE_TIMEOUT, gt=0, description="close a connection that has sent no "
                                "complete request head for this long, idle or slow")
    min_send_rate: float = Field(DEFAULT_MIN_SEND_RATE, gt=0, description="bytes per second a client must take, on "
                                 "average, or its answer is cut off (after send_grace)")
    send_grace: float = Field(DEFAULT_SEND_GRACE, ge=0, description="seconds every answer gets on top of its bytes "
                              "at min_send_rate")
    max_connections: int = Field(DEFAULT_MAX_CONNECTIONS, ge=1, description="open connections in all (lowered at "
                                 "start to fit the descriptor limit)")
    max_connections_per_address: int | None = Field(DEFAULT_MAX_CONNECTIONS_PER_ADDRESS, ge=1, description="open "
                                                    "connections from one IPv4 address or IPv6 /64; none: no "
                                                    "limit (behind a proxy, every client has its address)")
    max_transfers: int = Field(DEFAULT_MAX_TRANSFERS, ge=0, description="file downloads at once, in all")
    max_transfers_per_address: int | None = Field(DEFAULT_MAX_TRANSFERS_PER_ADDRESS, ge=1, description="file "
                                                  "downloads at once from one IPv4 address or IPv6 /64; none: "
                                                  "no limit")
    stream_wait: float = Field(DEFAULT_STREAM_WAIT, ge=0, description="while mirroring, how long a request for "
                               "bytes not verified yet waits before a 503")
    swarm_listen: str = Field("", description="also carry libp2p circuits for nodes with no inbound port, "
                              "listening on this multiaddr (e.g. /ip4/0.0.0.0/tcp/8491; needs veriroll[swarm]); "
                              "empty: off. Read by `relay run`, not by RelayServer")
    fetch_options: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of fetch_version "
                                          "for the mirror's fetches (timeouts, concurrency, max_attempts)")

    @field_validator("upstreams", "fallbacks")
    @classmethod
    def _urls(cls, urls: list[str]) -> list[str]:
        return [normalize_relay_url(u) for u in urls]

    @model_validator(mode="after")
    def _fallbacks_need_an_upstream(self) -> RelayConfig:
        if self.fallbacks and not self.upstreams:
            raise ValueError("fallback upstreams are for a mirror: give it an upstream too")
        return self


def relay_config(config: RelayConfig | None = None, **settings: Any) -> RelayConfig:
    """``config`` (default: the defaults) with ``settings`` (RelayConfig's fields) over it, validated."""
    if not settings:
        return config if config is not None else RelayConfig()
    base = config.model_dump() if config is not None else {}
    return RelayConfig.model_validate({**base, **settings})


# ---- the command line


def _count_or_off(text: str) -> int | None:
    """A per-address limit: a count, or 0 for none (behind a proxy, every client has the proxy's address)."""
    try:
        n = int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a count: {text!r}") from exc
    if n < 0:
        raise argparse.ArgumentTypeError(f"a limit is 0 (none) or more, got {n}")
    return n or None


@dataclass(frozen=True)
class _Flag:
    """A ``relay run`` flag and the RelayConfig field it sets."""

    flag: str
    field: str
    type: Callable[[str], Any] | None = None
    repeatable: bool = False
    metavar: str | None = None
    default_text: str | None = None  # how the help shows the default, where the field's value would mislead

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")


RELAY_FLAGS = (
    _Flag("--upstream", "upstreams", repeatable=True, metavar="URL"),
    _Flag("--fallback-upstream", "fallbacks", repeatable=True, metavar="URL"),
    _Flag("--fallback-after", "fallback_after", float),
    _Flag("--host", "host"),
    _Flag("--swarm-listen", "swarm_listen", metavar="MULTIADDR", default_text="off"),
    _Flag("--keep", "keep", int),
    _Flag("--poll-interval", "poll_interval", float),
    _Flag("--idle-timeout", "idle_timeout", float),
    _Flag("--max-connections", "max_connections", int),
    _Flag("--max-connections-per-address", "max_connections_per_address", _count_or_off, metavar="N",
          default_text=f"{DEFAULT_MAX_CONNECTIONS_PER_ADDRESS}; 0: no limit"),
    _Flag("--max-transfers", "max_transfers", int),
    _Flag("--max-transfers-per-address", "max_transfers_per_address", _count_or_off, metavar="N",
          default_text=f"{DEFAULT_MAX_TRANSFERS_PER_ADDRESS}; 0: no limit"),
    _Flag("--stream-wait", "stream_wait", float),
)
"""Every RelayConfig field ``relay run`` takes, with its flag. ``--port`` is required there, so it is added
by the command itself (its field's bounds still apply); ``min_send_rate``, ``send_grace`` and
``fetch_options`` have no flag."""


def add_relay_flags(parser: argparse.ArgumentParser) -> None:
    """Add RELAY_FLAGS to ``parser``: help and default from each field."""
    fields = RelayConfig.model_fields
    for f in RELAY_FLAGS:
        info = fields[f.field]
        default = info.get_default(call_default_factory=True)
        shown = f.default_text or (", ".join(default) if isinstance(default, list) else default)
        help_text = f"{info.description}" + (" (repeatable)" if f.repeatable else f" (default {shown})")
        kwargs: dict[str, Any] = {"default": default, "help": help_text}
        if f.repeatable:
            kwargs["action"] = "append"
        if f.type is not None:
            kwargs["type"] = f.type
        if f.metavar is not None:
            kwargs["metavar"] = f.metavar
        parser.add_argument(f.flag, **kwargs)


class RelayConfigError(ValueError):
    """The flags make no valid RelayConfig; the message names each flag and why."""


def relay_config_from_args(args: argparse.Namespace, **settings: Any) -> RelayConfig:
    """The RelayConfig that parsed RELAY_FLAGS (and ``settings``, e.g. ``port``) describe."""
    values = {f.field: getattr(args, f.dest) for f in RELAY_FLAGS}
    try:
        return RelayConfig.model_validate({**values, **settings})
    except ValidationError as exc:
        flag_of = {f.field: f.flag for f in RELAY_FLAGS}
        problems = []
        for error in exc.errors():
            field = str(error["loc"][0]) if error["loc"] else ""
            where = flag_of.get(field, f"--{field.replace('_', '-')}" if field else "the relay's settings")
            problems.append(f"{where}: {error['msg']}")
        raise RelayConfigError("; ".join(problems)) from exc
