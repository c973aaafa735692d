"""Runs and their prompts: creating a run with its configuration, and enqueueing prompt groups."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import Connection
from sqlalchemy.exc import IntegrityError

from .. import queries
from ..errors import Conflict, InvalidInput
from ..idempotency import transactional
from ..types import RunConfig, check_config
from .core import Prompt, TxMixin, check_batch, enqueue_prompts, load_run
from .events import Event, log_events


class RunOps(TxMixin):
    @transactional
    def create_run(self, name: str, config: RunConfig, *, conn: Connection | None = None) -> int:
        check_config(config)
        if not name or len(name) > 200:
            raise InvalidInput("run name must have 1..200 characters")
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
                        },
                    ).scalar_one()
            except IntegrityError:
                raise Conflict([(0, f"a run named {name!r} exists already")]) from None
            log_events(conn, run_id, [Event("run_created", data={"name": name})])
            return run_id

    @transactional
    def enqueue(self, run_id: int, prompts: Sequence[Prompt], *, conn: Connection | None = None) -> list[int]:
        """Group ids for the prompts, in order; a client key seen before returns its group."""
        check_batch(prompts, "prompts")
        with self.tx(conn) as conn:
            run = load_run(conn, run_id, lock=False)
            return enqueue_prompts(conn, run, prompts)
