"""Parsing GenerateRequest bytes so that malformed input is a client error, not an INTERNAL one.

protobuf refuses a `string` field holding invalid UTF-8 while it parses, before any handler runs;
gRPC would then answer INTERNAL. The servicer parses requests with `parse_generate_request`,
which returns a `MalformedRequest` instead of raising, naming the offending field, so the client
gets INVALID_ARGUMENT with a message it can act on.
"""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError
from pdserve_proto.v1 import generation_pb2 as pb

_WIRE_VARINT, _WIRE_FIXED64, _WIRE_LENGTH_DELIMITED, _WIRE_FIXED32 = 0, 1, 2, 5


@dataclass(frozen=True)
class MalformedRequest:
    message: str  # what is wrong, for the INVALID_ARGUMENT status


def parse_generate_request(data: bytes) -> pb.GenerateRequest | MalformedRequest:
    try:
        return pb.GenerateRequest.FromString(data)
    except DecodeError:
        pass
    field_path = _find_invalid_utf8(data, pb.GenerateRequest.DESCRIPTOR)
    if field_path is not None:
        return MalformedRequest(f"{field_path} is not valid UTF-8; send text encoded as UTF-8")
    return MalformedRequest("the request is not a well-formed pdserve.v1.GenerateRequest message")


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= len(data) or shift > 63:
            raise ValueError("truncated varint")
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if not byte & 0x80:
            return value, pos


def _find_invalid_utf8(data: bytes, descriptor: Descriptor, prefix: str = "") -> str | None:
    """Path ("messages[1].content") of the first string field that is not UTF-8, if any."""
    counts: dict[int, int] = {}
    pos = 0
    try:
        while pos < len(data):
            key, pos = _read_varint(data, pos)
            number, wire_type = key >> 3, key & 7
            if wire_type == _WIRE_VARINT:
                _, pos = _read_varint(data, pos)
            elif wire_type in (_WIRE_FIXED64, _WIRE_FIXED32):
                pos += 8 if wire_type == _WIRE_FIXED64 else 4
            elif wire_type == _WIRE_LENGTH_DELIMITED:
                length, pos = _read_varint(data, pos)
                chunk, pos = data[pos : pos + length], pos + length
                field = descriptor.fields_by_number.get(number)
                if field is None:
                    continue
                index = counts.get(number, 0)
                counts[number] = index + 1
                path = prefix + field.name + (f"[{index}]" if _is_repeated(field) else "")
                found = _check_chunk(chunk, field, path)
                if found is not None:
                    return found
            else:
                return None  # groups or garbage: not a UTF-8 problem we can name
    except ValueError:
        return None
    return None


def _is_repeated(field: FieldDescriptor) -> bool:
    if hasattr(field, "is_repeated"):  # protobuf >= 6 (where `label` is gone)
        return bool(field.is_repeated)
    return field.label == FieldDescriptor.LABEL_REPEATED


def _check_chunk(chunk: bytes, field: FieldDescriptor, path: str) -> str | None:
    if field.type == FieldDescriptor.TYPE_STRING:
        try:
            chunk.decode("utf-8")
        except UnicodeDecodeError as exc:
            return f"{path} (byte {exc.start})"
        return None
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return _find_invalid_utf8(chunk, field.message_type, path + ".")
    return None
