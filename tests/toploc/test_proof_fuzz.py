"""Any bytes given as a proof, and any tensor given as trusted states, give a Verdict: never a crash."""

from __future__ import annotations

import struct

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from veriroll.toploc import REASONS, Verdict, commit, verify
from veriroll.toploc import proof as toploc_proof

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

_g = torch.Generator().manual_seed(0)
HIDDEN = torch.randn(70, 16, generator=_g)  # 3 chunks, the last partial
PROOF = commit(HIDDEN)


def assert_verdict(v) -> None:
    assert isinstance(v, Verdict)
    assert v.ok or v.reason in REASONS
    assert v.reason != "verification_error", v.detail  # every failure should have a specific reason


@FUZZ
@given(st.binary(max_size=2000))
def test_arbitrary_bytes_are_a_rejection(data):
    v = verify(data, HIDDEN)
    assert_verdict(v)
    assert not v.ok


@FUZZ
@given(
    magic=st.sampled_from([b"TL", b"XX"]),
    version=st.integers(0, 255),
    dtype=st.integers(0, 255),
    chunk=st.sampled_from([0, 1, 31, 32, 33, 0xFFFF]),
    topk=st.sampled_from([0, 1, 127, 128, 129, 0xFFFF]),
    t=st.sampled_from([0, 1, 69, 70, 71, 0xFFFFFFFF]),
    h=st.sampled_from([0, 1, 16, 17, 0xFFFFFFFF]),
    body=st.binary(max_size=1200),
)
def test_any_header_with_any_body_is_a_verdict(magic, version, dtype, chunk, topk, t, h, body):
    header = struct.pack(">2sBBHHII", magic, version, dtype, chunk, topk, t, h)
    assert_verdict(verify(header + body, HIDDEN))


@FUZZ
@given(st.data())
def test_mutated_honest_proofs_are_a_verdict(data):
    p = bytearray(PROOF)
    op = data.draw(st.sampled_from(["flip", "truncate", "extend", "splice"]))
    if op == "flip":
        for _ in range(data.draw(st.integers(1, 8))):
            i = data.draw(st.integers(0, len(p) - 1))
            p[i] = data.draw(st.integers(0, 255))
    elif op == "truncate":
        p = p[: data.draw(st.integers(0, len(p)))]
    elif op == "extend":
        p += data.draw(st.binary(min_size=1, max_size=600))
    else:
        i = data.draw(st.integers(0, len(p)))
        p = p[:i] + data.draw(st.binary(max_size=64)) + p[i:]
    v = verify(bytes(p), HIDDEN)
    assert_verdict(v)
    if bytes(p) != PROOF and op != "flip":
        assert not v.ok


@FUZZ
@given(
    moduli=st.lists(st.integers(0, 0xFFFF), min_size=3, max_size=3),
    coef=st.integers(0, 0xFFFF),
)
def test_any_modulus_or_coefficient_is_a_verdict(moduli, coef):
    p = bytearray(PROOF)
    offset = toploc_proof.HEADER_SIZE
    for m, k in zip(moduli, (128, 128, 96), strict=True):
        p[offset : offset + 2] = struct.pack(">H", m)
        p[offset + 2 : offset + 4] = struct.pack(">H", coef)
        offset += 2 + 2 * k
    v = verify(bytes(p), HIDDEN)
    assert_verdict(v)
    if any(m == 0 or m > toploc_proof.P for m in moduli) or coef >= toploc_proof.P:
        assert v.reason == "malformed_proof"


@FUZZ
@given(
    shape=st.lists(st.integers(0, 5), min_size=0, max_size=3),
    dtype=st.sampled_from(
        [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.bool]
    ),
    special=st.sampled_from([None, float("nan"), float("inf"), -float("inf")]),
)
def test_any_trusted_tensor_is_a_verdict(shape, dtype, special):
    x = torch.randn(*shape).to(dtype) if shape else torch.tensor(1.0).to(dtype)
    if special is not None and x.is_floating_point() and x.numel():
        x.view(-1)[0] = special
    proof = commit(x) if x.dim() == 2 and x.is_floating_point() and x.shape[1] > 0 else PROOF
    assert_verdict(verify(proof, x))
    assert_verdict(verify(PROOF, x))


@FUZZ
@given(
    t=st.integers(0, 70),
    h=st.integers(1, 40),
    chunk=st.integers(1, 40),
    topk=st.integers(1, 300),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    seed=st.integers(0, 2**31),
)
def test_honest_proofs_of_any_shape_pass_and_have_the_stated_size(t, h, chunk, topk, dtype, seed):
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(seed)).to(dtype)
    proof = commit(x, chunk_size=chunk, topk=topk)
    rows = [min(chunk, t - s) for s in range(0, t, chunk)]
    assert len(proof) == toploc_proof.HEADER_SIZE + sum(2 + 2 * min(topk, r * h) for r in rows)
    v = verify(proof, x, chunk_size=chunk, topk=topk)
    assert v.ok, (v.reason, v.detail)
    assert len(v.chunks) == len(rows)


@FUZZ
@given(st.data())
def test_interpolation_goes_through_every_point(data):
    k = data.draw(st.integers(1, 130))
    xs = data.draw(st.lists(st.integers(0, toploc_proof.P - 1), min_size=k, max_size=k, unique=True))
    ys = data.draw(st.lists(st.integers(0, toploc_proof.P - 1), min_size=k, max_size=k))
    x = np.array([xs], dtype=np.int64)
    y = np.array([ys], dtype=np.int64)
    coef = toploc_proof._interpolate(x, y)
    assert coef.shape == (1, k) and ((coef >= 0) & (coef < toploc_proof.P)).all()
    assert (toploc_proof._evaluate(coef, x) == y).all()


@FUZZ
@given(st.lists(st.integers(0, 40 * 4096 - 1), min_size=1, max_size=128, unique=True))
def test_injective_modulus_keeps_indices_distinct(idx):
    idx = np.array(idx, dtype=np.int64)
    m = toploc_proof._injective_modulus(idx)
    assert len(idx) <= m <= toploc_proof.P
    assert np.unique(idx % m).size == idx.size
