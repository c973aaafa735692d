"""The packed-array codec (workers.wire.packed) and the report model's two forms: round trips
of token ids and log-probs, and the refusals (bad base64, a length that is not whole 4-byte
elements, negative ids, non-finite or out-of-range log-probs), each naming the field."""

from __future__ import annotations

import base64
import json
import math
import struct

import pytest
from pydantic import ValidationError

from staleflow_db import payloads
from workers.wire.models import ReportIn, ReportsIn
from workers.wire.models.training import ConsumeOut
from workers.wire.packed import (
    LIST_TAG,
    LOGPROB_BOUND,
    PACKED_CONTEXT,
    PackedArray,
    pack_float32,
    pack_int32,
    unpack_logprobs,
    unpack_token_ids,
    untagged,
)

ROUTE = "12345678-1234-1234-1234-123456789012"


def f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def test_token_ids_round_trip_little_endian():
    ids = [0, 1, 255, 256, 65_535, 2**31 - 1, 7]
    packed = pack_int32(ids)
    assert base64.b64decode(packed) == struct.pack(f"<{len(ids)}i", *ids)
    assert unpack_token_ids(packed) == ids
    assert unpack_token_ids("") == [] and pack_int32([]) == ""


def test_logprobs_round_trip_as_float32():
    values = [0.0, -0.0, -0.5, -1e-40, -123.456, -3.0e38, 3.0e38, f32(-0.1)]
    packed = pack_float32(values)
    assert base64.b64decode(packed) == struct.pack(f"<{len(values)}f", *values)
    assert unpack_logprobs(packed) == [f32(v) for v in values]  # rounded as a float4 column keeps them


@pytest.mark.parametrize(
    "text, message",
    [
        ("not base64!", "not base64"),
        ("AAAA=AAA", "not base64"),
        ("AAA", "not base64"),  # bad padding
        ("é", "not base64"),
        (b64(b"\x00" * 7), "7 bytes is not a whole number of 4-byte int32 values"),
        (b64(struct.pack("<3i", 5, -1, 6)), "token id -1 is negative"),
        (b64(struct.pack("<i", -(2**31))), "is negative"),
    ],
)
def test_token_ids_refused(text, message):
    with pytest.raises(ValueError, match=message):
        unpack_token_ids(text)


@pytest.mark.parametrize(
    "values, message",
    [
        ([-0.5, math.nan], "finite"),
        ([math.inf], "finite"),
        ([-math.inf, -0.5], "finite"),
        ([-0.5, 3.2e38], "outside"),
        ([-3.3e38], "outside"),
    ],
)
def test_logprobs_refused(values, message):
    with pytest.raises(ValueError, match=message):
        unpack_logprobs(b64(struct.pack(f"<{len(values)}f", *values)))


def test_logprobs_near_the_bound_are_checked_exactly():
    # high byte 0x7f / 0xff but finite and inside the bound: the slow path takes them
    assert unpack_logprobs(pack_float32([2.0e38, -2.9e38])) == [f32(2.0e38), f32(-2.9e38)]
    with pytest.raises(ValueError, match="multiple|whole number"):
        unpack_logprobs(b64(b"\x00" * 6))


def _report(**kw):
    return {"sample_id": 1, "attempt": 0, "route_token": ROUTE, "version": 0, **kw}


def test_report_takes_either_form_and_sends_packed_on_request():
    ids, lps = [3, 4, 5], [f32(-0.25), f32(-1.5), f32(-0.1)]
    listed = ReportIn.model_validate(_report(tokens=ids, logprobs=lps))
    packed = ReportIn.model_validate_json(json.dumps(_report(tokens=pack_int32(ids), logprobs=pack_float32(lps))))
    assert listed.tokens == packed.tokens == ids and listed.logprobs == packed.logprobs == lps
    # JSON lists unless asked: what older readers take; packed with the context
    assert json.loads(listed.model_dump_json())["tokens"] == ids
    sent = json.loads(listed.model_dump_json(context=PACKED_CONTEXT))
    assert sent["tokens"] == pack_int32(ids) and sent["logprobs"] == pack_float32(lps)
    assert ReportIn.model_validate_json(listed.model_dump_json(context=PACKED_CONTEXT)) == listed
    assert listed.model_dump()["tokens"] == ids  # Python mode: lists


def test_a_packed_report_array_is_kept_as_its_bytes():
    ids, lps = [3, 4, 2**31 - 1], [f32(-0.25), f32(-1.5), f32(-0.1)]
    r = ReportIn.model_validate_json(json.dumps(_report(tokens=pack_int32(ids), logprobs=pack_float32(lps))))
    assert isinstance(r.tokens, PackedArray) and isinstance(r.logprobs, PackedArray)
    assert r.tokens.raw == struct.pack("<3i", *ids) and r.logprobs.raw == struct.pack("<3f", *lps)
    # read as a list where something reads it
    assert len(r.tokens) == 3 and list(r.tokens) == ids and r.tokens[-1] == 2**31 - 1 and r.logprobs == lps
    # stored as it came: the data layer's packing hands the very bytes on, as a list packs to them
    assert payloads.pack_tokens(r.tokens) is r.tokens.raw and payloads.pack_logprobs(r.logprobs) is r.logprobs.raw
    assert payloads.pack_tokens(ids) == r.tokens.raw and payloads.pack_logprobs(lps) == r.logprobs.raw
    # out again: lists unless packed is asked (JSON), lists in Python
    assert json.loads(r.model_dump_json())["tokens"] == ids
    assert json.loads(r.model_dump_json(context=PACKED_CONTEXT))["logprobs"] == pack_float32(lps)
    assert type(r.model_dump()["tokens"]) is list and r.model_dump(context=PACKED_CONTEXT)["tokens"] == ids
    assert ReportIn.model_validate(dict(r)) == r  # a model built from its values


