"""Bounds on every string, bytes and repeated field a node may send, checked right after parsing and
before anything else looks at the request.

gRPC caps a request's total size; these cap each field, so that no field can make one check or one
stored row costly (a 7 MiB CPU name, a million available versions, a megabyte of finish reason).
A request over a bound is refused as ``malformed`` naming the field. Self-descriptions keep their own,
tighter cut when stored (``store.bound_node_fields``): a long display name is shortened, an absurd one
refused here. ``tests/protos/test_bounds.py`` checks that every such field of every request message
has a bound, so a field added to the contract cannot slip through.
"""

from __future__ import annotations

from google.protobuf.descriptor import FieldDescriptor

PACKAGE = "veriroll.v1"

LIMITS: dict[tuple[str, str], int] = {
    # (message, field): most characters (string), bytes (bytes) or entries (repeated)
    ("HardwareReport", "cpu"): 1024,
    ("HardwareReport", "os"): 1024,
    ("HardwareReport", "engine"): 64,
    ("HardwareReport", "device"): 64,
    ("HardwareReport", "gpus"): 64,
    ("Gpu", "name"): 1024,
    ("RegisterRequest", "public_key"): 32,
    ("RegisterRequest", "software_version"): 256,
    ("RegisterRequest", "display_name"): 1024,
    ("RegisterRequest", "session_id"): 64,
    ("HeartbeatRequest", "session_id"): 64,
    ("HeartbeatRequest", "swarm_peer_id"): 128,
    ("HeartbeatRequest", "swarm_addrs"): 8,  # each multiaddr is checked by shardcast.swarm.hints.PeerDirectory
    ("HeartbeatRequest", "swarm_versions"): 64,
    ("HeartbeatRequest", "bad_peers"): 16,
    ("LeaseRequest", "available_versions"): 64,
    ("SubmitGroupRequest", "lease_id"): 64,
    ("SubmitGroupRequest", "samples"): 256,  # leases.group_size is at most 256
    ("SubmitGroupRequest", "compute_dtype"): 16,
    ("Sample", "token_ids"): 1 << 16,
    ("Sample", "logprobs"): 4 << 16,  # float32 per token
    ("Sample", "proof"): 1 << 20,  # checked again against the sample's length by the intake
    ("Sample", "finish_reason"): 16,
}


def _bounded(field: FieldDescriptor) -> bool:
    return field.is_repeated or field.type in (FieldDescriptor.TYPE_STRING,
                                                                          FieldDescriptor.TYPE_BYTES)


def unbounded_fields(descriptor, seen: set | None = None) -> list[str]:
    """Fields of ``descriptor`` (and the messages inside it) that need a bound and have none."""
    seen = set() if seen is None else seen
    if descriptor.full_name in seen:
        return []
    seen.add(descriptor.full_name)
    missing = []
    for field in descriptor.fields:
        if _bounded(field) and (descriptor.name, field.name) not in LIMITS:
            missing.append(f"{descriptor.name}.{field.name}")
        if field.message_type is not None:
            missing += unbounded_fields(field.message_type, seen)
    return missing


def field_problem(message) -> str | None:
    """The first field of ``message`` over its bound, said in words; None when every field is within."""
    name = message.DESCRIPTOR.name
    for field_name, limit, unit, is_repeated, has_message in _plan(message.DESCRIPTOR):
        value = getattr(message, field_name)
        if limit is not None and len(value) > limit:
            return f"{name}.{field_name} has {len(value)} {unit}, at most {limit} are accepted"
        if has_message:
            for item in value if is_repeated else (value,):
                problem = field_problem(item)
                if problem is not None:
                    return problem
    return None


_PLANS: dict[str, tuple] = {}


def _plan(descriptor) -> tuple:
    """The fields of ``descriptor`` that :func:`field_problem` looks at, worked out once per message type:
    (name, limit or None, unit, repeated, holds messages). Every request passes here, so the descriptor is
    not walked per call."""
    plan = _PLANS.get(descriptor.full_name)
    if plan is None:
        plan = tuple(
            (f.name, LIMITS.get((descriptor.name, f.name)),
             "entries" if f.is_repeated else ("characters" if f.type == FieldDescriptor.TYPE_STRING else "bytes"),
             f.is_repeated, f.message_type is not None)
            for f in descriptor.fields
            if (descriptor.name, f.name) in LIMITS or f.message_type is not None)
        _PLANS[descriptor.full_name] = plan
    return plan
