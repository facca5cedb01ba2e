"""One base for veriroll's errors and refusals, and refusal reasons parsed once where the node reads them."""

from __future__ import annotations

import grpc
import pytest

from veriroll.protos import errors
from veriroll.protos.reasons import Reason, parse_reason
from veriroll.protos.service import CallError


def test_the_doors_refusal_is_a_protos_refusal_with_its_reason_and_detail():
    from veriroll.coordinator.edge import MAX_DETAIL_CHARS, Refusal

    with pytest.raises(errors.Refusal) as caught:
        raise Refusal(Reason.LEASE_EXPIRED, "x" * 10_000)
    refusal = caught.value
    assert isinstance(refusal, errors.VerirollError) and refusal.reason is Reason.LEASE_EXPIRED
    assert len(refusal.detail) == MAX_DETAIL_CHARS and str(refusal) == f"lease_expired: {refusal.detail}"
    assert Refusal(Reason.BANNED).detail == Reason.BANNED.message and not Refusal(Reason.BANNED).counted


def test_a_swarm_refusal_is_a_refusal_reason_spelled_as_on_its_wire():
    from veriroll.shardcast.swarm.wire import Refusal

    assert issubclass(Refusal, errors.RefusalReason)
    assert str(Refusal.BUSY) == f"{Refusal.BUSY}" == "peer-busy" and Refusal("peer-stalled") is Refusal.STALLED


def test_the_coordinators_own_exceptions_share_one_base_and_keep_theirs():
    from veriroll.coordinator.app import CannotListen, DirectoryInUse
    from veriroll.coordinator.cli import InitError
    from veriroll.coordinator.environments import EnvironmentLoadError
    from veriroll.coordinator.http import BadParameter
    from veriroll.coordinator.plan import PlanError
    from veriroll.coordinator.prompts import PromptRenderError
    from veriroll.coordinator.rewards import RewardWorkerError
    from veriroll.protos.config import ConfigError
    from veriroll.protos.envelope import EnvelopeError
    from veriroll.protos.identity import InvalidPublicKey, KeyFileError

    for cls in (CannotListen, DirectoryInUse, InitError, ConfigError, KeyFileError, CallError):
        assert issubclass(cls, errors.VerirollError), cls
    for cls in (EnvironmentLoadError, BadParameter, PlanError, PromptRenderError, EnvelopeError, InvalidPublicKey):
        assert issubclass(cls, errors.VerirollError) and issubclass(cls, ValueError), cls
    assert issubclass(RewardWorkerError, errors.VerirollError) and issubclass(RewardWorkerError, RuntimeError)


@pytest.mark.parametrize(("wire", "parsed"), [
    ("banned", Reason.BANNED),
    ("unknown_key", Reason.UNKNOWN_KEY),
    ("unavailable", Reason.UNAVAILABLE),
    ("deadline_exceeded", None),  # a failed call without a veriroll reason: the gRPC status, in lower case
    ("a_reason_of_a_newer_coordinator", None),
    ("", None),
])
def test_a_calls_reason_is_parsed_once_into_the_enum_or_none(wire, parsed):
    err = CallError(grpc.StatusCode.PERMISSION_DENIED, wire, f"{wire}: said")
    assert err.refusal is parsed is parse_reason(wire)
    assert err.reason == wire and str(err) == f"{wire} (PERMISSION_DENIED): said"
