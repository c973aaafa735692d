"""The environment interface: tool-call parsing, the tool environment, the guessing task,
the runner's timeout and failure reasons, loading `module:Factory`, splitting turns."""

from __future__ import annotations

import threading

import pytest

from workers.envs.base import EnvFailed, Runner, Step, as_step, load_env, split_turns
from workers.envs.guess import GuessEnv
from workers.envs.tools import ToolCall, ToolEnv, parse_call


def test_parse_call_finds_the_last_call_of_a_turn():
    assert parse_call("let me see <call>calc(3*7)</call>") == ToolCall("calc", "3*7")
    assert parse_call("<call>a(1)</call> then <call> b ( x, y ) </call>") == ToolCall("b", "x, y")
    assert parse_call("the answer is 21") is None
    assert parse_call("<call>3*7</call>") is None  # no tool name: not a call


def _calc(args: str) -> str:
    a, b = args.split("*")
    return str(int(a) * int(b))


def test_tool_env_answers_calls_and_scores_the_final_answer():
    env = ToolEnv({"calc": _calc}, lambda answer, meta: float(answer.strip() == str(meta["answer"])), max_calls=2)
    assert env.reset("3*7*2=?", {"answer": 42}) == ""
    assert env.step("<call>calc(3*7)</call>") == Step("<result>21</result>", 0.0, False)
    assert env.step("<call>nope(1)</call>").observation == "<result>unknown tool nope</result>"
    assert env.step("42") == Step("", 1.0, True)
    env.reset("", {"answer": 1})
    assert env.step("<call>calc(x)</call>").observation.startswith("<result>error:")  # the model reads it


def test_guess_env_answers_higher_or_lower_and_ends_on_a_hit():
    env = GuessEnv(max_turns=3)
    env.reset("guess", {"target": 5})
    assert [env.step("8;").observation, env.step("2;").observation] == ["<", ">"]
    assert env.step("5;") == Step("", 1.0, True, {"turns": 3})
    env.reset("guess", {"target": 5})
    assert [env.step("0;").done, env.step("1;").done, env.step("2;")] == [
        False,
        False,
        Step("", 0.0, True, {"turns": 3}),
    ]


class Hangs:
    def __init__(self, release: threading.Event):
        self.release = release

    def reset(self, prompt, meta):
        return ""

    def step(self, turn):
        self.release.wait()
        return Step("x")


class Raises:
    def reset(self, prompt, meta):
        return ""

    def step(self, turn):
        raise RuntimeError("sandbox gone")


def test_runner_names_why_an_environment_failed():
    release = threading.Event()
    runner = Runner(lambda: Hangs(release), timeout_s=0.2)
    env, first, total = runner.start("p", {}, [])
    with pytest.raises(EnvFailed) as e:
        runner.step(env, "hello")
    assert e.value.reason == "env_timeout"
    release.set()
    runner = Runner(Raises)
    with pytest.raises(EnvFailed, match="env_failed: RuntimeError: sandbox gone"):
        runner.step(Raises(), "x")
    with pytest.raises(EnvFailed, match="must answer with an observation"):
        Runner(GuessEnv).step(_silent(), "x")
    runner.close()


def _silent():
    class Silent:
        def reset(self, prompt, meta):
            return ""

        def step(self, turn):
            return ("", 0.0, False, {})

    return Silent()


def test_runner_replays_earlier_turns_to_rebuild_an_environment_elsewhere():
    runner = Runner(GuessEnv)
    env, first, total = runner.start("guess", {"target": 3}, ["8;", "2;"])
    assert (first, total) == ("", 0.0)
    assert runner.step(env, "3;") == Step("", 1.0, True, {"turns": 3})  # the replayed turns count
    runner.close()


def test_as_step_takes_the_gymnasium_tuple_and_refuses_anything_else():
    assert as_step(("obs", 1, False, None)) == Step("obs", 1.0, False, {})
    with pytest.raises(TypeError):
        as_step(("obs", 1.0))


def test_load_env_takes_module_and_factory():
    assert isinstance(load_env("workers.envs.guess:GuessEnv")(), GuessEnv)
    with pytest.raises(ValueError):
        load_env("workers.envs.guess")
    with pytest.raises(ValueError):
        load_env("workers.envs.guess:Nope")


def test_split_turns_cuts_at_observations():
    def text(ts):
        return "".join(chr(t) for t in ts)

    assert split_turns(text, [56, 59, 60, 50, 59, 62], [1, 1, 0, 1, 1, 0]) == ["8;", "2;"]
    assert split_turns(text, [56, 60, 50], [1, 0, 1]) == ["8", "2"]
    assert split_turns(text, [], []) == []


def _end(turns, sid, turn):
    """A turn handed to the environment, and its answer once the step is done."""
    turns.begin(sid, turn, 0.0)
    turns.calls[sid][0].result(timeout=30)
    return turns.answer(sid, 0.0)


def test_a_turn_waits_for_its_environment_in_the_background_until_answer_or_timeout():
    """`begin` returns at once; `answer` is None while the environment works (the trajectory
    waits for it: `env_since`), then its reply, or env_timeout once the wait passes the limit."""
    from workers.rollout.turns import Turns
    from workers.tasks.guess import EOS, NUMBER0, GuessCodec

    release = threading.Event()
    turns = Turns(lambda: Hangs(release), GuessCodec(), timeout_s=5.0)
    turns.start(1, [1, 2], [], [], {})
    turns.begin(1, [NUMBER0 + 3, EOS], 100.0)
    assert turns.env_since(1) == 100.0 and turns.env_since(2) is None
    assert turns.answer(1, 104.9) is None  # working, within the limit
    with pytest.raises(EnvFailed) as e:
        turns.answer(1, 105.0)
    assert e.value.reason == "env_timeout"
    release.set()
    turns.forget(1)
    assert turns.calls == {}
    turns.close()


def test_turns_rebuild_an_environment_from_a_prefix_and_end_each_turn():
    """The rollout side (workers/rollout/turns.py): a trajectory taken over between turns or
    within one replays exactly its completed turns; each ended turn gets the environment's
    answer as tokens."""
    from workers.rollout.turns import Turns, turn_start
    from workers.tasks.guess import EOS, HIGHER, LOWER, NUMBER0, GuessCodec

    seven, three = NUMBER0 + 7, NUMBER0 + 3
    assert turn_start([]) == 0 and turn_start([1, 1, 0]) == 3 and turn_start([1, 1, 0, 1]) == 3
    turns = Turns(GuessEnv, GuessCodec())
    meta = {"target": 5}
    assert turns.start(1, [1, 2], [], [], meta) == []  # fresh: reset observes nothing
    turn = _end(turns, 1, [seven, EOS])
    assert (turn.step.done, turn.observation) == (False, [LOWER])
    # taken over between turns: the prefix ends with the observation; one turn replayed
    turns.start(2, [1, 2], [seven, EOS, LOWER], [1, 1, 0], meta)
    assert _end(turns, 2, [three, EOS]).observation == [HIGHER]  # its second turn
    # taken over within turn 2 (a partial "3" generated): only turn 1 is replayed
    turns.start(3, [1, 2], [seven, EOS, LOWER, three], [1, 1, 0, 1], meta)
    assert _end(turns, 3, [three, EOS]).step.info == {} and turns.envs[3].turns == 2
    turn = _end(turns, 3, [NUMBER0 + 5, EOS])
    assert (turn.step.done, turn.step.reward, turn.observation) == (True, 1.0, [])
    turns.close()
