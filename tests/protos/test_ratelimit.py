"""Token buckets (protos/ratelimit.py): one bucket's arithmetic, and a bounded map of them."""

from __future__ import annotations

import math

import pytest

from veriroll.protos.ratelimit import BucketMap, TokenBucket


def test_a_bucket_starts_full_and_refills_at_its_rate_up_to_its_burst():
    bucket = TokenBucket(2.0, 3.0, now=0.0)
    assert [bucket.take(now=0.0) for _ in range(4)] == [True, True, True, False]
    assert bucket.level(0.5) == pytest.approx(1.0)
    assert bucket.take(now=0.5) and not bucket.take(now=0.5)
    assert bucket.level(100.0) == 3.0  # a long idle spell is no bigger burst


def test_a_refused_take_takes_nothing():
    bucket = TokenBucket(1.0, 2.0, now=0.0)
    assert not bucket.take(2.5, now=0.0)
    assert bucket.level(0.0) == 2.0


def test_spend_overdraws_and_the_debt_is_repaid_by_refill():
    bucket = TokenBucket(0.5, 4.0, now=0.0)
    assert bucket.spend(6.0, now=0.0) == -2.0
    assert not bucket.take(now=5.0)  # -2 + 2.5 = 0.5
    assert bucket.seconds_until(1.0, now=5.0) == pytest.approx(1.0)
    assert bucket.take(now=6.0)


def test_a_clock_that_goes_back_refills_nothing():
    bucket = TokenBucket(1.0, 5.0, now=10.0)
    bucket.spend(5.0, now=10.0)
    assert bucket.level(4.0) == 0.0


def test_seconds_until_is_zero_when_held_and_infinite_when_never():
    assert TokenBucket(1.0, 2.0, now=0.0).seconds_until(1.0, now=0.0) == 0.0
    empty = TokenBucket(0.0, 1.0, now=0.0)
    empty.spend(1.0, now=0.0)
    assert math.isinf(empty.seconds_until(1.0, now=0.0))
    assert math.isinf(TokenBucket(1.0, 2.0, now=0.0).seconds_until(3.0, now=0.0))  # over the burst


def test_keys_have_buckets_of_their_own_and_an_unseen_key_is_full_without_being_kept():
    buckets = BucketMap(1.0, 2.0, max_keys=10)
    assert buckets.take("a", now=0.0) and buckets.take("a", now=0.0) and not buckets.take("a", now=0.0)
    assert buckets.take("b", now=0.0)
    assert buckets.level("never", now=0.0) == 2.0 and len(buckets) == 2


def test_past_its_bound_the_least_recently_used_key_is_forgotten():
    buckets = BucketMap(1.0, 1.0, max_keys=3)
    for key in "abc":
        buckets.spend(key, 5.0, now=0.0)
    buckets.take("a", now=0.0)  # refused, but "a" is now the most recently used
    buckets.spend("d", 5.0, now=0.0)
    assert len(buckets) == 3
    assert buckets.level("b", now=0.0) == 1.0  # forgotten: back full
    assert buckets.level("a", now=0.0) == buckets.level("c", now=0.0) == -4.0  # kept, debt and all


def test_the_bound_holds_under_100000_distinct_keys_and_the_newest_are_the_ones_kept():
    """The maps this replaced grew past their bound when no kept bucket was idle (and scanned every kept
    bucket on each new key once full); this one forgets the least recently used, one per new key."""
    buckets = BucketMap(1.0, 1.0, max_keys=1000)
    for i in range(100_000):
        assert buckets.take(f"key-{i}", now=0.0)  # each new, each taking its whole burst: none full again
        assert len(buckets) == min(i + 1, 1000)
    assert all(buckets.level(f"key-{i}", now=0.0) == 0.0 for i in range(99_000, 100_000))  # kept, spent
    assert buckets.level("key-98999", now=0.0) == 1.0  # forgotten: full again


def test_a_new_rate_holds_for_kept_and_new_buckets():
    buckets = BucketMap(10.0, 8.0, max_keys=10)
    buckets.take("a", now=0.0)
    buckets.set_rate(2.5, 2.0)
    assert buckets.level("a", now=0.0) == 2.0 and buckets.level("new", now=0.0) == 2.0
    assert [buckets.take("a", now=0.0) for _ in range(3)] == [True, True, False]
    assert buckets.level("a", now=0.4) == pytest.approx(1.0)


def test_max_keys_must_keep_at_least_one_bucket():
    with pytest.raises(ValueError, match="max_keys"):
        BucketMap(1.0, 1.0, max_keys=0)
