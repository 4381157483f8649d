"""The user side of the ``tau2`` env (:mod:`rollout.envs.tau2`): the :class:`UserSimulator` protocol and
its three kinds, :class:`TicketUser` (no live user: the ticket / scenario is the opening), :class:`ScriptedUser`
(fixed replies, for tests) and :class:`ModelUser` (a policy-sampled user model following tau²'s user
guidelines, with the telecom user-device tools); and the views of a tau² message history they read."""

from __future__ import annotations

import re
import time
from typing import Any, Optional, Protocol, Sequence, runtime_checkable

from .base import parse_tool_calls

__all__ = ["UserSimulator", "UserToolLimit", "TicketUser", "ScriptedUser", "ModelUser"]

_THINK_RE = re.compile(r"<think>.*?</think>", re.DOTALL)


def _strip_think(text: str) -> str:
    return _THINK_RE.sub("", text or "").strip()


def _user_view(history: Sequence[Any]) -> list[dict]:
    """tau² messages as the user sees them (tau²'s ``UserState.flip_roles`` keeps the same ones): the
    agent's text, the user's own messages (with its tool calls) and the outputs of the user's tools."""
    out: list[dict] = []
    for m in history:
        if m.role == "assistant" and m.content and not m.tool_calls:
            out.append({"role": "agent", "content": m.content})
        elif m.role == "user" and (m.content or m.tool_calls):
            d: dict = {"role": "user", "content": m.content or ""}
            if m.tool_calls:
                d["tool_calls"] = [{"name": tc.name, "arguments": dict(tc.arguments)} for tc in m.tool_calls]
            out.append(d)
        elif m.role == "tool" and getattr(m, "requestor", None) == "user":
            out.append({"role": "tool", "content": m.content or ""})
    return out


def _chat_messages(history: Sequence[Any]) -> list[dict]:
    """tau² messages as the agent loop's chat dicts (``tool_calls`` as ``{name, arguments}``)."""
    out: list[dict] = []
    for m in history:
        if m.role == "tool":
            out.append({"role": "tool", "content": m.content or ""})
        elif m.role in ("assistant", "user"):
            d: dict = {"role": m.role, "content": m.content or ""}
            if m.tool_calls:
                d["tool_calls"] = [{"name": tc.name, "arguments": dict(tc.arguments)} for tc in m.tool_calls]
            out.append(d)
    return out


# ---------------------------------------------------------------------------------- user side
@runtime_checkable
class UserSimulator(Protocol):
    """The customer side of a tau² episode.

    ``opening(task)`` is the first user message (after the agent's greeting); ``reply(task,
    conversation)`` is the user's answer to the agent's last text message, given the conversation as
    the *user* sees it (``[{"role": "agent"|"user"|"tool", "content": str}]``, a user message with the
    user's own ``tool_calls``, ``tool`` the outputs of the user's tools; the agent's tool calls and their
    outputs left out, as tau²'s ``UserState.flip_roles`` leaves them out). A reply containing one of
    tau²'s stop tokens ends the episode (``USER_STOP``); ``None`` means there is no user to answer
    (the episode ends as an agent stop).

    A user with tools (telecom's user-device tools) also has ``attach_tools(schemas, call)``: the env
    calls it at each reset with the user tools' OpenAI schemas (``None`` for a domain without) and
    ``call(calls, content) -> observations``, which runs parsed ``{"name", "arguments"}`` calls on the
    episode's environment as the user's (tau²'s ``requestor="user"``) and records them in the episode
    (``content``: the text the user wrote beside them). A user that exceeds its bound on tool calls
    raises :class:`UserToolLimit` (the episode ends as tau²'s ``MAX_STEPS``, reward 0).
    """

    def opening(self, task: Any) -> str: ...

    def reply(self, task: Any, conversation: list[dict]) -> Optional[str]: ...


class UserToolLimit(RuntimeError):
    """The user called tools more times in one turn than its bound allows (``MAX_STEPS``)."""


class TicketUser:
    """``user=ticket``: no simulated user. The opening message is the task's ticket when it has one,
    else its rendered user scenario; nobody answers the agent (its first text message ends)."""

    def opening(self, task: Any) -> str:
        return str(task.ticket) if task.ticket else str(task.user_scenario)

    def reply(self, task: Any, conversation: list[dict]) -> Optional[str]:
        return None


class ScriptedUser:
    """A user that says fixed lines (tests, demonstrations): ``opening`` is ``first`` (default the
    ticket / rendered scenario), then each reply is the next of ``replies``, then ``###STOP###``."""

    def __init__(self, replies: Sequence[str] = (), first: Optional[str] = None):
        self.replies = list(replies)
        self.first = first
        self._i = 0

    def opening(self, task: Any) -> str:
        self._i = 0
        return self.first if self.first is not None else TicketUser().opening(task)

    def reply(self, task: Any, conversation: list[dict]) -> Optional[str]:
        if self._i < len(self.replies):
            self._i += 1
            return self.replies[self._i - 1]
        return "###STOP###"


