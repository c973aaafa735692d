"""Runs and their prompts: creating a run with its configuration, its lifecycle (pause,
resume, cancel), and enqueueing prompt groups.

Lifecycle (docs/api.md, "Run lifecycle"): `active` <-> `paused` -> `cancelled` (terminal,
from either). Paused: routing refuses (the coordinator skips its cycles), so no instance gets
new work; in-flight samples finish, are scored, and full buffers train. Cancelled: every
unfinished group (queued or reserved) and its live members are aborted with the reason
`run_cancelled` (running ones get an abort command); finished groups waiting in a buffer stay
as they are, never trained; enqueue, route, register, consume and publish are refused (409)."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import Connection
from sqlalchemy.exc import IntegrityError

from workers.wire.enums import DropReason, RunState
from workers.wire.types import is_run_id

from .. import queries
from ..errors import Conflict, InvalidInput, RunNotActive
from ..idempotency import transactional
from ..types import RunConfig, check_config
from .core import Prompt, TxMixin, check_batch, check_state, enqueue_prompts, load_run
from .events import Event, log_events

# state -> the states it may be entered from
_FROM: dict[RunState, tuple[RunState, ...]] = {
    RunState.PAUSED: (RunState.ACTIVE, RunState.PAUSED),
    RunState.ACTIVE: (RunState.PAUSED, RunState.ACTIVE),
    RunState.CANCELLED: (RunState.ACTIVE, RunState.PAUSED, RunState.CANCELLED),
}


def check_run_name(name: str) -> None:
    """Names stand in REST paths for ids: all digits would read as an id, a `/` as a path."""
    if not name or len(name) > 200:
        raise InvalidInput("run name must have 1..200 characters")
    if is_run_id(name):
        raise InvalidInput(f"run name {name!r} is all digits: it would read as a run id")
    if "/" in name or name.strip() != name:
        raise InvalidInput(f"run name {name!r} may not contain '/' or start or end with spaces")


class RunOps(TxMixin):
    @transactional
    def create_run(self, name: str, config: RunConfig, *, conn: Connection | None = None) -> int:
        check_config(config)
        check_run_name(name)
        with self.tx(conn) as conn:
            try:
                with conn.begin_nested():
                    run_id: int = conn.execute(
                        queries.text("create_run"),
                        {
                            "name": name,
                            "B": config.batch_size,
                            "Bc": config.buffer_capacity,
                            "N": config.group_size,
                            "Nc": config.samples_per_group,
                            "eta": config.eta,
                            "mr": config.max_response_tokens,
                            "mp": config.max_prompt_tokens,
                            "f": config.dapo_filter,
                            "t": config.temperature,
                            "p": config.top_p,
                        },
                    ).scalar_one()
            except IntegrityError:
                # The item names the existing run (id 0 would name none).
                existing = conn.execute(queries.text("run_by_name"), {"name": name}).scalar_one()
                raise Conflict([(existing, f"a run named {name!r} exists already")]) from None
            log_events(conn, run_id, [Event("run_created", data={"name": name})])
            return run_id

    @transactional
    def set_state(
        self, run_id: int, state: RunState, reason: str | None = None, *, conn: Connection | None = None
    ) -> list[int]:
        """Pause, resume or cancel the run (one transaction under the run lock); returns the
        groups a cancel aborted. Setting the state the run is in again changes nothing (a retry;
        a cancel again aborts any unfinished group left); a cancelled run stays cancelled
        (RunNotActive)."""
        state = RunState(state)
        if reason is not None and len(reason) > 1000:
            raise InvalidInput("reason must have at most 1000 characters")
        with self.run_tx(run_id, conn) as rtx:
            now = RunState(rtx.run.state)
            if now not in _FROM[state]:
                raise RunNotActive(run_id, f"run {run_id} is {now.value}: it cannot become {state.value}")
            if now != state:
                why = reason or ("cancelled" if state == RunState.CANCELLED else None)
                rtx.conn.execute(queries.text("set_run_state"), {"run": run_id, "state": state.value, "reason": why})
                kind = "run_resumed" if state == RunState.ACTIVE else f"run_{state.value}"
                rtx.events.append(Event(kind, data={"reason": why}))
            if state != RunState.CANCELLED:
                return []
            # again on a cancelled run: aborts what an enqueue racing the first cancel added
            groups = list(rtx.conn.execute(queries.text("unfinished_groups"), {"run": run_id}).scalars())
            rtx.drop_groups(groups, "aborted", DropReason.RUN_CANCELLED)
            return groups

    @transactional
    def enqueue(self, run_id: int, prompts: Sequence[Prompt], *, conn: Connection | None = None) -> list[int]:
        """Group ids for the prompts, in order; a client key seen before returns its group."""
        check_batch(prompts, "prompts")
        with self.tx(conn) as conn:
            run = load_run(conn, run_id, lock=False)
            check_state(run, "enqueue")
            return enqueue_prompts(conn, run, prompts)
