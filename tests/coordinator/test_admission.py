"""The cost of a new identity: the proof-of-work check on Register and the new-keys-per-hour limiter."""

from __future__ import annotations

import asyncio
import time

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from veriroll.coordinator.admission import NewIdentityLimiter, RateLimiter, check_register_pow
from veriroll.coordinator.config import CoordinatorConfig
from veriroll.protos.envelope import parse_headers, sign_request
from veriroll.protos.identity import PrivateKey
from veriroll.protos.pow import Challenge, solve
from veriroll.protos.reasons import Reason
from veriroll.protos.service import full_method
from veriroll.protos.v1 import coordinator_pb2 as pb

HOUR = 3600.0

# --- the limiter -----------------------------------------------------------------------------------------


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def limiter(clock: Clock, **kw) -> NewIdentityLimiter:
    args = dict(per_hour_per_address=2, burst_per_address=3, per_hour_per_prefix=6, burst_per_prefix=5)
    return NewIdentityLimiter(**{**args, **kw}, clock=clock)


def test_an_address_gets_its_burst_then_its_hourly_rate():
    clock = Clock()
    lim = limiter(clock)
    assert [lim.allow("203.0.113.7") for _ in range(3)] == [None, None, None]
    refusal = lim.allow("203.0.113.7")
    assert refusal is not None and refusal[0] is Reason.NEW_IDENTITY_LIMITED
    assert "203.0.113.7" in refusal[1] and "retry in 1800 s" in refusal[1]  # 2 per hour: one every 30 min
    clock.now += HOUR / 2 - 1
    assert lim.allow("203.0.113.7") is not None
    clock.now += 1
    assert lim.allow("203.0.113.7") is None
    assert lim.allow("203.0.113.7") is not None


def test_addresses_of_one_network_share_its_budget_and_other_networks_do_not():
    clock = Clock()
    lim = limiter(clock)
    allowed = [lim.allow(f"203.0.113.{i}") is None for i in range(1, 9)]
    assert allowed == [True] * 5 + [False] * 3  # the /24's burst of 5
    refusal = lim.allow("203.0.113.99")
    assert refusal is not None and "203.0.113.0/24" in refusal[1]
    assert lim.allow("198.51.100.1") is None  # another /24


def test_a_refusal_by_the_network_spends_nothing_of_the_address():
    clock = Clock()
    lim = limiter(clock, burst_per_address=3, burst_per_prefix=3, per_hour_per_prefix=1)
    for i in range(3):
        assert lim.allow(f"203.0.113.{i + 1}") is None  # the /24 is now empty
    for _ in range(5):
        assert lim.allow("203.0.113.50") is not None
    clock.now += 3 * HOUR  # the /24 refills 3
    assert [lim.allow("203.0.113.50") for _ in range(3)] == [None, None, None]  # the address still has all 3


def test_ipv6_hosts_are_limited_by_their_64():
    clock = Clock()
    lim = limiter(clock, burst_per_address=100, burst_per_prefix=4)
    assert all(lim.allow(f"2001:db8:0:1::{i:x}") is None for i in range(1, 5))
    assert lim.allow("2001:db8:0:1::ffff") is not None  # a fresh address in the same /64 does not help
    assert lim.allow("2001:db8:0:2::1") is None


def test_ipv4_mapped_ipv6_counts_against_its_ipv4():
    clock = Clock()
    lim = limiter(clock)
    for _ in range(3):
        assert lim.allow("203.0.113.7") is None
    assert lim.allow("::ffff:203.0.113.7") is not None


def test_unparsable_peers_share_one_budget_rather_than_escaping_it():
    clock = Clock()
    lim = limiter(clock)
    outcomes = [lim.allow(peer) for peer in ("unknown", "unix:/a", "unix:/b", "garbage", "")]
    assert outcomes[:3] == [None, None, None] and all(o is not None for o in outcomes[3:])


