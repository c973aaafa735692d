"""Trainer side of the protocol: Consume (fence the ready buffer and return its batch) and
publish (buffer consumed and the run's version +1, atomically)."""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any

from sqlalchemy import Connection, Row

from workers.wire.enums import DropReason
from workers.wire.packed import PACKED_LOGPROBS, PACKED_TOKEN_IDS

from .. import payloads, queries
from ..errors import Conflict, Corrupted, InvalidInput
from ..idempotency import transactional
from ..rules import reserve_target
from .core import RunTx, TxMixin, check_state, load_run
from .events import Event
from .scoring import checked_metrics


@dataclass
class SegmentInfo:
    seq: int
    version: int | None  # None for an environment observation
    instance_id: int
    n_tokens: int
    generated: bool = True


@dataclass
class TrainSample:
    sample_id: int
    idx: int
    v_traj: int
    # the stored bytes (workers.wire.packed.PackedArray): sequences of their values, serialised
    # packed as they are (context {"packed": True}) or as lists
    tokens: Annotated[Sequence[int], PACKED_TOKEN_IDS]
    logprobs: Annotated[Sequence[float], PACKED_LOGPROBS]
    reward: float
    finish_reason: str | None
    segments: list[SegmentInfo]
    loss_mask: list[int]  # per token: 1 generated (trained on), 0 an environment observation's


@dataclass
class TrainGroup:
    group_id: int
    group_version: int
    prompt_tokens: list[int]
    meta: dict[str, Any]
    samples: list[TrainSample] = field(default_factory=list)


@dataclass
class Batch:
    run_id: int
    version: int  # the buffer index: trains model `version` into `version + 1`
    consume_fence: int  # publish quotes it; a later consume of the buffer fences it
    groups: list[TrainGroup]


