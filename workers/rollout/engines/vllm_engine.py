"""The `vllm` rollout engine: a small adapter from vLLM's async engine (V1 `AsyncLLM`) to our Engine.

vLLM is an optional extra for GPU hosts (`pip install 'staleflow[vllm]'`, see pyproject for the
pin) and is imported lazily: this module imports without it, and constructing the engine
without it raises VLLMUnavailable with that instruction. Written against vLLM 0.33; every call
below exists unchanged in the pinned 0.32.

How the interface maps:
  * add_request -> `AsyncLLM.add_request(request_id, tokens_input(prompt + prefix),
    SamplingParams(max_tokens, seed, logprobs=0, output_kind=DELTA, detokenize=False))` on a
    private event-loop thread, then a task that drains the request's output collector. Each
    stretch gets a fresh request id, because vLLM may still hold an aborted id for a moment.
    The engine runs with `logprobs_mode="processed_logprobs"`: log-probs of the distribution
    actually sampled (after temperature), which is what the trainer's TIS weights expect.
  * step -> drain the outputs that arrived (waiting up to `poll_s` when there are none):
    deltas become TokensEvents, vLLM's finish reasons FinishedEvents (stop -> "eos"; "length"
    with no token at all -> "capacity": the prompt was never scheduled; vLLM's own "abort",
    "error" and "repetition" pass through under those names, see base.FINISH_REASONS). A
    request vLLM refuses or fails alone ends as "error" too; a dead engine raises from step().
  * interrupt/abort -> mark the stretch stopping and `abort` it once vLLM has registered it
    (a stretch still being registered aborts itself right after), then wait for its task to
    end: vLLM's final "abort" output carries the tokens not yet read, which the partial keeps.
  * load_weights / load_from_ps -> the vLLM workers pull the version from the parameter
    server themselves (the worker extension below), streamed in buckets into `reload_weights`
    (vLLM's post-load processing runs): rank 0 of the tensor-parallel group receives and
    broadcasts each bucket to the other ranks (tp_pull), so the PS sends the model once per
    instance and each GPU holds one bucket beside the model; tensors passed through
    `collective_rpc` would arrive as plain lists (vLLM's msgpack decodes them untyped). Around it generation is paused with
    `mode="keep", clear_cache=True`: running requests are preempted (recomputed on the new
    weights when resumed) and the prefix cache emptied, so no K/V of the old weights is reused.
  * stats -> a stat logger records vLLM's scheduler stats (running, waiting, KV usage).
  * capacity -> the scheduler config's max_num_seqs and the KV cache's num_gpu_blocks x
    block_size from the cache config (set once vLLM has profiled the GPU, before we register).
Not available: PreemptedEvent. vLLM preempts and recomputes internally and does not say
which request it preempted, so φ_wait migration inside the engine does not apply.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import queue
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from workers.rollout.engines.base import (
    Engine,
    EngineEvent,
    EngineStats,
    FinishedEvent,
    Partial,
    TokensEvent,
    request_context,
)
from workers.wire.models.rollout import Capacity

INSTALL_HINT = "the vllm engine needs vLLM on a GPU host: pip install 'staleflow[vllm]'"
# vLLM's finish reason -> ours; "abort" of a stretch we stopped ourselves is no finish at all
VLLM_FINISH_REASONS = {
    "stop": "eos",
    "length": "length",
    "abort": "abort",
    "error": "error",
    "repetition": "repetition",
}
EXTENSION = f"{__name__}.StaleFlowWorkerExtension"
log = logging.getLogger("staleflow.rollout.vllm")
STOP_TIMEOUT_S = 30.0  # how long interrupt() waits for vLLM's final output of a stopped stretch


class VLLMUnavailable(ImportError):
    """vLLM is not installed (it is an optional extra for GPU hosts)."""


def import_vllm() -> Any:
    try:
        import vllm
    except ImportError as e:
        raise VLLMUnavailable(f"{INSTALL_HINT} ({e})") from e
    return vllm


def sampled_logprobs(logprobs: Any, token_ids: Sequence[int]) -> list[float]:
    """The sampled tokens' log-probs from vLLM's per-position {token_id: Logprob} maps."""
    if logprobs is None:
        raise ValueError("vLLM returned no log-probs: SamplingParams(logprobs=0) is required")
    return [float(logprobs[i][t].logprob) for i, t in enumerate(token_ids)]


def engine_args(model: str, *, max_num_seqs: int = 256, **engine_kwargs: Any) -> Any:
    """vLLM's AsyncEngineArgs for `model`: `engine_kwargs` (the engine config, checked by
    engine_config.check_vllm) plus our worker extension and sampled-distribution log-probs
    unless the config sets `logprobs_mode`."""
    vllm = import_vllm()
    engine_kwargs.setdefault("worker_extension_cls", EXTENSION)
    engine_kwargs.setdefault("logprobs_mode", "processed_logprobs")
    return vllm.AsyncEngineArgs(model=model, max_num_seqs=max_num_seqs, **engine_kwargs)


@dataclass
class Stretch:
    """One add_request..finish/interrupt stretch of a sample, as vLLM request `request_id`."""

    sample_id: str
    request_id: str
    context_len: int  # prompt + prefix tokens
    prefix_len: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    done: bool = False  # vLLM sent its last output
    reported: bool = False  # a FinishedEvent went out: interrupt() returns no partial for it
    stopping: bool = False  # we aborted it (interrupt/abort): its "abort" finish is ours
    registered: bool = False  # vLLM knows the id: abort() reaches it (set on the loop thread)
    task: Any = None  # the concurrent.futures.Future of its drain task

    def absorb(self, out: Any) -> list[EngineEvent]:
        """Events for one RequestOutput (DELTA kind: only the new tokens)."""
        comp = out.outputs[0]
        new = [int(t) for t in comp.token_ids]
        lps = sampled_logprobs(comp.logprobs, new) if new else []
        self.tokens += new
        self.logprobs += lps
        events: list[EngineEvent] = [TokensEvent(self.sample_id, new, lps)] if new else []
        if out.finished:
            self.done = True
            fin = self.finish(comp.finish_reason)
            if fin is not None:
                events.append(fin)
        return events

    def finish(self, vllm_reason: Any) -> FinishedEvent | None:
        reason = str(vllm_reason)  # vLLM's FinishReason prints as its name
        if reason == "abort" and self.stopping:
            return None
        ours = VLLM_FINISH_REASONS.get(reason, reason)
        if ours == "length" and not self.tokens:
            # a request vLLM never scheduled (its prompt does not fit) ends as "length" with
            # no token; max_tokens >= 1 rules out every other way to get there
            ours = "capacity"
        self.reported = True
        return FinishedEvent(self.sample_id, list(self.tokens), list(self.logprobs), ours, self.prefix_len)


@dataclass(frozen=True)
class _Failed:
    request_id: str
    error: BaseException


class VLLMEngine(Engine):
    def __init__(
        self,
        model: str,
        *,
        version: int = 0,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_num_seqs: int = 256,
        poll_s: float = 0.01,
        ps_addr: str | None = None,
        **engine_kwargs: Any,
    ):
        """`ps_addr` (HOST:PORT): the parameter server every vLLM worker pulls weights from;
        without it the engine serves the weights in `model` and load_weights refuses."""
        vllm = import_vllm()
        from vllm.inputs import tokens_input
        from vllm.sampling_params import RequestOutputKind

        args = engine_args(model, max_num_seqs=max_num_seqs, **engine_kwargs)
        self._start(
            lambda: self._create(args),
            vllm.SamplingParams,
            tokens_input,
            RequestOutputKind.DELTA,
            version=version,
            temperature=temperature,
            top_p=top_p,
            poll_s=poll_s,
            ps_addr=ps_addr,
        )

    def _start(
        self,
        create: Any,
        sampling_params: Any,
        tokens_input: Any,
        delta: Any,
        *,
        version: int,
        temperature: float,
        poll_s: float,
        ps_addr: str | None,
        top_p: float = 1.0,
    ) -> None:
        """Everything but importing vLLM: the event-loop thread, the engine that `create()`
        builds on it, our bookkeeping. Unit tests pass stand-ins for vLLM's names here."""
        self._SamplingParams, self._tokens_input, self._DELTA = sampling_params, tokens_input, delta
        self._version, self.temperature, self.poll_s, self.ps_addr = version, temperature, poll_s, ps_addr
        self.top_p = top_p  # the run's; processed log-probs are then of the truncated distribution
        # the workers' PS key (workers/trainer/param_auth.py), as plain values: collective_rpc
        # carries msgpack; None for a PS that authenticates nobody
        self.ps_credentials: list | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-loop", daemon=True)
        self._thread.start()
        self._sched: Any = None  # the latest SchedulerStats, set by the stat logger
        self._preempted = 0
        self._llm = self._call(create())
        self._max_len = int(self._llm.vllm_config.model_config.max_model_len)
        self._outputs: queue.Queue = queue.Queue()
        self._live: dict[str, Stretch] = {}  # sample id -> running stretch
        self._by_request: dict[str, Stretch] = {}
        self._pending: list[EngineEvent] = []
        self._ids = itertools.count()
        self._recent: collections.deque[tuple[float, int]] = collections.deque(maxlen=256)

    # ---- event-loop plumbing -----------------------------------------------------------------
    def _call(self, coro: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _create(self, args: Any) -> Any:
        from vllm.v1.engine.async_llm import AsyncLLM

        return AsyncLLM.from_engine_args(args, stat_loggers=[self._stat_logger()])

    def _stat_logger(self) -> type:
        """A vLLM stat-logger class that keeps the latest scheduler stats for stats()."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        engine = self

        class _Stats(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0):
                pass

            def record(self, scheduler_stats: Any = None, iteration_stats: Any = None, *a: Any, **kw: Any) -> None:
                if scheduler_stats is not None:
                    engine._sched = scheduler_stats
                engine._preempted += int(getattr(iteration_stats, "num_preempted_reqs", 0) or 0)

            def log_engine_initialized(self) -> None:
                pass

        return _Stats

    async def _run(self, st: Stretch, context: list[int], params: Any) -> None:
        """Register the stretch's request with vLLM, then move its outputs to self._outputs."""
        try:
            q = await self._llm.add_request(st.request_id, self._tokens_input(context), params)
            st.registered = True
            if st.stopping:  # interrupted while vLLM was registering it: it must not run on
                await self._llm.abort(st.request_id)
            while True:
                out = q.get_nowait() or await q.get()
                self._outputs.put(out)
                if out.finished:
                    return
        except asyncio.CancelledError:
            raise
        except Exception as e:  # surfaced by the next step()
            if st.registered:
                await self._llm.abort(st.request_id)
            self._outputs.put(_Failed(st.request_id, e))

    async def _stop(self, stretches: list[Stretch]) -> None:
        """Abort the stretches and wait until vLLM's last output of each is in self._outputs."""
        for st in stretches:
            st.stopping = True
        registered = [st.request_id for st in stretches if st.registered]
        if registered:
            await self._llm.abort(registered)
        tasks = [asyncio.wrap_future(st.task) for st in stretches if st.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=STOP_TIMEOUT_S)

    def _pump(self, block: bool) -> None:
        """Move arrived outputs into events (buffered in self._pending)."""
        try:
            item = self._outputs.get(timeout=self.poll_s) if block else self._outputs.get_nowait()
        except queue.Empty:
            return
        while True:
            st = self._by_request.get(item.request_id)
            if isinstance(item, _Failed):
                if self._llm.errored:  # the engine is dead: nothing more will come
                    raise RuntimeError(f"vLLM request {item.request_id} failed: {item.error!r}") from item.error
                # one request refused or failed (e.g. a validation error): it ends as "error",
                # rather than stopping the worker, which would be handed the same sample again
                log.warning("vLLM request %s failed: %r", item.request_id, item.error)
                if st is not None and not st.stopping:
                    st.done = True
                    self._pending += [fin for fin in [st.finish("error")] if fin is not None]
                    self._forget(st)
            elif st is not None:  # else: interrupted or aborted meanwhile
                events = st.absorb(item)
                self._pending += events
                self._recent.append(
                    (time.monotonic(), sum(len(e.tokens) for e in events if isinstance(e, TokensEvent)))
                )
                if st.done:
                    self._forget(st)
            try:
                item = self._outputs.get_nowait()
            except queue.Empty:
                return

    def _forget(self, st: Stretch) -> None:
        self._by_request.pop(st.request_id, None)
        if self._live.get(st.sample_id) is st:
            del self._live[st.sample_id]

    # ---- interface --------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    def add_request(
        self,
        sample_id: str,
        prompt_tokens: Sequence[int],
        prefix_tokens: Sequence[int] = (),
        prefix_logprobs: Sequence[float] = (),
        max_new_tokens: int = 256,
        seed: int = 0,
    ) -> None:
        context = request_context(sample_id in self._live, sample_id, prompt_tokens, prefix_tokens)
        if len(context) >= self._max_len or max_new_tokens <= 0:
            self._pending.append(FinishedEvent(sample_id, [], [], "length", len(prefix_tokens)))
            return
        st = Stretch(sample_id, f"{sample_id}#{next(self._ids)}", len(context), len(prefix_tokens))
        params = self._SamplingParams(
            n=1,
            temperature=self.temperature,
            top_p=self.top_p,
            max_tokens=min(max_new_tokens, self._max_len - len(context)),
            seed=seed,
            logprobs=0,
            output_kind=self._DELTA,
            detokenize=False,
        )
        self._live[sample_id] = self._by_request[st.request_id] = st
        st.task = asyncio.run_coroutine_threadsafe(self._run(st, context, params), self._loop)

    def step(self) -> list[EngineEvent]:
        self._pump(block=not self._pending)
        events, self._pending = self._pending, []
        return events

    def interrupt(self, sample_ids: Sequence[str]) -> list[Partial]:
        live = [self._live[s] for s in sample_ids if s in self._live]
        if live:
            self._call(self._stop(live))
        self._pump(block=False)  # everything up to vLLM's final output belongs to the stretch
        out = []
        for st in live:
            self._forget(st)
            if not st.reported:  # a finish that raced the interrupt is reported as a finish
                out.append(Partial(st.sample_id, list(st.tokens), list(st.logprobs), st.prefix_len))
        # the partials hold every token: unread TokensEvents would otherwise reach the caller
        # after the partial, or be taken for a new stretch of the same sample
        stopped = {p.sample_id for p in out}
        self._pending = [e for e in self._pending if e.sample_id not in stopped]
        return out

    def abort(self, sample_ids: Sequence[str]) -> None:
        live = [self._live[s] for s in sample_ids if s in self._live]
        if live:
            self._call(self._stop(live))
        for st in live:
            self._forget(st)
        dropped = set(sample_ids)
        self._pending = [e for e in self._pending if e.sample_id not in dropped]

    def load_weights(self, state_dict: Mapping[str, Any] | None, version: int) -> None:
        """Install `version` from the parameter server (the latest committed one if the PS
        does not serve it). `state_dict` is not used: the workers pull the weights themselves,
        so the caller need not hold them (the CLI's weight source for this engine passes None)."""
        self.load_from_ps(version)

    def load_from_ps(self, version: int | None = None, wait_s: float = 0.0) -> int:
        """Every vLLM worker pulls `version` (the latest committed if None or not served) from
        the PS at `ps_addr` and installs it; returns the version loaded. `wait_s`: how long to
        wait for a PS that is not up or has nothing committed yet (the first load)."""
        if self.ps_addr is None:
            raise RuntimeError("the vllm engine loads weights from a parameter server: pass ps_addr")
        self._version = int(self._call(self._reload(self.ps_addr, version, wait_s)))
        return self._version

    async def _reload(self, addr: str, version: int | None, wait_s: float) -> int:
        # "keep" freezes running requests; clear_cache preempts them (they are recomputed on
        # the new weights when resumed) and empties the prefix cache, or vLLM raises
        await self._llm.pause_generation(mode="keep", clear_cache=True)
        try:
            args = (addr, version, wait_s, self.ps_credentials, self.bucket_bytes)
            got = await self._llm.collective_rpc("staleflow_pull", args=args)
            if len(set(got)) > 1:  # pipeline stages (one pull each) raced a commit: all load the newest
                args = (addr, max(got), wait_s, self.ps_credentials, self.bucket_bytes)
                got = await self._llm.collective_rpc("staleflow_pull", args=args)
            if not await self._llm.reset_prefix_cache():
                raise RuntimeError("vLLM kept prefix-cache blocks of the old weights")
        finally:
            await self._llm.resume_generation()
        return int(got[0])

    def capacity(self) -> Capacity:
        """vLLM's running slots and its KV cache in tokens: max_num_seqs per data-parallel
        engine, and the blocks vLLM allocated after profiling (summed over those engines)
        times tokens per block."""
        config = self._llm.vllm_config
        cache = config.cache_config
        dp = int(getattr(getattr(config, "parallel_config", None), "data_parallel_size", 1) or 1)
        return Capacity(
            max_running=int(config.scheduler_config.max_num_seqs) * dp,
            kv_capacity=int(cache.num_gpu_blocks or 0) * int(cache.block_size or 0),
        )

    def stats(self) -> EngineStats:
        capacity = self.capacity().kv_capacity
        s = self._sched
        usage = float(getattr(s, "kv_cache_usage", 0.0) or 0.0)
        now = time.monotonic()
        recent = [(t, n) for t, n in self._recent if now - t <= 5.0]
        span = now - recent[0][0] if recent else 0.0
        return EngineStats(
            version=self._version,
            running=int(getattr(s, "num_running_reqs", len(self._live))),
            waiting=int(getattr(s, "num_waiting_reqs", 0)),
            kv_tokens=round(usage * capacity),
            running_tokens={sid: st.context_len + len(st.tokens) for sid, st in self._live.items()},
            tokens_per_s=sum(n for _, n in recent) / span if span > 0 else 0.0,
            preemptions=self._preempted,
        )

    def has_work(self) -> bool:
        return bool(self._live or self._pending)

    def shutdown(self) -> None:
        self._llm.shutdown()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


