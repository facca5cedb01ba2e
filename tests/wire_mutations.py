"""Protobuf mutations at the field and the wire level, for fuzzing the coordinator's contract.

Mutations are generated from message descriptors, so a field added to ``coordinator.proto`` is
fuzzed without touching this file. Each mutation is a label and a function from a copy of a valid
message to the serialized bytes to send: most set one field to an extreme value through the
protobuf API; the rest write bytes the API cannot produce (invalid UTF-8, overflowing varints,
unpacked repeated fields, garbage where a nested message belongs, unknown and invalid field numbers,
truncated and bit-flipped bodies). Everything is drawn from the ``random.Random`` passed in, so a
seed gives the same cases every run.
"""

from __future__ import annotations

import math
import random
import struct
from collections.abc import Callable
from dataclasses import dataclass

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass

F = FieldDescriptor
VARINT, FIXED64, LEN, START_GROUP, END_GROUP, FIXED32 = 0, 1, 2, 3, 4, 5
MAX_FIELD_NUMBER = (1 << 29) - 1

_INT_RANGES = {
    F.TYPE_INT32: (-(1 << 31), (1 << 31) - 1), F.TYPE_SINT32: (-(1 << 31), (1 << 31) - 1),
    F.TYPE_SFIXED32: (-(1 << 31), (1 << 31) - 1), F.TYPE_INT64: (-(1 << 63), (1 << 63) - 1),
    F.TYPE_SINT64: (-(1 << 63), (1 << 63) - 1), F.TYPE_SFIXED64: (-(1 << 63), (1 << 63) - 1),
    F.TYPE_UINT32: (0, (1 << 32) - 1), F.TYPE_FIXED32: (0, (1 << 32) - 1),
    F.TYPE_UINT64: (0, (1 << 64) - 1), F.TYPE_FIXED64: (0, (1 << 64) - 1),
}
_FLOAT_VALUES = {
    F.TYPE_DOUBLE: (math.nan, math.inf, -math.inf, -0.0, 1.7976931348623157e308, 5e-324),
    F.TYPE_FLOAT: (math.nan, math.inf, -math.inf, -0.0, 3.4028234663852886e38, 1e-45),
}
_WIRE_TYPES = {F.TYPE_DOUBLE: FIXED64, F.TYPE_FIXED64: FIXED64, F.TYPE_SFIXED64: FIXED64, F.TYPE_FLOAT: FIXED32,
               F.TYPE_FIXED32: FIXED32, F.TYPE_SFIXED32: FIXED32, F.TYPE_STRING: LEN, F.TYPE_BYTES: LEN,
               F.TYPE_MESSAGE: LEN}


@dataclass(frozen=True)
class Mutation:
    """``label`` names the field path and what was done to it; ``body`` gives the bytes to send."""

    label: str
    body: Callable[[Message], bytes]


def varint(n: int) -> bytes:
    """Base-128 varint of ``n`` taken as 64-bit two's complement (how negative ints travel)."""
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def tag(number: int, wire_type: int) -> bytes:
    return varint(number << 3 | wire_type)


def length_delimited(number: int, payload: bytes) -> bytes:
    return tag(number, LEN) + varint(len(payload)) + payload


def copy_of(msg: Message) -> Message:
    out = type(msg)()
    out.CopyFrom(msg)
    return out


def message_mutations(desc: Descriptor, rng: random.Random, *, huge: int,
                      hints: dict[str, list] | None = None) -> list[Mutation]:
    """Mutations of every field of ``desc``, recursing into nested messages (their first element when
    repeated). ``huge`` bounds the size of large values; ``hints`` maps a field name to wrong-but-valid
    values worth trying (another node's lease id, a dtype the server does not accept, ...)."""
    hints = hints or {}
    return [Mutation(field.name + m.label, m.body) for field in desc.fields
            for m in _field_mutations(field, rng, huge, hints)]


