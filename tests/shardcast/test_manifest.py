"""The manifest format: pure functions, no files, no sockets."""

from __future__ import annotations

import hashlib
import json

import pytest

from veriroll.protos.identity import PrivateKey
from veriroll.shardcast.errors import ManifestError, ManifestSignatureError, WrongVersionError
from veriroll.shardcast.manifest import (
    FileEntry,
    build_manifest,
    canonical_json,
    plan_shards,
    sign_manifest,
    signing_message,
    validate_file_name,
    verify_manifest,
)

H = hashlib.sha256(b"x").hexdigest()


def _manifest(version=3, sizes=(("config.json", 10), ("model.safetensors", 25)), shard_size=8):
    files = [FileEntry(n, s, H) for n, s in sizes]
    shards = [(f, o, n, H) for f, o, n in plan_shards(sizes, shard_size)]
    return build_manifest(version, files, shards, shard_size=shard_size, created="2025-01-01T00:00:00Z")


def _signed_doc(body: dict, key: PrivateKey) -> bytes:
    return json.dumps({"manifest": body, "signature": key.sign(signing_message(body)).hex()}).encode()


def test_signed_manifest_round_trips():
    key = PrivateKey.generate()
    m = _manifest()
    assert verify_manifest(sign_manifest(m, key).to_bytes(), key.public) == m


def test_plan_shards_cuts_files_into_fixed_pieces_and_gives_empty_files_none():
    plan = plan_shards([("a", 20), ("empty", 0), ("b", 8)], 8)
    assert plan == [("a", 0, 8), ("a", 8, 8), ("a", 16, 4), ("b", 0, 8)]


def test_signature_does_not_depend_on_how_the_relay_formats_the_json():
    key = PrivateKey.generate()
    doc = json.loads(sign_manifest(_manifest(), key).to_bytes())
    # Reorder keys and change whitespace: the canonical bytes, hence the signature check, are unchanged.
    reformatted = json.dumps(
        {"signature": doc["signature"], "manifest": dict(reversed(doc["manifest"].items()))}
    )
    assert verify_manifest(reformatted.encode(), key.public).version == 3


def test_canonical_json_is_sorted_compact_ascii():
    assert canonical_json({"b": 1, "a": ["é", 2]}) == b'{"a":["\\u00e9",2],"b":1}'


def test_manifest_signed_by_another_key_is_refused():
    key, impostor = PrivateKey.generate(), PrivateKey.generate()
    data = sign_manifest(_manifest(), impostor).to_bytes()
    with pytest.raises(ManifestSignatureError, match="claims to be signed by"):
        verify_manifest(data, key.public)


def test_altered_manifest_fails_its_signature():
    key = PrivateKey.generate()
    doc = json.loads(sign_manifest(_manifest(), key).to_bytes())
    doc["manifest"]["shards"][0]["sha256"] = "0" * 64
    with pytest.raises(ManifestSignatureError):
        verify_manifest(json.dumps(doc).encode(), key.public)


def test_signature_is_checked_before_the_manifest_is_believed():
    # An invalid manifest with a bad signature is a signature error, not a validation error.
    key = PrivateKey.generate()
    body = _manifest().to_dict()
    body["files"][0]["name"] = "../escape"
    doc = {"manifest": body, "signature": "00" * 64}
    with pytest.raises(ManifestSignatureError):
        verify_manifest(json.dumps(doc).encode(), key.public)


def test_wrong_version_is_refused_even_with_a_valid_signature():
    key = PrivateKey.generate()
    with pytest.raises(WrongVersionError, match="asked for version 4"):
        verify_manifest(sign_manifest(_manifest(version=3), key).to_bytes(), key.public, expect_version=4)


@pytest.mark.parametrize(
    "name",
    [
        "../model.safetensors",
        "a/../../etc/passwd",
        "/etc/passwd",
        "..",
        ".",
        "a//b",
        "a/",
        "a\\..\\b",
        "C:evil",
        "a\x00b",
        "",
        ".shardcast-ready",
        ".shardcast-manifest.json",
        "name with space",
        "~/x",
    ],
)
def test_unsafe_file_names_are_refused(name):
    with pytest.raises(ManifestError):
        validate_file_name(name)


@pytest.mark.parametrize(
    "name", ["config.json", "model-00001-of-00002.safetensors", "sub/dir/x.json", ".gitattributes"]
)
def test_plain_relative_file_names_are_accepted(name):
    assert validate_file_name(name) == name


