"""Packed arrays on the wire: token ids and log-probs as base64 of little-endian int32 / float32.

A JSON list of numbers costs the sender a decimal per element and the receiver a parse and a
bounds check per element; a log-prob printed from a float32 takes ~20 characters. Packed, an
element is 4 bytes (5.3 base64 characters), encoded and decoded in C (`array`, `base64`).

`models.common.TokenIds` and `LogProbs` are the field types of such arrays in requests (reports):
validation takes either form (a JSON list, as before, or a packed string). A list stays a list;
a packed string becomes a `PackedArray`, its checked bytes, which the data layer writes to the
segment columns as they are (staleflow_db/payloads.py) and which reads as a list only where
something iterates it: no Python object per element on the way from the wire to the table.
`models.training`'s arrays (a batch the trainer reads) always yield lists. A string that is not
base64, a byte length that is not a whole number of 4-byte elements, a negative token id or a
non-finite or out-of-range log-prob is refused with a ValueError (a 422 naming the field).
Serialised to JSON with the context `{"packed": True}` they are packed strings, otherwise lists
(what older readers expect).

The standard library and pydantic only (workers.wire is a leaf package).
"""

from __future__ import annotations

import base64
import binascii
import struct
import sys
from array import array
from collections.abc import Callable, Iterator, Sequence
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
_CODES = {"int32": _I32, "float32": "f"}
_STRUCT = {"int32": "<i", "float32": "<f"}  # one element, little-endian


INT32, FLOAT32 = "int32", "float32"  # PackedArray.kind


def _pack(code: str, values: Sequence[Any]) -> str:
    # struct takes the values as arguments in C: about twice as fast as building an array
    return base64.b64encode(struct.pack(f"<{len(values)}{code}", *values)).decode("ascii")


def _decode(kind: str, text: str) -> bytes:
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"not base64 of packed {kind} values ({exc})") from None
    if len(raw) % 4:
        raise ValueError(f"{len(raw)} bytes is not a whole number of 4-byte {kind} values")
    return raw


def _values(code: str, raw: bytes) -> array[Any]:
    values: array[Any] = array(code)
    values.frombytes(raw)
    if not _LITTLE:
        values.byteswap()
    return values


def pack_int32(values: Sequence[int]) -> str:
    """Base64 of little-endian int32; struct.error outside the int32 range."""
    if isinstance(values, PackedArray) and values.kind == INT32:
        return values.base64()
    return _pack("i", values)


def pack_float32(values: Sequence[float]) -> str:
    """Base64 of little-endian float32 (each value rounded to float32, as a float4 column keeps it)."""
    if isinstance(values, PackedArray) and values.kind == FLOAT32:
        return values.base64()
    return _pack("f", values)


# The checks look at each element's high byte first (every 4th byte, sliced in C): below 0x80
# an int32 is not negative; a float32 whose high byte is neither 0x7f nor 0xff has an exponent
# below 254, so it is finite and under 2**127 (~1.7e38) in magnitude. Only arrays that fail that
# are checked element by element.


def _checked_token_ids(raw: bytes) -> bytes:
    if not raw[3::4].isascii():
        raise ValueError(f"token id {min(_values(_I32, raw))} is negative (token ids are 0..{2**31 - 1})")
    return raw


def _checked_logprobs(raw: bytes) -> bytes:
    high = raw[3::4]
    if b"\x7f" in high or b"\xff" in high:
        values = _values("f", raw)
        # float32 elements cannot overflow a float64 sum: it is finite iff every element is
        total = sum(values)
        if total != total or total in (float("inf"), float("-inf")):
            raise ValueError("log-probs must be finite (a NaN or an infinity is packed)")
        low, top = min(values), max(values)
        if low < -_F32_BOUND or top > _F32_BOUND:
            raise ValueError(f"log-prob {low if low < -_F32_BOUND else top:g} outside ±{LOGPROB_BOUND:g}")
    return raw


def unpack_token_ids(text: str) -> list[int]:
    return _values(_I32, _checked_token_ids(_decode("int32", text))).tolist()


def unpack_logprobs(text: str) -> list[float]:
    return _values("f", _checked_logprobs(_decode("float32", text))).tolist()


