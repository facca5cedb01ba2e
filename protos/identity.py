"""Identities: Ed25519 key files and node ids.

A private key is a PKCS#8 PEM file (mode 0600). Its public key lives beside it at ``PATH.pub`` as one
line, ``ed25519 <64 hex chars>``, so it can be pasted into configs and issues. A node id is a pure
function of the public key (the first 16 bytes of its SHA-256, hex), so a volunteer who keeps the key
file keeps their identity and history; nothing else has to be backed up.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

PUBLIC_KEY_PREFIX = "ed25519"
PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64


class KeyFileError(Exception):
    """A key file is missing, unreadable, malformed, or would be overwritten."""


def node_id_of(public_key: bytes) -> str:
    """The node id of a raw 32-byte Ed25519 public key: hex of the first 16 bytes of its SHA-256."""
    if len(public_key) != PUBLIC_KEY_BYTES:
        raise ValueError(f"an Ed25519 public key is {PUBLIC_KEY_BYTES} bytes, got {len(public_key)}")
    return hashlib.sha256(public_key).hexdigest()[:32]


@dataclass(frozen=True)
class PublicKey:
    """A verifying key: raw bytes plus the node id derived from them."""

    raw: bytes

    @property
    def node_id(self) -> str:
        return node_id_of(self.raw)

    def verify(self, signature: bytes, message: bytes) -> bool:
        """True when ``signature`` is a valid Ed25519 signature of ``message`` by this key."""
        if len(signature) != SIGNATURE_BYTES:
            return False
        try:
            Ed25519PublicKey.from_public_bytes(self.raw).verify(signature, message)
        except (InvalidSignature, ValueError):
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
        return cls(raw)


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


def load_private_key(path: str | os.PathLike) -> PrivateKey:
    """Load a private key file written by :func:`write_keypair` (or any PKCS#8 Ed25519 PEM)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise KeyFileError(f"cannot read key file {path}: {exc.strerror or exc}") from exc
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise KeyFileError(f"{path} is not an unencrypted PEM private key: {exc}") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyFileError(f"{path} holds a {type(key).__name__}, not an Ed25519 key")
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
