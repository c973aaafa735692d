"""Drops, the coordinator's (or an operator's) commands: abort samples, abort a group, and drop
the reserved groups whose whole window is ready (abort after ready); and a rollout instance's:
drop trajectories whose environment failed. Each under the run lock: a drop releases
reservations."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection

from workers.wire.enums import DropReason

from .. import queries
from ..errors import Conflict, InvalidInput, NotFound
from ..idempotency import transactional
from ..rules import window_has_room
from ..types import Report
from .core import RunTx, TxMixin, abort_samples_where, check_batch, check_live, route_lost


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
            return _abort_members(rtx, run_id, sample_ids, info, reason)

    @transactional
    def drop_trajectories(
        self,
        run_id: int,
        instance_id: int,
        drops: Sequence[tuple[int, int, str]],
        reason: DropReason = DropReason.ENV_FAILED,
        *,
        conn: Connection | None = None,
    ) -> list[int]:
        """A rollout instance gives up on samples routed to it (`drops`: (sample, attempt, route
        token)) because their environment failed or hung: aborted with `reason`, fenced by the
        route like a report, all or nothing; a group that can no longer reach N live members is
        aborted too. A sample already dropped at that attempt with that reason is skipped (a
        retry). Returns the samples aborted now."""
        if DropReason(reason) not in ENV_DROP_REASONS:
            allowed = ", ".join(r.value for r in ENV_DROP_REASONS)
            raise InvalidInput(
                f"a rollout instance drops trajectories with reason {allowed}, not {DropReason(reason).value}"
            )
        check_batch(drops, "samples")
        ids = [d[0] for d in drops]
        if len(set(ids)) != len(ids):
            raise InvalidInput("a sample appears twice in one drop batch")
        quoted = {
            sid: Report(sid, attempt, None, [], [], instance_id=instance_id, route_token=token)
            for sid, attempt, token in drops
        }
        tokens = {sid: r.route_token_uuid() for sid, r in quoted.items()}
        reason_value = DropReason(reason).value
        with self.run_tx(run_id, conn) as rtx:
            inst = rtx.conn.execute(queries.text("trajectory_drop_instance"), {"run": run_id, "i": instance_id}).first()
            if inst is None:
                raise NotFound(f"instance {instance_id} in run {run_id}")
            rows = rtx.conn.execute(queries.text("trajectory_drop_candidates"), {"run": run_id, "ids": ids}).all()
            info = {r.id: r for r in rows}
            chosen, conflicts = [], []
            for sid in ids:
                s = info.get(sid)
                if s is None:
                    raise NotFound(f"sample {sid} in run {run_id}")
                r = quoted[sid]
                if s.state == "aborted" and s.attempt == r.attempt and s.reason == reason_value:
                    continue  # dropped by this very route already
                why = route_lost(r, s.state, s.attempt, s.instance_id, s.route_token, tokens[sid])
                if why:
                    conflicts.append((sid, why))
                else:
                    chosen.append(sid)
            check_live(instance_id, inst.state, inst.live)
            if conflicts:
                raise Conflict(conflicts)
            return _abort_members(rtx, run_id, chosen, info, reason)

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


ENV_DROP_REASONS = (DropReason.ENV_FAILED, DropReason.ENV_TIMEOUT)


def _abort_members(
    rtx: RunTx, run_id: int, sample_ids: Sequence[int], info: dict[int, Any], reason: DropReason
) -> list[int]:
    """Abort the live members among `sample_ids` (`info`: each one's group and states); a group
    that can no longer reach N live members is aborted too (insufficient_members)."""
    gids = sorted({info[s].group_id for s in sample_ids if info[s].group_state in ("queued", "reserved")})
    live: defaultdict[int, int] = defaultdict(int)
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
