"""A refusal is counted in the metric and the store alike, even when its caller is cancelled while the
store records it (gRPC ends a call it refused itself while the edge's handler is still counting it)."""

from __future__ import annotations

import asyncio
import threading

from veriroll.coordinator import store as st
from veriroll.coordinator.ledger import Ledger
from veriroll.coordinator.metrics import CoordinatorMetrics
from veriroll.protos.reasons import Reason

HANG_GUARD_S = 30


def metric_counts(metrics: CoordinatorMetrics) -> dict[str, float]:
    return {labels[0]: value for labels, value in dict(metrics.rejections.values).items()}


def stored_counts(db: st.Database) -> dict[str, int]:
    return db.read(st.rejections_by_reason).result()


def test_a_refusal_whose_caller_is_cancelled_mid_write_is_still_counted_once_in_both(tmp_path):
    db = st.Database(tmp_path / "s.db")
    metrics = CoordinatorMetrics()
    ledger = Ledger(db, metrics, clock=lambda: 0, max_strikes=3, probation_groups=1, session_ttl_s=60)
    gate = threading.Event()
    try:
        held = db.submit(lambda conn: gate.wait(HANG_GUARD_S))  # the writer is busy: the refusal waits behind it

        async def scenario() -> None:
            caller = asyncio.create_task(ledger.refuse("", Reason.MALFORMED, "the call ended without a message"))
            await asyncio.sleep(0.05)
            assert not caller.done()
            caller.cancel()  # as gRPC cancels the handler of a call it answered itself
            await asyncio.gather(caller, return_exceptions=True)
            assert caller.cancelled()
            gate.set()  # the writer goes on and commits the refusal
            for _ in range(HANG_GUARD_S * 100):
                if metric_counts(metrics):
                    break
                await asyncio.sleep(0.01)

        asyncio.run(scenario())
        held.result()
        assert stored_counts(db) == {"malformed": 1}
        assert metric_counts(metrics) == {"malformed": 1}
    finally:
        gate.set()
        db.close()


def test_a_refusal_the_store_cannot_take_is_raised_and_not_counted(tmp_path):
    db = st.Database(tmp_path / "s.db")
    metrics = CoordinatorMetrics()
    ledger = Ledger(db, metrics, clock=lambda: 0, max_strikes=3, probation_groups=1, session_ttl_s=60)
    try:
        def broken(conn):
            raise st.StoreUnavailable("the store is down")

        async def scenario() -> None:
            try:
                await ledger.refuse("", Reason.MALFORMED, also=broken)
            except st.StoreUnavailable:
                return
            raise AssertionError("the store's error did not reach the caller")

        asyncio.run(scenario())
        assert metric_counts(metrics) == {} and stored_counts(db) == {}
    finally:
        db.close()
