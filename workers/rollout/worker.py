"""The rollout worker: wraps one engine and speaks to StaleFlow only through the REST client.

Loop: take routed samples and commands from the inbox (a thread long-polling for them, so
a command arrives while the engine steps), step the engine, report finished and
interrupted stretches as segments (batched, fenced by instance, attempt and route token),
checkpoint long stretches as partial segments so a crash loses little, and pull new weights
when the coordinator says so. A lost route (409) drops the sample locally: its late result
is never applied.

Calls follow transitions, not timers. Any call of the instance (poll, report) renews its lease,
so a busy instance needs no heartbeat for it. A report goes when a segment ends (finished,
interrupted, a turn answered) or a checkpoint is due: one call for every sample's pending
segments, coalesced over `report_every_s`; a finished sample's report may wait for company, at
most 1% of its stretch's time and `finish_slack_max_s` (FINISH_SLACK_SHARE). A checkpoint (every
held stretch's unsent tokens as a partial segment) is due when a stretch holds
`checkpoint_tokens` unsent tokens or `checkpoint_every_s` passed: what a killed worker loses, at
most, per sample. Counted in tokens, a checkpoint row carries a few hundred of them whatever the
decode rate, so the rows (the database's work per report) follow the tokens, not the clock; a
checkpoint still unsent when the next is due (the report timer, an API that is slow or away) is
extended only up to `checkpoint_tokens`, past them the next is a segment of its own. A report
that goes anyway takes the checkpoint along once 80% of either is reached. A report carries the
instance's snapshot when one is due: at most one a `heartbeat_s` (the snapshot's staleness, as
when heartbeats came once a second), sooner for a change the coordinator cannot predict. A
heartbeat goes alone, at most one a `heartbeat_s`, only for what no report carried: such a
change (a sample preempted to waiting, a trajectory gone to its environment, a new version), a
snapshot a report left out (the next report usually takes it first), progress unsent for
`snapshot_every_s` while it holds samples, or no call at all for half a lease. An idle
instance's long-polls (`poll_wait_s`) renew its lease; the inbox polls only while this loop
ticks, so an engine that hangs stops renewing it, and the lease lapses and requeues its samples.
An idle loop waits for a delivery, a due report or snapshot, or `idle_wait_s`.

With an environment (`turns`, turns.py), a finished stretch ends a turn: the environment
steps in the background while the engine decodes the others (the snapshot reports the
trajectory as waiting for it, outside the engine's counts), then the trajectory either ends
or goes back to the queue with the observation appended; a failed or hung environment drops
it through the API with the reason.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from workers.client import Conflict, StaleFlowClient, Unavailable
from workers.envs.base import EnvFailed
from workers.rollout.engines.base import (
    Engine,
    FinishedEvent,
    PreemptedEvent,
    TokensEvent,
    engine_should_interrupt_preempted,
)
from workers.rollout.node import Node, NodeInbox, Part, Settled, Wake
from workers.rollout.turns import Turn, Turns, turn_start
from workers.rollout.worker_inbox import Delivery, Inbox

log = logging.getLogger("staleflow.rollout")
ENV_POLL_S = 0.005  # idle engine, environment calls in flight: how often to look for answers
# a report that goes anyway takes the checkpoint along once this much of its interval passed:
# a call saved, at most 1/0.8 the partial segments (rows) of checkpoints on their own timer
CHECKPOINT_RIDES_AT = 0.8
# what a killed worker loses at most per sample: the unsent tokens of a stretch, or its time
# (a slow decode); a crash costs the re-prefill of every held sample elsewhere anyway, which
# at these bounds is the larger part (docs/scaling.md, "Checkpoints"). A row of n tokens is
# ~110 + 8n bytes, kept whole in the heap up to 4,080 (two to a page, migration 0021): ~496 tokens
CHECKPOINT_TOKENS = 480
CHECKPOINT_EVERY_S = 60.0
# A finished sample's report may wait for company: at most this share of the time its stretch
# took, and at most `finish_slack_max_s`. The finish that completes a group or a step is then
# late by at most 1% of that sample's own decode, while a node's other instances (or this one's
# other samples) finish meanwhile and one call carries them all (docs/scaling.md, "Calls, not
# only transitions"). Interrupts, turns and checkpoints keep the report timer: the coordinator
# or an environment waits for them.
FINISH_SLACK_SHARE = 0.01
FINISH_SLACK_MAX_S = 1.0

# (target version) -> (state dict, version); None for engines without weights (sim)
WeightSource = Callable[[int | None], tuple[Mapping[str, Any] | None, int]]


@dataclass
class _Held:
    """A routed sample this instance is generating."""

    attempt: int
    route_token: str  # the route's secret token: every report quotes it
    prefix_len: int  # response tokens before this stretch
    prompt_len: int
    reported: int = 0  # tokens of this stretch already sent as partial segments
    tokens: list[int] = field(default_factory=list)  # this stretch so far, from TokensEvents
    logprobs: list[float] = field(default_factory=list)
    turn_prefix: list[int] = field(default_factory=list)  # multi-turn: the current turn's tokens before this stretch
    budget: int = 0  # response tokens this stretch may still add (turn and observations)
    ended: FinishedEvent | None = None  # multi-turn: the turn its environment is answering
    ended_version: int = 0  # the version that generated that turn (a pull may come meanwhile)
    started: float = field(default_factory=time.monotonic)  # when this stretch was delivered


@dataclass
class WorkerStats:
    routed: int = 0
    finished: int = 0
    interrupted: int = 0
    migrated: int = 0  # φ_wait engine-side interrupts
    pulls: int = 0
    lost: int = 0  # reports refused with 409: route lost
    tokens: int = 0
    commands: int = 0
    turns: int = 0  # multi-turn: turns answered by the environment, the trajectory going on
    env_dropped: int = 0  # multi-turn: trajectories dropped because their environment failed
    # seconds commands waited in the inbox for the engine's step to end, summed
    command_wait_s: float = 0.0
    # seconds finished samples' reports waited before they were sent (their slack), summed
    finish_wait_s: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)


class RolloutWorker:
    def __init__(
        self,
        client: StaleFlowClient,
        run_id: int,
        engine: Engine,
        *,
        name: str = "rollout",
        weights: WeightSource | None = None,
        phi_wait: int | None = None,
        heartbeat_s: float = 1.0,
        lease_s: float = 15.0,
        report_every_s: float = 0.05,
        finish_slack_max_s: float = FINISH_SLACK_MAX_S,
        finish_slack_share: float = FINISH_SLACK_SHARE,
        checkpoint_tokens: int = CHECKPOINT_TOKENS,
        checkpoint_every_s: float = CHECKPOINT_EVERY_S,
        idle_wait_s: float = 1.0,
        turns: Turns | None = None,
        snapshot_every_s: float | None = None,
        poll_wait_s: float | None = None,
        node: Node | None = None,
    ):
        self.client, self.run_id, self.engine, self.name = client, run_id, engine, name
        self.weights, self.phi_wait = weights, phi_wait
        self.heartbeat_s, self.lease_s = heartbeat_s, lease_s
        self.report_every_s = report_every_s
        self.finish_slack_max_s, self.finish_slack_share = finish_slack_max_s, finish_slack_share
        self.checkpoint_tokens, self.checkpoint_every_s = checkpoint_tokens, checkpoint_every_s
        self.idle_wait_s = idle_wait_s
        # a third of the lease: the longest a held sample's progress goes unsent, and an idle
        # long-poll (each renews the lease well before it lapses)
        self.snapshot_every_s = lease_s / 3 if snapshot_every_s is None else snapshot_every_s
        self.poll_wait_s = lease_s / 3 if poll_wait_s is None else poll_wait_s
        self.instance_id: int | None = None
        self.turns = turns
        self.held: dict[int, _Held] = {}
        self.pending: list[dict] = []  # reports not sent yet
        self._due = math.inf  # when the earliest pending report falls due (a finish's slack)
        self._finished_at: dict[int, float] = {}  # pending finished segments: when they ended
        self.stats = WorkerStats()
        self.step_s = 0.0  # the last engine step's wall time (0 when idle): a node's flush waits that long
        self._stop = False
        now = time.monotonic()
        # last heartbeat, report, checkpoint, snapshot sent (with either) and loop tick
        self._last = {"heartbeat": 0.0, "report": 0.0, "checkpoint": now, "snapshot": 0.0, "tick": now}
        self._sent: tuple[int, ...] | None = None  # the unpredictable counts of the last snapshot sent
        self._owed = False  # a report went without the snapshot: one is owed within heartbeat_s
        self._inbox: Inbox | NodeInbox | None = None
        # on a node (workers/rollout/node.py), reports, heartbeats and polls go through it
        self.node = node

    # ---- lifecycle -------------------------------------------------------------------------

    def stop(self) -> None:
        """Finish the step, flush reports and deregister. Through an API outage the calls left
        give up after a lease's time: by then the instance lease has lapsed and its samples are
        requeued anyway, so the process exits instead of retrying for ever."""
        self._stop = True
        if self.client.give_up_at is None:
            self.client.give_up_at = time.monotonic() + self.lease_s

    @property
    def _instance(self) -> int:
        """The registered instance id, for calls that only make sense once run() registered."""
        if self.instance_id is None:
            raise RuntimeError("the rollout worker is not registered: call run()")
        return self.instance_id

    def run(self, until: Callable[[], bool] | None = None) -> WorkerStats:
        """Serve until stopped (or `until()` is true); deregisters on the way out."""
        self.instance_id = self.client.register(
            self.run_id, self.name, self.engine.version, self.lease_s, capacity=self.engine.capacity()
        ).instance_id
        log.info("instance %s registered at version %s", self.instance_id, self.engine.version)
        self._last["heartbeat"] = self._last["snapshot"] = time.monotonic()  # registration: the capacity
        self._sent = self._unpredictable()
        inbox: Inbox | NodeInbox
        if self.node is not None:
            inbox = self.node.attach(self)
        else:
            inbox = Inbox(self.client, self.run_id, lambda: self.instance_id, self.poll_wait_s, self._looping)
        self._inbox = inbox
        inbox.start()
        try:
            while not self._stop and not (until and until()):
                self.tick(inbox)
        except Unavailable:
            if not self._stop:
                raise
            log.warning("stopping with the API unavailable")
        finally:
            inbox.stop()  # closed after the deregistration, which ends the long-poll in flight
            if self.stats.commands:
                log.info(
                    "%s commands applied, %.1f ms after delivery on average (the engine step in progress)",
                    self.stats.commands,
                    self.stats.command_wait_s / self.stats.commands * 1000,
                )
            if self.stats.finished:
                log.info(
                    "%s samples finished, their reports sent %.1f ms after the finish on average (slack for company)",
                    self.stats.finished,
                    self.stats.finish_wait_s / self.stats.finished * 1000,
                )
            if self.client.give_up_at is None:  # stopped by `until`: the same bound (see stop)
                self.client.give_up_at = time.monotonic() + self.lease_s
            try:
                self._flush(force=True)
                self.client.deregister(self.run_id, self.instance_id)
            except Exception as e:  # the run or the API may be gone; the lease expires anyway
                log.warning("deregister failed (unsent work is requeued when the lease lapses): %s", e)
            finally:
                self.client.give_up_at = None
                inbox.close()
        return self.stats

    def _looping(self) -> bool:
        """Whether this loop ticked lately: the inbox polls (renewing the lease) only then."""
        return time.monotonic() - self._last["tick"] < self.lease_s / 2

    def tick(self, inbox: Inbox | NodeInbox) -> None:
        self._last["tick"] = time.monotonic()
        wait = 0.0
        if not self.engine.has_work():  # idle: until work arrives or a heartbeat or report is due
            now = time.monotonic()
            due = now + self.idle_wait_s
            # A snapshot past its interval and not sent was not needed (nothing changed): what
            # changes that is a delivery, which ends the wait, not the clock. Waiting for it
            # would spin.
            if self._last["snapshot"] + self.heartbeat_s > now:
                due = min(due, self._last["snapshot"] + self.heartbeat_s)
            if self.pending:
                due = min(due, self._reports_due())
            wait = max(0.0, due - now)
            if self.turns is not None and self.turns.calls:
                wait = min(wait, ENV_POLL_S)
        for delivery in inbox.get(wait):
            self._deliver(delivery)
        self.step_s = 0.0
        if self.engine.has_work():
            started = time.monotonic()
            self._handle(self.engine.step())
            self.step_s = time.monotonic() - started
            for delivery in inbox.get(0.0):  # what arrived during the step: before its reports go out
                self._deliver(delivery)
        if self.turns is not None:
            self._answer_turns()
        now = time.monotonic()
        since = now - self._last["checkpoint"]
        reporting = bool(self.pending) and now >= self._reports_due()
        if self.node is not None:  # on a node: its flush goes anyway when it asks for ours
            reporting = reporting or self.node.asked(self)
        if self._checkpoint_due(since, CHECKPOINT_RIDES_AT if reporting else 1.0):
            self._checkpoint()  # due, or nearly and a report goes anyway: it rides along
        self._flush()
        if self._heartbeat_due(time.monotonic()):
            self._heartbeat()

    # ---- work and commands -----------------------------------------------------------------

    def _deliver(self, d: Any) -> None:
        if not isinstance(d, Delivery):  # on a node: a refused part of a flush, or a wake-up
            self._settled(d)
            return
        if d.instance_id != self.instance_id:
            return  # polled for an instance we have since given up (registered again)
        if isinstance(d.error, Conflict):  # the instance lease lapsed: poll is refused by time, before any sweep
            self._register_again()
            return
        if d.error is not None:
            raise d.error
        assert d.out is not None
        out = d.out
        for w in out.work:
            prefix, logprobs, budget = list(w.prefix_tokens), list(w.prefix_logprobs), w.max_new_tokens
            held = _Held(w.attempt, w.route_token, len(prefix), len(w.prompt_tokens), budget=budget)
            self.held[w.sample_id] = held
            self.stats.routed += 1
            if self.turns is not None:
                try:
                    first = self.turns.start(w.sample_id, w.prompt_tokens, prefix, w.prefix_mask, w.meta)
                except EnvFailed as e:
                    self._drop(w.sample_id, e)
                    continue
                if first:  # the reset observation opens the trajectory
                    self._observe(w.sample_id, first, "partial")
                    prefix, logprobs, budget = first, [0.0] * len(first), budget - len(first)
                    held.budget, held.prefix_len = budget, len(first)
                held.turn_prefix = prefix[turn_start(list(w.prefix_mask) + [0] * len(first)) :]
            self.engine.add_request(
                str(w.sample_id),
                w.prompt_tokens,
                prefix,
                logprobs,
                max_new_tokens=budget,
                seed=w.sample_id,
            )
        now = time.monotonic()
        for c in out.commands:
            self.stats.commands += 1
            self.stats.command_wait_s += now - d.received_at
            if c.kind == "interrupt" and c.sample_id in self.held and self.held[c.sample_id].attempt == c.attempt:
                self._interrupt([c.sample_id])
            elif c.kind == "abort" and c.sample_id in self.held and self.held[c.sample_id].attempt == c.attempt:
                self.engine.abort([str(c.sample_id)])
                self._release(c.sample_id)
            elif c.kind == "pull":
                self._pull(c.target_version)

    def _handle(self, events: list) -> None:
        for e in events:
            if isinstance(e, FinishedEvent) and self.turns is not None:
                self._end_turn(int(e.sample_id), e)
            elif isinstance(e, FinishedEvent):
                self._queue(int(e.sample_id), e.tokens, e.logprobs, "finished", e.finish_reason)
                self.stats.finished += 1
            elif isinstance(e, PreemptedEvent) and engine_should_interrupt_preempted(e.waiting, self.phi_wait):
                # engine-side migration: a preempted sample would wait here; let routing move it
                self._interrupt([int(e.sample_id)])
                self.stats.migrated += 1
            elif isinstance(e, TokensEvent):
                self.stats.tokens += len(e.tokens)
                held = self.held.get(int(e.sample_id))
                if held is not None:
                    held.tokens.extend(e.tokens)
                    held.logprobs.extend(e.logprobs)

    def _end_turn(self, sid: int, e: FinishedEvent) -> None:
        """The turn goes to the environment; the instance holds the trajectory (no decode slot)
        until it answers."""
        held = self.held.get(sid)
        if held is None or self.turns is None:
            return
        held.ended, held.ended_version = e, self.engine.version
        self.turns.begin(sid, held.turn_prefix + list(e.tokens), time.monotonic())

    def _answer_turns(self) -> None:
        """Environments that answered: each trajectory ends (done, or no room for another
        turn) or goes back to the queue with the observation appended."""
        assert self.turns is not None
        for sid in list(self.turns.calls):
            held = self.held.get(sid)
            if held is None or held.ended is None:
                self.turns.forget(sid)
                continue
            try:
                turn = self.turns.answer(sid, time.monotonic())
            except EnvFailed as x:
                self._queue(sid, held.ended.tokens, held.ended.logprobs, "partial", None, held.ended_version)
                self._drop(sid, x)  # what was generated is kept
                continue
            if turn is not None:
                self._turn_answered(sid, held, held.ended, turn)

    def _turn_answered(self, sid: int, held: _Held, e: FinishedEvent, turn: Turn) -> None:
        v = held.ended_version  # the turn's segment: the version that generated it
        # the next turn needs room for a token after the observation, in the run's response
        # limit and in the engine's context (a trajectory never ends on an observation)
        room = held.budget - len(e.tokens) - len(turn.observation)
        max_seq = getattr(self.engine, "max_seq", None)
        context = held.prompt_len + held.prefix_len + len(e.tokens) + len(turn.observation)
        if turn.step.done or e.finish_reason == "length" or room <= 0 or (max_seq and context >= max_seq):
            self._queue(sid, e.tokens, e.logprobs, "finished", e.finish_reason, v)
            self.stats.finished += 1
            return
        self._queue(sid, e.tokens, e.logprobs, "partial", None, v)
        self._observe(sid, turn.observation, "interrupted")
        self._release(sid)
        self.stats.turns += 1

    def _observe(self, sid: int, tokens: list[int], kind: str) -> None:
        """Queue an environment observation: not generated (no version, loss mask 0)."""
        held = self.held[sid]
        self.pending.append(
            {
                "sample_id": sid,
                "attempt": held.attempt,
                "route_token": held.route_token,
                "version": None,
                "tokens": list(tokens),
                "logprobs": [],
                "kind": kind,
                "finish_reason": None,
                "generated": False,
            }
        )
        self._due = min(self._due, time.monotonic())  # the trajectory waits for it: the report timer

    def _drop(self, sid: int, err: EnvFailed) -> None:
        """Drop a trajectory whose environment failed, with the reason, through the API (after
        what is pending for it: the route must still hold). A lost route drops nothing."""
        held = self.held.get(sid)
        if held is None:
            return
        log.warning("sample %d: dropping its trajectory (%s)", sid, err)
        self._flush(force=True)
        try:
            self.client.drop_trajectories(
                self.run_id, self._instance, [(sid, held.attempt, held.route_token)], err.reason
            )
            self.stats.env_dropped += 1
        except Conflict:
            self.stats.lost += 1
        self.engine.abort([str(sid)])
        self._release(sid)

    def _release(self, sid: int) -> None:
        """The sample is no longer this instance's to generate."""
        self.held.pop(sid, None)
        if self.turns is not None:
            self.turns.forget(sid)

    def _interrupt(self, sample_ids: list[int]) -> None:
        # a trajectory waiting for its environment is not in the engine: it goes back to the
        # queue when the environment answers
        for p in self.engine.interrupt([str(s) for s in sample_ids]):
            self._queue(int(p.sample_id), p.tokens, p.logprobs, "interrupted", None)
            self.stats.interrupted += 1

    def _queue(
        self, sid: int, tokens: list[int], logprobs: list[float], kind: str, reason: str | None, v: int | None = None
    ) -> None:
        """Queue what is new since the last checkpoint of this stretch as one segment, at
        version `v` (None: the engine's)."""
        held = self.held.get(sid)
        if held is None:
            return
        version = self.engine.version if v is None else v
        new_t, new_lp = tokens[held.reported :], logprobs[held.reported :]
        last = next((r for r in reversed(self.pending) if r["sample_id"] == sid), None)
        if (
            last is not None
            and last["kind"] == "partial"
            and last["attempt"] == held.attempt
            and last["version"] == version
            and (self.checkpoint_tokens <= 0 or len(last["tokens"]) + len(new_t) <= self.checkpoint_tokens)
        ):
            # one report per sample per batch: extend the unsent checkpoint instead, up to a
            # checkpoint's tokens (a row stays within the size the segments table keeps whole in
            # its heap); past them a segment of its own, sent in the next call
            last["tokens"] += list(new_t)
            last["logprobs"] += list(new_lp)
            last["kind"], last["finish_reason"] = kind, reason
        else:
            self.pending.append(
                {
                    "sample_id": sid,
                    "attempt": held.attempt,
                    "route_token": held.route_token,
                    "version": version,
                    "tokens": list(new_t),
                    "logprobs": list(new_lp),
                    "kind": kind,
                    "finish_reason": reason,
                }
            )
        now = time.monotonic()
        slack = 0.0
        if kind == "finished":
            slack = min(self.finish_slack_max_s, self.finish_slack_share * (now - held.started))
            self._finished_at[sid] = now
        self._due = min(self._due, now + slack)
        if kind == "partial":
            held.reported += len(new_t)
        else:
            self._release(sid)

    def _checkpoint_due(self, since: float, share: float) -> bool:
        """Whether `share` of a checkpoint's bound is reached: a stretch's unsent tokens or the
        time since the last checkpoint (0 turns either bound off)."""
        if self.checkpoint_every_s > 0 and since >= self.checkpoint_every_s * share:
            return True
        if self.checkpoint_tokens <= 0:
            return False
        unsent = max((len(h.tokens) - h.reported for h in self.held.values() if h.ended is None), default=0)
        return unsent >= self.checkpoint_tokens * share

    def _checkpoint(self) -> None:
        """Partial segments for long stretches: after a crash the queue resumes from here."""
        self._last["checkpoint"] = time.monotonic()
        for sid, held in list(self.held.items()):
            if held.ended is None and len(held.tokens) > held.reported:  # an ended turn goes out once answered
                self._queue(sid, held.tokens, held.logprobs, "partial", None)

    def _flush(self, force: bool = False) -> None:
        if self.node is not None:
            self._hand(force)
            return
        if not self.pending or (not force and time.monotonic() < self._reports_due()):
            return
        pending, self.pending = self.pending, []
        self._sending(pending)
        snapshot: dict[str, Any] | None = None
        while pending:
            # one report per sample per batch: a turn and its observation go in two, in order
            batch: list[dict] = []
            later: list[dict] = []
            seen: set[int] = set()
            for r in pending:
                (later if r["sample_id"] in seen else batch).append(r)
                seen.add(r["sample_id"])
            if not later and self._snapshot_due():  # on the last call: after every segment queued
                snapshot = self._snapshot()
            while batch:
                try:
                    self.client.report(self.run_id, self._instance, batch, snapshot if not later else None)
                    break
                except Conflict as e:  # lost routes: drop those samples, send the rest
                    lost = {item["id"] for item in e.items}
                    if not lost:
                        raise
                    self.stats.lost += len({r["sample_id"] for r in batch if r["sample_id"] in lost})
                    for sid in lost:
                        if sid in self.held:
                            self.engine.abort([str(sid)])
                            self._release(sid)
                    batch = [r for r in batch if r["sample_id"] not in lost]
                    later = [r for r in later if r["sample_id"] not in lost]
            pending = later
        self._last["report"] = time.monotonic()
        if snapshot is not None:
            self._sent_snapshot(snapshot)
        else:
            self._owed = True

    def _reports_due(self) -> float:
        """When pending reports go: once the earliest is due (a finish waits out its slack) and
        this worker's report timer allows, on a node the node's."""
        timer = self.node.due_at if self.node is not None else self._last["report"] + self.report_every_s
        return max(timer, self._due)

    def _sending(self, batch: list[dict]) -> None:
        """`batch` leaves `pending`: what is left falls due at once (it waited its turn)."""
        now = time.monotonic()
        for r in batch:
            ended = self._finished_at.pop(r["sample_id"], None) if r["kind"] == "finished" else None
            if ended is not None:
                self.stats.finish_wait_s += now - ended
        self._due = now if self.pending else math.inf

    def _hand(self, force: bool) -> None:
        """On a node: hand the pending reports to its flush when the node's report timer is due,
        a flush asks for them, or `force` (then sent at once, waiting for the outcome). One
        segment per sample per flush: the rest waits for the next."""
        assert self.node is not None
        asked = self.node.asked(self)
        if not force and not asked and not (self.pending and time.monotonic() >= self._reports_due()):
            return
        while True:
            batch: list[dict] = []
            later: list[dict] = []
            seen: set[int] = set()
            for r in self.pending:
                (later if r["sample_id"] in seen else batch).append(r)
                seen.add(r["sample_id"])
            self.pending = later
            self._sending(batch)
            # the snapshot rides a flush once 80% due, as a checkpoint does: no heartbeat of its own later
            rides = self._snapshot_due(CHECKPOINT_RIDES_AT)
            snapshot = self._snapshot() if batch and not later and rides else None
            part = Part(self, self._instance, batch, snapshot) if batch else None
            # an owed snapshot, or progress unsent for 80% of `snapshot_every_s`, rides as this
            # flush's heartbeat: no flush of its own for it later
            stale = (
                bool(self.held)
                and time.monotonic() - self._last["snapshot"] >= self.snapshot_every_s * CHECKPOINT_RIDES_AT
            )
            if not batch and rides and (self._owed or stale):
                snapshot = self._snapshot()
                beat = {"version": self.engine.stats().version, "snapshot": snapshot, "lease_seconds": self.lease_s}
                part = Part(self, self._instance, heartbeat=beat)
                self._last["heartbeat"] = time.monotonic()
            self.node.hand(self, part, force)
            if batch:
                self._last["report"] = time.monotonic()
            if snapshot is not None:
                self._sent_snapshot(snapshot)
            elif batch:
                self._owed = True
            if not (force and self.pending):
                return
            for d in self._inbox.get(0.0) if self._inbox is not None else []:  # lost routes first
                self._deliver(d)

    def _settled(self, s: Settled | Wake) -> None:
        """A refused part of a node's flush: its lost routes drop their samples; a fenced
        instance registers again."""
        if not isinstance(s, Settled) or s.instance_id != self.instance_id:
            return  # a wake-up, or a part of an instance given up since
        if s.fenced:
            self._register_again()
            return
        self.stats.lost += len(s.lost)
        for sid in s.lost:
            if sid in self.held:
                self.engine.abort([str(sid)])
                self._release(sid)
        self.pending = [r for r in self.pending if r["sample_id"] not in s.lost]
        if not self.pending:
            self._due = math.inf

    # ---- weights and snapshots --------------------------------------------------------------

    def _pull(self, target: int | None) -> None:
        """Interrupt everything (one version per segment), load new weights, resume via routing."""
        self._interrupt([int(s) for s in list(self.held)])
        self._flush(force=True)
        if self.weights is None:
            return
        self._heartbeat(pulling=True)
        state, version = self.weights(target)
        if version > self.engine.version:
            self.engine.load_weights(state, version)  # None: the engine pulls `version` itself
            self.stats.pulls += 1
            log.info("instance %s pulled version %s", self.instance_id, version)
        self._heartbeat()

    def _unpredictable(self) -> tuple[int, ...]:
        """What the coordinator cannot foresee from its own commands and our reports: samples
        the engine preempted to waiting, trajectories waiting for their environment, the version.
        (Routed samples taken in it counted when it routed them; finishes and interrupts travel
        with their report, and the snapshot with it.)"""
        s = self.engine.stats()
        env = 0
        if self.turns is not None:
            env = sum(1 for sid, h in self.held.items() if h.ended is not None and sid in self.turns.calls)
        return (s.waiting, env, s.version)

    def _heartbeat_due(self, now: float) -> bool:
        """A heartbeat goes alone only for what nothing else carried (see the module docstring)."""
        since = now - self._last["snapshot"]
        polled = self._inbox.last_poll if self._inbox is not None else 0.0
        if now - max(self._last["report"], self._last["heartbeat"], polled) >= self.lease_s / 2:
            return True  # no call at all for half a lease (a poll stuck in flight): renew it
        if since < self.heartbeat_s:
            return False
        return self._owed or self._unpredictable() != self._sent or (since >= self.snapshot_every_s and bool(self.held))

    def _snapshot_due(self, rides: float = 1.0) -> bool:
        """Whether a report carries the snapshot: at most one a `heartbeat_s` (as heartbeats once
        did), sooner for an unpredictable change. A report without one takes the instance row
        only FOR SHARE (a renewal aside), so it never waits on a route to the instance. `rides`:
        the share of `heartbeat_s` that is enough (a node's flush takes it along sooner)."""
        since = time.monotonic() - self._last["snapshot"]
        return since >= self.heartbeat_s * rides or self._unpredictable() != self._sent

    def _sent_snapshot(self, snapshot: dict[str, Any]) -> None:
        self._last["snapshot"], self._owed = time.monotonic(), False
        self._sent = self._unpredictable()

    def _heartbeat(self, pulling: bool = False) -> None:
        snapshot = self._snapshot(pulling)
        if self.node is not None:  # its outcome comes back as a Settled (fenced: register again)
            heartbeat = {"version": self.engine.stats().version, "snapshot": snapshot, "lease_seconds": self.lease_s}
            self.node.hand(self, Part(self, self._instance, heartbeat=heartbeat))
            self._last["heartbeat"] = time.monotonic()
            self._sent_snapshot(snapshot)
            return
        try:
            self.client.heartbeat(self.run_id, self._instance, self.engine.stats().version, snapshot, self.lease_s)
        except Conflict:
            self._register_again()
        self._last["heartbeat"] = time.monotonic()
        self._sent_snapshot(snapshot)

    def _snapshot(self, pulling: bool = False) -> dict[str, Any]:
        """What the coordinator reads: the engine's load, per-sample progress, the capacity."""
        s = self.engine.stats()
        # the engine's counts leave out trajectories waiting for their environment: it finished them
        snapshot: dict[str, Any] = {
            "running": s.running,
            "waiting": s.waiting,
            "kv_used": s.kv_tokens,
            # engines count prompt + response; the snapshot carries response tokens
            "running_samples": [
                self._progress(int(k), max(0, v - self.held[int(k)].prompt_len))
                for k, v in s.running_tokens.items()
                if int(k) in self.held
            ],
            "capacity": self.engine.capacity().model_dump(),
            "throughput": s.tokens_per_s,
            "pulling": pulling,
            "routed_seen": self.stats.routed,
        }
        if self.turns is not None:
            now = time.monotonic()
            env = [(sid, h) for sid, h in self.held.items() if h.ended is not None and sid in self.turns.calls]
            snapshot["running_samples"] += [
                self._progress(sid, h.prefix_len + len(h.ended.tokens), now - self.turns.calls[sid][1])
                for sid, h in env
                if h.ended is not None
            ]
            snapshot["env_waiting"] = len(env)
        return snapshot

    def _progress(self, sid: int, tokens: int, env_s: float | None = None) -> dict[str, Any]:
        """A trajectory's entry in the heartbeat: response tokens so far; multi-turn, also the
        current turn's and, while it waits for its environment, how long it has waited."""
        entry: dict[str, Any] = {"sample_id": sid, "tokens": tokens}
        if self.turns is not None:
            held = self.held[sid]
            entry["turn_tokens"] = max(0, len(held.turn_prefix) + tokens - held.prefix_len)
        if env_s is not None:
            entry["env_waited_s"] = round(env_s, 3)
        return entry

    def _register_again(self) -> None:
        """Fenced (lease lapsed or expired): the sweep requeues our samples; start over as a new instance."""
        log.warning("instance %s lost its lease; registering again", self.instance_id)
        self.engine.abort([str(k) for k in self.held])
        for sid in list(self.held):
            self._release(sid)
        self.pending.clear()
        self._due = math.inf
        self._finished_at.clear()
        self.instance_id = self.client.register(
            self.run_id, self.name, self.engine.version, self.lease_s, capacity=self.engine.capacity()
        ).instance_id
        self._last["heartbeat"] = self._last["snapshot"] = time.monotonic()
