"""Hypothesis strategies for GenerateRequests as raw wire bytes: well-framed ones whose string
fields may hold invalid UTF-8 (with the field path the router must name), and garbled ones.
Our stubs cannot build such messages; a raw channel sends the bytes as they are."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st
from pdserve_proto.v1 import generation_pb2 as pb

_INT64 = (-(2**63), 2**63 - 1)


def varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # negative int32/int64 go on the wire as 10-byte two's complement
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def length_delimited(field_number: int, payload: bytes) -> bytes:
    return varint(field_number << 3 | 2) + varint(len(payload)) + payload


@dataclass(frozen=True)
class RawRequest:
    data: bytes
    first_bad_utf8: str | None  # "messages[1].content (byte 3)": what the router must name


_STRING_FIELDS = {1: "prompt", 9: "stop", 12: "request_id"}
_text_bytes = st.one_of(
    st.text(max_size=12).map(str.encode),
    st.binary(max_size=12),  # mostly not UTF-8
    st.sampled_from([b"caf\xc3", b"\xed\xa0\x80", b"\xc0\xaf", b"\xf4\x90\x80\x80", b"ok\xff"]),
)


def _bad_utf8_at(payload: bytes) -> int | None:
    try:
        payload.decode("utf-8")
    except UnicodeDecodeError as exc:
        return exc.start
    return None


@st.composite
def raw_requests(draw: st.DrawFn) -> RawRequest:
    """Well-framed wire bytes whose string fields may hold invalid UTF-8, with unknown fields,
    wrong wire types and out-of-range varints among them."""
    parts: list[bytes] = []
    first_bad: str | None = None
    counts: dict[str, int] = {}
    kinds = ("string", "message", "varint", "packed", "double", "unknown")
    for kind in draw(st.lists(st.sampled_from(kinds), min_size=1, max_size=6)):
        if kind in ("string", "message"):
            number = draw(st.sampled_from(sorted(_STRING_FIELDS))) if kind == "string" else 3
            name = _STRING_FIELDS.get(number, "messages")
            index = counts.get(name, 0)
            counts[name] = index + 1
            path = name if name in ("prompt", "request_id") else f"{name}[{index}]"
            payload, bad = _string_or_message(draw, kind, path)
            first_bad = first_bad or bad
            parts.append(length_delimited(number, payload))
        elif kind == "varint":
            number = draw(st.sampled_from([2, 4, 7, 8, 10, 11, 1, 12]))  # 1, 12: wrong type
            parts.append(varint(number << 3) + varint(draw(st.integers(*_INT64))))
        elif kind == "packed":
            values = draw(st.lists(st.integers(*_INT64), max_size=5))
            number = draw(st.sampled_from([2, 10]))
            parts.append(length_delimited(number, b"".join(varint(v) for v in values)))
        elif kind == "double":
            number = draw(st.sampled_from([5, 6]))
            parts.append(varint(number << 3 | 1) + draw(st.binary(min_size=8, max_size=8)))
        else:
            parts.append(length_delimited(draw(st.integers(13, 2000)), draw(st.binary(max_size=8))))
    return RawRequest(b"".join(parts), first_bad)


def _string_or_message(draw: st.DrawFn, kind: str, path: str) -> tuple[bytes, str | None]:
    if kind == "string":
        payload = draw(_text_bytes)
        bad = _bad_utf8_at(payload)
        return payload, None if bad is None else f"{path} (byte {bad})"
    role, content = draw(_text_bytes), draw(_text_bytes)
    for field_name, value in (("role", role), ("content", content)):
        bad = _bad_utf8_at(value)
        if bad is not None:
            return length_delimited(1, role) + length_delimited(2, content), (
                f"{path}.{field_name} (byte {bad})"
            )
    return length_delimited(1, role) + length_delimited(2, content), None


_GROUP_START, _GROUP_END = varint(13 << 3 | 3), varint(13 << 3 | 4)
_PATHOLOGICAL = [
    _GROUP_START * 100_000 + _GROUP_END * 100_000,  # nested past any parser's depth limit
    _GROUP_START * 3 + _GROUP_END * 3,  # a well-formed unknown group
    _GROUP_START,  # a group never closed
    _GROUP_END,  # a group never opened
    varint(1 << 3 | 2) + varint(2**63) + b"abc",  # a length far past the end
    varint(2 << 3 | 2) + varint(3) + b"\xff\xff\xff",  # packed ids cut inside a varint
    varint(4 << 3) + b"\xff" * 20,  # a varint longer than 10 bytes
    b"\x00\x01",  # field number 0
    varint((2**29 - 1) << 3) + b"\x01",  # the largest field number
    varint(2**29 << 3) + b"\x01",  # one past it
]


@st.composite
def garbled_bytes(draw: st.DrawFn) -> bytes:
    """Bytes that are mostly not a protobuf message: random, or a valid request cut or flipped."""
    valid = pb.GenerateRequest(
        prompt=draw(st.text(max_size=8)), max_tokens=2, stop=["a"], request_id="r"
    ).SerializeToString()
    how = draw(st.sampled_from(["random", "cut", "flip", "splice", "pathological"]))
    if how == "random":
        return draw(st.binary(max_size=64))
    if how == "pathological":
        return draw(st.sampled_from(_PATHOLOGICAL))
    if how == "cut":
        return valid[: draw(st.integers(0, max(0, len(valid) - 1)))]
    if how == "flip":
        position = draw(st.integers(0, len(valid) - 1))
        return valid[:position] + bytes([draw(st.integers(0, 255))]) + valid[position + 1 :]
    return valid + draw(st.binary(min_size=1, max_size=16))
