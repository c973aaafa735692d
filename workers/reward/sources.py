"""Where a reward comes from: a registered verifier, the user's Python function, or a reward
service over HTTP. Each scores a list of claimed samples; the worker (worker.py) retries the
ones that failed and drops those that keep failing (docs/integration.md#your-reward).

A reward is a finite number, or a dict ``{"reward": number, "metrics": {name: number}}``
(`parse_reward`); the metrics are stored with the reward and shown per training step.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import httpx

from workers.tasks.verifiers import VERIFIERS, Detokenize

MAX_METRICS = 64  # as the API takes (workers/wire/models/training.py)


@dataclass(frozen=True)
class RewardSample:
    """One claimed sample, as a reward function gets it (and, as JSON, a reward service)."""

    run_id: int
    sample_id: int
    group_id: int
    prompt_tokens: list[int]
    response_tokens: list[int]
    prompt: str  # the tokens decoded: with --model's tokenizer, else as UTF-8 bytes (ids 0..255)
    response: str
    finish_reason: str | None  # "eos" or "length"
    meta: dict[str, Any] = field(default_factory=dict)  # the prompt's metadata (e.g. the answer)
    # per response token: 1 generated, 0 an environment observation's (multi-turn)
    response_mask: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Scored:
    reward: float
    metrics: dict[str, float] | None = None


class InvalidReward(ValueError):
    """A reward function or service returned something that is not a reward."""


def _finite(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidReward(f"{what} must be a number, not {type(value).__name__}")
    if not math.isfinite(value) or abs(value) > 1e300:
        raise InvalidReward(f"{what} must be finite, got {value!r}")
    return float(value)


def parse_reward(value: Any) -> Scored:
    """A number, or ``{"reward": number, "metrics": {name: number}}`` (metrics optional, at
    most 64): anything else is an InvalidReward (the sample is retried, then dropped)."""
    if not isinstance(value, dict):
        return Scored(_finite(value, "the reward"))
    extra = set(value) - {"reward", "metrics"}
    if extra or "reward" not in value:
        raise InvalidReward(f'a reward dict has "reward" and optionally "metrics", got keys {sorted(value)}')
    metrics = value.get("metrics")
    if metrics is None:
        return Scored(_finite(value["reward"], "the reward"))
    if not isinstance(metrics, dict) or len(metrics) > MAX_METRICS:
        raise InvalidReward(f'"metrics" must be an object of at most {MAX_METRICS} numbers')
    checked = {}
    for k, v in metrics.items():
        if not isinstance(k, str) or not 1 <= len(k) <= 200 or "\x00" in k:
            raise InvalidReward(f"metric name {k!r}: 1..200 characters, no NUL")
        checked[k] = _finite(v, f"metric {k!r}")
    return Scored(_finite(value["reward"], "the reward"), checked or None)


Outcome = Scored | BaseException  # per sample: the reward, or why it failed


class RewardSource(Protocol):
    """Scores samples; one outcome per sample, in order. An error of the whole call (a batch
    function that raised, a service that answered 500) is that error for every sample."""

    description: str

    async def score(self, samples: Sequence[RewardSample], timeout: float) -> list[Outcome]: ...

    async def aclose(self) -> None: ...


async def _bounded(limit: asyncio.Semaphore, call: Callable[[], Awaitable[Any]], timeout: float) -> Any:
    async with limit:
        return await asyncio.wait_for(call(), timeout)


async def _each(calls: Sequence[Callable[[], Awaitable[Any]]], limit: asyncio.Semaphore, timeout: float) -> list[Any]:
    """Run the calls, at most `limit` at a time, each within `timeout`; errors are returned."""
    return list(await asyncio.gather(*(_bounded(limit, c, timeout) for c in calls), return_exceptions=True))


class VerifierReward:
    """A verifier of workers/tasks/verifiers.py, called in the worker's (main) thread: the math
    verifier's timeouts use signal.alarm, which only the main thread may set."""

    def __init__(self, name: str, detokenize: Detokenize):
        self.description, self.verify, self.detokenize = f"verifier {name}", VERIFIERS[name], detokenize

    async def score(self, samples: Sequence[RewardSample], timeout: float) -> list[Outcome]:
        out: list[Outcome] = []
        for s in samples:
            try:
                out.append(parse_reward(self.verify(s.response_tokens, s.finish_reason, s.meta, self.detokenize)))
            except Exception as e:
                out.append(e)
        return out

    async def aclose(self) -> None:
        pass


