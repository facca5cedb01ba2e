"""The verifier budget: seconds per minute per node key, address and /24 or /64, on an injected clock."""

from __future__ import annotations

import pytest

from veriroll.coordinator.config import CoordinatorConfig
from veriroll.coordinator.verify_budget import VerifierBudget
from veriroll.protos.reasons import Reason


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def budget(identity=10.0, address=0.0, prefix=0.0, **kw) -> tuple[VerifierBudget, Clock]:
    clock = Clock()
    return VerifierBudget(identity, address, prefix, clock=clock, **kw), clock


def test_a_fresh_key_has_one_minutes_allowance_and_is_refused_once_it_is_spent():
    b, _ = budget(identity=10.0)
    assert b.reserve("k", "10.0.0.1") is None
    b.charge("k", "10.0.0.1", 6.0)
    assert b.reserve("k", "10.0.0.1") is None  # 4 s left
    b.charge("k", "10.0.0.1", 6.0)  # one verification may overdraw: 2 s of debt
    refused = b.reserve("k", "10.0.0.1")
    assert refused.reason is Reason.RATE_LIMITED and not refused.reason.strike
    assert "node key" in refused.detail and "10 s of verifier time per minute" in refused.detail
    assert "retry in 12 s" in refused.detail  # 2 s of debt at 10 s per minute
    assert b.reserve("other", "10.0.0.1") is None  # another key is not touched


def test_debt_is_repaid_by_refill_before_the_key_is_verified_again():
    b, clock = budget(identity=6.0)  # 0.1 s per second
    b.charge("k", "a", 9.0)  # -3 s
    clock.now += 29.0
    assert b.reserve("k", "a") is not None  # -0.1 s
    clock.now += 2.0
    assert b.reserve("k", "a") is None
    clock.now += 3600.0
    b.charge("k", "a", 6.0)  # refill stops at one minute's allowance: a long idle spell is no bigger burst
    assert b.reserve("k", "a") is not None


def test_over_any_minute_a_busy_key_uses_at_most_its_allowance_plus_one_burst():
    b, clock = budget(identity=12.0)
    used, cost = 0.0, 0.25
    for _ in range(6000):  # a try every 50 ms for 5 minutes
        if b.reserve("k", "a") is None:
            b.charge("k", "a", cost)
            used += cost
        clock.now += 0.05
    assert 5 * 12.0 <= used <= 6 * 12.0 + cost


def test_many_keys_from_one_address_share_its_allowance():
    b, _ = budget(identity=10.0, address=15.0)
    for i in range(3):
        assert b.reserve(f"k{i}", "192.0.2.7") is None
        b.charge(f"k{i}", "192.0.2.7", 5.0)
    refused = b.reserve("k-new", "192.0.2.7")  # a fresh key, but its address is used up
    assert refused.reason is Reason.RATE_LIMITED and "address (192.0.2.7)" in refused.detail
    assert b.reserve("k-new", "192.0.2.8") is None


def test_addresses_of_one_prefix_share_its_allowance_in_ipv4_and_ipv6():
    b, _ = budget(identity=0.0, address=10.0, prefix=20.0)
    for host in range(1, 5):
        b.charge(f"k{host}", f"198.51.100.{host}", 5.0)
    refused = b.reserve("k9", "198.51.100.200")
    assert refused.reason is Reason.RATE_LIMITED and "network (198.51.100.0/24)" in refused.detail
    assert b.reserve("k9", "198.51.101.1") is None  # the next /24
    for host in range(1, 5):
        b.charge(f"v{host}", f"2001:db8:1:2::{host}", 5.0)
    assert "2001:db8:1:2::/64" in b.reserve("v9", "2001:db8:1:2:ffff::1").detail
    assert b.reserve("v9", "2001:db8:1:3::1") is None


def test_one_client_seen_over_ipv6_and_ipv4_has_one_address_budget():
    b, _ = budget(identity=0.0, address=10.0)
    # a dual-stack listener reports an IPv4 client as IPv4-mapped IPv6; an IPv4 socket as itself
    b.charge("k1", "::ffff:1.2.3.4", 6.0)
    b.charge("k2", "1.2.3.4", 6.0)
    refused = b.reserve("k3", "ipv6:[::ffff:1.2.3.4]:5")
    assert refused.reason is Reason.RATE_LIMITED and "address (1.2.3.4)" in refused.detail
    assert b.reserve("k3", "ipv4:1.2.3.4:6") is not None
    assert b.reserve("k3", "1.2.3.5") is None


