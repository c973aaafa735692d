"""Schema-driven fuzzing: schemathesis generates valid and invalid requests for every operation
of the app's own OpenAPI schema and sends them over HTTP to a real server. No 5xx, ever; every
4xx carries the JSON error body."""

from __future__ import annotations

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from sqlalchemy import text

from api.auth import create_token
from staleflow_db.protocol import Prompt, Protocol
from staleflow_db.types import RunConfig
from tests.api_helpers import ApiServer

pytestmark = pytest.mark.slow

EXAMPLES = {GenerationMode.POSITIVE: 20, GenerationMode.NEGATIVE: 10}


def _seed(engine) -> None:
    """Small ids exist (the generator favours them), so requests reach past the 404s."""
    p = Protocol(engine)
    run = p.create_run("fuzz", RunConfig(batch_size=1, group_size=2, eta=1, samples_per_group=3))
    p.enqueue(run, [Prompt(f"k{i}", [1, 2, 3]) for i in range(3)])
    inst = p.register_instance(run, "gpu0", 0)
    with engine.connect() as c:
        samples = c.execute(text("SELECT id FROM samples ORDER BY id LIMIT 4")).scalars().all()
    p.route(run, [(s, inst) for s in samples])


def test_no_server_errors_on_generated_requests(db_url, engine):
    _seed(engine)
    admin = create_token(engine, "admin")["token"]
    with ApiServer(db_url, STALEFLOW_API_MAX_WAIT="0.05") as server:
        schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
        session = requests.Session()
        session.headers["Authorization"] = f"Bearer {admin}"
        failures: list[str] = []
        seen = 0
        for result in schema.get_all_operations():
            op = result.ok()
            for mode, n in EXAMPLES.items():

                @settings(max_examples=n, deadline=None, database=None, suppress_health_check=list(HealthCheck))
                @given(case=op.as_strategy(generation_mode=mode))
                def check(case) -> None:
                    nonlocal seen
                    try:
                        r = case.call(base_url=server.url, session=session, timeout=30)
                    except (requests.exceptions.InvalidHeader, UnicodeEncodeError, ValueError):
                        return  # the client library refused to send it: nothing reached the server
                    seen += 1
                    if r.status_code >= 500:
                        failures.append(f"{r.status_code} {case.as_curl_command()}\n{r.text[:300]}")
                    elif r.status_code >= 400 and "/metrics" not in op.path:
                        body = r.json()
                        if set(body) != {"error"} or not {"code", "message"} <= set(body["error"]):
                            failures.append(f"{r.status_code} without the error body: {case.as_curl_command()}")

                try:
                    check()
                except Unsatisfiable:  # nothing to break (an operation without parameters)
                    assert mode == GenerationMode.NEGATIVE
        assert seen > 400
        assert not failures, "\n\n".join(failures[:10]) + "\n\nserver log:\n" + server.output()
