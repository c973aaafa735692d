"""The data layer as the API uses it: protocol transactions that can join an outer transaction,
so a write and the stored outcome of its request id commit together (ENGINEERING pattern 5)."""

from __future__ import annotations

import hashlib
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Callable, Iterator, TypeVar

from pydantic import BaseModel
from sqlalchemy import Connection, text
from sqlalchemy.exc import IntegrityError

from staleflow_db.errors import Conflict
from staleflow_db.protocol import Protocol

T = TypeVar("T", bound=BaseModel)

# The transaction a protocol call should join (set only inside `ApiProtocol.once`).
_outer: ContextVar[Connection | None] = ContextVar("staleflow_api_outer_tx", default=None)


class KeyReused(Conflict):
    code = "idempotency_key_reused"


class ApiProtocol(Protocol):
    @contextmanager
    def tx(self) -> Iterator[Connection]:
        outer = _outer.get()
        if outer is not None:
            yield outer
            return
        with self.engine.begin() as conn:
            yield conn

    def once(
        self,
        key: str | None,
        operation: str,
        body: BaseModel | None,
        call: Callable[[Connection], T],
        model: type[T],
        store: Callable[[T], bool] = lambda _: True,
    ) -> tuple[T, bool]:
        """Run `call` in one transaction with the stored outcome of `key`; (outcome, replayed).

        A key already used returns its stored response without running anything; the same key
        with a different body is refused. Outcomes `store` rejects (an empty long-poll) are not
        kept: repeating them is harmless and they would only fill the table.
        """
        if key is None:
            with self.engine.begin() as conn:
                return self._joined(conn, call), False
        digest = hashlib.sha256(body.model_dump_json().encode() if body is not None else b"").hexdigest()[:16]
        op = f"{operation}#{digest}"
        for attempt in range(2):
            try:
                with self.engine.begin() as conn:
                    row = conn.execute(
                        text("SELECT operation, response FROM idempotency WHERE request_id = :r"), {"r": key}
                    ).first()
                    if row is not None:
                        if row[0] != op:
                            raise KeyReused([(0, f"Idempotency-Key was already used for another request ({row[0].split('#')[0]})")])
                        return model.model_validate(row[1]), True
                    outcome = self._joined(conn, call)
                    if store(outcome):
                        conn.execute(
                            text(
                                "INSERT INTO idempotency (request_id, operation, response)"
                                " VALUES (:r, :o, CAST(:resp AS jsonb))"
                            ),
                            {"r": key, "o": op, "resp": outcome.model_dump_json()},
                        )
                    return outcome, False
            except IntegrityError as exc:
                # A concurrent retry with the same key committed first: replay its outcome.
                if attempt or "idempotency" not in str(exc.orig):
                    raise
        raise AssertionError("unreachable")

    @staticmethod
    def _joined(conn: Connection, call: Callable[[Connection], T]) -> T:
        token = _outer.set(conn)
        try:
            return call(conn)
        finally:
            _outer.reset(token)


def scoped_key(key: str | None, scope: str) -> str | None:
    """Keys are the client's, but one run (or instance) never sees another's outcomes."""
    return None if key is None else f"{scope}:{key}"


def dump(value: Any) -> Any:
    """Data-layer dataclasses to plain data for the response models."""
    import dataclasses

    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    if isinstance(value, list):
        return [dump(v) for v in value]
    return value
