"""Proof of work on Register (protos/pow.py): bound to one key, one coordinator and one timestamp; cheap to check."""

from __future__ import annotations

import hashlib
import struct

import pytest

from veriroll.protos.pow import (
    DOMAIN,
    MAX_BITS,
    Challenge,
    check,
    leading_zero_bits,
    pow_digest,
    solve,
)

COORDINATOR = bytes(range(32))
NODE = bytes(range(32, 64))
TS = 1_700_000_000_000
BITS = 14  # ~16k hashes: a few milliseconds, and a 1 in 16384 chance that a wrong input passes by luck


@pytest.fixture(scope="module")
def nonce() -> int:
    return solve(COORDINATOR, NODE, TS, BITS)


def test_the_digest_is_the_documented_hash():
    expected = hashlib.sha256(DOMAIN + COORDINATOR + NODE + struct.pack("<q", TS) + struct.pack("<Q", 7)).digest()
    assert pow_digest(COORDINATOR, NODE, TS, 7) == expected


def test_a_solution_checks_and_is_the_first_nonce_that_reaches_the_bits(nonce):
    assert check(COORDINATOR, NODE, TS, nonce, BITS)
    assert leading_zero_bits(pow_digest(COORDINATOR, NODE, TS, nonce)) >= BITS
    assert not any(check(COORDINATOR, NODE, TS, n, BITS) for n in range(nonce))


def test_a_solution_does_not_carry_over_to_another_key_coordinator_or_timestamp(nonce):
    other = bytes(reversed(NODE))
    assert not check(COORDINATOR, other, TS, nonce, BITS)
    assert not check(other, NODE, TS, nonce, BITS)
    assert not check(COORDINATOR, NODE, TS + 1, nonce, BITS)
    assert not check(NODE, COORDINATOR, TS, nonce, BITS)  # the order of the keys matters too


def test_difficulty_is_respected(nonce):
    achieved = leading_zero_bits(pow_digest(COORDINATOR, NODE, TS, nonce))
    assert check(COORDINATOR, NODE, TS, nonce, achieved)
    assert not check(COORDINATOR, NODE, TS, nonce, achieved + 1)
    for bits in (1, 4, 9):
        found = solve(COORDINATOR, NODE, TS, bits)
        assert leading_zero_bits(pow_digest(COORDINATOR, NODE, TS, found)) >= bits


def test_zero_bits_asks_nothing_and_impossible_bits_never_pass():
    assert check(COORDINATOR, NODE, TS, 0, 0)
    assert solve(COORDINATOR, NODE, TS, 0) == 0
    assert not check(COORDINATOR, NODE, TS, 0, MAX_BITS + 1)
    with pytest.raises(ValueError, match="bits"):
        solve(COORDINATOR, NODE, TS, MAX_BITS + 1)


@pytest.mark.parametrize("args", [
    (COORDINATOR, NODE, TS, -1), (COORDINATOR, NODE, TS, 2**64), (COORDINATOR, NODE, 2**63, 0),
    (COORDINATOR[:31], NODE, TS, 0), (COORDINATOR, NODE + b"x", TS, 0),
], ids=["negative-nonce", "nonce-over-64-bits", "ts-over-int64", "short-coordinator-key", "long-node-key"])
def test_out_of_range_input_is_not_a_proof_and_never_raises(args):
    assert check(*args, 1) is False


def test_leading_zero_bits_counts_from_the_most_significant_bit():
    assert leading_zero_bits(bytes(32)) == 256
    assert leading_zero_bits(b"\x80" + bytes(31)) == 0
    assert leading_zero_bits(b"\x01" + bytes(31)) == 7
    assert leading_zero_bits(b"\x00\x00\x10" + b"\xff" * 29) == 19


def test_solving_stops_when_cancelled():
    polls = []

    def cancelled() -> bool:
        polls.append(1)
        return len(polls) > 3

    assert solve(COORDINATOR, NODE, TS, 60, cancelled=cancelled) is None
    assert len(polls) == 4


def test_a_challenge_travels_in_a_refusal_detail():
    challenge = Challenge(21, COORDINATOR)
    status_message = f"pow_required: {challenge.detail()}"  # as the node's CallError carries it
    assert Challenge.from_detail(status_message) == challenge
    assert "21 bits" in challenge.detail()
    assert Challenge.from_detail("pow_required: no challenge here") is None
    assert Challenge.from_detail(f"pow_bits=65 coordinator_key={COORDINATOR.hex()}") is None  # unsolvable
    assert Challenge.from_detail("") is None


def test_a_challenge_accepts_exactly_its_own_solution(nonce):
    challenge = Challenge(BITS, COORDINATOR)
    assert challenge.accepts(NODE, TS, nonce)
    assert not challenge.accepts(NODE, TS + 1, nonce)
    assert not Challenge(BITS, NODE).accepts(NODE, TS, nonce)


def test_refusals_of_a_new_key_are_never_strikes_and_a_limited_one_is_retryable():
    import grpc

    from veriroll.protos.reasons import Reason

    for reason in (Reason.POW_REQUIRED, Reason.POW_INVALID, Reason.NEW_IDENTITY_LIMITED):
        assert not reason.strike and reason.message
    assert Reason.NEW_IDENTITY_LIMITED.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert Reason.POW_REQUIRED.code is grpc.StatusCode.FAILED_PRECONDITION
