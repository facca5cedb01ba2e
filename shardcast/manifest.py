"""The signed manifest of one checkpoint version: what it is, how it is signed, what a valid one looks like.

Pure functions over plain data: no files, no network.

A manifest lists a version's files (name, size, SHA-256) and the shards that cut them into pieces
(file, offset, size, SHA-256). On the wire it travels as one JSON document::

    {"manifest": {...}, "signature": "<128 hex chars>", "signer": "ed25519 <64 hex chars>"}

The signature is Ed25519 over ``SIGNING_CONTEXT + canonical_json(manifest)``, where canonical JSON is
sorted keys, no whitespace, ASCII only, integers and strings only (no floats, so no two encoders can
disagree on a number). The verifier re-canonicalizes what it parsed, so it never depends on how a relay
chose to format the document. ``signer`` is a hint for error messages, never trusted.

Rules a manifest must keep (:func:`validate_manifest`), each checked because a relay or a buggy
publisher could break it:

- file names are relative POSIX paths of plain components (no ``..``, no absolute paths, no
  backslashes, no reserved ``.shardcast`` names), unique, and no file is also a directory of another;
- the shards of each file are listed in file order, in ascending offset, and cover it exactly: the
  first starts at 0, each starts where the previous ended, the last ends at the file's size;
- every size is a non-negative integer (shards are 1..``shard_size`` bytes), every hash is 64 lowercase
  hex characters, and the version is an integer in [0, 2^53).

A manifest may carry a ``delta`` section (``delta.py``): the same version again, as pieces that rebuild
some of its shards from an older version the node may hold. It names the base version and the hash of
the base's manifest (exactly which bytes the pieces were made against), and for each piece the shard it
rebuilds, where it lies in the version's delta file, its compressed size and SHA-256. Its rules: the
base is older than the version; pieces follow shard order, at most one per shard; they cover the delta
file exactly, end to end; and no piece is larger than the shard it rebuilds (a delta that does not save
bytes is not published, so none can make a node download more than the whole shard). A manifest without
deltas has no ``delta`` key at all, so it signs exactly as before deltas existed.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from veriroll.protos.identity import PrivateKey, PublicKey

from .errors import ManifestError, ManifestSignatureError, WrongVersionError

FORMAT = "veriroll-shardcast/1"
# Domain separation: a signature over a manifest can never be replayed as a signature over anything else.
SIGNING_CONTEXT = b"veriroll-shardcast-manifest-v1\x00"
DEFAULT_SHARD_SIZE = 32 * 1024 * 1024
MAX_SHARD_SIZE = 1024 * 1024 * 1024  # a client holds at most a few shards in flight; keep them sane
MAX_MANIFEST_BYTES = 64 * 1024 * 1024  # ~400k shards: a 12 TiB checkpoint at the default shard size
MAX_FILES = 100_000
MAX_SIZE = 2**53 - 1  # JSON integers beyond this are not exact in every parser
MAX_NAME_LENGTH = 1024
MAX_COMPONENT_LENGTH = 255
MAX_DEPTH = 16
RESERVED_PREFIX = ".shardcast"

_HEX64 = re.compile(r"[0-9a-f]{64}")
_HEX128 = re.compile(r"[0-9a-f]{128}")
_COMPONENT = re.compile(r"[A-Za-z0-9_.+=@,-]+")
_CREATED = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z")


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint."""

    name: str
    size: int
    sha256: str


@dataclass(frozen=True)
class ShardEntry:
    """One contiguous byte range of one file; ``index`` is its position in the manifest's shard list."""

    index: int
    file: str
    offset: int
    size: int
    sha256: str

    @property
    def end(self) -> int:
        return self.offset + self.size


@dataclass(frozen=True)
class DeltaPiece:
    """The compressed XOR that rebuilds shard ``shard`` from the base; bytes ``offset..offset+size`` of the
    version's delta file."""

    shard: int
    offset: int
    size: int
    sha256: str

    @property
    def end(self) -> int:
        return self.offset + self.size