def test_path_traversal_in_a_validly_signed_manifest_is_refused():
    key = PrivateKey.generate()
    body = _manifest().to_dict()
    body["files"][0]["name"] = "../../outside.json"
    for s in body["shards"]:
        if s["file"] == "config.json":
            s["file"] = "../../outside.json"
    with pytest.raises(ManifestError, match="path traversal"):
        verify_manifest(_signed_doc(body, key), key.public)


def _mutated(mutate):
    key = PrivateKey.generate()
    body = _manifest().to_dict()
    mutate(body)
    return verify_manifest(_signed_doc(body, key), key.public)


def test_shards_that_leave_a_gap_are_refused():
    def gap(body):
        body["shards"].pop(3)  # second shard of model.safetensors

    with pytest.raises(ManifestError, match="gap"):
        _mutated(gap)


def test_shards_that_stop_short_of_the_file_end_are_refused():
    def short(body):
        body["shards"].pop()

    with pytest.raises(ManifestError, match="cover 24 of its 25 bytes|cover"):
        _mutated(short)


def test_file_without_any_shard_is_refused():
    def orphan(body):
        body["shards"] = [s for s in body["shards"] if s["file"] != "config.json"]

    with pytest.raises(ManifestError, match="cover 0 of its 10 bytes"):
        _mutated(orphan)


def test_overlapping_shards_are_refused():
    def overlap(body):
        body["shards"][3]["offset"] = 4

    with pytest.raises(ManifestError, match="overlaps"):
        _mutated(overlap)


def test_shard_past_the_file_end_is_refused():
    def past(body):
        body["shards"][-1]["size"] = 8

    with pytest.raises(ManifestError, match="past the file's size"):
        _mutated(past)


def test_shard_of_an_unlisted_file_is_refused():
    def unknown(body):
        body["shards"][0]["file"] = "other.bin"

    with pytest.raises(ManifestError, match="not a listed file"):
        _mutated(unknown)


def test_shard_larger_than_the_shard_size_is_refused():
    def big(body):
        body["shard_size"] = 4

    with pytest.raises(ManifestError, match="size of shard 0"):
        _mutated(big)


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda b: b["files"][0].update(size=-1), "size of"),
        (lambda b: b["files"][0].update(size=True), "size of"),
        (lambda b: b["files"][0].update(sha256=H.upper()), "sha256"),
        (lambda b: b["files"][0].update(sha256=H[:-1]), "sha256"),
        (lambda b: b["shards"][0].update(sha256=None), "sha256"),
        (lambda b: b.update(version=-1), "version"),
        (lambda b: b.update(version="3"), "version"),
        (lambda b: b.update(created="yesterday"), "created"),
        (lambda b: b.update(format="other/9"), "format"),
        (lambda b: b.update(extra=1), "unknown keys"),
        (lambda b: b["files"].append(dict(b["files"][0])), "listed twice"),
        (lambda b: b.update(files=[]), "at least one file"),
    ],
)
def test_malformed_sizes_hashes_and_fields_are_refused(mutate, match):
    with pytest.raises(ManifestError, match=match):
        _mutated(mutate)


def test_a_file_that_is_also_a_directory_is_refused():
    key = PrivateKey.generate()
    sizes = (("a", 4), ("a/b", 4))
    files = [FileEntry(n, s, H) for n, s in sizes]
    body = {
        "format": "veriroll-shardcast/1",
        "version": 1,
        "created": "2025-01-01T00:00:00Z",
        "shard_size": 8,
        "files": [{"name": f.name, "size": f.size, "sha256": f.sha256} for f in files],
        "shards": [{"file": n, "offset": 0, "size": 4, "sha256": H} for n, _ in sizes],
    }
    with pytest.raises(ManifestError, match="also a directory"):
        verify_manifest(_signed_doc(body, key), key.public)


@pytest.mark.parametrize(
    "text,match",
    [
        (b'{"manifest": {}, "manifest": {}, "signature": ""}', "twice"),
        (b'{"manifest": {"version": 1.0}, "signature": ""}', "integers only"),
        (b'{"manifest": {"version": NaN}, "signature": ""}', "no NaN"),
        (b"\xff\xfe", "not valid JSON"),
        (b"[]", "signed manifest is an object"),
    ],
)
def test_ambiguous_or_broken_json_is_refused(text, match):
    with pytest.raises(ManifestError, match=match):
        verify_manifest(text, PrivateKey.generate().public)