class ModelUser:
    """The user simulator as a model jax-rl serves itself (``env.tau2.user=model``).

    Like tau²'s ``UserSimulator``: the system prompt is tau²'s own (its ``simulation_guidelines.md``
    and the task's ``str(user_scenario)`` in tau²'s ``SYSTEM_PROMPT``), the conversation is shown
    with the roles flipped (the agent's messages as ``user`` turns, the user's own as ``assistant``
    turns), and the reply ends the episode when it holds one of tau²'s stop tokens.

    Unlike tau²'s: the model is a local checkpoint behind a jax-rl generator (``generator.submit``,
    the agent loop's interface; frozen: its tokens are never in any trajectory, so never in
    ``loss_mask``), rendered through the Qwen3 chat template (``tokenizer.render_chat``) rather than
    an API model's, sampled with the generator's temperature and a per-turn seed; its ``<think>`` block
    is dropped; the opening message is generated as tau²'s is, in answer to the agent's greeting.

    Tools (telecom: the user acts on their phone through 30 user-device tools): after
    :meth:`attach_tools`, the prompt is tau²'s tool-using user prompt (``simulation_guidelines_tools``)
    with the user tools' schemas rendered by the chat template; ``<tool_call>`` blocks in the user's
    output are parsed as JSON (:func:`rollout.envs.base.parse_tool_calls`, never evaluated) and run through
    the env's callback (tau²'s ``Environment.get_response`` with ``requestor="user"``); their outputs
    are shown to the user as tool turns and the user is asked again, until it writes text without a
    call. More than ``max_tool_calls`` calls in one turn raise :class:`UserToolLimit`.

    Args:
        generator: ``submit(prompt_ids, *, max_new_tokens, seed, stop_ids) -> Future[Completion]``.
        tokenizer: a :class:`jax_rl.models.tokenizer.ChatTokenizer`.
        max_new_tokens: per user turn.
        max_context: a user prompt longer than this ends the episode (``reply`` returns the stop token).
        seed: base sampling seed (combined with the episode seed and the turn).
        max_tool_calls: tool calls (and malformed call blocks) the user may make in one turn.
    """

    def __init__(self, generator: Any, tokenizer: Any, max_new_tokens: int = 256, max_context: int = 8192,
                 seed: int = 0, timeout_s: Optional[float] = 600.0, max_tool_calls: int = 8):
        self.generator = generator
        self.max_tool_calls = int(max_tool_calls)
        self.tools: Optional[list[dict]] = None
        self._call: Any = None
        self.tool_calls = 0
        self.tok = tokenizer
        self.max_new_tokens = int(max_new_tokens)
        self.max_context = int(max_context)
        self.seed = int(seed)
        self.timeout_s = timeout_s
        self._turn = 0
        self.tokens_generated = 0
        self.gen_s = 0.0

    def attach_tools(self, schemas: Optional[Sequence[dict]], call: Any) -> None:
        """The user's tools for this episode (``None`` / ``[]``: none) and the env's ``call(calls) -> observations``."""
        self.tools = [dict(t) for t in schemas] if schemas else None
        self._call = call if schemas else None

    @staticmethod
    def system_prompt(task: Any, use_tools: bool = False) -> str:
        """tau²'s user-simulator system prompt for ``task`` (its guidelines with or without tools)."""
        from tau2.user.user_simulator import SYSTEM_PROMPT, get_global_user_sim_guidelines

        return SYSTEM_PROMPT.format(global_user_sim_guidelines=get_global_user_sim_guidelines(use_tools=use_tools),
                                    instructions=str(task.user_scenario))

    def _generate(self, task: Any, conversation: list[dict]) -> str:
        """The user's next text message; its tool calls (with tools attached) run first (class doc)."""
        conv = list(conversation)
        n_calls = 0
        while True:
            text = self._sample(task, conv)
            if text is None:  # the prompt outgrew max_context
                return "###STOP###"
            body = _strip_think(text)
            if self._call is None or "<tool_call>" not in body:
                return body
            calls, errors = parse_tool_calls(body)
            n_calls += len(calls) + len(errors)
            self.tool_calls += len(calls)
            if n_calls > self.max_tool_calls:
                raise UserToolLimit(f"the user model made more than {self.max_tool_calls} tool calls in one turn")
            content = re.sub(r"<tool_call>.*?(</tool_call>|$)", "", body, flags=re.DOTALL).strip()
            observations = list(self._call(calls, content)) + [f"Error: {e}" for e in errors]
            conv.append({"role": "user", "content": content, "tool_calls": calls})
            conv += [{"role": "tool", "content": o} for o in observations]

    def _sample(self, task: Any, conv: list[dict]) -> Optional[str]:
        """One completion of the user model on ``conv`` (roles flipped), or None when the prompt is too long."""
        msgs = [{"role": "system", "content": self.system_prompt(task, use_tools=self.tools is not None)}]
        for m in conv:
            if m["role"] == "agent":
                msgs.append({"role": "user", "content": m["content"]})
            elif m["role"] == "tool":
                msgs.append({"role": "tool", "content": m["content"]})
            else:
                d = {"role": "assistant", "content": m["content"]}
                if m.get("tool_calls"):
                    d["tool_calls"] = m["tool_calls"]
                msgs.append(d)
        ids, _ = self.tok.render_chat(msgs, self.tools, add_generation_prompt=True)
        room = self.max_context - len(ids)
        if room <= 0:
            return None
        seed = (self.seed * 1_000_003 + self._turn * 101 + 7) % (2**31 - 1)
        self._turn += 1
        t0 = time.monotonic()
        fut = self.generator.submit(ids, max_new_tokens=min(self.max_new_tokens, room), seed=seed,
                                    stop_ids=tuple(self.tok.stop_ids))
        comp = fut.result(timeout=self.timeout_s)
        self.gen_s += time.monotonic() - t0
        toks = list(comp.tokens)
        self.tokens_generated += len(toks)
        if toks and toks[-1] in tuple(self.tok.stop_ids):
            toks = toks[:-1]
        return self.tok.decode(toks)

    def opening(self, task: Any) -> str:
        from tau2.orchestrator.orchestrator import DEFAULT_FIRST_AGENT_MESSAGE

        self._turn = 0
        return self._generate(task, [{"role": "agent", "content": DEFAULT_FIRST_AGENT_MESSAGE.content}])

    def reply(self, task: Any, conversation: list[dict]) -> Optional[str]:
        return self._generate(task, conversation)


# ---------------------------------------------------------------------------------- the env
