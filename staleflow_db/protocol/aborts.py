"""Drops, the coordinator's (or an operator's) commands: abort samples, abort a group, and drop
the reserved groups whose whole window is ready (abort after ready). Each under the run lock:
a drop releases reservations."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from sqlalchemy import Connection

from workers.wire.enums import DropReason

from .. import queries
from ..errors import InvalidInput, NotFound
from ..idempotency import transactional
from ..rules import window_has_room
from .core import TxMixin, abort_samples_where, check_batch


class AbortOps(TxMixin):
    @transactional
    def abort_samples(
        self,
        run_id: int,
        sample_ids: Sequence[int],
        reason: DropReason = DropReason.USER,
        *,
        conn: Connection | None = None,
    ) -> list[int]:
        """Abort members; a group that can no longer reach N live members is aborted too."""
        check_batch(sample_ids, "samples")
        if len(set(sample_ids)) != len(sample_ids):  # counted twice, it would doom the group
            raise InvalidInput("a sample appears twice in one abort batch")
        with self.run_tx(run_id, conn) as rtx:
            rows = rtx.conn.execute(queries.text("abort_candidates"), {"run": run_id, "ids": list(sample_ids)}).all()
            info = {r.id: r for r in rows}
            for sid in sample_ids:
                if sid not in info:
                    raise NotFound(f"sample {sid} in run {run_id}")
            gids = sorted({r.group_id for r in rows if r.group_state in ("queued", "reserved")})
            live = defaultdict(int)
            for gid, n in rtx.conn.execute(queries.text("live_members"), {"g": gids}).all():
                live[gid] = n
            chosen, doomed = [], []
            for sid in sample_ids:  # one at a time, as the reference model does
                s = info[sid]
                gid = s.group_id
                if s.state == "aborted" or s.group_state not in ("queued", "reserved") or gid in doomed:
                    continue
                chosen.append(sid)
                live[gid] -= 1
                if live[gid] < rtx.run.group_size:
                    doomed.append(gid)
            aborted = abort_samples_where(rtx.conn, run_id, "id", chosen, getattr(reason, "value", reason), rtx.events)
            rtx.drop_groups(doomed, "aborted", DropReason.INSUFFICIENT_MEMBERS)
            return sorted(aborted)

    @transactional
    def abort_group(
        self, run_id: int, group_id: int, reason: DropReason = DropReason.USER, *, conn: Connection | None = None
    ) -> bool:
        with self.run_tx(run_id, conn) as rtx:
            state = rtx.conn.execute(queries.text("lock_group"), {"g": group_id, "run": run_id}).scalar()
            if state is None:
                raise NotFound(f"group {group_id} in run {run_id}")
            if state not in ("queued", "reserved"):
                return False
            rtx.drop_groups([group_id], "aborted", reason)
            return True

    @transactional
    def abort_after_ready(self, run_id: int, *, conn: Connection | None = None) -> list[int]:
        """With redundancy: reserved groups whose whole window is ready can never land; drop them.
        The window is that of the group's live version (its members now, not every routing ever)."""
        with self.run_tx(run_id, conn) as rtx:
            run = rtx.run
            doomed = sorted(
                gid
                for gid, r in rtx.reservations().items()
                if r.version is not None and not window_has_room(rtx.buffers, r.version, run.version, run.limits)
            )
            rtx.drop_groups(doomed, "aborted", DropReason.WINDOW_READY)
            return doomed
