"""`GET /v1/runs/{run}/snapshot/changes`: whole without `since`, then only what changed, merged by
the client's SnapshotMirror into what `GET …/snapshot` says; a bad `since` is a 422."""

from __future__ import annotations

from api_helpers import in_process

from api.auth import create_token
from staleflow_db.protocol import Prompt, Protocol
from staleflow_db.types import RunConfig
from workers.wire.models import ClusterSnapshotOut, SnapshotChangesOut
from workers.wire.snapshot_mirror import SnapshotMirror


def test_changes_over_http_merge_into_the_snapshot(db_url, engine):
    p = Protocol(engine)
    run = p.create_run("r", RunConfig(batch_size=2, group_size=2, eta=1))
    p.enqueue(run, [Prompt("a", [1, 2]), Prompt("b", [3])])
    auth = {"Authorization": f"Bearer {create_token(engine, 'coordinator', run)['token']}"}
    mirror = SnapshotMirror()
    with in_process(db_url) as http:

        def read() -> SnapshotChangesOut:
            since = {} if mirror.position is None else {"since": mirror.position}
            r = http.get(f"/v1/runs/{run}/snapshot/changes", params=since, headers=auth)
            assert r.status_code == 200, r.text
            doc = SnapshotChangesOut.model_validate_json(r.content)
            mirror.apply(r.json())
            return doc

        first = read()
        assert first.whole and len(first.queued or ()) == 4
        inst = p.register_instance(run, "i", 0)
        sid = mirror.view().queued[0][0]
        p.route(run, [(sid, inst)])
        second = read()
        assert not second.whole and [r[1] for r in second.running or ()] == [sid]
        full = ClusterSnapshotOut.model_validate_json(http.get(f"/v1/runs/{run}/snapshot", headers=auth).content)
        view = mirror.view()
        assert [q[0] for q in view.queued] == [q.sample_id for q in full.queued]
        assert [(i[0], [r[1] for r in view.running if r[0] == i[0]]) for i in view.instances] == [
            (i.instance_id, [r.sample_id for r in i.running]) for i in full.instances
        ]
        for since in ("1:2", "5:3:"):  # not a position; xmin after xmax
            bad = http.get(f"/v1/runs/{run}/snapshot/changes", params={"since": since}, headers=auth)
            assert bad.status_code in (400, 422) and "since" in bad.text, bad.text
        assert http.get(f"/v1/runs/{run + 99}/snapshot/changes", headers=auth).status_code in (403, 404)
