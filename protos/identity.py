"""Identities: Ed25519 key files and node ids.

A private key is a PKCS#8 PEM file (mode 0600). Its public key lives beside it at ``PATH.pub`` as one
line, ``ed25519 <64 hex chars>``, so it can be pasted into configs and issues. A node id is a pure
function of the public key (the first 16 bytes of its SHA-256, hex), so a volunteer who keeps the key
file keeps their identity and history; nothing else has to be backed up.

Every public key that enters (a ``.pub`` file, the ``x-veriroll-key`` header, a RegisterRequest, a
key announced in a policy) is checked by :func:`public_key_problem`: a non-canonical encoding or a
point of small order is refused. For a small-order key ``A`` (the identity, for one) the signature
``R = identity, S = 0`` satisfies ``[8][S]B == [8]R + [8][k]A`` for every message, and OpenSSL accepts
it: an identity anyone could sign for without a private key.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import nacl.bindings
import nacl.exceptions
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from veriroll.protos.errors import VerirollError

PUBLIC_KEY_PREFIX = "ed25519"
PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64


class KeyFileError(VerirollError):
    """A key file is missing, unreadable, malformed, exposed, or would be overwritten; ``fix`` says what to do."""

    def __init__(self, message: str, fix: str = ""):
        super().__init__(message)
        self.fix = fix


class InvalidPublicKey(VerirollError, ValueError):
    """32 bytes that are not a usable Ed25519 public key (wrong length, not canonical, small order)."""


# --- Edwards25519 point checks (pure Python) ---------------------------------------------------------
# The curve -x^2 + y^2 = 1 + d x^2 y^2 over GF(p). Only decoding and three doublings are needed, so
# this stays small; the result is cached per key bytes (public_key_problem).

_P = 2**255 - 19
_D = -121665 * pow(121666, _P - 2, _P) % _P
_SQRT_M1 = pow(2, (_P - 1) // 4, _P)


def _decode_point(raw: bytes) -> tuple[int, int] | str:
    """The affine point ``(x, y)`` of a 32-byte encoding, or why it is not a canonical encoding of one."""
    n = int.from_bytes(raw, "little")
    sign = n >> 255
    y = n & ((1 << 255) - 1)
    if y >= _P:
        return "non-canonical encoding (y >= 2^255 - 19)"
    u = (y * y - 1) % _P
    v = (_D * y * y + 1) % _P  # never 0: -1/d is not a square
    # x = sqrt(u / v) with one exponentiation (RFC 8032, 5.1.3): x = u v^3 (u v^7)^((p - 5) / 8).
    v3 = v * v * v % _P
    x = u * v3 * pow(u * v3 * v3 * v % _P, (_P - 5) // 8, _P) % _P
    vx2 = v * x * x % _P
    if vx2 != u:
        if vx2 != (-u) % _P:
            return "not a point on Edwards25519"
        x = x * _SQRT_M1 % _P
    if x == 0 and sign:
        return "non-canonical encoding (x = 0 with the sign bit set)"
    if x & 1 != sign:
        x = _P - x
    return x, y


def _double(pt: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
    """[2]P in extended coordinates (X:Y:Z:T), a = -1 (dbl-2008-hwcd)."""
    x1, y1, z1, _ = pt
    a = x1 * x1 % _P
    b = y1 * y1 % _P
    c = 2 * z1 * z1 % _P
    h = (-a - b) % _P  # D - B with D = -A
    e = ((x1 + y1) * (x1 + y1) - a - b) % _P
    g = (b - a) % _P  # D + B
    f = (g - c) % _P
    return e * f % _P, g * h % _P, f * g % _P, e * h % _P


def _public_key_problem(raw: bytes) -> str | None:
    if len(raw) != PUBLIC_KEY_BYTES:
        return f"an Ed25519 public key is {PUBLIC_KEY_BYTES} bytes, got {len(raw)}"
    point = _decode_point(raw)
    if isinstance(point, str):
        return point
    x, y = point
    pt = (x, y, 1, x * y % _P)
    for _ in range(3):
        pt = _double(pt)
    if pt[0] % _P == 0 and (pt[1] - pt[2]) % _P == 0:  # [8]P is the identity (X = 0, Y = Z)
        return "small-order point (anyone can forge signatures for it)"
    return None


@functools.lru_cache(maxsize=16384)
def public_key_problem(raw: bytes) -> str | None:
    """Why ``raw`` is not an acceptable Ed25519 public key, or None when it is.

    Refused: a length other than 32, a y coordinate >= p, x = 0 with the sign bit set, a y with no x
    on the curve, and any point whose order divides 8. Cached per key bytes: the hot path is a lookup.
    """
    return _public_key_problem(raw)


def check_public_key(raw: bytes) -> bytes:
    """``raw`` as bytes when it is an acceptable public key; raises :class:`InvalidPublicKey` otherwise."""
    raw = bytes(raw)
    problem = public_key_problem(raw)
    if problem is not None:
        raise InvalidPublicKey(f"unusable Ed25519 public key {raw.hex()[:16]}...: {problem}")
    return raw


def node_id_of(public_key: bytes) -> str:
    """The node id of a raw 32-byte Ed25519 public key: hex of the first 16 bytes of its SHA-256."""
    if len(public_key) != PUBLIC_KEY_BYTES:
        raise ValueError(f"an Ed25519 public key is {PUBLIC_KEY_BYTES} bytes, got {len(public_key)}")
    return hashlib.sha256(public_key).hexdigest()[:32]


@dataclass(frozen=True)
class PublicKey:
    """A verifying key: raw bytes plus the node id derived from them."""

    raw: bytes

    def __post_init__(self) -> None:
        # Raises InvalidPublicKey: no PublicKey exists for a small-order or non-canonical key.
        object.__setattr__(self, "raw", check_public_key(self.raw))

    @property
    def node_id(self) -> str:
        return node_id_of(self.raw)

    def verify(self, signature: bytes, message: bytes) -> bool:
        """True when ``signature`` is a valid Ed25519 signature of ``message`` by this key."""
        if len(signature) != SIGNATURE_BYTES or public_key_problem(self.raw) is not None:
            return False
        # libsodium, not OpenSSL: twice as fast per signature, and it releases the GIL while it checks (the
        # coordinator verifies every request of every node). It is the stricter of the two: it also refuses
        # a non-canonical S and a small-order R, which no honest signer produces.
        try:
            nacl.bindings.crypto_sign_open(signature + message, self.raw)
        except (nacl.exceptions.BadSignatureError, nacl.exceptions.ValueError, nacl.exceptions.TypeError):
            return False
        return True

    def to_line(self) -> str:
        return f"{PUBLIC_KEY_PREFIX} {self.raw.hex()}\n"

    @classmethod
    def from_line(cls, text: str) -> PublicKey:
        parts = text.strip().split()
        if len(parts) != 2 or parts[0] != PUBLIC_KEY_PREFIX:
            raise KeyFileError(f"expected '{PUBLIC_KEY_PREFIX} <64 hex chars>', got {text.strip()[:40]!r}")
        try:
            raw = bytes.fromhex(parts[1])
        except ValueError as exc:
            raise KeyFileError(f"public key is not hex: {exc}") from exc
        if len(raw) != PUBLIC_KEY_BYTES:
            raise KeyFileError(f"public key must be {PUBLIC_KEY_BYTES} bytes, got {len(raw)}")
        try:
            return cls(raw)
        except InvalidPublicKey as exc:
            raise KeyFileError(str(exc)) from exc


@dataclass(frozen=True)
class PrivateKey:
    """A signing key."""

    key: Ed25519PrivateKey

    @classmethod
    def generate(cls) -> PrivateKey:
        return cls(Ed25519PrivateKey.generate())

    @property
    def public(self) -> PublicKey:
        raw = self.key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        return PublicKey(raw)

    @property
    def node_id(self) -> str:
        return self.public.node_id

    def sign(self, message: bytes) -> bytes:
        return self.key.sign(message)

    def to_pem(self) -> bytes:
        return self.key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )


def public_path_for(path: str | os.PathLike) -> Path:
    """Where the public key of the private key file ``path`` lives."""
    return Path(str(path) + ".pub")


def write_keypair(path: str | os.PathLike, *, force: bool = False) -> PrivateKey:
    """Generate a key pair; write the private key to ``path`` (0600) and the public key to ``path.pub``.

    Refuses to overwrite an existing key unless ``force``: losing a key loses the node's history.
    """
    path = Path(path)
    pub = public_path_for(path)
    if not force and (path.exists() or pub.exists()):
        raise KeyFileError(f"{path} already exists; refusing to overwrite a key (use --force to replace it)")
    path.parent.mkdir(parents=True, exist_ok=True)
    key = PrivateKey.generate()
    tmp = path.with_name(path.name + ".tmp")
    # Create with 0600 from the start: never let the secret exist with wider permissions.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(key.to_pem())
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)
    pub.write_text(key.public.to_line())
    return key


def load_private_key(path: str | os.PathLike, *, owner_only: bool = False) -> PrivateKey:
    """Load a private key file written by :func:`write_keypair` (or any PKCS#8 Ed25519 PEM).

    A ``.pub`` file is named as the public half. A key other users can read (POSIX mode & 0o077) is
    refused when ``owner_only`` (a node's key: anyone who reads it can act as that node), else logged
    as a warning (the coordinator's key, whose operator may keep it on a mount this check cannot judge).
    """
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            mode = stat.S_IMODE(os.fstat(fh.fileno()).st_mode)
            data = fh.read()
    except OSError as exc:
        raise KeyFileError(f"cannot read key file {path}: {exc.strerror or exc}") from exc
    if data.lstrip().startswith(PUBLIC_KEY_PREFIX.encode() + b" "):
        private = path.with_suffix("") if path.suffix == ".pub" else None
        raise KeyFileError(f"{path} is a public key (the shareable half of a key pair), not the private key",
                           f"pass the private key: {private}" if private else
                           "pass the private key file (the one without .pub, written by `veriroll keygen`)")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise KeyFileError(f"{path} is not an unencrypted PEM private key: {exc}") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyFileError(f"{path} holds a {type(key).__name__}, not an Ed25519 key")
    if os.name == "posix" and mode & 0o077:
        problem = f"{path} can be read by other users (mode {mode:04o})"
        fix = f"make it private: `chmod 600 {path}` (anyone who reads it can sign as this key)"
        if owner_only:
            raise KeyFileError(problem, fix)
        logging.getLogger("veriroll.identity").warning("%s; %s", problem, fix)
    return PrivateKey(key)


def load_public_key(path: str | os.PathLike) -> PublicKey:
    """Load a ``.pub`` file (``ed25519 <hex>``). A private key path is accepted too: its public half is used."""
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise KeyFileError(f"cannot read public key file {path}: {exc}") from exc
    if "PRIVATE KEY" in text:
        return load_private_key(path).public
    return PublicKey.from_line(text)