def test_a_packed_array_reads_each_index_as_its_list_does():
    ids, lps = [7, 0, 2**31 - 1, 12], [f32(-0.25), f32(-3.5), f32(0.0)]
    for values, packed in (
        (ids, PackedArray(struct.pack("<4i", *ids), "int32")),
        (lps, PackedArray(struct.pack("<3f", *lps), "float32")),
    ):
        n = len(values)
        assert [packed[i] for i in range(-n, n)] == [values[i] for i in range(-n, n)]
        assert packed[1:3] == values[1:3] and packed[::-1] == values[::-1]
        for outside in (n, -n - 1):
            with pytest.raises(IndexError):
                packed[outside]


def test_a_consumed_batch_keeps_the_stored_bytes_and_sends_either_form():
    """The data layer's batch holds the segments' bytes as they are stored: the packed answer
    is their base64, the list answer their values, and the two decode to the same batch."""
    from api.packed_batch import consumed_json
    from api.routers.training import _ConsumeJson
    from api.service import dump
    from staleflow_db.protocol.training import Batch, TrainGroup, TrainSample

    ids, lps = [5, 6, 2**31 - 1], [f32(-0.5), f32(-1e-8), f32(-30.25)]
    tokens, logprobs = (
        payloads.packed_tokens(payloads.pack_tokens(ids)),
        payloads.packed_logprobs(payloads.pack_logprobs(lps)),
    )
    sample = TrainSample(1, 0, 0, tokens, logprobs, 1.0, "eos", [], [1, 1, 0])
    batch = Batch(1, 0, 3, [TrainGroup(2, 0, [1, 2], {}, [sample])])
    packed = json.loads(consumed_json(0, batch))
    (s,) = packed["batch"]["groups"][0]["samples"]
    assert s["tokens"] == b64(tokens.raw) and s["logprobs"] == b64(logprobs.raw)
    listed = json.loads(dump(_ConsumeJson, {"ready": True, "version": 0, "batch": batch}))
    assert listed["batch"]["groups"][0]["samples"][0]["tokens"] == ids
    assert ConsumeOut.model_validate(packed) == ConsumeOut.model_validate(listed)


def test_a_batch_reads_packed_arrays_as_lists():
    """The trainer's side (consume?packed=true): arrays are decoded to lists, not kept."""
    sample = {"sample_id": 1, "idx": 0, "v_traj": 0, "tokens": pack_int32([5, 6]), "loss_mask": [1, 1]}
    sample |= {"logprobs": pack_float32([-0.5, -1.0]), "reward": 1.0, "finish_reason": None, "segments": []}
    group = {"group_id": 1, "group_version": 0, "prompt_tokens": pack_int32([1]), "meta": {}, "samples": [sample]}
    batch = {"run_id": 1, "version": 0, "consume_fence": 1, "groups": [group]}
    out = ConsumeOut.model_validate_json(json.dumps({"ready": True, "version": 0, "batch": batch}))
    (s,) = out.batch.groups[0].samples
    assert type(s.tokens) is list and s.tokens == [5, 6] and type(s.logprobs) is list


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("tokens", "***", "not base64"),
        ("tokens", b64(b"\x01\x00\x00\x00\x02"), "not a whole number"),
        ("tokens", b64(struct.pack("<i", -3)), "negative"),
        ("logprobs", b64(struct.pack("<f", math.nan)), "finite"),
        ("logprobs", 5, "valid array"),  # neither a list nor a string
    ],
)
def test_report_refusals_name_the_field(field, value, message):
    body = {"reports": [_report(tokens=[1], logprobs=[-0.5]) | {field: value}]}
    with pytest.raises(ValidationError) as err:
        ReportsIn.model_validate_json(json.dumps(body))
    errors = err.value.errors()
    assert all(e["loc"][:3] == ("reports", 0, field) for e in errors)
    assert any(message in e["msg"] for e in errors)


def test_list_form_keeps_its_element_checks():
    with pytest.raises(ValidationError) as err:
        ReportsIn.model_validate_json(json.dumps({"reports": [_report(tokens=[1, -2], logprobs=[-0.5, -0.5])]}))
    errors = err.value.errors()
    assert ("reports", 0, "tokens", LIST_TAG, 1) in [e["loc"] for e in errors]
    # as the API shows them: located as without the packed form, the string branch left out
    assert [e["loc"] for e in untagged(errors)] == [("reports", 0, "tokens", 1)]


def test_json_schema_publishes_both_forms():
    tokens = ReportIn.model_json_schema()["properties"]["tokens"]
    kinds = {c.get("type"): c for c in tokens["anyOf"]}
    assert kinds["array"]["items"]["minimum"] == 0
    assert kinds["string"]["contentEncoding"] == "base64"
    assert "int32" in kinds["string"]["description"]
    assert LOGPROB_BOUND == 3.0e38
