"""Tool calls in the model's text: `<call>name(args)</call>`, the stop string of a turn.

`parse_call` finds the last call of a turn; `ToolEnv` answers calls with a registry of tools
(`{name: fn(args: str) -> str}`), the result appended as `<result>...</result>`, and ends the
trajectory on a turn without a call (the model's final answer, scored by `score`)."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .base import Step

CALL_STOP = "</call>"
CALL = re.compile(r"<call>\s*([A-Za-z_]\w*)\s*\((.*?)\)\s*</call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    args: str


def parse_call(turn: str) -> ToolCall | None:
    """The last `<call>name(args)</call>` of a turn, or None (no call: a final answer)."""
    found = CALL.findall(turn)
    if not found:
        return None
    name, args = found[-1]
    return ToolCall(name, args.strip())


def result(text: str) -> str:
    return f"<result>{text}</result>"


class ToolEnv:
    """An environment of tools: each turn that calls one gets its result; a turn without a call
    ends the trajectory, scored by `score(answer, meta)`; `max_calls` calls at most."""

    def __init__(
        self,
        tools: Mapping[str, Callable[[str], str]],
        score: Callable[[str, dict[str, Any]], float],
        max_calls: int = 8,
    ):
        self.tools, self.score, self.max_calls = dict(tools), score, max_calls
        self.meta: dict[str, Any] = {}
        self.calls = 0

    def reset(self, prompt: str, meta: dict[str, Any]) -> str:
        self.meta, self.calls = dict(meta), 0
        return ""

    def step(self, turn: str) -> Step:
        call = parse_call(turn)
        if call is None:
            return Step("", self.score(turn, self.meta), True)
        self.calls += 1
        if self.calls > self.max_calls:
            return Step("", 0.0, True, {"why": "too many calls"})
        tool = self.tools.get(call.name)
        if tool is None:
            return Step(result(f"unknown tool {call.name}"), 0.0, False)
        try:
            return Step(result(tool(call.args)), 0.0, False)
        except Exception as e:  # a tool's error is the model's to read, not the environment's failure
            return Step(result(f"error: {e}"[:200]), 0.0, False)
