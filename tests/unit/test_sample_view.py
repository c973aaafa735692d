"""The sample page's shaping (api/ui/samples.py): which tokens read as text, how segments fall
into turns, and where a migration and a resumption are."""

from __future__ import annotations

from datetime import UTC, datetime

from api.ui.samples import decode, sample_view


def test_text_only_from_utf8_bytes_of_printable_text():
    assert decode(list("héllo\n\tworld".encode())) == "héllo\n\tworld"
    assert decode([]) == ""
    assert decode([300, 65]) is None  # not a byte
    assert decode([0xC3]) is None  # a cut UTF-8 sequence
    assert decode([12, 13, 14]) is None  # control bytes: a toy vocabulary's ids, not text
    assert decode([1, 65]) is None


def _seg(seq, generated, version, instance, attempt, tokens):
    at = datetime(2026, 1, 1, 0, 0, seq, tzinfo=UTC)
    return {"seq": seq, "generated": generated, "version": version, "instance_id": instance,
            "instance_name": f"i{instance}", "attempt": attempt, "token_ids": tokens,
            "finish_reason": None, "created_at": at}  # fmt: skip


def test_turns_migrations_and_resumptions():
    segs = [
        _seg(0, True, 0, 1, 1, list(b"a")),
        _seg(1, True, 0, 1, 1, list(b"b")),
        _seg(2, True, 1, 2, 2, list(b"c")),  # another instance, another attempt: migrated
        _seg(3, False, None, 2, 2, list(b"obs")),
        _seg(4, True, 1, 2, 3, list(b"d")),  # same instance, next attempt: resumed
        _seg(5, False, None, 2, 3, list(b"obs")),
        _seg(6, True, 2, 2, 4, [300]),
    ]
    sample = {"sample_id": 9, "prompt_tokens": list(b"q"), "segments": segs, "events": [], "commands": []}
    view = sample_view({"id": 1}, sample)
    got = [(s["turn"], s["after_turn"], s["migrated_from"], s["resumed"]) for s in view["segments"]]
    assert got == [
        (1, None, None, False),
        (1, None, None, False),
        (1, None, "i1", True),
        (None, 1, None, False),
        (2, None, None, True),
        (None, 2, None, False),
        (3, None, None, True),
    ]
    assert view["turns"] == 3 and view["versions"] == [0, 1, 2]
    assert view["decoding"] == "token ids"  # one segment is not text: the page says ids
    assert [e["kind"] for e in view["timeline"]][:4] == ["segment", "segment", "migration", "segment"]
