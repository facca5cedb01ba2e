"""Key files, node ids, the signed envelope, and the protobuf modules' currency."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from veriroll.protos.envelope import EnvelopeError, parse_headers, sign_request, verify_signature
from veriroll.protos.identity import (
    KeyFileError,
    PrivateKey,
    PublicKey,
    load_private_key,
    load_public_key,
    node_id_of,
    write_keypair,
)


def test_keypair_files_are_private_and_node_id_is_a_function_of_the_key(tmp_path):
    path = tmp_path / "node.key"
    key = write_keypair(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert load_private_key(path).node_id == key.node_id
    assert load_public_key(str(path) + ".pub") == key.public
    assert node_id_of(key.public.raw) == key.node_id and len(key.node_id) == 32


def test_keygen_refuses_to_overwrite_without_force(tmp_path):
    path = tmp_path / "node.key"
    first = write_keypair(path)
    with pytest.raises(KeyFileError, match="--force"):
        write_keypair(path)
    assert load_private_key(path).node_id == first.node_id
    assert write_keypair(path, force=True).node_id != first.node_id


def test_malformed_key_files_give_clear_errors(tmp_path):
    bad = tmp_path / "bad.pub"
    bad.write_text("ed25519 zz\n")
    with pytest.raises(KeyFileError, match="hex"):
        load_public_key(bad)
    with pytest.raises(KeyFileError, match="cannot read"):
        load_private_key(tmp_path / "missing.key")
    (tmp_path / "junk.key").write_text("not a key")
    with pytest.raises(KeyFileError, match="PEM"):
        load_private_key(tmp_path / "junk.key")


def test_envelope_signature_binds_method_body_time_and_nonce():
    key = PrivateKey.generate()
    md = sign_request(key, "/veriroll.v1.Coordinator/SubmitGroup", b"body", now_ms=1000, nonce="a" * 32)
    headers = parse_headers(md)
    assert verify_signature(headers, "/veriroll.v1.Coordinator/SubmitGroup", b"body")
    assert not verify_signature(headers, "/veriroll.v1.Coordinator/SubmitGroup", b"bodY")
    assert not verify_signature(headers, "/veriroll.v1.Coordinator/LeaseWork", b"body")
    tampered = dict(md)
    tampered["x-veriroll-ts"] = "1001"
    assert not verify_signature(parse_headers(tuple(tampered.items())), "/veriroll.v1.Coordinator/SubmitGroup", b"body")


@pytest.mark.parametrize("drop, reason", [("x-veriroll-sig", "unsigned"), ("x-veriroll-nonce", "unsigned")])
def test_missing_envelope_headers_are_named(drop, reason):
    md = dict(sign_request(PrivateKey.generate(), "/m", b""))
    del md[drop]
    with pytest.raises(EnvelopeError) as info:
        parse_headers(tuple(md.items()))
    assert info.value.reason == reason and drop in str(info.value)


def test_public_key_line_roundtrip():
    key = PrivateKey.generate().public
    assert PublicKey.from_line(key.to_line()) == key


def test_generated_protobuf_modules_are_current():
    proc = subprocess.run([sys.executable, "-m", "veriroll.protos.generate", "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


# --- small-order and non-canonical public keys (issue 12, "Identities") ---------------------------------
# The well-known blocklist (libsodium; Chalkias et al., "Taming the many EdDSAs"): the 8 points of order
# dividing 8 in their canonical encodings, then non-canonical encodings of some of them.
P = 2**255 - 19
D = -121665 * pow(121666, P - 2, P) % P
SMALL_ORDER_CANONICAL = [
    "0100000000000000000000000000000000000000000000000000000000000000",  # identity, order 1
    "ecffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f",  # y = p - 1, order 2
    "0000000000000000000000000000000000000000000000000000000000000000",  # y = 0, order 4
    "0000000000000000000000000000000000000000000000000000000000000080",  # y = 0, other x, order 4
    "c7176a703d4dd84fba3c0b760d10670f2a2053fa2c39ccc64ec7fd7792ac037a",  # order 8
    "c7176a703d4dd84fba3c0b760d10670f2a2053fa2c39ccc64ec7fd7792ac03fa",  # order 8
    "26e8958fc2b227b045c3f489f2ef98f0d5dfac05d3c63339b13802886d53fc05",  # order 8
    "26e8958fc2b227b045c3f489f2ef98f0d5dfac05d3c63339b13802886d53fc85",  # order 8
]
NON_CANONICAL = [
    "0100000000000000000000000000000000000000000000000000000000000080",  # identity, x = 0 with sign bit
    "ecffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff",  # y = p - 1, x = 0 with sign bit
    "eeffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f",  # y = p + 1 (the identity)
    "eeffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff",
    "edffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f",  # y = p (y = 0, order 4)
    "edffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff",
]
# Every y >= p (p .. 2^255 - 1, 19 values), with either sign bit.
ALL_Y_AT_LEAST_P = [((P + k) | (s << 255)).to_bytes(32, "little").hex() for k in range(19) for s in (0, 1)]
REFUSED = SMALL_ORDER_CANONICAL + NON_CANONICAL + ALL_Y_AT_LEAST_P
# The constant "signature" R = identity, S = 0: valid for every message under a small-order key.
CONSTANT_SIGNATURE = bytes.fromhex(SMALL_ORDER_CANONICAL[0]) + bytes(32)


def _affine_add(a, b):
    """Edwards25519 addition in affine coordinates (independent of the module's extended formulas)."""
    (x1, y1), (x2, y2) = a, b
    t = D * x1 * x2 * y1 * y2 % P
    x3 = (x1 * y2 + y1 * x2) * pow(1 + t, P - 2, P) % P
    y3 = (y1 * y2 + x1 * x2) * pow(1 - t, P - 2, P) % P
    return x3, y3


def _decode_any(hexkey: str):
    """(x, y) for an encoding, reducing y mod p and ignoring canonicity; None when no x exists."""
    n = int.from_bytes(bytes.fromhex(hexkey), "little")
    sign, y = n >> 255, (n & ((1 << 255) - 1)) % P
    x2 = (y * y - 1) * pow(D * y * y + 1, P - 2, P) % P
    roots = [x for x in (pow(x2, (P + 3) // 8, P), pow(x2, (P + 3) // 8, P) * pow(2, (P - 1) // 4, P) % P)
             if x * x % P == x2]
    if not roots:
        return None
    x = roots[0]
    return (x if x & 1 == sign else (P - x) % P), y


def _order(point, limit=8):
    """The order of ``point`` if it divides ``limit``, by repeated addition; None for a larger order."""
    assert (-point[0] ** 2 + point[1] ** 2 - 1 - D * point[0] ** 2 * point[1] ** 2) % P == 0  # on the curve
    acc = point
    for n in range(1, limit + 1):
        if acc == (0, 1):
            return n
        acc = _affine_add(acc, point)
    return None


def test_the_blocklist_is_what_it_claims_small_order_points_checked_by_our_own_arithmetic():
    points = {_decode_any(h) for h in SMALL_ORDER_CANONICAL}
    assert len(points) == 8  # all eight points of order dividing 8: the whole torsion subgroup
    assert sorted(_order(pt) for pt in points) == [1, 2, 4, 4, 8, 8, 8, 8]
    for h in SMALL_ORDER_CANONICAL:
        n = int.from_bytes(bytes.fromhex(h), "little")
        assert n & ((1 << 255) - 1) < P  # canonical y
    for h in NON_CANONICAL:
        pt = _decode_any(h)
        assert pt is not None and _order(pt) in (1, 2, 4)
    # A real key has prime order (not a divisor of 8).
    assert _order(_decode_any(PrivateKey.generate().public.raw.hex())) is None


@pytest.mark.parametrize("hexkey", REFUSED)
def test_small_order_and_non_canonical_keys_are_refused_everywhere(hexkey, tmp_path):
    from veriroll.protos.identity import InvalidPublicKey, public_key_problem

    raw = bytes.fromhex(hexkey)
    assert public_key_problem(raw) is not None
    with pytest.raises(InvalidPublicKey):
        PublicKey(raw)
    with pytest.raises(KeyFileError, match="unusable"):
        PublicKey.from_line(f"ed25519 {hexkey}\n")
    (tmp_path / "weak.pub").write_text(f"ed25519 {hexkey}\n")
    with pytest.raises(KeyFileError, match="unusable"):
        load_public_key(tmp_path / "weak.pub")
    # The envelope: a request under this key with the constant signature is refused before any verify.
    md = dict(sign_request(PrivateKey.generate(), "/m", b"body"))
    md["x-veriroll-key"] = hexkey
    md["x-veriroll-sig"] = CONSTANT_SIGNATURE.hex()
    with pytest.raises(EnvelopeError) as info:
        parse_headers(tuple(md.items()))
    assert info.value.reason == "bad_key"


def test_a_public_key_object_built_around_the_check_still_verifies_nothing():
    # OpenSSL itself accepts R = identity, S = 0 under the identity key for any message; verify() must not.
    key = object.__new__(PublicKey)
    object.__setattr__(key, "raw", bytes.fromhex(SMALL_ORDER_CANONICAL[0]))
    assert not key.verify(CONSTANT_SIGNATURE, b"message")


def test_real_random_keys_are_all_accepted():
    from veriroll.protos.identity import public_key_problem

    for _ in range(1000):
        key = PrivateKey.generate()
        assert public_key_problem(key.public.raw) is None
        assert PublicKey(key.public.raw) == key.public
    assert public_key_problem(b"\x01" * 31) is not None  # wrong length


def test_key_check_is_cached_per_key_bytes(monkeypatch):
    from veriroll.protos import identity

    calls = []
    inner = identity._public_key_problem
    monkeypatch.setattr(identity, "_public_key_problem", lambda raw: calls.append(raw) or inner(raw))
    identity.public_key_problem.cache_clear()
    good = PrivateKey.generate().key.public_key().public_bytes_raw()
    weak = bytes.fromhex(SMALL_ORDER_CANONICAL[4])
    for _ in range(3):
        assert identity.public_key_problem(good) is None
        assert identity.public_key_problem(weak) is not None
        PublicKey(good)
    assert calls == [good, weak]
    identity.public_key_problem.cache_clear()


def test_verify_accepts_a_signature_and_refuses_every_malleation():
    key = PrivateKey.generate()
    message = b"veriroll/v1/request\nSubmitGroup"
    sig = key.sign(message)
    assert key.public.verify(sig, message)
    assert not key.public.verify(sig, message + b"x")
    assert not key.public.verify(bytes([sig[0] ^ 1]) + sig[1:], message)
    assert not key.public.verify(sig[:-1], message) and not key.public.verify(sig + b"\0", message)
    assert not PrivateKey.generate().public.verify(sig, message)
    # S + L is the same scalar mod L: a second valid-looking encoding of the same signature (malleability).
    order = 2**252 + 27742317777372353535851937790883648493
    s = int.from_bytes(sig[32:], "little") + order
    assert s < 2**256
    assert not key.public.verify(sig[:32] + s.to_bytes(32, "little"), message)
