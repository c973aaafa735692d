from sqlalchemy import text

from staleflow_db.protocol import Prompt, Protocol
from staleflow_db.types import Report, RunConfig


def test_full_lifecycle(engine):
    p = Protocol(engine)
    run = p.create_run("r", RunConfig(batch_size=2, group_size=2, eta=1, samples_per_group=3))
    gids = p.enqueue(run, [Prompt(k, [1, 2]) for k in "abcde"])
    assert gids == p.enqueue(run, [Prompt(k, [1, 2]) for k in "abcde"])
    inst = p.register_instance(run, "i0", 0)
    with engine.connect() as c:
        queued = c.execute(text("select id from samples where state='queued' order by id")).scalars().all()
    p.route(run, [(s, inst) for s in queued])
    work = p.poll_work(inst).work
    p.report(
        run,
        [
            Report(w.sample_id, w.attempt, 0, [5, 6], [-0.1, -0.2], instance_id=inst, route_token=w.route_token)
            for w in work
        ],
    )
    tasks = p.claim_rewards(run, 100)
    p.record_rewards(run, [(t.sample_id, t.reward_attempt, 1.0) for t in tasks])
    batch = p.consume(run, 0)
    assert batch is not None and len(batch.groups) == 2
    assert p.publish(run, 0, batch.consume_fence) == 1
    assert p.publish(run, 0, batch.consume_fence) == 1
    with engine.connect() as c:
        assert c.execute(text("select * from staleness_violations")).all() == []
        assert len(c.execute(text("select * from trained_samples")).all()) == 4
    print(p.reads.status(run))
