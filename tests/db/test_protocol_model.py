"""Model-based test: the same random operations drive the in-memory reference model and the
PostgreSQL implementation; after every step their whole state must agree and every
invariant of SPEC §2 must hold (the reference's own check and the `staleness_violations` view).
"""

from __future__ import annotations

import itertools
import os
import uuid
from collections import Counter

import pytest
from hypothesis import HealthCheck, seed, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from sqlalchemy import text

from staleflow_db.errors import ProtocolError
from staleflow_db.protocol import Prompt, Protocol
from staleflow_db.reference import ReferenceProtocol
from staleflow_db.types import Report, RunConfig
from workers.wire.enums import SampleState, SegmentKind

_runs = itertools.count()
REWARDS = st.sampled_from([0.0, 0.0, 0.5, 1.0, 1.0])
# Outcomes a run must meet to not be vacuous: CI's examples here, bench/model_based.py's chunks together.
COVERAGE = (
    "route routed",
    "route not_admitted",
    "group occupied",
    "group filtered",
    "published",
    "refused Conflict",
    "refused InvalidInput",
)


def same_outcome(ref_call, db_call):
    """Both succeed (returning their values) or both refuse with the same error class."""
    try:
        ref = ref_call()
    except ProtocolError as e:
        ProtocolMachine.seen[f"refused {type(e).__name__}"] += 1
        with pytest.raises(type(e)):
            db_call()
        return None, None
    return ref, db_call()


