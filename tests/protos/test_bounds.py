"""Every string, bytes and repeated field of every request has a bound, and a request over one is refused
as malformed, counted, over a real coordinator; at the bound it passes the check."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from veriroll.protos.bounds import LIMITS, field_problem, unbounded_fields
from veriroll.protos.service import METHODS
from veriroll.protos.v1 import coordinator_pb2 as pb


@pytest.mark.parametrize("name", sorted(METHODS))
def test_every_variable_size_field_of_every_request_has_a_bound(name):
    assert unbounded_fields(METHODS[name][0].DESCRIPTOR) == []


def over(message_name: str, field: str, extra: int = 1):
    """A value of ``field`` ``extra`` past its bound, and one exactly at it."""
    limit = LIMITS[(message_name, field)]
    desc = getattr(pb, message_name).DESCRIPTOR.fields_by_name[field]
    if desc.is_repeated:
        make = (lambda n: [pb.Gpu()] * n) if desc.message_type is not None and desc.message_type.name == "Gpu" else \
            (lambda n: [pb.Sample()] * n) if desc.message_type is not None else \
            (lambda n: ["x"] * n) if desc.type == desc.TYPE_STRING else (lambda n: [1] * n)
    elif desc.type == desc.TYPE_STRING:
        make = lambda n: "x" * n  # noqa: E731 - one of three value makers
    else:
        make = lambda n: b"x" * n  # noqa: E731 - one of three value makers
    return make(limit + extra), make(limit)


def build(message_name: str, field: str, value):
    """The request that carries ``message_name.field = value`` (nested where the field lives)."""
    def setf(msg, v):
        if isinstance(v, list):
            getattr(msg, field).extend(v)
        else:
            setattr(msg, field, v)
        return msg

    if message_name == "HardwareReport":
        return pb.RegisterRequest(hardware=setf(pb.HardwareReport(), value))
    if message_name == "Gpu":
        return pb.RegisterRequest(hardware=pb.HardwareReport(gpus=[setf(pb.Gpu(), value)]))
    if message_name == "Sample":
        return pb.SubmitGroupRequest(samples=[setf(pb.Sample(), value)])
    return setf(getattr(pb, message_name)(), value)


@pytest.mark.parametrize("message_name, field", sorted(LIMITS))
def test_one_past_a_bound_is_a_problem_naming_the_field_and_the_bound_itself_is_not(message_name, field):
    too_much, at_limit = over(message_name, field)
    problem = field_problem(build(message_name, field, too_much))
    assert problem is not None and f"{message_name}.{field}" in problem and str(LIMITS[(message_name, field)]) in problem
    assert field_problem(build(message_name, field, at_limit)) is None


def test_a_request_over_a_bound_is_refused_malformed_and_counted_before_it_is_used(tmp_path):
    from support import make_coordinator_dir, node_client, running_coordinator

    from veriroll.coordinator import store as st
    from veriroll.protos.service import CallError

    async def expect_refusal(awaitable, code, reason):
        with pytest.raises(CallError) as info:
            await awaitable
        assert (info.value.code, info.value.reason) == (code, reason)
        return info.value

    async def scenario():
        async with running_coordinator(make_coordinator_dir(tmp_path)) as coord, node_client(coord) as stub:
            versions = pb.LeaseRequest(available_versions=list(range(65)))
            await expect_refusal(stub.lease_work(versions), grpc.StatusCode.INVALID_ARGUMENT, "malformed")
            lease = (await stub.lease_work(pb.LeaseRequest())).leases[0]
            long_finish = pb.SubmitGroupRequest(lease_id=lease.lease_id, samples=[pb.Sample(finish_reason="s" * 5000)])
            err = await expect_refusal(stub.submit_group(long_finish), grpc.StatusCode.INVALID_ARGUMENT, "malformed")
            state = coord.db.run_sync(lambda c: c.execute("SELECT state FROM leases WHERE lease_id = ?",
                                                          (lease.lease_id,)).fetchone()[0])
            return err, state, coord.db.run_sync(st.status_summary)

    err, state, summary = asyncio.run(scenario())
    assert "Sample.finish_reason has 5000 characters, at most 16" in err.details
    assert state == "open"  # refused before the intake read the lease
    assert summary["rejections_by_reason"] == {"malformed": 2}