def load_function(spec: str) -> Callable[..., Any]:
    """`module:function` (a dotted attribute path after the colon) imported from sys.path."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--reward takes module:function, got {spec!r}")
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        # The module itself is missing (not one it imports): most often a file in the current
        # folder, which a console script does not put on sys.path as `python -m` would.
        parts = module_name.split(".")
        if e.name not in {".".join(parts[: i + 1]) for i in range(len(parts))}:
            raise
        raise ModuleNotFoundError(
            f"no module {module_name!r} on the Python path; for {module_name.replace('.', '/')}.py in the "
            "current folder: export PYTHONPATH=$PWD",
            name=e.name,
        ) from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"{spec!r}: {module_name} has no {attr}") from None
    if not callable(obj):
        raise ValueError(f"{spec!r} is not callable")
    return obj


class FunctionReward:
    """The user's function: `fn(sample) -> reward`, or with `batch` `fn(samples) -> [reward]`
    (one per sample, in order). Sync functions run in threads, async ones on the worker's
    loop; at most `concurrency` calls at a time, each within the timeout."""

    def __init__(self, fn: Callable[..., Any], *, batch: bool = False, concurrency: int = 8, name: str = ""):
        self.fn, self.batch, self.concurrency = fn, batch, concurrency
        self.description = f"function {name or getattr(fn, '__qualname__', fn)}" + (" (batch)" if batch else "")
        self._limit: asyncio.Semaphore | None = None

    def _call(self, arg: Any) -> Callable[[], Awaitable[Any]]:
        async def call() -> Any:
            if inspect.iscoroutinefunction(self.fn):
                return await self.fn(arg)
            result = await asyncio.to_thread(self.fn, arg)
            return await result if inspect.isawaitable(result) else result

        return call

    async def score(self, samples: Sequence[RewardSample], timeout: float) -> list[Outcome]:
        if self._limit is None:  # created on the loop that runs it
            self._limit = asyncio.Semaphore(self.concurrency)
        if not self.batch:
            results = await _each([self._call(s) for s in samples], self._limit, timeout)
            return [r if isinstance(r, BaseException) else _parsed(r) for r in results]
        try:
            got = await _bounded(self._limit, self._call(list(samples)), timeout)
        except Exception as e:
            return [e] * len(samples)
        if not isinstance(got, (list, tuple)) or len(got) != len(samples):
            n = len(got) if isinstance(got, (list, tuple)) else type(got).__name__
            return [InvalidReward(f"a batch reward function must return {len(samples)} rewards, got {n}")] * len(
                samples
            )
        return [_parsed(r) for r in got]

    async def aclose(self) -> None:
        pass


def _parsed(value: Any) -> Outcome:
    try:
        return parse_reward(value)
    except InvalidReward as e:
        return e


class RewardServiceError(RuntimeError):
    """A reward service answered with an error status, a body that breaks the contract, or an
    error for one sample."""


class HttpReward:
    """A reward service: POST `url` with up to `request_size` samples per request, at most
    `concurrency` requests in flight (the contract: docs/integration.md#a-reward-service).

    Request ``{"run_id": int, "samples": [RewardSample as JSON]}``; response 200 with
    ``{"rewards": [{"sample_id": int, "reward": number, "metrics": {name: number}}]}``, one
    entry per sample (order free), or ``{"sample_id": int, "error": "why"}`` for a sample the
    service could not score."""

    def __init__(
        self, url: str, *, concurrency: int = 8, request_size: int = 16, headers: dict[str, str] | None = None
    ):
        self.url, self.concurrency, self.request_size = url, concurrency, request_size
        self.headers = headers or {}
        self.description = f"reward service {url}"
        self._client: httpx.AsyncClient | None = None
        self._limit: asyncio.Semaphore | None = None

    async def _post(self, samples: Sequence[RewardSample]) -> list[Outcome]:
        assert self._client is not None
        body = {"run_id": samples[0].run_id, "samples": [asdict(s) for s in samples]}
        r = await self._client.post(self.url, json=body)
        if r.status_code != 200:
            raise RewardServiceError(f"{self.url} answered {r.status_code}: {r.text[:200]}")
        try:
            entries = r.json()["rewards"]
            by_id = {e["sample_id"]: e for e in entries}
        except (ValueError, KeyError, TypeError) as e:
            raise RewardServiceError(
                f'{self.url}: the body is not {{"rewards": [{{"sample_id": ...}}]}} ({e})'
            ) from None
        out: list[Outcome] = []
        for s in samples:
            entry = by_id.get(s.sample_id)
            if not isinstance(entry, dict):
                out.append(RewardServiceError(f"{self.url}: no reward for sample {s.sample_id}"))
            elif "error" in entry:
                out.append(RewardServiceError(f"{self.url}: sample {s.sample_id}: {str(entry['error'])[:200]}"))
            else:
                out.append(_parsed({k: v for k, v in entry.items() if k != "sample_id"}))
        return out

    async def score(self, samples: Sequence[RewardSample], timeout: float) -> list[Outcome]:
        if self._client is None:  # created on the loop that runs it
            # the worker's timeout (asyncio.wait_for) governs; httpx's is a backstop
            self._client = httpx.AsyncClient(timeout=timeout + 5, headers=self.headers)
            self._limit = asyncio.Semaphore(self.concurrency)
        assert self._limit is not None
        chunks = [samples[i : i + self.request_size] for i in range(0, len(samples), self.request_size)]
        results = await _each([functools.partial(self._post, c) for c in chunks], self._limit, timeout)
        out: list[Outcome] = []
        for chunk, got in zip(chunks, results):
            out.extend(got if isinstance(got, list) else [got] * len(chunk))
        return out

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
