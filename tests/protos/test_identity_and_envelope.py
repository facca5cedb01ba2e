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
