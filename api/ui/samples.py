"""One sample as the sample browser shows it (api/routers/samples.py): its text, its turns, the
model version of each segment, and a timeline of what happened to it.

Text: a run records no tokenizer, so the only decoding the API can do without loading a model's
tokenizer is the byte tokenizer (ids 0..255, UTF-8: the default of `staleflow enqueue` and the
environments). Tokens that are not printable UTF-8 bytes are shown as ids, and `decoding` says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

BYTES = "utf-8 bytes"
IDS = "token ids"
_CONTROL_OK = {"\n", "\t", "\r"}
_SEGMENT_EVENTS = {"sample_partial", "sample_observed"}


def decode(tokens: Sequence[int]) -> str | None:
    """The tokens as text when they are the UTF-8 bytes of printable text, else None."""
    if any(not 0 <= t < 256 for t in tokens):
        return None
    try:
        text = bytes(tokens).decode("utf-8")
    except UnicodeDecodeError:
        return None
    return text if all(ch.isprintable() or ch in _CONTROL_OK for ch in text) else None


def _event_text(e: dict[str, Any]) -> tuple[str, str]:
    """(class, words) of an event row."""
    kind, data, inst = e["kind"], e["data"] or {}, e.get("instance_name") or e.get("instance_id")
    if kind == "sample_routed":
        return "route", f"routed to {inst} (V_traj {data.get('v')})"
    if kind == "sample_interrupted":
        return "interrupt", f"interrupted on {inst}: back to the queue with its tokens"
    if kind == "sample_finished":
        return "route", f"finished on {inst}"
    if kind == "sample_requeued":
        return "interrupt", f"interrupted on {inst}: back to the queue ({data.get('why', '')})"
    if kind == "sample_aborted":
        return "drop", f"dropped: {data.get('reason', '')}"
    if kind == "sample_rewarded":
        return "reward", f"rewarded {data.get('reward')}"
    if kind == "published":
        return "reward", f"trained at step {e['buffer']}: version {data.get('version')} published"
    if kind == "group_enqueued":
        return "group", "group enqueued"
    if kind == "group_reserved":
        return "group", f"group reserved buffer {e['buffer']} (version {data.get('version')})"
    if kind == "group_occupied":
        return "group", f"group occupied buffer {e['buffer']} (version {data.get('version')})"
    if kind == "reservation_moved":
        return "group", f"group's reservation moved from buffer {data.get('from')} to {e['buffer']}"
    if kind.startswith("group_"):
        reason = f": {data['reason']}" if data.get("reason") else ""
        return "drop" if kind in ("group_filtered", "group_aborted") else "group", f"group {kind[6:]}{reason}"
    return "event", kind.replace("_", " ")


def _segments(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """Each segment with its text, its turn (a turn is the generated segments between two
    observations), and whether it moved to another instance (a migration) or resumed after an
    interruption (a new attempt) relative to the segment before it."""
    out, turn, prev = [], 0, None
    for r in rows:
        if r["generated"] and (prev is None or not prev["generated"]):
            turn += 1
        seg = {k: v for k, v in r.items()}
        seg["n_tokens"] = len(r["token_ids"])
        seg["text"] = decode(r["token_ids"])
        seg["turn"] = turn if r["generated"] else None
        seg["after_turn"] = None if r["generated"] else turn  # an observation follows this turn
        seg["migrated_from"] = None
        seg["resumed"] = False
        if prev is not None and r["attempt"] != prev["attempt"]:
            seg["resumed"] = True
            if r["instance_id"] != prev["instance_id"]:
                seg["migrated_from"] = prev.get("instance_name") or prev["instance_id"]
        out.append(seg)
        prev = r
    return out, turn


def _timeline(sample: dict[str, Any], segments: list[dict[str, Any]]) -> list[dict[str, Any]]:
    entries: list[tuple[datetime, int, dict[str, Any]]] = []

    def add(at: datetime, order: int, cls: str, text: str, **extra: Any) -> None:
        entries.append((at, order, {"at": at, "class": cls, "text": text, **extra}))

    for e in sample["events"]:
        if e["sample_id"] not in (None, sample["sample_id"]) or e["kind"] in _SEGMENT_EVENTS:
            continue  # a sibling's event of the same group, or a segment's (shown as the segment)
        cls, text = _event_text(e)
        add(e["at"], 2, cls, text, kind=e["kind"], instance=e.get("instance_name"))
    for c in sample["commands"]:
        target = f" (to version {c['target_version']})" if c["target_version"] is not None else ""
        cls = "interrupt" if c["kind"] in ("interrupt", "pull") else "drop"
        add(c["created_at"], 3, cls, f"{c['kind']} command to {c['instance_name']}{target}: {c['state']}",
            kind=f"command_{c['kind']}", instance=c["instance_name"])  # fmt: skip
    for s in segments:
        inst = s["instance_name"] or s["instance_id"]
        if s["migrated_from"] is not None:
            add(s["created_at"], 0, "migration", f"migrated from {s['migrated_from']} to {inst}",
                kind="migration", instance=inst, seq=s["seq"])  # fmt: skip
        if s["generated"]:
            text = f"turn {s['turn']}: segment {s['seq']} on {inst} at version {s['version']} ({s['n_tokens']} tokens)"
            add(s["created_at"], 1, "segment", text, kind="segment", instance=inst, seq=s["seq"], version=s["version"])
        else:
            text = f"observation after turn {s['after_turn']} ({s['n_tokens']} tokens)"
            add(s["created_at"], 1, "observation", text, kind="observation", instance=inst, seq=s["seq"])
    # one transaction's entries share its time: a migration, then the segment, then the events
    # the report logged (an interruption after the tokens it kept), then commands
    entries.sort(key=lambda x: (x[0], x[1]))
    return [e for _, _, e in entries]


def sample_view(run: dict[str, Any], sample: dict[str, Any]) -> dict[str, Any]:
    """What the sample page renders: the sample, its prompt and segments with text, the versions
    (the legend), the timeline and how the text was decoded."""
    segments, turns = _segments(sample["segments"])
    prompt_text = decode(sample["prompt_tokens"])
    decoded = prompt_text is not None and all(s["text"] is not None for s in segments)
    versions = sorted({s["version"] for s in segments if s["version"] is not None})
    body = {k: v for k, v in sample.items() if k not in ("segments", "events", "commands", "prompt_tokens")}
    return {
        "run": run,
        "sample": body,
        "prompt": {"tokens": sample["prompt_tokens"], "text": prompt_text},
        "segments": segments,
        "turns": turns,
        "versions": versions,
        "timeline": _timeline(sample, segments),
        "decoding": BYTES if decoded else IDS,
        "decoding_note": (
            "decoded as UTF-8 bytes (the run names no tokenizer)"
            if decoded
            else "token ids: the run names no tokenizer and the tokens are not UTF-8 bytes of text"
        ),
    }
