"""The signed-request envelope.

A request is signed over ``(full method name, SHA-256 of the serialized request, timestamp, nonce)``
with the sender's Ed25519 key. The four values travel in gRPC metadata:

    x-veriroll-key        hex of the raw 32-byte public key
    x-veriroll-ts         unix time in milliseconds
    x-veriroll-nonce      32 hex chars (16 random bytes), never reused
    x-veriroll-sig        hex of the 64-byte signature

Binding the method name stops a signature for one call being replayed against another; binding the
body hash stops tampering; the timestamp bounds how long a nonce must be remembered, and the server
remembers every nonce for the whole window (Prime's protocol kept nonces 60 s against a 300 s
timestamp window, so a replay in between went through).
"""

from __future__ import annotations

import hashlib
import secrets
import time
from dataclasses import dataclass

from veriroll.protos.errors import VerirollError
from veriroll.protos.identity import InvalidPublicKey, PrivateKey, PublicKey

DOMAIN = b"veriroll/v1/request"
KEY_HEADER = "x-veriroll-key"
TS_HEADER = "x-veriroll-ts"
NONCE_HEADER = "x-veriroll-nonce"
SIG_HEADER = "x-veriroll-sig"
REASON_TRAILER = "x-veriroll-reason"
NONCE_HEX_LEN = 32


def signing_message(method: str, body: bytes, ts_ms: int, nonce: str) -> bytes:
    """The exact bytes that are signed for a request."""
    digest = hashlib.sha256(body).hexdigest()
    return b"\n".join([DOMAIN, method.encode(), digest.encode(), str(ts_ms).encode(), nonce.encode()])


def sign_request(key: PrivateKey, method: str, body: bytes, *, now_ms: int | None = None,
                 nonce: str | None = None) -> tuple[tuple[str, str], ...]:
    """gRPC metadata that authenticates ``body`` as a call of ``method`` by ``key``."""
    ts = int(time.time() * 1000) if now_ms is None else now_ms
    nonce = secrets.token_hex(NONCE_HEX_LEN // 2) if nonce is None else nonce
    sig = key.sign(signing_message(method, body, ts, nonce))
    return (
        (KEY_HEADER, key.public.raw.hex()),
        (TS_HEADER, str(ts)),
        (NONCE_HEADER, nonce),
        (SIG_HEADER, sig.hex()),
    )


@dataclass(frozen=True)
class SignedHeaders:
    """The envelope fields read from metadata, parsed but not yet verified."""

    public_key: PublicKey
    ts_ms: int
    nonce: str
    signature: bytes


class EnvelopeError(VerirollError, ValueError):
    """The envelope is missing or malformed; ``reason`` is a veriroll reason code."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def parse_headers(metadata) -> SignedHeaders:
    """Read the envelope from gRPC invocation metadata; raises :class:`EnvelopeError`."""
    md: dict[str, str] = {}
    for key, value in metadata or ():
        if isinstance(value, bytes):
            continue
        md.setdefault(key.lower(), value)
    missing = [h for h in (KEY_HEADER, TS_HEADER, NONCE_HEADER, SIG_HEADER) if h not in md]
    if missing:
        raise EnvelopeError("unsigned", f"request is not signed (missing {', '.join(missing)})")
    try:
        raw = bytes.fromhex(md[KEY_HEADER])
        sig = bytes.fromhex(md[SIG_HEADER])
        ts = int(md[TS_HEADER])
    except ValueError as exc:
        raise EnvelopeError("bad_signature", f"malformed signature headers: {exc}") from exc
    nonce = md[NONCE_HEADER]
    if len(raw) != 32 or len(sig) != 64:
        raise EnvelopeError("bad_signature", "public key must be 32 bytes and signature 64 bytes")
    if len(nonce) != NONCE_HEX_LEN or any(c not in "0123456789abcdef" for c in nonce):
        raise EnvelopeError("bad_signature", f"nonce must be {NONCE_HEX_LEN} lowercase hex chars")
    try:
        public_key = PublicKey(raw)
    except InvalidPublicKey as exc:  # small order or non-canonical: signatures by it prove nothing
        raise EnvelopeError("bad_key", str(exc)) from exc
    return SignedHeaders(public_key, ts, nonce, sig)


def verify_signature(headers: SignedHeaders, method: str, body: bytes) -> bool:
    """True when the envelope's signature covers this method and body."""
    return headers.public_key.verify(headers.signature, signing_message(method, body, headers.ts_ms, headers.nonce))