def test_peers_that_are_not_ip_addresses_share_one_budget():
    b, _ = budget(identity=0.0, address=10.0, prefix=10.0)
    b.charge("k1", "unix:/tmp/a.sock", 11.0)
    assert b.reserve("k2", "unix:/tmp/b.sock") is not None and b.reserve("k2", "unknown") is not None
    assert b.reserve("k2", "192.0.2.1") is None


def test_memory_is_bounded_and_the_least_recently_used_bucket_goes_first():
    b, clock = budget(identity=1.0, address=1.0, max_keys=100)
    b.charge("old", "10.9.9.9", 5.0)
    for i in range(1000):
        clock.now += 0.001
        b.charge(f"k{i}", f"10.0.{i // 256}.{i % 256}", 0.01)
    assert b.tracked() == {"node key": 100, "address": 100}
    assert b.reserve("k999", "10.0.3.231") is None
    # "old" was evicted: a new bucket (the price of bounded memory; the prefix scope keeps churn in check)
    assert b.reserve("old", "10.9.9.9") is None


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_a_negative_or_non_finite_allowance_is_a_configuration_error(bad):
    with pytest.raises(ValueError, match="per_address"):
        VerifierBudget(1.0, bad, 1.0)


def test_built_from_the_intake_config():
    cfg = CoordinatorConfig()
    cfg.intake.verify_seconds_per_minute_per_identity = 2.0
    cfg.intake.verify_seconds_per_minute_per_prefix = 0.0
    clock = Clock()
    b = VerifierBudget.from_config(cfg.intake, clock=clock)
    b.charge("k", "10.0.0.1", 3.0)
    assert b.reserve("k", "10.0.0.1").reason is Reason.RATE_LIMITED
    assert b.reserve("k2", "10.0.0.1") is None  # the address still has most of its 60 s
    assert set(b.tracked()) == {"node key", "address"}


def test_edges_sharing_a_store_share_one_verifier_budget(store_target):
    """Two edge processes (two budgets, one store): seconds one spends are gone for the other; a scope in
    debt is refused with its wait, and refill pays the debt back at the per-minute rate."""
    import asyncio

    from veriroll.coordinator import store as st
    from veriroll.coordinator.verify_budget import SharedVerifierBudget

    db = st.Database(store_target)
    now_ms = [5_000_000.0]
    edges = [SharedVerifierBudget(10.0, 0.0, 30.0, db, clock_ms=lambda: now_ms[0]) for _ in range(2)]

    async def scenario():
        seen = [await edges[0].check("k", "10.0.0.1")]
        await edges[0].spend("k", "10.0.0.1", 6.0)
        seen.append(await edges[1].check("k", "10.0.0.1"))  # 4 s left, whichever edge asks
        await edges[1].spend("k", "10.0.0.1", 6.0)  # overdrawn: 2 s of debt
        seen.append(await edges[0].check("k", "10.0.0.1"))
        seen.append(await edges[1].check("other", "10.0.0.2"))  # another key of the same /24: 18 s left there
        now_ms[0] += 13_000  # 10 s per minute: 2 s of debt paid back after 12 s
        seen.append(await edges[1].check("k", "10.0.0.1"))
        return seen

    try:
        fresh, after_one, in_debt, neighbour, repaid = asyncio.run(scenario())
    finally:
        db.close()
    assert fresh is None and after_one is None and neighbour is None and repaid is None
    assert in_debt is not None and in_debt.reason is Reason.RATE_LIMITED
    assert "node key (k)" in in_debt.detail and "retry in 12 s" in in_debt.detail


def test_the_configured_budget_is_shared_when_given_a_store_and_local_otherwise(tmp_path):
    import asyncio

    from veriroll.coordinator import store as st
    from veriroll.coordinator.verify_budget import SharedVerifierBudget

    intake = CoordinatorConfig().intake
    local = VerifierBudget.from_config(intake)
    assert asyncio.run(local.check("k", "10.0.0.1")) is None
    asyncio.run(local.spend("k", "10.0.0.1", intake.verify_seconds_per_minute_per_identity + 1))
    assert asyncio.run(local.check("k", "10.0.0.1")).reason is Reason.RATE_LIMITED  # the same calls, in memory
    db = st.Database(tmp_path / "state.db")
    try:
        assert isinstance(VerifierBudget.from_config(intake, shared_db=db), SharedVerifierBudget)
    finally:
        db.close()