@dataclass(frozen=True)
class Delta:
    """A version as pieces against ``base_version``, whose signed manifest hashes to ``base_manifest_sha256``."""

    base_version: int
    base_manifest_sha256: str
    pieces: tuple[DeltaPiece, ...]

    @property
    def size(self) -> int:
        """Bytes of the delta file: every piece, end to end."""
        return sum(p.size for p in self.pieces)

    def to_dict(self) -> dict[str, Any]:
        return {
            "base_version": self.base_version,
            "base_manifest_sha256": self.base_manifest_sha256,
            "pieces": [{"shard": p.shard, "offset": p.offset, "size": p.size, "sha256": p.sha256}
                       for p in self.pieces],
        }  # fmt: skip


@dataclass(frozen=True)
class Manifest:
    """A checkpoint version: its files, the shards that cover them, and optionally a delta against an older one."""

    version: int
    created: str
    shard_size: int
    files: tuple[FileEntry, ...]
    shards: tuple[ShardEntry, ...]
    delta: Delta | None = None
    _by_name: dict[str, FileEntry] = field(default=None, init=False, repr=False, compare=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {f.name: f for f in self.files})

    @property
    def total_size(self) -> int:
        return sum(f.size for f in self.files)

    def file(self, name: str) -> FileEntry | None:
        """The entry of file ``name``, or None when the manifest has no such file."""
        return self._by_name.get(name)

    def shards_of(self, name: str) -> list[ShardEntry]:
        return [s for s in self.shards if s.file == name]

    def to_dict(self) -> dict[str, Any]:
        body = {
            "format": FORMAT,
            "version": self.version,
            "created": self.created,
            "shard_size": self.shard_size,
            "files": [{"name": f.name, "size": f.size, "sha256": f.sha256} for f in self.files],
            "shards": [
                {"file": s.file, "offset": s.offset, "size": s.size, "sha256": s.sha256} for s in self.shards
            ],
        }
        if self.delta is not None:
            body["delta"] = self.delta.to_dict()
        return body


@dataclass(frozen=True)
class SignedManifest:
    """A manifest with the coordinator's signature over its canonical bytes."""

    manifest: Manifest
    signature: bytes
    signer: PublicKey

    def to_bytes(self) -> bytes:
        """The wire document, as relays store and serve it."""
        doc = {
            "manifest": self.manifest.to_dict(),
            "signature": self.signature.hex(),
            "signer": self.signer.to_line().strip(),
        }
        return json.dumps(doc, sort_keys=True, indent=1, ensure_ascii=True).encode() + b"\n"


# -- canonical bytes ---------------------------------------------------------------------------------


def canonical_json(obj: Any) -> bytes:
    """The one byte string a JSON value of ints, strings, lists and objects encodes to."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def signing_message(manifest: Manifest | dict[str, Any]) -> bytes:
    """What the coordinator signs: the context string followed by the manifest's canonical JSON."""
    body = manifest.to_dict() if isinstance(manifest, Manifest) else manifest
    return SIGNING_CONTEXT + canonical_json(body)


# -- building ----------------------------------------------------------------------------------------


def utc_now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def plan_shards(files: Iterable[tuple[str, int]], shard_size: int) -> list[tuple[str, int, int]]:
    """Cut files into ``(file, offset, size)`` pieces of ``shard_size`` bytes (the last one of a file shorter).

    An empty file gets no shard: its size and hash in the file list say all there is to say.
    """
    if not isinstance(shard_size, int) or not 0 < shard_size <= MAX_SHARD_SIZE:
        raise ManifestError(f"shard size must be an integer in 1..{MAX_SHARD_SIZE}, got {shard_size!r}")
    plan = []
    for name, size in files:
        for offset in range(0, size, shard_size):
            plan.append((name, offset, min(shard_size, size - offset)))
    return plan


def build_manifest(
    version: int,
    files: Sequence[FileEntry],
    shards: Sequence[tuple[str, int, int, str]],
    *,
    shard_size: int = DEFAULT_SHARD_SIZE,
    created: str | None = None,
) -> Manifest:
    """A validated manifest from file entries and ``(file, offset, size, sha256)`` shards.

    Files are sorted by name and shards by (file, offset), so the same checkpoint always gives the same
    manifest.
    """
    files = sorted(files, key=lambda f: f.name)
    order = {f.name: i for i, f in enumerate(files)}
    ordered = sorted(shards, key=lambda s: (order.get(s[0], len(order)), s[1]))
    manifest = Manifest(
        version=version,
        created=created or utc_now_rfc3339(),
        shard_size=shard_size,
        files=tuple(files),
        shards=tuple(ShardEntry(i, f, o, n, h) for i, (f, o, n, h) in enumerate(ordered)),
    )
    validate_manifest(manifest)
    return manifest