class StaleFlowWorkerExtension:
    """Mixed into every vLLM worker (`worker_extension_cls`); called via collective_rpc."""

    def staleflow_pull(
        self,
        addr: str,
        version: int | None,
        wait_s: float = 0.0,
        credentials: list | None = None,
        bucket_bytes: int | None = None,
    ) -> int:
        """Stream `version` from the PS (the latest committed one if it does not serve it: not
        committed yet, or dropped for a newer one) into this worker's model, bucket by bucket:
        rank 0 of the tensor-parallel group pulls and broadcasts each bucket to the others
        (tp_pull). `credentials`: [run id, role, key hex] (VLLMEngine.ps_credentials);
        `bucket_bytes`: what a rank holds at a time (None: the client's default). Returns the
        version installed."""
        from workers.rollout.engines.tp_pull import pull_shared
        from workers.trainer.param_auth import PSCredentials
        from workers.trainer.param_client import ParamClient

        creds = (
            None
            if credentials is None
            else PSCredentials(credentials[0], credentials[1], bytes.fromhex(credentials[2]))
        )
        kw = {} if bucket_bytes is None else {"bucket_bytes": int(bucket_bytes)}

        def pull(load: Any) -> int:
            pc = ParamClient(addr, retry_for=wait_s, credentials=creds)  # rides through a PS that is not up yet
            got, _ = pc.pull_served(load, version, wait_s=wait_s, device=self.device, **kw)  # type: ignore[attr-defined]
            return got

        return pull_shared(_tp_group(), pull, self._staleflow_install, self.device)  # type: ignore[attr-defined]

    def _staleflow_install(self, version: int, tensors: Iterator[tuple[str, Any]]) -> None:
        # clones: vLLM's in-place reload keeps a layer's tensors until the layer is complete,
        # while the bucket they come from is reused for the next one (a layer's tensors are
        # adjacent in the PS's name order, so about one layer is held beside the bucket)
        weights = ((name, t.clone()) for name, t in tensors)
        if hasattr(self, "reload_weights"):  # the worker's own path: post-load processing runs
            self.reload_weights(weights_iterator=weights)
        else:
            self.model_runner.model.load_weights(weights=weights)  # type: ignore[attr-defined]


def _tp_group() -> Any:
    """This worker's tensor-parallel group (vLLM's GroupCoordinator); None outside vLLM."""
    try:
        from vllm.distributed import parallel_state
    except ImportError:
        return None
    return parallel_state.get_tp_group() if parallel_state.model_parallel_is_initialized() else None
