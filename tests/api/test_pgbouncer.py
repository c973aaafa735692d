"""Many API replicas on one primary: the API through a real PgBouncer in transaction mode
(every transaction may run on another server connection), its LISTEN connection straight to
the server (STALEFLOW_LISTEN_DATABASE_URL: a LISTEN belongs to a session), prepared statements
off (STALEFLOW_PREPARED_STATEMENTS=0: PgBouncer < 1.21 does not carry them across server
connections). A full lifecycle (route, report, claim, reward, train) on one replica while the
trainer long-polls on the other, whose wake-up can only come through NOTIFY: its poll interval
is longer than the wait. Skipped, saying why, without a `pgbouncer` binary (.ci/run installs
Debian's)."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from collections.abc import Iterator

import pytest

from bench.pooler import local_pgbouncer, on_tcp, pgbouncer_binary
from tests.api_helpers import ROLES, ApiServer, token, walk_lifecycle

pytestmark = pytest.mark.slow


@pytest.fixture
def pgbouncer(db_url: str) -> Iterator[str]:
    """A PgBouncer in transaction mode in front of the test database's server, on a free
    port: yields the test database's URL through it."""
    if pgbouncer_binary() is None:
        pytest.skip("pgbouncer is not installed (apt-get install -y pgbouncer)")
    if not on_tcp(db_url):
        pytest.skip("the test server is not on TCP (set STALEFLOW_TEST_DATABASE_URL to a host:port)")
    with local_pgbouncer(db_url) as bouncer:
        yield bouncer.url


def pooler_transactions(bouncer_url: str) -> int:
    """Transactions PgBouncer served for all databases (its admin console, simple protocol)."""
    admin = bouncer_url.rsplit("/", 1)[0] + "/pgbouncer"
    out = subprocess.run(
        ["psql", admin, "-AtF,", "-c", "SHOW STATS"], capture_output=True, text=True, check=True, timeout=30
    ).stdout
    return sum(int(line.split(",")[1]) for line in out.splitlines() if line and line.split(",")[0] != "pgbouncer")


def test_replicas_through_pgbouncer_with_a_direct_listen(db_url, pgbouncer):
    env = {
        "STALEFLOW_LISTEN_DATABASE_URL": db_url,
        "STALEFLOW_PREPARED_STATEMENTS": "0",
        # no re-check within the wait: only NOTIFY wakes
        "STALEFLOW_API_POLL_INTERVAL": "60",
        "STALEFLOW_API_NOTIFIED_POLL_INTERVAL": "60",
    }
    with ApiServer(pgbouncer, **env) as a, ApiServer(pgbouncer, **env) as b:
        admin = b.client(token(db_url, "admin"))
        run = admin.create_run("pooled", batch_size=2, group_size=2, eta=1, samples_per_group=2)
        roles = {r: b.client(token(db_url, r, run.id)) for r in ROLES}
        waiting = a.client(token(db_url, "trainer", run.id))
        woke: dict[str, object] = {}

        def trainer_waits() -> None:  # on replica a; everything else happens on replica b
            t0 = time.monotonic()
            woke["batch"] = waiting.consume(run.id, 0, wait=25)
            woke["after"] = time.monotonic() - t0

        waiter = threading.Thread(target=trainer_waits)
        waiter.start()

        def batch_from_waiter():
            waiter.join(30)
            return woke["batch"]

        out = walk_lifecycle(admin, roles, run.id, batch_from_waiter)
        # woken by replica b's NOTIFY through a's direct LISTEN, long before its poll interval
        assert out["batch"] is not None and woke["after"] < 20
        assert out["version"] == 1
        assert admin.violations(run.id) == []
        assert len(admin.trained_samples(run.id)) == 4
        if shutil.which("psql"):
            assert pooler_transactions(pgbouncer) > 0