def test_exempt_networks_are_not_limited_and_zero_per_hour_switches_a_level_off():
    clock = Clock()
    lim = limiter(clock, exempt=["127.0.0.0/8", "::1/128"])
    assert all(lim.allow("127.0.0.1") is None for _ in range(50))
    assert all(lim.allow("::1") is None for _ in range(50))
    no_address_level = limiter(clock, per_hour_per_address=0, burst_per_prefix=8)
    assert all(no_address_level.allow("203.0.113.7") is None for _ in range(8))
    assert no_address_level.allow("203.0.113.7") is not None  # the /24 still binds


def test_memory_is_bounded_and_the_longest_idle_is_forgotten_first():
    clock = Clock()
    lim = limiter(clock, max_tracked=50)
    assert lim.allow("192.0.2.1") is None
    for i in range(500):
        clock.now += 1
        assert lim.allow(f"10.{i // 256}.{i % 256}.1") is None  # each in its own /24
    assert len(lim.by_address) == 50 and len(lim.by_prefix) == 50
    # 192.0.2.1 was forgotten: it comes back with a full bucket, which after 500 s it nearly had anyway.
    assert [lim.allow("192.0.2.1") for _ in range(3)] == [None, None, None]


def test_the_limiter_reads_the_identity_section_of_the_config():
    cfg = CoordinatorConfig.model_validate({"identity": {"new_per_hour_per_address": 1, "new_burst_per_address": 1,
                                                         "exempt_networks": []}}).identity
    lim = NewIdentityLimiter.from_config(cfg)
    assert lim.allow("127.0.0.1") is None
    assert lim.allow("127.0.0.1") is not None  # loopback is limited once it is not exempt
    assert NewIdentityLimiter.from_config(CoordinatorConfig().identity).allow("127.0.0.1") is None


def test_a_bad_exempt_network_is_refused_when_the_config_loads():
    with pytest.raises(ValueError, match="exempt_networks"):
        CoordinatorConfig.model_validate({"identity": {"exempt_networks": ["not-a-network"]}})


# --- the proof of work on Register -----------------------------------------------------------------------

BITS = 12  # fixed keys below: a wrong proof that passes by luck (1 in 4096) would fail every run, not one in 4096


def fixed_key(seed: int) -> PrivateKey:
    return PrivateKey(Ed25519PrivateKey.from_private_bytes(bytes([seed]) * 32))


COORDINATOR = fixed_key(1).public.raw


def signed(key: PrivateKey, req: pb.RegisterRequest, ts_ms: int):
    """``req`` as the edge sees it: the parsed envelope of a Register signed at ``ts_ms``."""
    return parse_headers(sign_request(key, full_method("Register"), req.SerializeToString(), now_ms=ts_ms))


def proven_request(key: PrivateKey, ts_ms: int, bits: int = BITS) -> pb.RegisterRequest:
    nonce = solve(COORDINATOR, key.public.raw, ts_ms, bits)
    return pb.RegisterRequest(public_key=key.public.raw, pow_nonce=nonce, pow_bits=bits)


def test_a_register_with_the_work_done_passes():
    key = fixed_key(2)
    req = proven_request(key, 1_000)
    assert check_register_pow(BITS, COORDINATOR, req, signed(key, req, 1_000)) is None


def test_a_register_without_work_is_told_the_challenge():
    key = fixed_key(2)
    req = pb.RegisterRequest(public_key=key.public.raw)
    reason, detail = check_register_pow(BITS, COORDINATOR, req, signed(key, req, 1_000))
    assert reason is Reason.POW_REQUIRED and not reason.strike
    assert Challenge.from_detail(detail) == Challenge(BITS, COORDINATOR)


def test_work_at_fewer_bits_than_required_is_asked_again():
    key = fixed_key(2)
    req = proven_request(key, 1_000, bits=BITS - 4)
    reason, detail = check_register_pow(BITS, COORDINATOR, req, signed(key, req, 1_000))
    assert reason is Reason.POW_REQUIRED and Challenge.from_detail(detail).bits == BITS


