"""The ways a publish, a relay or a fetch can fail, as types.

Each error says what went wrong and what to do about it. The CLI maps each one to its own exit status
(:data:`EXIT_CODES`), so scripts can tell "try again later" (no relay reachable) from "your
configuration is wrong" (bad signature) from "free some space" (disk full).
"""

from __future__ import annotations


class ShardcastError(Exception):
    """Base class of every shardcast failure."""


class ManifestError(ShardcastError):
    """A manifest is malformed or breaks a rule (path traversal, shards not covering a file, bad sizes)."""


class WrongVersionError(ManifestError):
    """A validly signed manifest carries another version than the one asked for (an old version served as new)."""


class ManifestSignatureError(ShardcastError):
    """No manifest for the version carried a valid signature by the configured coordinator key."""


class NoRelayReachableError(ShardcastError):
    """Not one of the given relays answered."""


class VersionGoneError(ShardcastError):
    """No reachable relay holds the requested version (never published, or already pruned everywhere)."""


class ShardUnavailableError(ShardcastError):
    """Relays hold the version, but some shard could not be obtained intact from any of them."""


class DeltaError(ShardcastError):
    """A delta piece cannot rebuild its shard (wrong base, wrong size, corrupt or oversized data).

    Never fatal to a fetch: the shard is fetched whole instead, and the reason is kept in
    ``FetchResult.delta_problems``.
    """


class DiskFullError(ShardcastError, OSError):
    """The target filesystem ran out of space (ENOSPC) or quota (EDQUOT)."""


class PublishError(ShardcastError):
    """Publishing a checkpoint into a store failed; nothing was listed."""


class OutputDirError(ShardcastError):
    """The output directory exists and holds something that is not a shardcast checkpoint."""


EXIT_CODES: dict[type[ShardcastError], int] = {
    NoRelayReachableError: 3,
    ManifestSignatureError: 4,
    VersionGoneError: 5,
    DiskFullError: 6,
    ShardUnavailableError: 7,
    ManifestError: 8,
    PublishError: 9,
    OutputDirError: 10,
}


def exit_code_of(exc: BaseException) -> int:
    """The CLI exit status for an error: its own code for a shardcast error, 1 for anything else."""
    for cls in type(exc).__mro__:
        if cls in EXIT_CODES:
            return EXIT_CODES[cls]
    return 1