def packed_token_ids(text: str) -> PackedArray:
    """`unpack_token_ids`'s checks, the values kept packed."""
    return PackedArray(_checked_token_ids(_decode("int32", text)), INT32)


def packed_logprobs(text: str) -> PackedArray:
    """`unpack_logprobs`'s checks, the values kept packed."""
    return PackedArray(_checked_logprobs(_decode("float32", text)), FLOAT32)


class PackedArray(Sequence[Any]):
    """A packed array as a request carried it: its checked little-endian bytes (`raw`) and
    their `kind` (INT32 or FLOAT32). It is a read-only sequence of its values (unpacked when
    read) and equal to a list of the same values, so code that reads it as a list works; code
    that stores it takes `raw` as it is."""

    __slots__ = ("raw", "kind")

    def __init__(self, raw: bytes, kind: str):
        if kind not in _CODES or len(raw) % 4:
            raise ValueError(f"{len(raw)} bytes of {kind}: not a packed array")
        self.raw, self.kind = raw, kind

    def tolist(self) -> list[Any]:
        return _values(_CODES[self.kind], self.raw).tolist()

    def base64(self) -> str:
        return base64.b64encode(self.raw).decode("ascii")

    def __len__(self) -> int:
        return len(self.raw) // 4

    def __iter__(self) -> Iterator[Any]:
        return iter(_values(_CODES[self.kind], self.raw))

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, int):  # one element read from the bytes, not the whole array unpacked
            n = len(self)
            if not -n <= index < n:
                raise IndexError("packed array index out of range")
            return struct.unpack_from(_STRUCT[self.kind], self.raw, 4 * (index % n))[0]
        return self.tolist()[index]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedArray):
            return self.kind == other.kind and self.raw == other.raw
        if isinstance(other, (list, tuple)):
            return self.tolist() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equal to lists, which are unhashable

    def __repr__(self) -> str:
        return f"PackedArray({self.tolist()!r}, {self.kind!r})"


class _Packed:
    """Annotated metadata: the list schema of the annotation, or a packed string decoded to a
    list (`keep` false) or kept as a `PackedArray` (`keep` true)."""

    unpack: Callable[[str], Any]
    pack: Callable[[Sequence[Any]], str]

    def __init__(self, kind: str, keep: bool):
        self.kind = kind
        if kind == INT32:
            self.unpack, self.pack = (packed_token_ids if keep else unpack_token_ids), pack_int32
        else:
            self.unpack, self.pack = (packed_logprobs if keep else unpack_logprobs), pack_float32

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        listed = handler(source)
        packed = core_schema.no_info_after_validator_function(self.unpack, core_schema.str_schema(strict=True))
        return core_schema.union_schema(
            [(listed, LIST_TAG), (packed, PACKED_TAG)],
            mode="left_to_right",  # a list is tried first: the JSON-list form costs what it did
            serialization=core_schema.plain_serializer_function_ser_schema(self._serialize, info_arg=True),
        )

    def __get_pydantic_json_schema__(self, schema: CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        out = handler(schema)
        for choice in out.get("anyOf", ()):
            if choice.get("type") == "string":
                choice["contentEncoding"] = "base64"
                choice["description"] = f"packed: base64 of little-endian {self.kind}"
        return out

    def _serialize(self, value: Sequence[Any], info: SerializationInfo) -> Any:
        context = info.context
        if context is not None and context.get("packed") and info.mode_is_json():
            return self.pack(value)
        return value.tolist() if isinstance(value, PackedArray) else value  # lists, in Python too


# Annotated metadata: `Annotated[list[TokenId], KEPT_TOKEN_IDS]` (models.common.TokenIds, the
# reports' arrays, handed to the data layer packed); `Annotated[list[int], PACKED_TOKEN_IDS]`
# (models.training, a batch's arrays, read as lists)
PACKED_TOKEN_IDS = _Packed(INT32, keep=False)
PACKED_LOGPROBS = _Packed(FLOAT32, keep=False)
KEPT_TOKEN_IDS = _Packed(INT32, keep=True)
KEPT_LOGPROBS = _Packed(FLOAT32, keep=True)


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
