"""End to end over real HTTP: `staleflow serve` subprocesses on the test database, spoken to
through the worker client. Lifecycle, long-poll wake-ups across replicas, a PostgreSQL
restart, and request-id replay of a call whose response was lost."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from staleflow_db import migrate
from tests.api_helpers import ROLES, ApiServer, token, walk_lifecycle
from workers.client import Conflict, StaleFlowClient

pytestmark = pytest.mark.slow


def _role_clients(server: ApiServer, db_url: str, run_id: int) -> dict[str, StaleFlowClient]:
    return {r: server.client(token(db_url, r, run_id)) for r in ROLES}


def test_lifecycle_over_http_with_clean_audit(db_url):
    with ApiServer(db_url) as server:
        admin = server.client(token(db_url, "admin"))
        run = admin.create_run("e2e", batch_size=2, group_size=2, eta=1, samples_per_group=2)
        roles = _role_clients(server, db_url, run.id)

        # The trainer long-polls before anything exists: the rewards' commit must wake it.
        woke: dict[str, object] = {}

        def trainer_waits() -> None:
            t0 = time.monotonic()
            woke["batch"] = roles["trainer"].consume(run.id, 0, wait=25)
            woke["after"] = time.monotonic() - t0

        waiter = threading.Thread(target=trainer_waits)
        waiter.start()

        def batch_from_waiter():
            waiter.join(30)
            return woke["batch"]

        out = walk_lifecycle(admin, roles, run.id, batch_from_waiter)
        assert out["batch"] is not None and woke["after"] < 20

        assert out["version"] == 1
        assert admin.run_status(run.id).version == 1
        assert admin.violations(run.id) == []
        trained = admin.trained_samples(run.id)
        assert len(trained) == 4 and {t.step for t in trained} == {0}
        assert all(0 <= t.staleness <= 1 for t in trained)
        cont = next(t for t in trained if t.sample_id == out["continued"].sample_id)
        assert cont.n_segments == 3 and cont.n_tokens == 4
        assert admin.param_versions(run.id)[0].location == "ps://0"
        metrics = admin.metrics()
        assert f'staleflow_run_version{{run="{run.id}"}} 1.0' in metrics
        assert "staleflow_api_request_seconds_bucket" in metrics and "staleflow_staleness_versions_bucket" in metrics


def test_long_poll_wakes_on_commit_through_another_replica(db_url):
    # Replica A re-checks only every 30 s: a prompt wake-up can come from NOTIFY alone.
    slow = {"STALEFLOW_API_POLL_INTERVAL": "30", "STALEFLOW_API_NOTIFIED_POLL_INTERVAL": "30"}
    a, b = ApiServer(db_url, **slow).launch(), ApiServer(db_url).launch()
    with a, b:  # launched together, waited for in turn
        admin = b.client(token(db_url, "admin"))
        run = admin.create_run("replicas", batch_size=1, group_size=1, eta=0)
        on_a, on_b = _role_clients(a, db_url, run.id), _role_clients(b, db_url, run.id)
        on_b["trainer"].enqueue(run.id, [("only", [1, 2])])
        inst = on_a["rollout"].register(run.id, "gpu0", 0).instance_id
        for _ in range(50):  # A's LISTEN connection comes up in the background
            if on_a["admin"].readyz()["listening"]:
                break
            time.sleep(0.1)

        got: dict[str, object] = {}

        def poll_on_a() -> None:
            t0 = time.monotonic()
            got["work"] = on_a["rollout"].poll(run.id, inst, wait=25).work
            got["after"] = time.monotonic() - t0

        t = threading.Thread(target=poll_on_a)
        t.start()
        time.sleep(0.5)  # the poll is waiting on A
        (sample,) = [q.sample_id for q in on_b["coordinator"].snapshot(run.id).queued]
        assert on_b["coordinator"].route(run.id, [(sample, inst)])[0].outcome == "routed"
        t.join(30)
        assert [w.sample_id for w in got["work"]] == [sample]
        assert got["after"] < 5, f"woke after {got['after']:.1f}s: NOTIFY did not reach replica A"


def test_a_database_outage_reaches_a_held_poll_as_503(embedded_pg, monkeypatch):
    """While a replica listens, its long-polls re-check rarely (a NOTIFY wakes them). When the
    LISTEN connection goes with the database, the polls already held re-check at once: the
    outage reaches their callers as 503 (they retry, and log it) instead of hiding behind a
    long wait, and they go on after it."""
    embedded_pg.start()
    home = str(embedded_pg.home)
    monkeypatch.setenv("STALEFLOW_HOME", home)
    env = {"STALEFLOW_API_POLL_INTERVAL": "0.2", "STALEFLOW_API_NOTIFIED_POLL_INTERVAL": "60"}
    with ApiServer(None, STALEFLOW_HOME=home, **env) as server:
        admin = StaleFlowClient(server.url, retry_for=60)
        run = admin.create_run("held-poll-outage", batch_size=1, group_size=1, eta=0)
        rollout = StaleFlowClient(server.url, token(embedded_pg.url(), "rollout", run.id), retry_for=60)
        inst = rollout.register(run.id, "gpu0", 0).instance_id
        for _ in range(50):  # the LISTEN connection comes up in the background
            if admin.readyz()["listening"]:
                break
            time.sleep(0.1)
        assert admin.readyz()["listening"]

        done = threading.Event()
        t = threading.Thread(target=lambda: (rollout.poll(run.id, inst, wait=20), done.set()))
        t.start()
        time.sleep(0.5)  # the poll is held
        embedded_pg.stop()
        deadline = time.monotonic() + 10
        while rollout.api.count == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert rollout.api.count == 1, "the held poll kept waiting through the outage"
        embedded_pg.start()
        t.join(60)
        assert done.is_set() and not rollout.api.down


class DropFirstResponse(httpx.HTTPTransport):
    """Delivers the request, then loses the response once, as a network fault would."""

    def __init__(self, path_suffix: str):
        super().__init__()
        self.suffix, self.dropped = path_suffix, 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        if request.url.path.endswith(self.suffix) and not self.dropped:
            response.read()
            self.dropped += 1
            raise httpx.ReadError("connection reset after the server answered")
        return response


def test_retry_after_lost_response_replays_stored_outcome(db_url):
    with ApiServer(db_url) as server:
        admin = server.client(token(db_url, "admin"))
        run = admin.create_run("replay", batch_size=1, group_size=1, eta=0)
        roles = _role_clients(server, db_url, run.id)
        roles["trainer"].enqueue(run.id, [("k", [1])])
        inst = roles["rollout"].register(run.id, "gpu0", 0).instance_id
        (sample,) = [q.sample_id for q in roles["coordinator"].snapshot(run.id).queued]
        roles["coordinator"].route(run.id, [(sample, inst)])

        lossy = httpx.Client(base_url=server.url, transport=DropFirstResponse("/poll"))
        flaky = StaleFlowClient(token=roles["rollout"].token, http=lossy)
        (work,) = flaky.poll(run.id, inst, wait=5).work  # delivered once, lost, replayed
        assert work.sample_id == sample

        lossy = httpx.Client(base_url=server.url, transport=DropFirstResponse("/segments"))
        flaky = StaleFlowClient(token=roles["rollout"].token, http=lossy)
        report = [
            {
                "sample_id": sample,
                "attempt": work.attempt,
                "route_token": work.route_token,
                "version": 0,
                "tokens": [3],
                "logprobs": [-1.0],
            }
        ]
        assert flaky.report(run.id, inst, report) == 1  # the retry is not a stale attempt
        with pytest.raises(Conflict):  # a genuinely new call with the same data is
            roles["rollout"].report(run.id, inst, report)
        assert admin.run_status(run.id).samples == {"finished": 1}


def test_local_default_and_postgres_restart(embedded_pg, monkeypatch):
    """`staleflow serve` on the embedded default migrates it and leaves the local user an admin
    token the client finds by itself; a PostgreSQL restart is 503 while down, then recovery."""
    embedded_pg.start()  # the fixture's server, which `serve` reuses as the embedded default
    home = str(embedded_pg.home)
    monkeypatch.setenv("STALEFLOW_HOME", home)
    with ApiServer(None, STALEFLOW_HOME=home) as server:
        token_file = embedded_pg.home / "token"
        assert token_file.stat().st_mode & 0o777 == 0o600
        admin = StaleFlowClient(server.url, retry_for=60)  # the token comes from $STALEFLOW_HOME/token
        run = admin.create_run("restart", batch_size=1, group_size=1, eta=0)
        assert httpx.get(f"{server.url}/readyz", timeout=10).json()["schema_revision"] == migrate.head()

        embedded_pg.stop()
        raw = httpx.get(
            f"{server.url}/v1/runs/{run.id}", headers={"Authorization": f"Bearer {admin.token}"}, timeout=10
        )
        assert raw.status_code == 503 and raw.headers["Retry-After"]
        assert raw.json()["error"]["code"] == "database_unavailable"
        assert httpx.get(f"{server.url}/readyz", timeout=10).status_code == 503

        result: dict[str, object] = {}
        t = threading.Thread(target=lambda: result.update(ids=admin.enqueue(run.id, [("during", [1])])))
        t.start()  # retried on 503 until the database is back
        time.sleep(1.0)
        embedded_pg.start()
        t.join(60)
        assert len(result["ids"]) == 1
        assert admin.run_status(run.id).groups == {"queued": 1}
        for _ in range(100):
            if httpx.get(f"{server.url}/readyz", timeout=10).json()["listening"]:
                break
            time.sleep(0.1)
        assert httpx.get(f"{server.url}/readyz", timeout=10).status_code == 200


def test_connections_the_database_dropped_cost_a_retried_503_not_a_500(db_url):
    """The API pools without pre-ping: a pooled connection the database dropped (a restart, here
    its backends terminated) fails its request's first statement. That request answers 503 with
    Retry-After (never 500), the client retries it, and the pool is fresh afterwards."""
    from sqlalchemy import text

    from staleflow_db.db import make_engine

    with ApiServer(db_url) as server:
        admin = server.client(token(db_url, "admin"))
        run = admin.create_run("dropped", batch_size=1, group_size=1, eta=0)
        for _ in range(3):
            admin.run_status(run.id)  # pooled connections now exist
        engine = make_engine(db_url)
        try:
            with engine.begin() as conn:
                killed = conn.execute(
                    text(
                        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                        " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                        " AND application_name = 'staleflow'"
                    )
                ).scalar()
        finally:
            engine.dispose()
        assert killed >= 1
        url, auth = f"{server.url}/v1/runs/{run.id}", {"Authorization": f"Bearer {admin.token}"}
        raw = httpx.get(url, headers=auth, timeout=10)
        assert raw.status_code in (200, 503), raw.text
        if raw.status_code == 503:
            assert raw.headers["Retry-After"] and raw.json()["error"]["code"] == "database_unavailable"
        assert admin.run_status(run.id).run_id == run.id  # retried through a 503 if it meets one
        assert httpx.get(url, headers=auth, timeout=10).status_code == 200
