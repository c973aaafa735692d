"""Packed payloads (staleflow_db/payloads.py): little-endian int32 token ids and float32
log-probs, 4 bytes per token, and the objects of the payload store."""

from __future__ import annotations

import struct

import pytest

from staleflow_db.errors import InvalidInput
from staleflow_db.payloads import (
    pack_logprobs,
    pack_object,
    pack_tokens,
    per_token,
    unpack_logprobs,
    unpack_object,
    unpack_tokens,
)


def test_tokens_and_logprobs_round_trip_as_little_endian_32_bit():
    tokens, logprobs = [0, 1, 151_000, 2**31 - 1, -(2**31)], [-0.5, 0.0, -1e-45, -3.0e38]
    assert pack_tokens(tokens) == struct.pack("<5i", *tokens)
    assert pack_logprobs(logprobs) == struct.pack("<4f", *logprobs)
    assert unpack_tokens(pack_tokens(tokens)) == tokens
    assert unpack_logprobs(pack_logprobs(logprobs)) == [struct.unpack("<f", struct.pack("<f", x))[0] for x in logprobs]
    assert unpack_tokens(None) == unpack_tokens(b"") == [] and unpack_logprobs(None) == []


def test_a_token_id_outside_int32_is_refused():
    with pytest.raises(InvalidInput, match="int32"):
        pack_tokens([2**31])


def test_per_token_values_and_objects():
    assert per_token([2, 0, 1], [1, 0, 1]) == [1, 1, 1] and per_token(None, None) == []
    t, lp = pack_tokens([3, 4]), pack_logprobs([-1.0, -2.0])
    assert unpack_object(pack_object(t, lp), 2) == (t, lp)
    with pytest.raises(ValueError, match="not 16"):
        unpack_object(pack_object(t, lp)[:-1], 2)
