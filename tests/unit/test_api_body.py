"""api.body.ModelBodyRoute: a valid JSON body is validated in one pass from the bytes (no
json.loads), and every body it refuses gets exactly the answer plain FastAPI gives."""

from __future__ import annotations

import json
import warnings
from types import SimpleNamespace

import pytest
from fastapi import APIRouter, FastAPI
from fastapi.routing import APIRoute

from api import body as body_module
from api.body import ModelBodyRoute
from api.errors import install
from workers.wire.models import ReportsIn

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient


def _app(route_class: type[APIRoute]) -> TestClient:
    app = FastAPI()
    install(app, retry_after=1)
    router = APIRouter(route_class=route_class)

    @router.post("/r/{n}")
    def take(n: int, body: ReportsIn) -> dict:
        r = body.reports[0]
        return {
            "n": n,
            "type": type(body).__name__,
            "tokens": r.tokens,
            "route_token": str(r.route_token),
            "kind": r.kind,
        }

    app.include_router(router)
    return TestClient(app)


REPORT = {"sample_id": 1, "attempt": 0, "route_token": "12345678-1234-5678-1234-567812345678", "version": 0}
GOOD = {"reports": [{**REPORT, "tokens": [1, 2], "logprobs": [-0.5, -1]}]}


def test_a_valid_body_is_validated_from_the_bytes(monkeypatch):
    def no_loads(*a, **kw):
        raise AssertionError("json.loads on a valid body")

    monkeypatch.setattr(body_module, "json", SimpleNamespace(loads=no_loads))
    fast = _app(ModelBodyRoute).post("/r/3", json=GOOD)
    assert fast.status_code == 200, fast.text
    assert fast.json() == {
        "n": 3,
        "type": "ReportsIn",
        "tokens": [1, 2],
        "route_token": REPORT["route_token"],
        "kind": "finished",
    }


BAD = [
    json.dumps({"reports": [{**REPORT, "tokens": [1, "2"], "logprobs": [0, 0]}]}),  # strict int
    json.dumps({"reports": [{**REPORT, "tokens": [1.0], "logprobs": [0]}]}),
    json.dumps({"reports": [{**REPORT, "tokens": [1], "logprobs": [True]}]}),
    json.dumps({"reports": [{**REPORT, "tokens": [1], "logprobs": [0], "typo": 1}]}),  # unknown field
    json.dumps({"reports": [{**REPORT, "tokens": [-1], "logprobs": [0]}]}),
    json.dumps({"reports": [{**REPORT, "route_token": "not-a-uuid", "tokens": [1], "logprobs": [0]}]}),
    '{"reports": [{"sample_id": 1, "tokens": [1], "logprobs": [NaN]}]}',  # json.loads takes NaN
    '{"reports": [',  # invalid JSON
    "[]",
    "null",
    "",
]


@pytest.mark.parametrize("raw", BAD)
@pytest.mark.parametrize("content_type", ["application/json", None, "text/plain"])
def test_a_refused_body_gets_fastapis_own_answer(raw, content_type):
    headers = {} if content_type is None else {"content-type": content_type}
    fast = _app(ModelBodyRoute).post("/r/3", content=raw.encode(), headers=headers)
    plain = _app(APIRoute).post("/r/3", content=raw.encode(), headers=headers)
    assert fast.status_code == plain.status_code and fast.status_code >= 400
    assert fast.json() == plain.json()