def manifest_sha256(manifest: Manifest) -> str:
    """The hash that names exactly one manifest (of its signed message): what a delta's base is named by."""
    return hashlib.sha256(signing_message(manifest)).hexdigest()


def sign_manifest(manifest: Manifest, key: PrivateKey) -> SignedManifest:
    """Sign a (validated) manifest with the coordinator's key."""
    validate_manifest(manifest)
    return SignedManifest(manifest, key.sign(signing_message(manifest)), key.public)


# -- validation --------------------------------------------------------------------------------------


def validate_file_name(name: Any) -> str:
    """``name`` when it is a safe relative path inside a checkpoint directory; ManifestError otherwise.

    Only plain components of ``[A-Za-z0-9_.+=@,-]`` joined by ``/`` pass: this refuses ``..``, absolute
    paths, backslashes, NUL, drive letters and control characters in one rule, instead of trying to
    list every way to escape a directory.
    """
    if not isinstance(name, str) or not name:
        raise ManifestError(f"file name must be a non-empty string, got {name!r}")
    if len(name) > MAX_NAME_LENGTH:
        raise ManifestError(f"file name longer than {MAX_NAME_LENGTH} characters: {name[:60]!r}...")
    parts = name.split("/")
    if len(parts) > MAX_DEPTH:
        raise ManifestError(f"file name nested deeper than {MAX_DEPTH} directories: {name!r}")
    for part in parts:
        if part in ("", ".", ".."):
            raise ManifestError(f"file name {name!r} is not a plain relative path (path traversal refused)")
        if len(part) > MAX_COMPONENT_LENGTH or not _COMPONENT.fullmatch(part):
            raise ManifestError(
                f"file name {name!r} has a component outside [A-Za-z0-9_.+=@,-] or longer than "
                f"{MAX_COMPONENT_LENGTH}"
            )
    if parts[0].startswith(RESERVED_PREFIX):
        raise ManifestError(f"file name {name!r} is reserved for shardcast's own bookkeeping")
    return name


def _check_int(value: Any, what: str, low: int, high: int) -> int:
    # bool is an int in Python; a manifest saying "size": true is malformed, not 1.
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ManifestError(f"{what} must be an integer in [{low}, {high}], got {value!r}")
    return value


def _check_hash(value: Any, what: str) -> str:
    if not isinstance(value, str) or not _HEX64.fullmatch(value):
        raise ManifestError(f"{what} must be 64 lowercase hex characters (SHA-256), got {value!r}")
    return value


