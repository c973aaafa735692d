"""The data layer as the API uses it: each request's protocol calls run in one transaction (the
`conn` that `once` hands to its `call`, passed on as `conn=`), retried on deadlock by
staleflow_db.idempotency together with the stored outcome of its Idempotency-Key (ENGINEERING
pattern 5) -- the same implementation the protocol's own `request_id` uses."""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, TypeVar

from pydantic import BaseModel, TypeAdapter
from sqlalchemy import Connection
from starlette.responses import Response

from staleflow_db import idempotency
from staleflow_db.idempotency import KeyReused  # noqa: F401 (re-exported: 409 idempotency_key_reused)
from staleflow_db.protocol import Protocol
from workers.wire.packed import PACKED_CONTEXT

T = TypeVar("T", bound=BaseModel)


class ApiProtocol(Protocol):
    # Times every outermost protocol transaction by operation (see staleflow_db.idempotency.transactional).
    observe_transaction: Callable[[str], AbstractContextManager[None]] | None = None

    def once(
        self,
        key: str | None,
        operation: str,
        body: BaseModel | None,
        call: Callable[[Connection], T],
        model: type[T],
        store: Callable[[T], bool] | None = None,
        idle: Callable[[Connection], T | None] | None = None,
    ) -> tuple[T, bool]:
        """Run `call` in one transaction with the stored outcome of `key`; (outcome, replayed).

        A key already used returns its stored response without running anything; the same key
        with a different body is refused (409 idempotency_key_reused); a concurrent duplicate
        waits for the first and replays its outcome. Outcomes `store` rejects (an empty
        long-poll) are not kept. Deadlocks and serialization failures rerun the transaction.
        `idle`: `idempotency.once`'s.
        """
        return self._once(key, operation, body, call, lambda o: o.model_dump_json(), model.model_validate, store, idle)

    def once_json(
        self,
        key: str | None,
        operation: str,
        body: BaseModel | None,
        call: Callable[[Connection], bytes],
        model: type[BaseModel],
        store: Callable[[bytes], bool] | None = None,
        idle: Callable[[Connection], bytes | None] | None = None,
        context: dict[str, Any] | None = None,
    ) -> tuple[bytes, bool]:
        """`once` for a `call` that returns the response body already serialised (see `dump`):
        large outcomes skip building a model per item. The outcome is kept as its JSON text (a
        jsonb string), which PostgreSQL keeps without building a document of it first: 2,000
        route results 3.3 -> 1.3 ms, written under the run lock. A replay re-reads it through
        `model`, so it is the same JSON a fresh call gives (`context`: the serialisation context
        the call's JSON was made with, PACKED_CONTEXT for packed arrays). `idle`:
        `idempotency.once`'s."""

        def replay(stored: Any) -> bytes:
            # a document: kept by a replica from before outcomes were kept as text
            out = model.model_validate_json(stored) if isinstance(stored, str) else model.model_validate(stored)
            return out.model_dump_json(context=context).encode()

        return self._once(key, operation, body, call, _json_text, replay, store, idle)

    def _once(
        self,
        key: str | None,
        operation: str,
        body: BaseModel | None,
        call: Callable[[Connection], Any],
        encode: Callable[[Any], str],
        decode: Callable[[Any], Any],
        store: Callable[[Any], bool] | None,
        idle: Callable[[Connection], Any] | None = None,
    ) -> tuple[Any, bool]:
        with self._timed(operation):
            return idempotency.once(
                self.engine, key, operation, _digest(key, body), call, encode, decode, store, idle=idle
            )

    @contextmanager
    def _timed(self, operation: str) -> Iterator[None]:
        # the operation without the ids some carry (abort_group<id>): a bounded label
        observe = self.observe_transaction
        with observe(operation.rstrip("0123456789")) if observe is not None else nullcontext():
            yield


def _json_text(body: bytes) -> str:
    return json.dumps(body.decode())


def _digest(key: str | None, body: BaseModel | None) -> str:
    # Without a key nothing is stored or compared: skip serialising the body. Token arrays are
    # digested packed: a report's packed bytes as they came (no list, no decimal per element),
    # and a JSON list the same as its packed form (the same values stored).
    if key is None:
        return ""
    return idempotency.digest(body.model_dump_json(context=PACKED_CONTEXT) if body is not None else b"")


def scoped_key(key: str | None, scope: str) -> str | None:
    """Keys are the client's, but one run (or instance) never sees another's outcomes."""
    return None if key is None else f"{scope}:{key}"


def from_data(model: type[T], value: Any) -> T:
    """A response model from data-layer dataclasses (nested in dicts and lists too), read by
    attribute: dataclasses.asdict deep-copied every token list first, which cost ~80x more
    (a 128-sample batch: 124 ms against 1.5 ms)."""
    return model.model_validate(value, from_attributes=True)


def respond(out: BaseModel, status_code: int = 200) -> Response:
    """`out` as the JSON body FastAPI would send for it (no aliases here), bypassing its
    response validation, which for a plain `def` endpoint is one more thread-pool hand-off
    per request. The route's `response_model` still documents the body."""
    return Response(out.model_dump_json(), status_code, media_type="application/json")


@functools.cache
def _adapter(tp: Any) -> TypeAdapter[Any]:
    return TypeAdapter(tp)


def dump(tp: Any, value: Any, exclude: Any = None, context: dict[str, Any] | None = None) -> bytes:
    """`value` as JSON by the type `tp` (a TypedDict or dataclass mirroring a response model),
    serialised without validation: for large lists of data-layer dataclasses, whose fields are
    the model's, building a model per item first cost ~6x the serialising (2,000 routes: ~30 ms
    against ~5 ms). Dataclass fields the model lacks (`RouteResult.route_token`) are left out by
    `exclude` (see `unpublished`). tests/api/test_api_serialise.py checks each use gives the
    model's own JSON. `context`: the models' serialisation context (PACKED_CONTEXT: arrays
    packed)."""
    return _adapter(tp).dump_json(value, exclude=exclude, context=context)


def unpublished(dc: type, model: type[BaseModel]) -> set[str]:
    """Fields of dataclass `dc` that `model` does not publish: the `exclude` for `dump`."""
    return {f.name for f in dataclasses.fields(dc)} - set(model.model_fields)


def respond_json(body: bytes, status_code: int = 200) -> Response:
    return Response(body, status_code, media_type="application/json")