def body_mutations(rng: random.Random, *, cap: int, flipped: int = 2) -> list[Mutation]:
    """Mutations of a whole serialized message, for any type; ``cap`` is the server's message size cap,
    ``flipped`` the number of bodies with random bits flipped."""
    def flips(k: int) -> Callable[[Message], bytes]:
        seed = rng.getrandbits(32)

        def apply(msg: Message) -> bytes:
            raw = bytearray(msg.SerializeToString() or b"\x00")
            flip = random.Random(seed)
            for _ in range(k):
                raw[flip.randrange(len(raw))] ^= 1 << flip.randrange(8)
            return bytes(raw)
        return apply

    def appended(extra: bytes) -> Callable[[Message], bytes]:
        return lambda msg: msg.SerializeToString() + extra

    garbage = rng.randbytes(64)
    return [
        Mutation("body:empty", lambda msg: b""),
        Mutation("body:truncated_to_1_byte", lambda msg: msg.SerializeToString()[:1]),
        Mutation("body:truncated_half", lambda msg: (raw := msg.SerializeToString())[:len(raw) // 2]),
        Mutation("body:truncated_last_byte", lambda msg: msg.SerializeToString()[:-1]),
        *[Mutation(f"body:{k}_bits_flipped#{i}", flips(k)) for i in range(flipped) for k in (1, 8)],
        Mutation("body:random_bytes", lambda msg: garbage),
        Mutation("body:sent_twice", lambda msg: msg.SerializeToString() * 2),
        Mutation("body:unknown_varint_field", appended(tag(99, VARINT) + varint(-1))),
        Mutation("body:unknown_len_field", appended(length_delimited(1000, rng.randbytes(40)))),
        Mutation("body:unknown_fixed32_field", appended(tag(2047, FIXED32) + rng.randbytes(4))),
        Mutation("body:unknown_fixed64_max_number", appended(tag(MAX_FIELD_NUMBER, FIXED64) + rng.randbytes(8))),
        Mutation("body:unknown_huge_field", appended(length_delimited(77, bytes(cap // 2)))),
        Mutation("body:unknown_group", appended(tag(55, START_GROUP) + tag(1, VARINT) + b"\x01" + tag(55, END_GROUP))),
        Mutation("body:field_number_0", appended(tag(0, VARINT) + b"\x01")),
        Mutation("body:unterminated_group", appended(tag(56, START_GROUP) + tag(1, VARINT) + b"\x01")),
        Mutation("body:stray_end_group", appended(tag(57, END_GROUP))),
        Mutation("body:length_past_the_end", appended(tag(58, LEN) + varint(1 << 20) + b"abc")),
        Mutation("body:varint_11_bytes", appended(tag(59, VARINT) + b"\xff" * 10 + b"\x01")),
        Mutation("body:over_the_size_cap", appended(length_delimited(60, bytes(cap + 1)))),
    ]


def _field_mutations(field: FieldDescriptor, rng: random.Random, huge: int, hints: dict[str, list]) -> list[Mutation]:
    if field.type == F.TYPE_MESSAGE:
        return _message_field_mutations(field, rng, huge, hints)
    values = _scalar_values(field, rng, huge) + [(f"hint={v!r}"[:60], v) for v in hints.get(field.name, [])]
    wire = _scalar_wire_values(field, rng)
    if not field.is_repeated:
        return ([Mutation(f":={label}", _setting(field, value)) for label, value in values]
                + [Mutation(f":wire={label}", _replacing(field, raw)) for label, raw in wire])
    many = max(1, huge // 10)  # varints are at most 10 bytes: stays under the cap
    small = [v for label, v in values if label != "huge"]
    extreme = dict(values).get("min", dict(values).get("nan", small[0]))  # the longest varint, or NaN
    out = [Mutation(":=[]", _setting(field, [])),
           Mutation(f":={many}x_random", _setting(field, [rng.choice(small) for _ in range(many)])),
           Mutation(f":={many}x_extreme", _setting(field, [extreme] * many))]
    out += [Mutation(f":=[{label}]", _setting(field, [value])) for label, value in values]
    out += [Mutation(f":wire=[{label}]", _replacing(field, raw)) for label, raw in wire]
    if field.type not in (F.TYPE_STRING, F.TYPE_BYTES):
        # Proto3 packs repeated scalars; a parser must take them unpacked as well, and refuse a bad pack.
        unpacked = b"".join(_scalar_bytes(field, v) for _, v in values[:3])
        out.append(Mutation(":wire=unpacked", _replacing(field, unpacked)))
        out.append(Mutation(":wire=pack_length_past_the_end", _replacing(field, tag(field.number, LEN) + varint(99) + b"\x01")))
    return out


def _message_field_mutations(field: FieldDescriptor, rng: random.Random, huge: int,
                             hints: dict[str, list]) -> list[Mutation]:
    cls = GetMessageClass(field.message_type)
    garbage = rng.randbytes(48)
    out = [Mutation(":unset", _replacing(field, b"")),
           Mutation(":empty", _replacing(field, length_delimited(field.number, b""))),
           Mutation(":garbage", _replacing(field, length_delimited(field.number, garbage))),
           Mutation(":unknown_field_inside", _replacing(field, length_delimited(
               field.number, length_delimited(900, rng.randbytes(16)))))]
    if field.is_repeated:
        count = max(2, huge // 50)  # many elements, each a few bytes
        out.append(Mutation(f":count={count}_empty", _replacing(field, length_delimited(field.number, b"") * count)))
    for inner in message_mutations(field.message_type, rng, huge=huge, hints=hints):
        out.append(Mutation("." + inner.label, _nested(field, cls, inner.body)))
    return out


def _scalar_values(field: FieldDescriptor, rng: random.Random, huge: int) -> list[tuple[str, object]]:
    t = field.type
    if t in _INT_RANGES:
        lo, hi = _INT_RANGES[t]
        picks = [("0", 0), ("1", 1), ("random", rng.randint(lo, hi)), ("min", lo), ("max", hi)]
        return picks + ([("-1", -1)] if lo < 0 else [])
    if t in _FLOAT_VALUES:
        return [(repr(v), v) for v in _FLOAT_VALUES[t]]
    if t == F.TYPE_BOOL:
        return [("true", True), ("false", False)]
    if t == F.TYPE_ENUM:
        numbers = [v.number for v in field.enum_type.values]
        return [(f"enum_{n}", n) for n in numbers] + [("undefined_enum", max(numbers) + 1000)]
    if t == F.TYPE_STRING:
        return [("empty", ""), ("huge", "x" * huge), ("nul", "\x00"), ("unicode", "\u202e\U0001f600é\u200b"),
                ("whitespace", " \t\r\n "), ("random", rng.randbytes(12).hex())]
    if t == F.TYPE_BYTES:
        return [("empty", b""), ("huge", bytes(huge)), ("random", rng.randbytes(37)), ("one", b"\x01")]
    raise AssertionError(f"no mutations for field type {t} of {field.full_name}")


def _scalar_wire_values(field: FieldDescriptor, rng: random.Random) -> list[tuple[str, bytes]]:
    """Encodings of the field that the protobuf API would not write."""
    n, t = field.number, field.type
    if t == F.TYPE_STRING:
        return [("invalid_utf8", length_delimited(n, b"\xff\xfe\xfd")), ("overlong_nul", length_delimited(n, b"\xc0\x80")),
                ("lone_surrogate", length_delimited(n, b"\xed\xa0\x80")),
                ("wrong_wire_type", tag(n, VARINT) + b"\x05")]
    if t == F.TYPE_BYTES:
        return [("length_past_the_end", tag(n, LEN) + varint(1000) + b"abc"),
                ("wrong_wire_type", tag(n, FIXED32) + rng.randbytes(4))]
    if t == F.TYPE_DOUBLE:
        return [("signaling_nan", tag(n, FIXED64) + struct.pack("<Q", 0x7FF0000000000001)),
                ("wrong_wire_type", tag(n, LEN) + varint(3) + b"abc")]
    if t == F.TYPE_FLOAT:
        return [("signaling_nan", tag(n, FIXED32) + struct.pack("<I", 0x7F800001)),
                ("wrong_wire_type", tag(n, LEN) + varint(3) + b"abc")]
    return [("64_bit_overflow", tag(n, VARINT) + varint((1 << 64) - 1)),  # what int32 fields get from -1 in int64
            ("above_the_type", tag(n, VARINT) + varint(1 << 40)),
            ("varint_11_bytes", tag(n, VARINT) + b"\xff" * 10 + b"\x01"),
            ("wrong_wire_type", tag(n, LEN) + varint(3) + b"abc")]


def _scalar_bytes(field: FieldDescriptor, value) -> bytes:
    """One unpacked element of a repeated scalar field."""
    wire = _WIRE_TYPES.get(field.type, VARINT)
    if field.type == F.TYPE_DOUBLE:
        return tag(field.number, wire) + struct.pack("<d", value)
    if field.type == F.TYPE_FLOAT:
        return tag(field.number, wire) + struct.pack("<f", value)
    if wire == FIXED64:
        return tag(field.number, wire) + struct.pack("<Q", value & ((1 << 64) - 1))
    if wire == FIXED32:
        return tag(field.number, wire) + struct.pack("<I", value & ((1 << 32) - 1))
    return tag(field.number, wire) + varint(value)


def _setting(field: FieldDescriptor, value) -> Callable[[Message], bytes]:
    def apply(msg: Message) -> bytes:
        if field.is_repeated:
            container = getattr(msg, field.name)
            del container[:]
            container.extend(value)
        else:
            setattr(msg, field.name, value)
        return msg.SerializeToString()
    return apply


def _replacing(field: FieldDescriptor, raw: bytes) -> Callable[[Message], bytes]:
    """The message without ``field``, then ``raw`` (the field's new encoding) appended."""
    def apply(msg: Message) -> bytes:
        msg.ClearField(field.name)
        return msg.SerializeToString() + raw
    return apply


def _nested(field: FieldDescriptor, cls: type[Message], inner: Callable[[Message], bytes]) -> Callable[[Message], bytes]:
    """Apply ``inner`` to the value of ``field`` (its first element when repeated) and re-embed the bytes."""
    def apply(msg: Message) -> bytes:
        items = list(getattr(msg, field.name)) if field.is_repeated else [getattr(msg, field.name)]
        first = copy_of(items[0]) if items else cls()
        embedded = length_delimited(field.number, inner(first))
        embedded += b"".join(length_delimited(field.number, it.SerializeToString()) for it in items[1:])
        msg.ClearField(field.name)
        return msg.SerializeToString() + embedded
    return apply