def validate_manifest(manifest: Manifest) -> None:
    """Raise ManifestError unless ``manifest`` keeps every rule in the module docstring."""
    _check_int(manifest.version, "version", 0, MAX_SIZE)
    if not isinstance(manifest.created, str) or not _CREATED.fullmatch(manifest.created):
        raise ManifestError(f"created must be a UTC time like 2025-01-31T12:00:00Z, got {manifest.created!r}")
    _check_int(manifest.shard_size, "shard_size", 1, MAX_SHARD_SIZE)
    if not manifest.files:
        raise ManifestError("a manifest must list at least one file")
    if len(manifest.files) > MAX_FILES:
        raise ManifestError(f"a manifest may list at most {MAX_FILES} files, got {len(manifest.files)}")

    names: dict[str, FileEntry] = {}
    for f in manifest.files:
        validate_file_name(f.name)
        if f.name in names:
            raise ManifestError(f"file {f.name!r} is listed twice")
        _check_int(f.size, f"size of {f.name!r}", 0, MAX_SIZE)
        _check_hash(f.sha256, f"sha256 of {f.name!r}")
        names[f.name] = f
    # A file that is also a directory of another file ("a" and "a/b") cannot be written to disk.
    for name in names:
        parts = name.split("/")
        for depth in range(1, len(parts)):
            prefix = "/".join(parts[:depth])
            if prefix in names:
                raise ManifestError(f"file {prefix!r} is also a directory of {name!r}")

    order = {f.name: i for i, f in enumerate(manifest.files)}
    covered = {f.name: 0 for f in manifest.files}  # how far each file is covered so far
    last_file = -1
    for i, s in enumerate(manifest.shards):
        where = f"shard {i}"
        if s.index != i:
            raise ManifestError(f"{where} has index {s.index}: shards must be numbered by position")
        if s.file not in names:
            raise ManifestError(f"{where} belongs to {s.file!r}, which is not a listed file")
        _check_int(s.size, f"size of {where}", 1, manifest.shard_size)
        _check_int(s.offset, f"offset of {where}", 0, MAX_SIZE)
        _check_hash(s.sha256, f"sha256 of {where}")
        if order[s.file] < last_file:
            raise ManifestError(f"{where} of {s.file!r} is out of order: shards must follow the file order")
        last_file = order[s.file]
        if s.offset != covered[s.file]:
            kind = "overlaps the previous one" if s.offset < covered[s.file] else "leaves a gap before it"
            raise ManifestError(
                f"{where} of {s.file!r} starts at {s.offset} but the file is covered up to "
                f"{covered[s.file]}: it {kind}"
            )
        covered[s.file] = s.offset + s.size
        if covered[s.file] > names[s.file].size:
            raise ManifestError(f"{where} of {s.file!r} ends at {covered[s.file]}, past the file's size")
    for name, upto in covered.items():
        if upto != names[name].size:
            raise ManifestError(
                f"the shards of {name!r} cover {upto} of its {names[name].size} bytes: they must cover it exactly"
            )
    if manifest.delta is not None:
        validate_delta(manifest)


def validate_delta(manifest: Manifest) -> None:
    """Raise ManifestError unless ``manifest.delta`` keeps the delta rules in the module docstring."""
    delta = manifest.delta
    assert delta is not None
    _check_int(delta.base_version, "delta base_version", 0, MAX_SIZE)
    if delta.base_version >= manifest.version:
        raise ManifestError(
            f"a delta of version {manifest.version} must be against an older version, not {delta.base_version}"
        )
    _check_hash(delta.base_manifest_sha256, "delta base_manifest_sha256")
    if not delta.pieces:
        raise ManifestError("a delta must have at least one piece (publish none instead)")
    last_shard, covered = -1, 0
    for i, p in enumerate(delta.pieces):
        where = f"delta piece {i}"
        _check_int(p.shard, f"shard of {where}", 0, len(manifest.shards) - 1)
        if p.shard <= last_shard:
            raise ManifestError(f"{where} rebuilds shard {p.shard}: pieces must follow shard order, one per shard")
        last_shard = p.shard
        _check_int(p.size, f"size of {where}", 1, manifest.shards[p.shard].size)
        _check_int(p.offset, f"offset of {where}", 0, MAX_SIZE)
        _check_hash(p.sha256, f"sha256 of {where}")
        if p.offset != covered:
            raise ManifestError(
                f"{where} starts at {p.offset} but the delta file is covered up to {covered}: pieces lie end to end"
            )
        covered += p.size


# -- parsing -----------------------------------------------------------------------------------------


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ManifestError(f"key {k!r} appears twice in one JSON object")
        out[k] = v
    return out


def _refuse_float(text: str) -> Any:
    raise ManifestError(f"manifests hold integers only, got the number {text}")


def _refuse_constant(text: str) -> Any:
    raise ManifestError(f"manifests hold no {text}")


