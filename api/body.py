"""Request bodies validated by pydantic straight from the bytes.

FastAPI parses a JSON body with `json.loads` and then validates the Python objects: two passes,
the first building every token id and log-prob as a Python object only for the second to check
it. `model_validate_json` does both in one pass in Rust, 2-3x less CPU on the bodies that carry
lists (reports' token arrays, routes, rewards), where the two passes were ~9% of the server's
CPU under bench/api.py. A route of `ModelBodyRoute` hands FastAPI a request whose `json()` is
the validated model, which FastAPI's own validation then passes through as is.

Only valid bodies take this path: one the model refuses is parsed with `json.loads` as before,
so FastAPI validates it itself and every refusal (invalid JSON, a wrong type, an unknown field)
is the same 422 as without it; a wrong content type never reaches `json()`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError


class _ModelBodyRequest(Request):
    body_model: type[BaseModel]

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            try:
                self._json = self.body_model.model_validate_json(body)
            except ValidationError:
                self._json = json.loads(body)  # FastAPI refuses it, as it always did
        return self._json


def _body_model(route: APIRoute) -> type[BaseModel] | None:
    """The model of the route's one JSON body, when FastAPI takes the body as that model whole."""
    params = route.dependant.body_params
    if len(params) != 1 or route._embed_body_fields:
        return None
    annotation = params[0].field_info.annotation
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


class ModelBodyRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        model = _body_model(self)
        if model is None:
            return handler

        async def validated_in_one_pass(request: Request) -> Response:
            fast = _ModelBodyRequest(request.scope, request.receive)
            fast.body_model = model
            return await handler(fast)

        return validated_in_one_pass
