"""The run configuration is defined once (`workers.wire.run_config.RunConfig`): the `runs`
table, the columns the named queries select, the rules' limits and the API's models (as the
served OpenAPI schema publishes them) all agree with it, so a field added in one place and
not the others fails here. And the API refuses what the type refuses, changing nothing."""

from __future__ import annotations

import re

import pytest
from sqlalchemy import Boolean, Double, Integer, text

from staleflow_db import queries, schema
from staleflow_db.errors import InvalidInput
from staleflow_db.protocol import Protocol
from staleflow_db.protocol.core import RUN_COLUMNS, RunRow
from staleflow_db.rules import Limits, buffer_state
from staleflow_db.types import RunConfig
from tests.api_helpers import in_process
from workers.wire import run_config
from workers.wire.models import RunConfigIn, RunConfigOut

FIELDS = run_config.CONFIG_FIELDS
# the runs table's own columns, not the configuration's
RUN_ONLY = {"id", "name", "version", "created_at", "state", "state_reason"}
SQL_TYPES = {bool: Boolean, int: Integer, float: Double}
JSON_TYPES = {bool: "boolean", int: "integer", float: "number"}


def test_the_runs_table_holds_exactly_the_configuration():
    columns = {c.name: c for c in schema.runs.columns}
    assert set(columns) - RUN_ONLY == set(FIELDS)
    assert [c for c in columns if c in FIELDS] == list(FIELDS)  # the same order
    for f in FIELDS:
        assert isinstance(columns[f].type, SQL_TYPES[run_config.FIELD_TYPES[f]]), f
        assert not columns[f].nullable, f


@pytest.mark.parametrize(
    "name",
    [
        "load_run",
        "load_run_locked",
        "list_runs",
        "get_run",
        "metrics_runs",
        "report_run_and_instances",
        "node_instances",
    ],
)
def test_named_queries_select_the_run_columns(name):
    sql = queries.sql(name)
    # the SELECT that reads runs (a query may renew a lease in a CTE before it)
    listed = re.search(r"SELECT ([^()]*?) FROM runs\b", sql)
    assert listed, sql
    assert [c.strip() for c in listed.group(1).split(",")][: len(RUN_COLUMNS)] == list(RUN_COLUMNS)


def test_create_run_inserts_every_field():
    inserted = re.search(r"INSERT INTO runs \((.*?)\)", queries.sql("create_run"))
    assert inserted
    assert [c.strip() for c in inserted.group(1).split(",")] == ["name", *FIELDS]


def test_run_row_and_limits_are_views_of_the_configuration():
    row = {"id": 7, "version": 3, "state": "paused", "name": "x"} | {
        f: (True if f == "dapo_filter" else 2 + i) for i, f in enumerate(FIELDS)
    }
    run = RunRow.of(row)
    assert isinstance(run, RunConfig) and run.limits is run and Limits is RunConfig
    assert run.as_dict() == {f: row[f] for f in FIELDS}
    assert (run.id, run.version, run.state) == (7, 3, "paused")
    assert buffer_state(None, RunConfig(batch_size=1, group_size=1, eta=0)) == "waiting"


def test_defaults_and_refusals_in_process(engine):
    cfg = RunConfig(batch_size=3, group_size=2, eta=1)
    assert (cfg.buffer_capacity, cfg.samples_per_group) == (3, 2)  # B' = B, N' = N
    assert RunConfig(batch_size=3, group_size=2, eta=1, buffer_capacity=None, samples_per_group=None) == cfg  # type: ignore[arg-type]
    for f in FIELDS:
        spec = run_config.SPECS[f]
        if spec.le is not None:
            bad = RunConfig(**{"batch_size": 1, "group_size": 1, "eta": 0, f: spec.le + 1})
            assert f"{spec.label(f)} must be <= {spec.le}" in bad.problems()
            with pytest.raises(InvalidInput, match=re.escape(spec.label(f))):
                Protocol(engine).create_run("too-big", bad)
    with engine.connect() as c:
        assert c.execute(text("SELECT count(*) FROM runs")).scalar() == 0


def test_openapi_publishes_the_configuration(db_url):
    with in_process(db_url, max_wait=0.2) as http:
        components = http.get("/openapi.json").json()["components"]["schemas"]
    request, response = components["RunConfigIn"], components["RunConfigOut"]
    assert list(request["properties"]) == list(FIELDS) == list(response["properties"])
    assert set(request["required"]) == run_config.REQUIRED
    assert set(response["required"]) == set(FIELDS)
    assert request["additionalProperties"] is False
    for f in FIELDS:
        spec, prop = run_config.SPECS[f], request["properties"][f]
        published = prop["anyOf"][0] if spec.defaults_to else prop  # optional: int or null
        assert published["type"] == JSON_TYPES[run_config.FIELD_TYPES[f]], f
        assert published.get("minimum") == spec.ge and published.get("maximum") == spec.le, f
        assert prop["description"] == spec.description == response["properties"][f]["description"]
        if spec.defaults_to:
            assert prop.get("default") is None and f not in request["required"]
        elif f not in run_config.REQUIRED:
            assert prop["default"] == run_config.default(f)
    assert set(RunConfigIn.model_fields) == set(RunConfigOut.model_fields) == set(FIELDS)


def test_the_api_refuses_what_the_type_refuses(db_url, engine):
    from api.auth import create_token

    admin = create_token(engine, "admin")["token"]
    with in_process(db_url, max_wait=0.2) as http:
        http.headers["Authorization"] = f"Bearer {admin}"
        for config in (
            {"batch_size": 2, "group_size": 1, "eta": 0, "buffer_capacity": 1},  # B' < B
            {"batch_size": 1, "group_size": 1, "eta": 0, "dapo_filter": True},  # the filter needs N >= 2
            {"batch_size": 1, "group_size": 1, "eta": -1},  # a bound
        ):
            r = http.post("/v1/runs", json={"name": "bad", "config": config})
            assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_input", r.text
        r = http.post("/v1/runs", json={"name": "good", "config": {"batch_size": 2, "group_size": 2, "eta": 1}})
        assert r.status_code == 201, r.text
        assert r.json()["config"] == RunConfig(batch_size=2, group_size=2, eta=1).as_dict()
    with engine.connect() as c:
        assert c.execute(text("SELECT name FROM runs")).scalars().all() == ["good"]
