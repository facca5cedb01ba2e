"""Signed, sharded checkpoint broadcast through a tree of untrusted HTTP relays.

- :func:`publish_checkpoint` (``publish.py``): split a checkpoint into shards, sign the manifest, store it.
- :class:`RelayServer` (``relay/``): serve a store (origin) or mirror upstream relays, as its
  :class:`RelayConfig` says.
- :func:`fetch_version` / :func:`fetch_version_sync` (``fetch/``): get a version, every byte verified.
- ``delta.py``: versions as lossless deltas against the version before (XOR + zstd, per shard).
- ``manifest.py``: the pure manifest format; ``errors.py``: the failures, as types.
"""

from .errors import (
    DeltaError,
    DiskFullError,
    ManifestError,
    ManifestSignatureError,
    NoRelayReachableError,
    OutputDirError,
    PublishError,
    ShardcastError,
    ShardUnavailableError,
    VersionGoneError,
    WrongVersionError,
)
from .fetch import FetchResult, RelayIncident, RelayStats, fetch_version, fetch_version_sync
from .manifest import Manifest, verify_manifest
from .publish import PublishResult, publish_checkpoint
from .relay import RelayConfig, RelayServer, serve_relay

__all__ = [
    "DeltaError",
    "DiskFullError",
    "FetchResult",
    "Manifest",
    "ManifestError",
    "ManifestSignatureError",
    "NoRelayReachableError",
    "OutputDirError",
    "PublishError",
    "PublishResult",
    "RelayIncident",
    "RelayConfig",
    "RelayServer",
    "RelayStats",
    "ShardUnavailableError",
    "ShardcastError",
    "VersionGoneError",
    "WrongVersionError",
    "fetch_version",
    "fetch_version_sync",
    "publish_checkpoint",
    "serve_relay",
    "verify_manifest",
]
