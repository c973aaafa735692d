"""Packed segment payloads: how a segment's token ids and log-probs are stored.

A segment keeps its tokens as little-endian int32 (`token_ids`) and its log-probs as
little-endian float32 (`logprobs`), each a `bytea` of 4 bytes per token, with the count in
`n_tokens`: no array header, no per-element null bitmap, one memcpy to read. Log-probs were
float32 (`real`) before, so a value reads back exactly as it was stored. An object in the
payload store (`payload_store`) is the two concatenated: tokens, then log-probs.

The one place that packs and unpacks them: the SQL reads return the packed bytes (a sample's
segments concatenated in seq order) and the callers unpack here. Arrays that arrived packed (a
report's `workers.wire.packed.PackedArray`, its bytes checked on the way in) are the columns'
format already: they are stored as they are, never unpacked.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from typing import Any, TypeVar

from workers.wire.packed import FLOAT32, PackedArray
from workers.wire.packed import INT32 as PACKED_INT32

from .errors import InvalidInput

T = TypeVar("T")
_SWAP = sys.byteorder != "little"
WIDTH = 4  # bytes per token in each of the two columns
INT32 = (-(2**31), 2**31 - 1)


def pack_tokens(tokens: Sequence[int]) -> bytes:
    if isinstance(tokens, PackedArray) and tokens.kind == PACKED_INT32:
        return tokens.raw  # little-endian int32, none negative (checked when it was decoded)
    try:
        a = array("i", tokens)
    except OverflowError:
        raise InvalidInput(f"a token id outside int32 ({INT32[0]}..{INT32[1]})") from None
    if _SWAP:
        a.byteswap()
    return a.tobytes()


def pack_logprobs(logprobs: Sequence[float]) -> bytes:
    if isinstance(logprobs, PackedArray) and logprobs.kind == FLOAT32:
        return logprobs.raw  # little-endian float32, finite and in the float4 range (checked)
    a = array("f", logprobs)
    if _SWAP:
        a.byteswap()
    return a.tobytes()


def _unpack(code: str, data: bytes | memoryview | None) -> array[Any]:
    a: array[Any] = array(code)
    if data:
        a.frombytes(data)
        if _SWAP:
            a.byteswap()
    return a


def unpack_tokens(data: bytes | memoryview | None) -> list[int]:
    return _unpack("i", data).tolist()


def unpack_logprobs(data: bytes | memoryview | None) -> list[float]:
    return _unpack("f", data).tolist()


def packed_tokens(data: bytes) -> PackedArray:
    """Stored token ids as they are (a sequence of ints, unpacked where something reads it): a
    consume sends them to the wire packed, with no Python int per token on the way."""
    return PackedArray(data, PACKED_INT32)


def packed_logprobs(data: bytes) -> PackedArray:
    """Stored log-probs as they are (see `packed_tokens`)."""
    return PackedArray(data, FLOAT32)


def per_token(lengths: Sequence[int] | None, values: Sequence[T] | None) -> list[T]:
    """Each segment's value repeated for each of its tokens (a loss mask from `generated`, the
    token versions from `version`). A list repeated in C, not an element at a time: a batch's
    masks are millions of tokens, and the per-element form was most of a consume's CPU."""
    out: list[T] = []
    for n, v in zip(lengths or (), values or (), strict=True):
        out += [v] * n
    return out


def pack_object(tokens: bytes, logprobs: bytes) -> bytes:
    """A segment's object in the payload store."""
    return bytes(tokens) + bytes(logprobs)


def unpack_object(data: bytes, n_tokens: int) -> tuple[bytes, bytes]:
    """The packed (tokens, log-probs) of an object; ValueError if it does not hold n_tokens."""
    if len(data) != 2 * WIDTH * n_tokens:
        raise ValueError(f"{len(data)} bytes, not {2 * WIDTH * n_tokens} for {n_tokens} tokens")
    cut = WIDTH * n_tokens
    return data[:cut], data[cut:]