class TrainingOps(TxMixin):
    @transactional
    def consume(self, run_id: int, version: int, *, conn: Connection | None = None) -> Batch | None:
        """Take a new consume fence on buffer `version` once it is ready and return its full
        batch; None while it is not ready. A second consume (a restarted trainer) takes a new
        fence, and the old one no longer publishes."""
        with self.tx(conn) as conn:
            # A trainer polls this while it waits: answer "not ready" without the run lock.
            # At version `version` with buffer `version` not ready, no publish can be in flight
            # (it needs that buffer ready), so None is what the locked path would say too.
            waiting = conn.execute(queries.text("consume_waiting"), {"run": run_id, "v": version}).scalar()
            if waiting:
                return None
            run = load_run(conn, run_id, lock=True)
            check_state(run, "consume")
            if version != run.version:
                raise Conflict([(version, f"run {run_id} is at version {run.version}")])
            fence = conn.execute(queries.text("consume_fence"), {"run": run_id, "v": version}).scalar()
            if fence is None:
                return None
            groups = {
                g.id: TrainGroup(g.id, g.group_version, list(g.prompt_tokens), g.meta)
                for g in conn.execute(queries.text("consume_groups"), {"run": run_id, "v": version}).all()
            }
            self._check_trained_once(conn, run_id, version, list(groups))
            segs: defaultdict[int, list[Row[Any]]] = defaultdict(list)
            rows = conn.execute(queries.text("consume_segments"), {"g": list(groups)}).all()
            for r in rows:
                segs[r.sample_id].append(r)
            for s in conn.execute(queries.text("consume_samples"), {"g": list(groups)}).all():
                parts = segs[s.id]
                groups[s.group_id].samples.append(
                    TrainSample(
                        s.id,
                        s.idx,
                        s.v_traj,
                        payloads.packed_tokens(b"".join(p.token_ids for p in parts)),
                        payloads.packed_logprobs(b"".join(p.logprobs for p in parts)),
                        s.reward,
                        s.finish_reason,
                        [SegmentInfo(p.seq, p.version, p.instance_id, p.n_tokens, p.generated) for p in parts],
                        payloads.per_token([p.n_tokens for p in parts], [int(p.generated) for p in parts]),
                    )
                )
            return Batch(run_id, version, fence, list(groups.values()))

    @staticmethod
    def _check_trained_once(conn: Connection, run_id: int, version: int, group_ids: list[int]) -> None:
        """Trained once, checked against the event log (append-only), not the counters: a group
        is trained at the step of the one buffer its Occupy placed it in. A group of buffer
        `version` whose Occupy named another buffer (one before `version` is consumed: trained
        already) or that has no single Occupy is refused with its history (`Corrupted`, the
        fence not taken), never handed out; the audit names it `trained_once`."""
        placed: defaultdict[int, list[int]] = defaultdict(list)
        for gid, b in conn.execute(
            queries.text("consume_group_placements"),
            {"run": run_id, "g": group_ids},
        ).all():
            placed[gid].append(b)
        bad = []
        for gid in group_ids:
            got = placed.get(gid, [])
            if got == [version]:
                continue
            trained = sorted({b for b in got if b is not None and b < version})
            why = (
                f"already trained at step {', '.join(map(str, trained))} (its Occupy placed it in buffer"
                f" {', '.join(map(str, got))}): its samples are not handed out again"
                if trained
                else f"its Occupy is in the event log {len(got)} time(s), in buffer(s) {got}, not once in buffer {version}"
            )
            bad.append((gid, f"group {gid} in buffer {version} refused: {why}"))
        if bad:
            raise Corrupted(bad)

    @transactional
    def publish(
        self,
        run_id: int,
        version: int,
        consume_fence: int,
        size_bytes: int | None = None,
        checksum: str | None = None,
        location: str | None = None,
        metrics: dict[str, float] | None = None,
        *,
        conn: Connection | None = None,
    ) -> int:
        """Mark buffer `version` consumed and move the run to `version + 1`; returns the new
        version. Only from the expected version and consume fence. A repeated publish with the
        fence that published (and the same checksum, when given) is a no-op; any other is 409.
        `metrics`: what the trainer reports of the step (its loss ...), kept with the version."""
        with self.run_tx(run_id, conn) as rtx:
            conn, run = rtx.conn, rtx.run
            if version == run.version - 1:
                self._check_replay(rtx, version, consume_fence, checksum)
                return run.version  # already published under this very fence: a retry
            if version < run.version:  # a buffer published before the latest one
                raise Conflict(
                    [
                        (
                            version,
                            f"replay of an older version: batch {version} was published as version"
                            f" {version + 1}; run {run_id} is at version {run.version}",
                        )
                    ]
                )
            if version != run.version:
                raise Conflict([(version, f"run {run_id} is at version {run.version}")])
            check_state(run, "publish")
            buf = conn.execute(queries.text("publish_buffer"), {"run": run_id, "v": version}).first()
            if buf is None or buf.occupied < buf.batch_size:
                raise Conflict([(version, f"buffer {version} is not ready")])
            if buf.consume_fence != consume_fence:
                raise Conflict([(version, f"consume fence {consume_fence} lost (the latest is {buf.consume_fence})")])
            if size_bytes is not None and size_bytes < 0:
                raise InvalidInput("size_bytes must be >= 0")
            metrics = checked_metrics(f"step {version}", metrics)
            conn.execute(queries.text("publish_consume_buffer"), {"run": run_id, "v": version})
            conn.execute(queries.text("publish_consume_groups"), {"run": run_id, "v": version})
            conn.execute(queries.text("publish_version"), {"run": run_id})
            conn.execute(
                queries.text("publish_params"),
                {
                    "run": run_id,
                    "v": version + 1,
                    "size": size_bytes,
                    "sum": checksum,
                    "loc": location,
                    "metrics": None if metrics is None else json.dumps(metrics),
                },
            )
            rtx.run = dataclasses.replace(run, version=version + 1)
            rtx.buffers[version].consumed = True
            rtx.events.append(Event("published", buffer=version, data={"version": version + 1}))
            self._move_stranded(rtx, version)
            return version + 1

    @staticmethod
    def _check_replay(rtx: RunTx, version: int, consume_fence: int, checksum: str | None) -> None:
        """A publish of the version just published is a retry only from the trainer that
        published it: its consume fence is still the buffer's latest (no consume can follow a publish)
        and its checksum the recorded one. Anyone else was fenced: answering success would let
        a zombie trainer go on, its pushed weights no longer matching the published ones."""
        row = rtx.conn.execute(queries.text("publish_replay"), {"run": rtx.run.id, "v": version}).first()
        published = version + 1
        if row is None or row.consume_fence != consume_fence:
            raise Conflict(
                [
                    (
                        version,
                        f"fenced: another trainer published version {published}"
                        f" (consume fence {consume_fence}, the publishing fence was {row and row.consume_fence})",
                    )
                ]
            )
        if checksum is not None and row.checksum != checksum:
            raise Conflict(
                [(version, f"version {published} was published with checksum {row.checksum}, not {checksum}")]
            )

    @staticmethod
    def _move_stranded(rtx: RunTx, consumed: int) -> None:
        """With B' > B a consumed buffer may still hold reservations: re-reserve them in their
        window (latest admissible buffer, as Reserve does) or drop them `window_closed`.
        (Measured against keeping them in the consumed buffer: see docs/data-layer.md.)"""
        run = rtx.run
        stranded = sorted(gid for gid, r in rtx.reservations().items() if r.buffer == consumed)
        dropped = []
        for gid in stranded:
            res = rtx.reservations()[gid]
            rtx.unreserve(gid)  # no cascade: the slot it leaves is in a consumed buffer
            version = res.version if res.version is not None else run.version
            b = reserve_target(rtx.buffers, version, run.version, run.limits)
            if b is None:
                dropped.append(gid)
            else:
                rtx.add_reservation(gid, b, res.version)
                rtx.moved[gid] = b
                rtx.events.append(Event("reservation_moved", group=gid, buffer=b, data={"from": consumed}))
        rtx.drop_groups(dropped, "aborted", DropReason.WINDOW_CLOSED)