@pytest.mark.parametrize("reuse", ["other-key", "other-timestamp", "other-coordinator", "claimed-bits-only"])
def test_work_that_does_not_reach_its_claim_is_invalid(reuse):
    key, other = fixed_key(2), fixed_key(3)
    req = proven_request(key, 1_000)
    coordinator = COORDINATOR
    if reuse == "other-key":  # a solution lifted from another node's request
        req.public_key = other.public.raw
        key = other
    elif reuse == "other-coordinator":  # a solution made for another network
        coordinator = fixed_key(4).public.raw
    elif reuse == "claimed-bits-only":
        req.pow_nonce += 1
    ts = 2_000 if reuse == "other-timestamp" else 1_000
    reason, detail = check_register_pow(BITS, coordinator, req, signed(key, req, ts))
    assert reason is Reason.POW_INVALID and not reason.strike
    assert Challenge.from_detail(detail) == Challenge(BITS, coordinator)


def test_no_work_is_asked_when_the_operator_switches_it_off():
    key = fixed_key(2)
    req = pb.RegisterRequest(public_key=key.public.raw)
    assert check_register_pow(0, COORDINATOR, req, signed(key, req, 1_000)) is None


# --- the same budgets shared by several edge processes (kept in the store) --------------------------------


def test_edges_sharing_a_store_share_one_new_key_budget(store_target):
    """Two edge processes (two limiters, one store): an address's burst is spent once across both, a refusal
    takes nothing from either level, and the hourly rate refills it (the buckets' clock is the store's ms)."""
    from veriroll.coordinator import store as st
    from veriroll.coordinator.admission import SharedNewIdentityLimiter

    db = st.Database(store_target)
    now_ms = [1_000_000.0]
    args = dict(per_hour_per_address=2, burst_per_address=3, per_hour_per_prefix=6, burst_per_prefix=4)
    edges = [SharedNewIdentityLimiter(NewIdentityLimiter(**args), db, clock_ms=lambda: now_ms[0]) for _ in range(2)]

    async def register(edge: int, address: str):
        return await edges[edge].take(address)

    async def scenario():
        first = [await register(i % 2, "203.0.113.7") for i in range(4)]
        neighbour = await register(1, "203.0.113.8")  # the /24 has 4 at once: one left after three
        prefix_full = await register(0, "203.0.113.9")
        now_ms[0] += HOUR * 1000 / 2  # half an hour: one new key for the address (and three for the /24)
        later = [await register(1, "203.0.113.7"), await register(0, "203.0.113.7")]
        return first, neighbour, prefix_full, later

    try:
        first, neighbour, prefix_full, later = asyncio.run(scenario())
        given_back = db.run_sync(lambda c: st.bucket_level(c, "new_keys_address", "203.0.113.9",
                                                           st.BucketRate(2 / 3600, 3), now_ms[0]))
        forgotten = db.run_sync(lambda c: st.forget_full_buckets(c, now_ms[0] + HOUR * 1000 * 10))
    finally:
        db.close()
    assert first[:3] == [None, None, None]
    assert first[3][0] is Reason.NEW_IDENTITY_LIMITED and "address 203.0.113.7" in first[3][1]
    assert first[3][1].endswith("retry in 1800 s")
    assert neighbour is None
    assert prefix_full[0] is Reason.NEW_IDENTITY_LIMITED and "network 203.0.113.0/24" in prefix_full[1]
    assert later[0] is None and later[1] is not None and "address" in later[1][1]
    assert given_back == 3.0  # .9 was refused on its prefix: its address's token was given back
    assert forgotten == 4  # refilled buckets leave the table: it holds only recent spenders


def test_a_rate_limiter_split_among_edges_enforces_its_share():
    limiter = RateLimiter(10.0, 8.0)
    limiter.split(4)
    assert (limiter.rate, limiter.burst) == (2.5, 2.0)
    t0 = time.monotonic() + 10  # buckets are stamped with the monotonic clock when made
    assert [limiter.allow("k", now=t0) for _ in range(3)] == [True, True, False]
    limiter.split(1)  # the other edges went away: the whole limit again, for new and known keys
    assert limiter.allow("k", now=t0 + 0.2) and (limiter.rate, limiter.burst) == (10.0, 8.0)
    limiter.split(100)
    assert limiter.burst == 1.0  # never below one request, or nothing would pass
