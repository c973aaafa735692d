"""Packed arrays on the wire: token ids and log-probs as base64 of little-endian int32 / float32.

A JSON list of numbers costs the sender a decimal per element and the receiver a parse and a
bounds check per element; a log-prob printed from a float32 takes ~20 characters. Packed, an
element is 4 bytes (5.3 base64 characters), encoded and decoded in C (`array`, `base64`).

`models.common.TokenIds` and `LogProbs` are the field types of such arrays: validation takes either form
(a JSON list, as before, or a packed string) and yields a list either way, so the code behind
a model never sees the difference. A string that is not base64, a byte length that is not a
whole number of 4-byte elements, a negative token id or a non-finite or out-of-range log-prob
is refused with a ValueError (a 422 naming the field). Serialised to JSON with the context
`{"packed": True}` they are packed strings, otherwise lists (what older readers expect).

The standard library and pydantic only (workers.wire is a leaf package).
"""

from __future__ import annotations

import base64
import binascii
import struct
import sys
from array import array
from collections.abc import Sequence
from typing import Any

from pydantic import GetCoreSchemaHandler, GetJsonSchemaHandler, SerializationInfo
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema, core_schema

# float4 column: finite and inside its range (the bound of LogProb in models.common)
LOGPROB_BOUND = 3.0e38
PACKED_CONTEXT = {"packed": True}  # model_dump_json(context=...) sends arrays packed

# the union's branches, named in the locations of validation errors (see `untagged`)
LIST_TAG, PACKED_TAG = "[list]", "[packed]"
# packed: the float32 nearest the bound, so every log-prob the JSON form takes packs to one taken
_F32_BOUND = array("f", [LOGPROB_BOUND])[0]
_I32 = next(code for code in "ilh" if array(code).itemsize == 4)
_LITTLE = sys.byteorder == "little"


def _pack(code: str, values: Sequence[Any]) -> str:
    # struct takes the values as arguments in C: about twice as fast as building an array
    return base64.b64encode(struct.pack(f"<{len(values)}{code}", *values)).decode("ascii")


def _unpack(code: str, kind: str, text: str) -> tuple[bytes, list[Any]]:
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"not base64 of packed {kind} values ({exc})") from None
    if len(raw) % 4:
        raise ValueError(f"{len(raw)} bytes is not a whole number of 4-byte {kind} values")
    values = array(code)
    values.frombytes(raw)
    if not _LITTLE:
        values.byteswap()
    return raw, values.tolist()


def pack_int32(values: Sequence[int]) -> str:
    """Base64 of little-endian int32; struct.error outside the int32 range."""
    return _pack("i", values)


def pack_float32(values: Sequence[float]) -> str:
    """Base64 of little-endian float32 (each value rounded to float32, as a float4 column keeps it)."""
    return _pack("f", values)


# The checks look at each element's high byte first (every 4th byte, sliced in C): below 0x80
# an int32 is not negative; a float32 whose high byte is neither 0x7f nor 0xff has an exponent
# below 254, so it is finite and under 2**127 (~1.7e38) in magnitude. Only arrays that fail that
# are checked element by element.


def unpack_token_ids(text: str) -> list[int]:
    raw, values = _unpack(_I32, "int32", text)
    if not raw[3::4].isascii():
        raise ValueError(f"token id {min(values)} is negative (token ids are 0..{2**31 - 1})")
    return values


def unpack_logprobs(text: str) -> list[float]:
    raw, values = _unpack("f", "float32", text)
    high = raw[3::4]
    if b"\x7f" in high or b"\xff" in high:
        # float32 elements cannot overflow a float64 sum: it is finite iff every element is
        total = sum(values)
        if total != total or total in (float("inf"), float("-inf")):
            raise ValueError("log-probs must be finite (a NaN or an infinity is packed)")
        low, top = min(values), max(values)
        if low < -_F32_BOUND or top > _F32_BOUND:
            raise ValueError(f"log-prob {low if low < -_F32_BOUND else top:g} outside ±{LOGPROB_BOUND:g}")
    return values


class _Packed:
    """Annotated metadata: the list schema of the annotation, or a packed string decoded to it."""

    def __init__(self, kind: str, unpack: Any, pack: Any):
        self.kind, self.unpack, self.pack = kind, unpack, pack

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        listed = handler(source)
        packed = core_schema.no_info_after_validator_function(self.unpack, core_schema.str_schema(strict=True))
        return core_schema.union_schema(
            [(listed, LIST_TAG), (packed, PACKED_TAG)],
            mode="left_to_right",  # a list is tried first: the JSON-list form costs what it did
            serialization=core_schema.plain_serializer_function_ser_schema(
                self._serialize, info_arg=True, when_used="json"
            ),
        )

    def __get_pydantic_json_schema__(self, schema: CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        out = handler(schema)
        for choice in out.get("anyOf", ()):
            if choice.get("type") == "string":
                choice["contentEncoding"] = "base64"
                choice["description"] = f"packed: base64 of little-endian {self.kind}"
        return out

    def _serialize(self, value: list[Any], info: SerializationInfo) -> Any:
        context = info.context
        return self.pack(value) if context is not None and context.get("packed") else value


# Annotated metadata: `Annotated[list[TokenId], PACKED_TOKEN_IDS]` (models.common.TokenIds)
PACKED_TOKEN_IDS = _Packed("int32", unpack_token_ids, pack_int32)
PACKED_LOGPROBS = _Packed("float32", unpack_logprobs, pack_float32)


def untagged(errors: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Validation errors as they read without the packed form: a list's errors located as
    before (`tokens.3`, not `tokens.[list].3`), and the branch the input was not written in
    (the string branch of a list, the list branch of a string) left out."""
    out = []
    for e in errors:
        loc = tuple(e.get("loc", ()))
        if LIST_TAG in loc or PACKED_TAG in loc:
            value = e.get("input")
            if PACKED_TAG in loc and e.get("type") == "string_type" and isinstance(value, list):
                continue
            if LIST_TAG in loc and e.get("type") == "list_type" and isinstance(value, str):
                continue
            e = {**e, "loc": tuple(p for p in loc if p not in (LIST_TAG, PACKED_TAG))}
        out.append(e)
    return out
