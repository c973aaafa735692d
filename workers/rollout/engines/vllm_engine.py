"""The `vllm` rollout engine: a small adapter from vLLM's public async engine to our Engine.

vLLM is an optional extra for GPU hosts (`pip install 'staleflow[vllm]'`) and is imported
lazily: this module imports without it, and constructing the engine without it raises
VLLMUnavailable with that instruction.

How the interface maps (vLLM >= 0.8, V1 engine; `AsyncLLMEngine` is AsyncLLM there):
  * add_request -> `generate(TokensPrompt(prompt + prefix), SamplingParams(max_tokens,
    seed, logprobs=0, output_kind=DELTA, detokenize=False), request_id)` on a private
    event-loop thread; each stretch gets a fresh request id, because vLLM may still hold
    an aborted id for a moment.
  * step -> drain the outputs that arrived (waiting up to `poll_s` when there are none):
    deltas become TokensEvents, finish "stop"/"length" a FinishedEvent ("eos"/"length").
    `logprobs=0` returns the sampled token's log-prob only. For temperatures other than 1
    pass `logprobs_mode="processed_logprobs"` (vLLM >= 0.10.2) so they are of the sampling
    distribution, which is what the trainer's TIS weights expect.
  * interrupt/abort -> `abort(request_id)`; an interrupt returns the tokens seen so far.
  * load_weights -> `collective_rpc("staleflow_load_weights", ...)` into every worker via
    the worker extension below (vLLM's RLHF recipe), then `reset_prefix_cache()` so no new
    request reuses K/V computed by the old weights. `load_from_ps` instead has each worker
    pull from the parameter server itself (NCCL straight to the GPU for a PS started with
    `--backend nccl`), which is the path for models too large to ship over the RPC pipe.
  * stats -> a stat logger records vLLM's scheduler stats (running, waiting, KV usage).
Not available: PreemptedEvent. vLLM preempts and recomputes internally and does not say
which request it preempted, so φ_wait migration inside the engine does not apply.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from workers.rollout.engines.base import Engine, EngineEvent, EngineStats, FinishedEvent, Partial, TokensEvent

INSTALL_HINT = "the vllm engine needs vLLM on a GPU host: pip install 'staleflow[vllm]'"
FINISH_REASONS = {"stop": "eos", "length": "length"}  # vLLM's "abort" is ours: no event
EXTENSION = f"{__name__}.StaleFlowWorkerExtension"


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


@dataclass
class Stretch:
    """One add_request..finish/interrupt stretch of a sample, as vLLM request `request_id`."""

    sample_id: str
    request_id: str
    context_len: int  # prompt + prefix tokens
    prefix_len: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finished: bool = False

    def absorb(self, out: Any) -> list[EngineEvent]:
        """Events for one RequestOutput (DELTA kind: only the new tokens)."""
        comp = out.outputs[0]
        new = [int(t) for t in comp.token_ids]
        lps = sampled_logprobs(comp.logprobs, new) if new else []
        self.tokens += new
        self.logprobs += lps
        events: list[EngineEvent] = [TokensEvent(self.sample_id, new, lps)] if new else []
        if out.finished:
            self.finished = True
            reason = FINISH_REASONS.get(comp.finish_reason)
            if reason is not None:
                events.append(
                    FinishedEvent(self.sample_id, list(self.tokens), list(self.logprobs), reason, self.prefix_len)
                )
        return events


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
        max_num_seqs: int = 256,
        poll_s: float = 0.01,
        **engine_kwargs: Any,
    ):
        vllm = import_vllm()
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        self._vllm, self._TokensPrompt, self._DELTA = vllm, TokensPrompt, RequestOutputKind.DELTA
        self._version, self.temperature, self.poll_s = version, temperature, poll_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-loop", daemon=True)
        self._thread.start()
        engine_kwargs.setdefault("worker_extension_cls", EXTENSION)
        args = vllm.AsyncEngineArgs(model=model, max_num_seqs=max_num_seqs, **engine_kwargs)
        self._sched: Any = None  # the latest SchedulerStats, set by the stat logger
        self._preempted = 0
        self._llm = self._call(self._create(args))
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
        engine = self
        try:
            from vllm.v1.metrics.loggers import StatLoggerBase
        except ImportError:  # an engine without V1 stat loggers: stats() falls back to our counts
            return self._vllm.AsyncLLMEngine.from_engine_args(args)

        class _Stats(StatLoggerBase):  # keeps the latest scheduler stats for stats()
            def __init__(self, vllm_config: Any, engine_index: int = 0):
                pass

            def record(self, scheduler_stats: Any = None, iteration_stats: Any = None, *a: Any, **kw: Any) -> None:
                if scheduler_stats is not None:
                    engine._sched = scheduler_stats
                engine._preempted += int(getattr(iteration_stats, "num_preempted_reqs", 0) or 0)

            def log_engine_initialized(self) -> None:
                pass

        return self._vllm.AsyncLLMEngine.from_engine_args(args, stat_loggers=[_Stats])

    async def _abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:  # one at a time: older vLLMs take a single id
            await self._llm.abort(rid)

    async def _generate(self, request_id: str, prompt: list[int], params: Any) -> None:
        try:
            async for out in self._llm.generate(self._TokensPrompt(prompt_token_ids=prompt), params, request_id):
                self._outputs.put(out)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # surfaced by the next step()
            self._outputs.put(_Failed(request_id, e))

    def _pump(self, block: bool) -> None:
        """Move arrived outputs into events (buffered in self._pending)."""
        try:
            item = self._outputs.get(timeout=self.poll_s) if block else self._outputs.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(item, _Failed):
                raise RuntimeError(f"vLLM request {item.request_id} failed: {item.error!r}") from item.error
            st = self._by_request.get(item.request_id)
            if st is not None:  # else: aborted or interrupted meanwhile
                events = st.absorb(item)
                self._pending += events
                self._recent.append(
                    (time.monotonic(), sum(len(e.tokens) for e in events if isinstance(e, TokensEvent)))
                )
                if st.finished:
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
        if sample_id in self._live:
            raise ValueError(f"sample {sample_id!r} already in the engine")
        if not prompt_tokens:
            raise ValueError("empty prompt")
        context = [int(t) for t in prompt_tokens] + [int(t) for t in prefix_tokens]
        if len(context) >= self._max_len or max_new_tokens <= 0:
            self._pending.append(FinishedEvent(sample_id, [], [], "length", len(prefix_tokens)))
            return
        st = Stretch(sample_id, f"{sample_id}#{next(self._ids)}", len(context), len(prefix_tokens))
        params = self._vllm.SamplingParams(
            n=1,
            temperature=self.temperature,
            max_tokens=min(max_new_tokens, self._max_len - len(context)),
            seed=seed,
            logprobs=0,
            output_kind=self._DELTA,
            detokenize=False,
        )
        self._live[sample_id] = self._by_request[st.request_id] = st
        asyncio.run_coroutine_threadsafe(self._generate(st.request_id, context, params), self._loop)

    def step(self) -> list[EngineEvent]:
        self._pump(block=not self._pending)
        events, self._pending = self._pending, []
        return events

    def interrupt(self, sample_ids: Sequence[str]) -> list[Partial]:
        live = [self._live[s] for s in sample_ids if s in self._live]
        if live:
            self._call(self._abort([st.request_id for st in live]))
        self._pump(block=False)  # what arrived before the abort belongs to the stretch
        out = []
        for st in live:
            if not st.finished:  # a finish that raced the abort is reported as a finish
                self._forget(st)
                out.append(Partial(st.sample_id, list(st.tokens), list(st.logprobs), st.prefix_len))
        return out

    def abort(self, sample_ids: Sequence[str]) -> None:
        live = [self._live[s] for s in sample_ids if s in self._live]
        if live:
            self._call(self._abort([st.request_id for st in live]))
        for st in live:
            self._forget(st)
        dropped = set(sample_ids)
        self._pending = [e for e in self._pending if e.sample_id not in dropped]

    def load_weights(self, state_dict: Mapping[str, Any], version: int) -> None:
        # running requests keep their K/V (as the torch engine does); the worker
        # interrupts everything before a pull, so clearing the prefix cache is safe
        self._call(self._llm.collective_rpc("staleflow_load_weights", args=(list(state_dict.items()),)))
        self._call(self._llm.reset_prefix_cache())
        self._version = int(version)

    def load_from_ps(self, addr: str, version: int | None = None) -> int:
        """Every vLLM worker pulls `version` (the latest committed one if None; a version only
        once committed) from the PS at HOST:PORT."""
        (got, *_rest) = self._call(self._llm.collective_rpc("staleflow_pull", args=(addr, version)))
        self._call(self._llm.reset_prefix_cache())
        self._version = int(got)
        return self._version

    def stats(self) -> EngineStats:
        cache = self._llm.vllm_config.cache_config
        capacity = int(cache.num_gpu_blocks or 0) * int(cache.block_size or 0)
        s = self._sched
        usage = float(getattr(s, "kv_cache_usage", getattr(s, "gpu_cache_usage", 0.0)) or 0.0)
        now = time.monotonic()
        recent = [(t, n) for t, n in self._recent if now - t <= 5.0]
        span = now - recent[0][0] if recent else 0.0
        return EngineStats(
            version=self._version,
            running=int(getattr(s, "num_running_reqs", len(self._live))),
            waiting=int(getattr(s, "num_waiting_reqs", 0)),
            kv_tokens=round(usage * capacity),
            kv_capacity=capacity,
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

    def staleflow_load_weights(self, named_tensors: list) -> None:
        self.model_runner.model.load_weights(weights=named_tensors)  # type: ignore[attr-defined]

    def staleflow_pull(self, addr: str, version: int | None) -> int:
        from workers.trainer.param_server import ParamClient

        sd, got, _ = ParamClient(addr).pull(version, device=self.device)  # type: ignore[attr-defined]
        self.model_runner.model.load_weights(weights=list(sd.items()))  # type: ignore[attr-defined]
        return got