def parse_json_strict(data: bytes) -> Any:
    """JSON with no duplicate keys, no floats, no NaN/Infinity: one parse, one meaning."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"manifest is {len(data)} bytes, more than the {MAX_MANIFEST_BYTES} allowed")
    try:
        return json.loads(
            data.decode("utf-8"),
            object_pairs_hook=_no_duplicate_keys,
            parse_float=_refuse_float,
            parse_constant=_refuse_constant,
        )
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ManifestError(f"manifest is not valid JSON: {exc}") from exc


def _exact_keys(obj: Any, keys: set[str], what: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise ManifestError(f"{what} must be a JSON object, got {type(obj).__name__}")
    if set(obj) != keys:
        missing, extra = sorted(keys - set(obj)), sorted(set(obj) - keys)
        raise ManifestError(f"{what} has missing keys {missing} / unknown keys {extra}")
    return obj


def _delta_from_dict(body: Any) -> Delta:
    body = _exact_keys(body, {"base_version", "base_manifest_sha256", "pieces"}, "delta")
    if not isinstance(body["pieces"], list):
        raise ManifestError("delta 'pieces' must be a list")
    pieces = []
    for i, p in enumerate(body["pieces"]):
        p = _exact_keys(p, {"shard", "offset", "size", "sha256"}, f"delta piece {i}")
        pieces.append(DeltaPiece(p["shard"], p["offset"], p["size"], p["sha256"]))
    return Delta(body["base_version"], body["base_manifest_sha256"], tuple(pieces))


def manifest_from_dict(body: Any) -> Manifest:
    """A validated Manifest from its JSON object; ManifestError on any deviation."""
    keys = {"format", "version", "created", "shard_size", "files", "shards"}
    if isinstance(body, dict) and "delta" in body:
        keys.add("delta")
    body = _exact_keys(body, keys, "manifest")
    if body["format"] != FORMAT:
        raise ManifestError(f"manifest format is {body['format']!r}; this shardcast reads {FORMAT!r}")
    if not isinstance(body["files"], list) or not isinstance(body["shards"], list):
        raise ManifestError("manifest 'files' and 'shards' must be lists")
    files = []
    for i, f in enumerate(body["files"]):
        f = _exact_keys(f, {"name", "size", "sha256"}, f"file {i}")
        files.append(FileEntry(f["name"], f["size"], f["sha256"]))
    shards = []
    for i, s in enumerate(body["shards"]):
        s = _exact_keys(s, {"file", "offset", "size", "sha256"}, f"shard {i}")
        shards.append(ShardEntry(i, s["file"], s["offset"], s["size"], s["sha256"]))
    delta = _delta_from_dict(body["delta"]) if "delta" in body else None
    manifest = Manifest(body["version"], body["created"], body["shard_size"], tuple(files), tuple(shards), delta)
    validate_manifest(manifest)
    return manifest


def verify_manifest(data: bytes, key: PublicKey, *, expect_version: int | None = None) -> Manifest:
    """The manifest in the wire document ``data``, after checking, in this order:

    1. it parses (strictly) as a signed document;
    2. its signature is valid for ``key`` (ManifestSignatureError otherwise), before anything in the
       manifest is believed;
    3. the manifest keeps every rule (ManifestError);
    4. its version is ``expect_version`` when one is given (WrongVersionError: a relay serving an old,
       validly signed manifest under a newer version's name).
    """
    doc = parse_json_strict(data)
    if (
        not isinstance(doc, dict)
        or not {"manifest", "signature"} <= set(doc)
        or set(doc)
        - {
            "manifest",
            "signature",
            "signer",
        }
    ):
        raise ManifestError(
            "a signed manifest is an object with 'manifest', 'signature' and optional 'signer'"
        )
    sig = doc["signature"]
    if not isinstance(sig, str) or not _HEX128.fullmatch(sig):
        raise ManifestSignatureError("manifest signature is not 128 lowercase hex characters")
    try:
        message = signing_message(doc["manifest"])
    except (TypeError, ValueError) as exc:
        raise ManifestError(f"manifest cannot be canonicalized: {exc}") from exc
    if not key.verify(bytes.fromhex(sig), message):
        signer = doc.get("signer")
        hint = ""
        if isinstance(signer, str) and signer.strip() != key.to_line().strip():
            hint = f" (it claims to be signed by {signer[:80]!r})"
        raise ManifestSignatureError(
            f"manifest signature is not valid for the coordinator key {key.to_line().strip()}{hint}: "
            "the relay served a forged or altered manifest, or you configured the wrong coordinator key"
        )
    manifest = manifest_from_dict(doc["manifest"])
    if expect_version is not None and manifest.version != expect_version:
        raise WrongVersionError(
            f"asked for version {expect_version}, the manifest is version {manifest.version}"
        )
    return manifest