class ProtocolMachine(RuleBasedStateMachine):
    engine = None  # set by the test function
    seen: Counter = Counter()  # outcomes met, so the test can show it was not vacuous

    @initialize(
        B=st.integers(1, 3),
        extra_B=st.integers(0, 1),
        N=st.integers(1, 3),
        extra_N=st.integers(0, 1),
        eta=st.integers(0, 2),
        dapo=st.booleans(),
    )
    def setup(self, B, extra_B, N, extra_N, eta, dapo):
        cfg = dict(
            batch_size=B,
            buffer_capacity=B + extra_B,
            group_size=N,
            samples_per_group=N + extra_N,
            eta=eta,
            dapo_filter=dapo and N > 1,
            max_response_tokens=6,
        )  # DAPO needs N >= 2
        self.ref = ReferenceProtocol(RunConfig(**cfg))
        self.db = Protocol(self.engine)
        self.run = self.db.create_run(f"model-{next(_runs)}", RunConfig(**cfg))
        self.sample_map: dict[int, int] = {}  # reference id -> database id
        self.group_map: dict[int, int] = {}
        self.inst_map: dict[int, int] = {}
        self.db_tokens: dict[int, str] = {}  # database sample id -> route token of its latest route
        self.keys = itertools.count()
        self.reward_attempts: dict[int, int] = {}

    # ---- id mapping ------------------------------------------------------------------------

    def _map_new_groups(self):
        with self.engine.connect() as c:
            rows = c.execute(
                text(
                    "SELECT g.client_key, s.idx, s.id, g.id FROM samples s JOIN prompt_groups g ON g.id = s.group_id"
                    " WHERE g.run_id = :r"
                ),
                {"r": self.run},
            ).all()
        by_key = {(k, i): (sid, gid) for k, i, sid, gid in rows}
        for g in self.ref.groups.values():
            for sid in g.sample_ids:
                db_sid, db_gid = by_key[(g.client_key, self.ref.samples[sid].idx)]
                self.sample_map[sid], self.group_map[g.id] = db_sid, db_gid

    def _samples(self, state):
        return sorted(s.id for s in self.ref.samples.values() if s.state == state)

    # ---- rules -----------------------------------------------------------------------------

    @rule(n=st.integers(1, 3), prompt_len=st.sampled_from([0, 1, 2, 2, 3, 3, 3]))
    def enqueue(self, n, prompt_len):
        prompts = [Prompt(f"k{next(self.keys)}", list(range(1, prompt_len + 1))) for _ in range(n)]
        ref = [None]

        def ref_call():
            if prompt_len == 0:  # validation before any change, as the database does
                self.ref.enqueue(prompts[0].client_key, [])
            ref[0] = [self.ref.enqueue(p.client_key, p.prompt_tokens) for p in prompts]

        same_outcome(ref_call, lambda: self.db.enqueue(self.run, prompts))
        self._map_new_groups()

    @rule(data=st.data(), invalid=st.integers(0, 7))
    def register(self, data, invalid):
        version = data.draw(st.integers(0, self.ref.version)) + (invalid == 0)
        ref_id, db_id = same_outcome(
            lambda: self.ref.register_instance(version), lambda: self.db.register_instance(self.run, "i", version)
        )
        if ref_id is not None:
            self.inst_map[ref_id] = db_id

    @precondition(lambda self: self.inst_map)
    @rule(data=st.data())
    def pull(self, data):
        iid = data.draw(st.sampled_from(sorted(self.inst_map)))
        version = data.draw(st.integers(0, self.ref.version))
        same_outcome(lambda: self.ref.heartbeat(iid, version), lambda: self.db.heartbeat(self.inst_map[iid], version))

    def _active(self):
        return sorted(i for i, inst in self.ref.instances.items() if inst.state.value == "active")

    @precondition(lambda self: len(self._active()) > 1)
    @rule(data=st.data(), rare=st.integers(0, 3))
    def expire(self, data, rare):
        if rare:
            return
        iid = data.draw(st.sampled_from(self._active()))
        self.ref.expire_instance(iid)
        with self.engine.begin() as c:
            c.execute(
                text("UPDATE instances SET lease_expires_at = now() - interval '1 second' WHERE id = :i"),
                {"i": self.inst_map[iid]},
            )
        self.db.expire_instances(self.run)

    @precondition(lambda self: self.inst_map and self.ref.queued_samples())
    @rule(data=st.data())
    def route(self, data):
        queued = self._samples(SampleState.QUEUED)
        picked = data.draw(st.lists(st.sampled_from(queued), min_size=1, max_size=8, unique=True))
        iid = data.draw(st.sampled_from(self._active() or sorted(self.inst_map)))
        self._route(picked, iid)

    def _route(self, picked, iid):
        ref, db = same_outcome(
            lambda: self.ref.route([(s, iid) for s in picked]),
            lambda: self.db.route(self.run, [(self.sample_map[s], self.inst_map[iid]) for s in picked]),
        )
        for r, d in zip(ref or [], db or []):
            self.seen[f"route {r.outcome.value}"] += 1
            assert (r.outcome, r.attempt, r.v_traj, r.buffer) == (d.outcome, d.attempt, d.v_traj, d.buffer)
            assert (r.route_token is None) == (d.route_token is None)
            if d.route_token:
                self.db_tokens[d.sample_id] = d.route_token

    @precondition(lambda self: self._samples(SampleState.RUNNING))
    @rule(data=st.data(), kind=st.sampled_from([SegmentKind.FINISHED] * 4 + list(SegmentKind)), stale=st.integers(0, 5))
    def report(self, data, kind, stale):
        """stale 0: an old attempt; 1: another instance reports it; 2: a guessed route token."""
        self.seen[f"stale {stale}"] += 1
        running = self._samples(SampleState.RUNNING)
        picked = data.draw(st.lists(st.sampled_from(running), min_size=1, max_size=8, unique=True))
        reports = []
        for sid in picked:
            s = self.ref.samples[sid]
            n = data.draw(st.integers(0, 3))
            last = s.segments[-1].version if s.segments else s.v_traj
            version = data.draw(st.integers(last, self.ref.version))
            attempt = s.attempt - 1 if stale == 0 and sid == picked[0] else s.attempt
            tokens = [data.draw(st.integers(0, 50)) for _ in range(n)]
            reports.append((sid, attempt, version, tokens, [-0.5 * (i + 1) for i in range(n)]))
        forged = {}
        if stale == 1 and len(self.inst_map) > 1:
            forged["instance"] = data.draw(
                st.sampled_from(sorted(set(self.inst_map) - {self.ref.samples[picked[0]].instance_id}))
            )
        elif stale == 2:
            forged["route_token"] = str(uuid.uuid4())
        self._report(reports, kind, forged)

    def _report(self, reports, kind, forged=None):
        """Each report names its instance and quotes its route token (each side's own); `forged`
        replaces the first report's instance or route token."""
        self.seen["report"] += 1
        forged = forged or {}

        def ident(sid, first, db):
            s = self.ref.samples[sid]
            iid = forged.get("instance", s.instance_id) if first else s.instance_id
            token = self.db_tokens[self.sample_map[sid]] if db else s.route_token
            token = forged.get("route_token", token) if first else token
            return {"instance_id": self.inst_map[iid] if db else iid, "route_token": token}

        ref = [Report(s, a, v, t, lp, kind, **ident(s, i == 0, False)) for i, (s, a, v, t, lp) in enumerate(reports)]
        db = [
            Report(self.sample_map[s], a, v, t, lp, kind, **ident(s, i == 0, True))
            for i, (s, a, v, t, lp) in enumerate(reports)
        ]
        if forged:
            self.seen[f"forged {next(iter(forged))}"] += 1
        same_outcome(lambda: self.ref.report(ref), lambda: self.db.report(self.run, db))

    @precondition(lambda self: self._active())
    @rule(data=st.data())
    def advance(self, data):
        """A whole lifecycle step for many samples at once, so runs get deep enough to train."""
        iid = self._active()[-1]
        queued = self._samples(SampleState.QUEUED)[:12]
        if queued:
            self._route(queued, iid)
        running = self._samples(SampleState.RUNNING)
        if running:
            self._report(
                [(sid, self.ref.samples[sid].attempt, self.ref.version, [7], [-0.25]) for sid in running],
                SegmentKind.FINISHED,
            )
        self.claim(12)
        scoring = self._samples(SampleState.SCORING)
        if scoring:
            self._reward([(sid, self.ref.samples[sid].reward_attempt, data.draw(REWARDS)) for sid in scoring])

    @rule(limit=st.integers(1, 8))
    def claim(self, limit):
        ref = self.ref.claim_rewards(limit)
        self.seen["claimed"] += len(ref)
        db = self.db.claim_rewards(self.run, limit)
        assert [self.sample_map[s] for s, _ in ref] == [t.sample_id for t in db]
        assert [a for _, a in ref] == [t.reward_attempt for t in db]
        for t in db:
            self.reward_attempts[t.sample_id] = t.reward_attempt

    @precondition(lambda self: self._samples(SampleState.SCORING))
    @rule(data=st.data(), stale=st.integers(0, 5))
    def reward(self, data, stale):
        scoring = self._samples(SampleState.SCORING)
        picked = data.draw(st.lists(st.sampled_from(scoring), min_size=1, max_size=8, unique=True))
        rewards = [
            (s, self.ref.samples[s].reward_attempt - (stale == 0 and s == picked[0]), data.draw(REWARDS))
            for s in picked
        ]
        self._reward(rewards)

    def _reward(self, rewards):
        ref, db = same_outcome(
            lambda: self.ref.record_rewards(rewards),
            lambda: self.db.record_rewards(self.run, [(self.sample_map[s], a, r) for s, a, r in rewards]),
        )
        self._map_new_groups()
        self.seen["reward refused" if ref is None else "reward applied"] += 1
        for r, d in zip(ref or [], db or []):
            self.seen[f"group {r.state.value}"] += 1
            assert (self.group_map[r.group_id], r.state, r.buffer, r.reason) == (
                d.group_id,
                d.state,
                d.buffer,
                d.reason,
            )

    @precondition(lambda self: self.ref.samples)
    @rule(data=st.data(), rare=st.integers(0, 5))
    def abort(self, data, rare):
        if rare:  # aborts end groups; keep them rare so runs get deep enough to train
            return
        picked = data.draw(st.lists(st.sampled_from(sorted(self.ref.samples)), min_size=1, max_size=3, unique=True))
        ref = self.ref.abort_samples(picked)
        db = self.db.abort_samples(self.run, [self.sample_map[s] for s in picked])
        assert sorted(self.sample_map[s] for s in ref) == db

    @rule()
    def abort_after_ready(self):
        doomed = self.ref.abort_after_ready()
        self.seen["window ready"] += bool(doomed)
        assert [self.group_map[g] for g in doomed] == self.db.abort_after_ready(self.run)

    @rule(retry=st.booleans())
    def consume_and_publish(self, retry):
        v = self.ref.version
        ref = self.ref.consume(v)
        db = self.db.consume(self.run, v)
        if ref is None:
            assert db is None
            return
        fence, groups = ref
        self.seen["published"] += 1
        assert [self.group_map[g] for g in groups] == [g.group_id for g in db.groups]
        for g in db.groups:
            assert len(g.samples) == self.ref.config.group_size
            for s in g.samples:
                assert s.tokens == [
                    t for seg in self.ref.samples[self._ref_sample(s.sample_id)].segments for t in seg.tokens
                ]
        assert self.ref.publish(v, fence) == self.db.publish(self.run, v, db.consume_fence) == v + 1
        if retry:
            assert self.db.publish(self.run, v, db.consume_fence) == v + 1

    def _ref_sample(self, db_id):
        return next(r for r, d in self.sample_map.items() if d == db_id)

    # ---- agreement and invariants -----------------------------------------------------------

    @invariant()
    def states_agree(self):
        if not hasattr(self, "ref"):
            return
        self.seen["steps"] += 1
        with self.engine.connect() as c:
            samples = {
                r[0]: r[1:]
                for r in c.execute(
                    text(
                        "SELECT id, state::text, v_traj, attempt, n_tokens, reward, reason FROM samples WHERE run_id = :r"
                    ),
                    {"r": self.run},
                ).all()
            }
            groups = {
                r[0]: r[1:]
                for r in c.execute(
                    text(
                        "SELECT id, state::text, reserved_buffer, min_version, buffer, group_version, reason"
                        " FROM prompt_groups WHERE run_id = :r"
                    ),
                    {"r": self.run},
                ).all()
            }
            buffers = {
                r[0]: r[1:]
                for r in c.execute(
                    text("SELECT idx, occupied, reserved, consumed_at IS NOT NULL FROM buffers WHERE run_id = :r"),
                    {"r": self.run},
                ).all()
            }
            version = c.execute(text("SELECT version FROM runs WHERE id = :r"), {"r": self.run}).scalar()
            violations = c.execute(text("SELECT * FROM staleness_violations WHERE run_id = :r"), {"r": self.run}).all()
        assert version == self.ref.version
        for sid, s in self.ref.samples.items():
            assert samples[self.sample_map[sid]] == (
                s.state.value,
                s.v_traj,
                s.attempt,
                s.n_tokens,
                s.reward,
                s.reason,
            ), sid
        for gid, g in self.ref.groups.items():
            assert groups[self.group_map[gid]] == (
                g.state.value,
                g.reserved_buffer,
                g.min_version,
                g.buffer,
                g.group_version,
                g.reason,
            ), gid
        for b, buf in self.ref.buffers.items():
            assert buffers.get(b, (0, 0, False)) == (buf.occupied, buf.reserved, buf.consumed), b
        assert self.ref.check_invariants() == []
        assert violations == []


@pytest.mark.db
def test_reference_and_database_agree(engine):
    ProtocolMachine.engine = engine
    machine = ProtocolMachine.TestCase
    # CI runs a fixed, derandomized 60 x 80; bench/model_based.py sets a larger, random budget.
    examples = int(os.environ.get("STALEFLOW_MODEL_EXAMPLES", "60"))
    if examples == 60:
        # Hypothesis derives a derandomized seed from the machine's source, so a rename in it
        # drew other examples (and lost the coverage below): CI's run has its own fixed seed.
        seed(1)(ProtocolMachine)
    machine.settings = settings(
        max_examples=examples,
        stateful_step_count=80,
        deadline=None,
        derandomize=examples == 60,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    machine().runTest()
    print(dict(ProtocolMachine.seen))
    if examples != 60:  # a chunk of bench/model_based.py: it checks coverage over all chunks
        return
    for outcome in COVERAGE:
        assert ProtocolMachine.seen[outcome] > 0, outcome
