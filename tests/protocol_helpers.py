"""Small drivers for protocol tests: push samples through the lifecycle with few lines."""

from __future__ import annotations

from sqlalchemy import text

from staleflow_db.protocol import Prompt, Protocol
from staleflow_db.types import Report, RunConfig
from workers.wire.enums import SegmentKind
from workers.wire.types import RouteOutcome


class Driver:
    def __init__(self, engine, name="test", **config):
        self.engine = engine
        self.p = Protocol(engine)
        self.run = self.p.create_run(name, RunConfig(**config))
        self.keys = 0
        self.identities: dict[int, dict] = {}  # sample -> identity of its latest route through route()

    def enqueue(self, n: int = 1, prompt=(1, 2, 3)) -> list[int]:
        prompts = [Prompt(f"k{self.keys + i}", list(prompt)) for i in range(n)]
        self.keys += n
        return self.p.enqueue(self.run, prompts)

    def members(self, group_id: int) -> list[int]:
        return self.scalars("SELECT id FROM samples WHERE group_id = :g ORDER BY idx", g=group_id)

    def route(self, sample_ids, instance_id):
        results = self.p.route(self.run, [(s, instance_id) for s in sample_ids])
        self.identities.update(
            (r.sample_id, {"instance_id": instance_id, "route_token": r.route_token}) for r in results if r.route_token
        )
        return results

    def routed(self, sample_ids, instance_id) -> dict[int, int]:
        """Route and insist every sample was routed; returns attempts."""
        results = self.route(sample_ids, instance_id)
        assert [r.outcome for r in results] == [RouteOutcome.ROUTED] * len(results), results
        return {r.sample_id: r.attempt for r in results}

    def route_identity(self, sid: int) -> dict:
        """The reporting identity (instance and route token, as the instance got them with the
        work) of a running sample, else of its latest route: `Report(..., **d.route_identity(s))`."""
        instance_id, token = self.one("SELECT instance_id, route_token::text FROM samples WHERE id = :s", s=sid)
        if instance_id is None:
            return self.identities[sid]
        return {"instance_id": instance_id, "route_token": token}

    def finish(self, attempts: dict[int, int], version: int = 0, tokens=(7, 8)) -> None:
        self.p.report(
            self.run,
            [
                Report(
                    s, a, version, list(tokens), [-0.5] * len(tokens), SegmentKind.FINISHED, **self.route_identity(s)
                )
                for s, a in attempts.items()
            ],
        )

    def reward_all(self, reward=1.0, rewards: dict[int, float] | None = None):
        tasks = self.p.claim_rewards(self.run, 1000)
        return self.p.record_rewards(
            self.run, [(t.sample_id, t.reward_attempt, (rewards or {}).get(t.sample_id, reward)) for t in tasks]
        )

    def complete(self, sample_ids, instance_id, version: int = 0, reward=1.0):
        self.finish(self.routed(sample_ids, instance_id), version)
        return self.reward_all(reward)

    def train(self, version: int) -> None:
        batch = self.p.consume(self.run, version)
        assert batch is not None, f"buffer {version} not ready"
        assert self.p.publish(self.run, version, batch.consume_fence) == version + 1

    # ---- reads -----------------------------------------------------------------------------

    def rows(self, sql: str, **params):
        with self.engine.connect() as c:
            return c.execute(text(sql), {"r": self.run, **params}).all()

    def scalars(self, sql: str, **params):
        return [r[0] for r in self.rows(sql, **params)]

    def one(self, sql: str, **params):
        return self.rows(sql, **params)[0]

    def sample(self, sid: int):
        return self.one(
            "SELECT state::text, v_traj, attempt, n_tokens, reason, instance_id FROM samples WHERE id = :s", s=sid
        )

    def group(self, gid: int):
        return self.one(
            "SELECT state::text, reserved_buffer, buffer, group_version, reason FROM prompt_groups WHERE id = :g", g=gid
        )

    def buffers(self):
        return {r[0]: r[1:] for r in self.rows("SELECT idx, occupied, reserved FROM buffers WHERE run_id = :r")}

    def violations(self):
        return self.rows("SELECT invariant, subject, detail FROM staleness_violations WHERE run_id = :r")
