"""The environment protocol and shared helpers.

An environment instance runs one episode at a time (the agent makes one per episode through
a factory). Its contract:

* ``reset(seed) -> (messages, tools)``: the initial chat (system + user dicts) and the JSON tool
  schemas (``{"type": "function", "function": {name, description, parameters}}``). The same
  seed gives the same task.
* ``step(tool_call) -> str``: run one tool call ``{"name": str, "arguments": dict}`` and return the
  observation text. A bad call the model could fix (bad arguments, a rule violation, an
  unknown tool) raises :class:`ToolError`: the agent turns it into an error observation. Any
  other exception is an environment failure: the agent fails that episode.
* ``score(final_answer) -> (reward, info)``: reward in [0, 1] for the final assistant message
  (text with ``<answer>...</answer>``) and the episode's state; ``info`` is JSON-safe.
* ``reference_solution(seed) -> messages``: a demonstration, the messages that follow
  ``reset(seed)``'s messages (assistant turns with ``tool_calls``, ``tool`` results, and the final
  assistant answer). It resets the env to ``seed`` and plays the solution through ``step``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import random
import re
import time
from typing import Any, Callable, Optional, Protocol, runtime_checkable

__all__ = ["Env", "EnvSpec", "ToolError", "BaseEnv", "extract_final_answer", "tool_schema", "parse_tool_calls", "MAX_TOOL_LATENCY_S"]

_TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

# Longest simulated tool latency (seconds); also the cap on one lognormal draw. The config's bound on
# ``rollout.tool_latency_s`` (``jax_rl.config.MAX_TOOL_LATENCY_S`` is this one; this package does not import
# the config): finite, so ``time.sleep`` never overflows in a rollout thread.
MAX_TOOL_LATENCY_S = 600.0


class ToolError(Exception):
    """A tool call the model got wrong; its message becomes the observation ``Error: <msg>``."""


@runtime_checkable
class Env(Protocol):
    name: str

    def reset(self, seed: int) -> tuple[list[dict], list[dict]]: ...

    def step(self, tool_call: dict) -> str: ...

    def score(self, final_answer: str) -> tuple[float, dict]: ...

    def reference_solution(self, seed: int) -> list[dict]: ...


_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_final_answer(text: str) -> Optional[str]:
    """The content of the last ``<answer>...</answer>`` (stripped), or None.

    Same rule as ``reasoning_gym.utils.extract_answer`` (last match, stripped).
    """
    m = _ANSWER_RE.findall(text or "")
    return m[-1].strip() if m else None


def tool_schema(name: str, description: str, properties: dict[str, dict], required: Optional[list[str]] = None) -> dict:
    """A Qwen/OpenAI-style function tool schema."""
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": properties,
                "required": list(required if required is not None else properties),
            },
        },
    }


class BaseEnv:
    """Shared plumbing: tool dispatch, argument checks and simulated tool latency.

    Args:
        tool_latency_s: mean simulated latency of each tool call in seconds (0 = none).
        tool_latency_dist: ``"fixed"`` (always ``tool_latency_s``) or ``"lognormal"`` (sigma 0.5,
            mean ``tool_latency_s``, drawn from an RNG seeded by the episode seed).
        max_answer_chars: a final answer (the text inside ``<answer>``) longer than this scores 0.
    """

    name = "base"

    def __init__(self, tool_latency_s: float = 0.0, tool_latency_dist: str = "fixed", max_answer_chars: int = 64):
        lat = float(tool_latency_s)
        if not (math.isfinite(lat) and 0 <= lat <= MAX_TOOL_LATENCY_S):
            raise ValueError(f"tool_latency_s must be a finite number in [0, {MAX_TOOL_LATENCY_S:g}] seconds, "
                             f"got {tool_latency_s!r}")
        if tool_latency_dist not in ("fixed", "lognormal"):
            raise ValueError(f"tool_latency_dist must be fixed|lognormal, got {tool_latency_dist!r}")
        self.tool_latency_s = float(tool_latency_s)
        self.tool_latency_dist = tool_latency_dist
        self.max_answer_chars = int(max_answer_chars)
        self._latency_rng = random.Random(0)
        self._latency_on = True
        self.tool_calls = 0

    # subclasses: dict name -> bound method taking keyword arguments
    def _tools(self) -> dict[str, Any]:
        raise NotImplementedError

    def _seed_latency(self, seed: int) -> None:
        self._latency_rng = random.Random(seed * 7919 + 17)
        self.tool_calls = 0

    @contextlib.contextmanager
    def no_latency(self):
        """Tool calls made inside skip the simulated latency (reference demonstrations, tokenizer corpus)."""
        prev, self._latency_on = self._latency_on, False
        try:
            yield self
        finally:
            self._latency_on = prev

    def _sleep(self) -> None:
        if self.tool_latency_s <= 0 or not self._latency_on:
            return
        if self.tool_latency_dist == "fixed":
            d = self.tool_latency_s
        else:
            sigma = 0.5
            d = self._latency_rng.lognormvariate(math.log(self.tool_latency_s) - sigma * sigma / 2, sigma)
        time.sleep(min(max(d, 0.0), MAX_TOOL_LATENCY_S))

    def step(self, tool_call: dict) -> str:
        """Dispatch ``{"name", "arguments"}`` to the tool; ToolError for a bad call (see module doc)."""
        if not isinstance(tool_call, dict):
            raise ToolError("a tool call must be a JSON object with 'name' and 'arguments'")
        name = tool_call.get("name")
        tools = self._tools()
        if name not in tools:
            raise ToolError(f"unknown tool {name!r}; available: {', '.join(sorted(tools))}")
        args = tool_call.get("arguments", {})
        if args is None:
            args = {}
        if not isinstance(args, dict):
            raise ToolError(f"arguments of {name} must be a JSON object, got {type(args).__name__}")
        self.tool_calls += 1
        self._sleep()
        try:
            return tools[name](**args)
        except TypeError as e:  # wrong / missing keyword arguments
            raise ToolError(f"bad arguments for {name}: {e}") from None

    def _answer_or_reason(self, final_answer: str) -> tuple[Optional[str], dict]:
        """Extract the ``<answer>``; returns (answer or None, info with the reason when None)."""
        ans = extract_final_answer(final_answer)
        if ans is None:
            return None, {"answer": None, "reason": "no <answer> tag"}
        if len(ans) > self.max_answer_chars:
            return None, {"answer": ans[: self.max_answer_chars], "reason": "answer too long"}
        return ans, {"answer": ans}


def parse_tool_calls(text: str) -> tuple[list[dict], list[str]]:
    """Find ``<tool_call>{json}</tool_call>`` blocks in assistant text (``json.loads``, never eval).

    Returns:
        ``(calls, errors)``: ``calls`` are ``{"name": str, "arguments": dict}`` for well-formed blocks;
        ``errors`` one message per malformed block (bad JSON, not an object, no string ``name``,
        non-object ``arguments``, or an unclosed ``<tool_call>``).
    """
    calls: list[dict] = []
    errors: list[str] = []
    for body in _TOOL_CALL_RE.findall(text):
        try:
            obj = json.loads(body.strip())
        except json.JSONDecodeError as e:
            errors.append(f"malformed tool call (invalid JSON: {e.msg} at char {e.pos})")
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            errors.append('malformed tool call (expected {"name": <function-name>, "arguments": {...}})')
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                errors.append(f"malformed tool call (arguments of {obj['name']} are not a JSON object)")
                continue
        if args is None:
            args = {}
        if not isinstance(args, dict):
            errors.append(f"malformed tool call (arguments of {obj['name']} are not a JSON object)")
            continue
        calls.append({"name": obj["name"], "arguments": args})
    tail = text.rsplit("</tool_call>", 1)[-1]
    if "<tool_call>" in tail:
        errors.append("malformed tool call (<tool_call> without </tool_call>)")
    return calls, errors


@dataclasses.dataclass(frozen=True)
class EnvSpec:
    """One registered environment (``rollout.envs.ENVS[env.name]``): how to build it and what of the config it
    reads, so no caller branches on ``env.name``.

    Attributes:
        make: ``(**knobs) -> Env``, one instance (one episode at a time).
        section: the config key under ``env`` its knobs live in (``env.<section>``), named in its errors: the
            env's own name (``tests/test_structure.py`` checks it against the config's sections).
        kwargs: ``(env_cfg) -> dict`` of constructor knobs from ``jax_rl.config.EnvConfig``.
        check_knobs: ``(value of env.<section>) -> value``, the section's own schema, run when the config is
            loaded (ValueError naming the knob), or None.
        check: ``(env_cfg) -> None``, the run-start checks that need the env's own dependencies (datasets, a
            domain), ValueError naming the key; or None.
        splits_eval_seeds: the env takes ``eval_seed_offset`` (``eval.seed_offset``: train / test tasks).
        user_model: ``(env_cfg) -> bool``: the env's user simulator is a served model the runtime builds.
        agentic: per-episode shape metrics (turns, tool calls) are logged for it.
        held_out_tasks: ``(env_cfg) -> (count, where)`` for an env whose eval tasks are a fixed split (tau2's test
            split: ``where`` names the key that picks it, e.g. ``env.tau2.domain=mock``); None: unbounded seeds.
    """

    make: Callable[..., Any]
    section: str
    kwargs: Callable[[Any], dict]
    check_knobs: Optional[Callable[[Any], Any]] = None
    check: Optional[Callable[[Any], None]] = None
    splits_eval_seeds: bool = False
    user_model: Callable[[Any], bool] = lambda env_cfg: False
    agentic: bool = False
    held_out_tasks: Optional[Callable[[Any], tuple[int, str]]] = None
