"""Reward sources without the API: what counts as a reward, the user's functions (sync, async,
batch) under the concurrency limit and the timeout, and a reward service over real HTTP (a
server in a thread of this process) keeping its JSON contract."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from workers.reward.sources import (
    FunctionReward,
    HttpReward,
    InvalidReward,
    RewardSample,
    RewardServiceError,
    Scored,
    load_function,
    parse_reward,
)


def _sample(i: int, **meta) -> RewardSample:
    return RewardSample(1, i, 10 + i, [1, 2], [3] * i, "ab", "c" * i, "eos", meta)


def test_a_reward_is_a_number_or_a_dict_with_metrics():
    assert parse_reward(1) == Scored(1.0)
    assert parse_reward(0.25) == Scored(0.25)
    assert parse_reward({"reward": 1, "metrics": {"len": 3}}) == Scored(1.0, {"len": 3.0})
    assert parse_reward({"reward": 0.0, "metrics": {}}) == Scored(0.0)
    for bad, why in [
        (None, "number"),
        (True, "number"),  # a bool is no reward: likely a bug in the function
        ("1.0", "number"),
        (float("nan"), "finite"),
        (float("inf"), "finite"),
        ({"score": 1.0}, "keys"),
        ({"reward": 1.0, "extra": 2}, "keys"),
        ({"reward": 1.0, "metrics": {"x": "y"}}, "number"),
        ({"reward": 1.0, "metrics": [1]}, "object"),
        ({"reward": 1.0, "metrics": {str(i): 1 for i in range(65)}}, "at most 64"),
    ]:
        with pytest.raises(InvalidReward, match=why):
            parse_reward(bad)


def test_load_function_imports_module_colon_function():
    assert load_function("json:dumps") is json.dumps
    assert load_function("os.path:join.__call__")
    for bad, why in [("json", "module:function"), ("json:nope", "no nope"), ("json:__name__", "not callable")]:
        with pytest.raises(ValueError, match=why):
            load_function(bad)
    # The module missing: where it is looked for, and how a file in the current folder gets there.
    with pytest.raises(
        ModuleNotFoundError, match=r"no module 'no_such_module_here' on the Python path.*PYTHONPATH=\$PWD"
    ):
        load_function("no_such_module_here:f")
    with pytest.raises(ModuleNotFoundError, match="no module 'json.no_such' on the Python path"):
        load_function("json.no_such:f")


def test_load_function_names_what_the_users_module_fails_to_import(tmp_path, monkeypatch):
    (tmp_path / "needs_more.py").write_text("import no_such_dependency_here\n\ndef f(s):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="No module named 'no_such_dependency_here'"):
        load_function("needs_more:f")


def test_function_rewards_sync_async_and_failures():
    def sync(s):
        if s.sample_id == 3:
            raise RuntimeError("boom")
        return {"reward": len(s.response), "metrics": {"id": s.sample_id}} if s.sample_id == 2 else 0.5

    async def slow(s):
        await asyncio.sleep(10 if s.sample_id == 1 else 0)
        return 1.0

    out = asyncio.run(FunctionReward(sync).score([_sample(1), _sample(2), _sample(3)], 5.0))
    assert out[:2] == [Scored(0.5), Scored(2.0, {"id": 2.0})]
    assert isinstance(out[2], RuntimeError)
    out = asyncio.run(FunctionReward(slow).score([_sample(1), _sample(2)], 0.2))
    assert isinstance(out[0], TimeoutError) and out[1] == Scored(1.0)


def test_function_concurrency_is_bounded():
    running, peak = 0, 0

    async def fn(s):
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.01)
        running -= 1
        return 1.0

    out = asyncio.run(FunctionReward(fn, concurrency=3).score([_sample(i) for i in range(12)], 5.0))
    assert out == [Scored(1.0)] * 12 and peak == 3


def test_batch_functions_get_the_list_and_must_return_one_reward_each():
    seen = []

    def batch(samples):
        seen.append([s.sample_id for s in samples])
        return [s.sample_id / 10 for s in samples]

    out = asyncio.run(FunctionReward(batch, batch=True).score([_sample(1), _sample(2)], 5.0))
    assert out == [Scored(0.1), Scored(0.2)] and seen == [[1, 2]]
    short = asyncio.run(FunctionReward(lambda s: [1.0], batch=True).score([_sample(1), _sample(2)], 5.0))
    assert all(isinstance(o, InvalidReward) and "2 rewards" in str(o) for o in short)

    def broken(samples):
        raise ValueError("bad batch")

    failed = asyncio.run(FunctionReward(broken, batch=True).score([_sample(1), _sample(2)], 5.0))
    assert [type(o) for o in failed] == [ValueError, ValueError]


class _Service(BaseHTTPRequestHandler):
    """Rewards each sample with len(response)/10 and a metric; sample 3 is an error, 4 is
    missing; path /slow sleeps; path /500 answers 500."""

    requests: list[dict] = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append({"path": self.path, "body": body, "auth": self.headers.get("Authorization")})
        if self.path == "/slow":
            time.sleep(2)
        if self.path == "/500":
            self.send_response(500)
            self.end_headers()
            return
        rewards = []
        for s in body["samples"]:
            if s["sample_id"] == 3:
                rewards.append({"sample_id": 3, "error": "sandbox crashed"})
            elif s["sample_id"] != 4:
                rewards.append(
                    {"sample_id": s["sample_id"], "reward": len(s["response"]) / 10, "metrics": {"n": s["sample_id"]}}
                )
        data = json.dumps({"rewards": rewards[::-1]}).encode()  # any order
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def service():
    _Service.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Service)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_reward_service_contract(service):
    source = HttpReward(service + "/score", request_size=2, headers={"Authorization": "Bearer x"})

    async def go():
        try:
            return await source.score([_sample(1, answer="a"), _sample(2), _sample(3), _sample(4)], 5.0)
        finally:
            await source.aclose()

    out = asyncio.run(go())
    assert out[:2] == [Scored(0.1, {"n": 1.0}), Scored(0.2, {"n": 2.0})]
    assert isinstance(out[2], RewardServiceError) and "sandbox crashed" in str(out[2])
    assert isinstance(out[3], RewardServiceError) and "no reward for sample 4" in str(out[3])
    assert len(_Service.requests) == 2  # two samples per request
    first = min(_Service.requests, key=lambda r: r["body"]["samples"][0]["sample_id"])
    assert first["auth"] == "Bearer x"
    assert first["body"]["run_id"] == 1
    assert first["body"]["samples"][0] == {
        "run_id": 1,
        "sample_id": 1,
        "group_id": 11,
        "prompt_tokens": [1, 2],
        "response_tokens": [3],
        "prompt": "ab",
        "response": "c",
        "finish_reason": "eos",
        "meta": {"answer": "a"},
        "response_mask": [],  # per response token in a multi-turn trajectory (none given here)
    }


def test_reward_service_errors_and_timeouts_fail_the_request(service):
    async def go(path, timeout):
        source = HttpReward(service + path)
        try:
            return await source.score([_sample(1), _sample(2)], timeout)
        finally:
            await source.aclose()

    failed = asyncio.run(go("/500", 5.0))
    assert all(isinstance(o, RewardServiceError) and "500" in str(o) for o in failed)
    slow = asyncio.run(go("/slow", 0.2))
    assert all(isinstance(o, TimeoutError) for o in slow)


class _Flaky:
    """A source whose samples fail their first `fails[id]` tries."""

    description = "flaky"

    def __init__(self, fails: dict[int, int]):
        self.fails, self.calls = dict(fails), []

    async def score(self, samples, timeout):
        self.calls.append([s.sample_id for s in samples])
        out = []
        for s in samples:
            if self.fails.get(s.sample_id, 0) > 0:
                self.fails[s.sample_id] -= 1
                out.append(RuntimeError(f"try failed for {s.sample_id}"))
            else:
                out.append(Scored(1.0))
        return out

    async def aclose(self):
        pass


def _worker(source, attempts=3):
    from workers.retry import REWARD_CALL
    from workers.reward.worker import RewardWorker

    # scoring needs no API: the client is used only to claim and post
    return RewardWorker(None, 1, source, retry=REWARD_CALL.but(initial=0.001, cap=0.001, attempts=attempts))  # type: ignore[arg-type]


def test_the_worker_retries_only_the_failed_samples_a_bounded_number_of_times():
    source = _Flaky({2: 1, 3: 5})
    worker = _worker(source, attempts=3)
    try:
        got = worker._loop.run(worker.score([_sample(1), _sample(2), _sample(3)]))
    finally:
        worker.close()
    assert source.calls == [[1, 2, 3], [2, 3], [3]]  # three tries in all, the failed ones only
    assert got[1] == Scored(1.0) and got[2] == Scored(1.0)  # 2 made it on its retry
    assert isinstance(got[3], RuntimeError)  # 3 is given up on: the worker drops it
    assert worker.stats.failures == 1 + 3


def test_a_stopping_worker_leaves_samples_it_would_retry_unscored():
    source = _Flaky({2: 1})
    worker = _worker(source)
    worker.stop()
    try:
        got = worker._loop.run(worker.score([_sample(1), _sample(2)]))
    finally:
        worker.close()
    assert got == {1: Scored(1.0)}  # 2 is neither rewarded nor dropped: its claim expires
