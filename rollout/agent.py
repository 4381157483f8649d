"""Multi-turn agent loop: many concurrent episodes over a generator, assembled into Trajectories.

Token layout of an episode (what the generator saw is always a prefix of the trajectory)::

    prompt      = render_chat(reset messages, tools, add_generation_prompt=True)     mask False
    turn 0      = generated ids (incl. the <|im_end|> it sampled)                    mask True
    obs 0       = "\\n<|im_start|>user\\n<tool_response>\\n...\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n"   mask False
    turn 1      = generated ids                                                      mask True
    ...

The context submitted for turn k is exactly ``tokens[:len(prompt) + |turn 0| + |obs 0| + ...]``
so the learner's recomputed log-probs line up with ``behav_logp`` (the log-prob of token t is
at index t). Generated ids are never re-tokenised. An episode ends when

* the model answers (a turn ending in a stop id without ``<tool_call>``): ``env.score(text)``;
* a turn hits ``max_new_tokens`` without a stop id (``truncated="turn_length"``, reward 0);
* ``max_turns`` are used (``truncated="max_turns"``), the per-episode generated-token budget
  (``truncated="token_budget"``), the context length ``max_cache_len`` (``"context"``), or the
  wall-clock budget ``episode_timeout_s`` (``"time"``), all with reward 0;
* the prompt alone fills ``max_cache_len`` (no room for one generated token): ``info["overlong"]="prompt"``,
  nothing is generated, reward 0; counted (``stats["overlong"]``) and the buffer drops it
  (``dropped_overlong``): every sample of the task has the same prompt, so its whole group goes;
* the environment raises something other than :class:`ToolError` (or generation is aborted):
  the episode *fails*: ``info["failed"]=True``, ``info["fail_reason"]``, reward 0; it is counted
  (:attr:`AgentLoop.stats`) and the buffer never trains on it. Other episodes continue.

Malformed tool calls (bad JSON, missing name) and unknown tools become error observations
``Error: ...`` and the episode goes on.

An env with a user side (``tau2``) has ``user_reply(text) -> str | None``: a turn without a tool call
goes to it first; a string is the user's next message (a ``user`` turn, mask False, counted in
``info["user_turns"]``, its time in ``info["user_s"]``) and the episode goes on; None ends it with
``env.score(text)`` as above. ``info["reset_s"]`` is the seconds of ``env.reset``; an env with
``episode_info() -> dict`` adds what it measured itself to ``info`` at the end (tau2: its user model's
tokens and seconds).

K/V across turns: with a generator that has sessions (``release_session``, i.e.
:class:`rollout.generator.Generator`) every turn is submitted with the episode's session key, so the
generator keeps the episode's K/V between turns and the next turn prefills only its new tokens
(``rollout.keep_kv``); the session is released when the episode ends. ``info["prefill_tokens"]``
sums the cache positions the engine ran through prefill for the episode's turns.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Optional, Sequence

import numpy as np

from .envs.base import Env, ToolError, parse_tool_calls  # parse_tool_calls: re-exported
from .types import (ROUTE_MISSING, Completion, OrderedGenerator, PartialTokens, SessionGenerator, TokenGenerator,
                    Trajectory)

__all__ = ["AgentLoop", "GeneratorLike", "parse_tool_calls", "demo_chat", "build_sft_example", "sft_example",
           "episode_seed"]

class _Overlong(Exception):
    """The episode's prompt does not fit ``max_cache_len`` (ends the episode; not a failure)."""


GeneratorLike = TokenGenerator
"""What the agent asks of a generator (:class:`rollout.types.TokenGenerator`; its optional capabilities:
:class:`rollout.types.SessionGenerator`, :class:`~rollout.types.OrderedGenerator`, :class:`~rollout.types.PartialTokens`)."""


def episode_seed(task_seed: int, sample_idx: int, turn: int) -> int:
    """Deterministic sampling seed of one generation request (non-negative int < 2**31)."""
    return (int(task_seed) * 1_000_003 + int(sample_idx) * 10_007 + int(turn) * 101 + 12345) % (2**31 - 1)


class AgentLoop:
    """Runs episodes concurrently (a thread pool; each episode blocks on generator futures).

    A group's first requests form a gang the generator admits together (``rollout.admission``): a sample
    that has asked blocks its worker until the rest of its group has asked too. So :meth:`submit_group`
    puts a group's samples into the pool back to back, under a lock: two producer threads submitting groups
    at once interleaved them (A0 B0 A1 B1), and a pool of ``group_size`` workers then ran A0 and B0, each
    waiting for a sibling queued behind the other (a hang until the episode timeout; seen in
    ``tests/test_old_logits_routes.py``). In order, a pool of at least ``group_size`` workers always holds
    the whole of the group being started.

    Args:
        generator: any object with ``submit(prompt_ids, *, max_new_tokens, seed, stop_ids) ->
            Future[Completion]`` (docs/interfaces.md "Generator <-> agent").
        tokenizer: a :class:`jax_rl.models.tokenizer.ChatTokenizer`.
        env_factory: zero-argument callable returning a fresh :class:`Env` (one per episode).
        cfg: a ``RolloutConfig`` (uses max_turns, max_new_tokens_per_turn, max_tokens_per_episode,
            max_cache_len, episode_timeout_s, slots, threads).
        group_size: samples per task of :meth:`submit_group` (``algo.group_size``).
        max_workers: concurrent episodes; default ``max(cfg.slots * cfg.threads, group_size)``.
        env_name: name recorded in ``Trajectory.env`` (default: the env's ``name``).
        track: keep every episode, from its start until :meth:`release`, so that
            :meth:`unscored_prefixes` can ship the prefixes, token versions and recorded routes of
            finished and in-flight episodes (``old_logits.route=interrupt|retire``,
            :class:`jax_rl.learner.correction.old_logits.RetiringScorer`). Released keys are ``(group_id, sample_idx)``.
    """

    def __init__(
        self,
        generator: GeneratorLike,
        tokenizer: Any,
        env_factory: Callable[[], Env],
        cfg: Any,
        *,
        group_size: int = 1,
        max_workers: Optional[int] = None,
        env_name: Optional[str] = None,
        track: bool = False,
    ):
        self.generator = generator
        self.track = bool(track)
        self._live: dict[tuple[int, int], dict] = {}  # track: key -> {"tokens","mask","vers","fut","final","routes"}
        self._live_lock = threading.Lock()
        self.tok = tokenizer
        self.env_factory = env_factory
        self.cfg = cfg
        self.env_name = env_name
        self.group_size = int(group_size)
        self.max_workers = int(max_workers or max(cfg.slots * cfg.threads, self.group_size))
        self._sessions = itertools.count()
        self._pool = ThreadPoolExecutor(max_workers=self.max_workers, thread_name_prefix="agent")
        self._lock = threading.Lock()
        self._group_lock = threading.Lock()
        self.stats: dict[str, int] = {"episodes": 0, "failed": 0, "overlong": 0, "answered": 0, "truncated": 0,
                                      "tool_calls": 0, "tool_errors": 0}

    # ------------------------------------------------------------------ public
    def submit_episode(self, task_seed: int, *, group_id: int = 0, sample_idx: int = 0,
                       group_size: Optional[int] = None) -> "Future[Trajectory]":
        """Start one episode in the pool (``group_size``: of a group started together, :meth:`run_episode`)."""
        return self._pool.submit(self.run_episode, task_seed, group_id=group_id, sample_idx=sample_idx,
                                 group_size=group_size)

    def submit_group(self, task_seed: int, group_id: int, group_size: Optional[int] = None) -> "Future[list[Trajectory]]":
        """Start ``group_size`` (default the loop's ``group_size``) samples of task ``task_seed``; the future
        resolves to the list of trajectories (order = sample index) when all are done."""
        n = int(group_size or self.group_size)
        with self._group_lock:  # a group's samples enter the pool back to back (the class doc)
            futs = [self.submit_episode(task_seed, group_id=group_id, sample_idx=i, group_size=n) for i in range(n)]
        out: Future = Future()
        remaining = [n]
        lock = threading.Lock()

        def done(_f: Future) -> None:
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                try:
                    out.set_result([f.result() for f in futs])
                except BaseException as e:  # pragma: no cover - run_episode does not raise
                    out.set_exception(e)

        for f in futs:
            f.add_done_callback(done)
        return out

    def run_groups(self, task_seeds: Sequence[int], group_size: Optional[int] = None,
                   first_group_id: int = 0) -> list[list[Trajectory]]:
        """Run one group per task seed concurrently; blocking. Group ids are consecutive."""
        futs = [self.submit_group(s, first_group_id + i, group_size) for i, s in enumerate(task_seeds)]
        return [f.result() for f in futs]

    def close(self, wait: bool = True) -> None:
        self._pool.shutdown(wait=wait, cancel_futures=not wait)

    def __enter__(self) -> "AgentLoop":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ tracking (exact old logits)
    def unscored_prefixes(self) -> list[tuple[tuple[int, int], np.ndarray, np.ndarray, np.ndarray,
                                              Optional[np.ndarray]]]:
        """Every tracked episode not yet released, as ``(key, tokens int32 [L], versions int32 [L],
        loss_mask bool [L], routes)``: a finished one's whole trajectory; an in-flight one's tokens so
        far, with the current turn's tokens still in a generator slot (``generator.partial_tokens``)
        or in a completion not yet appended. ``routes`` (``moe.routing_replay``, a generator that
        records them; else None): int [L, n_moe_layers, k] aligned with ``tokens``, built as the
        episode's :class:`Trajectory` builds its own (earlier turns' routes, then the current turn's
        from the slot or completion; a position holds its most recent route; ``ROUTE_MISSING`` where none
        yet), so a prefix carries the routes its trajectory will carry at those positions unless a
        later prefill re-runs them (the next turn, a ``recompute_kv`` swap): the trajectory then holds
        the newer routes, the prefix the ones in use when it was taken.
        Consistent with the episode threads (one lock); every token generated before the call is
        included (later ones may be)."""
        out = []
        partial = self.generator.partial_tokens if isinstance(self.generator, PartialTokens) else None
        with self._live_lock:
            for key, ep in self._live.items():
                fin = ep["final"]
                if fin is not None:
                    out.append((key, fin.tokens, fin.versions, fin.loss_mask, fin.routes))
                    continue
                toks, vers, mask = list(ep["tokens"]), _cat(ep["vers"], np.int32), _cat(ep["mask"], bool)
                routes = ep.get("routes")
                fut = ep["fut"]
                extra = None
                if fut is not None:
                    rid = getattr(fut, "request_id", None)
                    if partial is not None and rid is not None:
                        extra = partial(rid)
                    if extra is None and fut.done() and not fut.cancelled() and fut.exception() is None:
                        c = fut.result()
                        extra = (c.tokens, c.versions, getattr(c, "routes", None))
                if extra:
                    toks += list(extra[0])
                    vers = np.concatenate([vers, np.asarray(extra[1], np.int32)])
                    mask = np.concatenate([mask, np.ones(len(extra[0]), bool)])
                    if len(extra) > 2 and extra[2] is not None:
                        routes = _merge_routes(routes, np.asarray(extra[2]))
                if routes is not None:  # aligned with toks: MISSING where nothing ran yet
                    routes = _merge_routes(routes, np.full((len(toks), *routes.shape[1:]), ROUTE_MISSING,
                                                           routes.dtype))
                out.append((key, np.asarray(toks, np.int32), vers, mask, routes))
        return out

    def release(self, keys) -> None:
        """Forget tracked episodes (their group is scored); unknown keys are ignored."""
        with self._live_lock:
            for k in keys:
                self._live.pop(tuple(int(x) for x in k), None)

    # ------------------------------------------------------------------ one episode
    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.stats[key] = self.stats.get(key, 0) + n

    def run_episode(self, task_seed: int, *, group_id: int = 0, sample_idx: int = 0,
                    group_size: Optional[int] = None) -> Trajectory:
        """Run one episode to completion; never raises (failures are recorded in ``info``).

        With a generator that admits deterministically (``rollout.Generator.withdraw``), every request
        carries the order key ``(group_id, sample_idx, turn)``, and with ``group_size`` (the episode is one
        of a group started together, :meth:`submit_group`) its first request is one of the group's gang,
        admitted with the others in one step (``rollout.admission``); an episode that ends before its first
        request withdraws from the gang."""
        ep = _Episode(self, task_seed, group_id, sample_idx, group_size)
        try:
            ep.play()
        except _Overlong as e:  # dropped by the buffer (counted as dropped_overlong), not an env failure
            ep.info["drop_reason"] = str(e)
            ep.reward = 0.0
        except Exception as e:  # env failure (or a broken generator): fail this episode only
            ep.info["failed"] = True
            ep.info["fail_reason"] = f"{type(e).__name__}: {e}"
            ep.info["traceback"] = traceback.format_exc(limit=4)
            ep.reward = 0.0
        return ep.finish()


class _Episode:
    """One episode while :meth:`AgentLoop.run_episode` runs it, in named steps: :meth:`start` (env reset,
    prompt), per turn :meth:`generate` (submit, wait, budget and deadline) and :meth:`respond` (the answer,
    the env's user or the tool calls), then :meth:`finish` (counts, the Trajectory). It holds the context
    given to the generator and the per-token fields as one array per appended piece (prompt, generated
    turn, tool / user turn), concatenated once into the Trajectory (the Completion's ``behav_logp`` /
    ``versions`` are never unpacked)."""

    def __init__(self, loop: AgentLoop, task_seed: int, group_id: int, sample_idx: int,
                 group_size: Optional[int] = None) -> None:
        self.loop, self.cfg, self.tok = loop, loop.cfg, loop.tok
        self.task_seed, self.group_id, self.sample_idx = task_seed, group_id, sample_idx
        self.t0 = time.monotonic()
        # episode_timeout_s=None: no wall-clock limit (result(timeout=None) waits for good)
        self.deadline = None if self.cfg.episode_timeout_s is None else self.t0 + float(self.cfg.episode_timeout_s)
        self.tokens: list[int] = []  # the context the generator is given (a list: it is submitted as one)
        self.mask: list[np.ndarray] = []
        self.behav_logp: list[np.ndarray] = []
        self.vers: list[np.ndarray] = []
        self.turns: list[np.ndarray] = []
        self.routes: Optional[np.ndarray] = None  # [<= len(tokens), n_moe_layers, k] (moe.routing_replay)
        self.info: dict[str, Any] = {"sample_idx": int(sample_idx), "turns": 0, "tool_calls": 0, "tool_errors": [],
                                     "truncated": None, "answered": False, "failed": False, "gen_s": 0.0,
                                     "tool_s": 0.0, "turn_starts": [], "finish_reasons": []}
        self.reward = 0.0
        self.env: Optional[Env] = None
        self.env_name = loop.env_name or ""
        # a generator with sessions (rollout.Generator) holds the episode's slot between turns
        self.session = (id(loop), next(loop._sessions)) if isinstance(loop.generator, SessionGenerator) else None
        self.session_kw: dict = {}
        self.ordered = isinstance(loop.generator, OrderedGenerator)  # admits by order key
        self.gang = None  # (key, n) until the first request is submitted
        if self.ordered and group_size and int(group_size) > 1:
            self.gang = ((id(loop), int(group_id)), int(group_size))
        self.info["prefill_tokens"] = 0
        self.info["prefix_hits"] = 0
        self.live = {"tokens": self.tokens, "mask": self.mask, "vers": self.vers, "fut": None, "final": None,
                     "routes": None}
        self.lock = loop._live_lock if loop.track else contextlib.nullcontext()
        if loop.track:
            with loop._live_lock:
                loop._live[(int(group_id), int(sample_idx))] = self.live

    def append(self, ids: Sequence[int], gen: Optional[Completion] = None, turn: int = -1,
               gen_routes: Optional[np.ndarray] = None) -> None:
        """Append a piece: generated (``gen``, mask True, its behav_logp / versions) or context."""
        with self.lock:  # tracked: the lists, the routes and the pending request change together
            n = len(ids)
            self.tokens.extend(int(i) for i in ids)
            if gen is None:
                self.mask.append(np.zeros(n, bool))
                self.behav_logp.append(np.zeros(n, np.float32))
                self.vers.append(np.full(n, -1, np.int32))
                self.turns.append(np.full(n, -1, np.int32))
            else:
                self.mask.append(np.ones(n, bool))
                self.behav_logp.append(gen.behav_logp)
                self.vers.append(gen.versions)
                self.turns.append(np.full(n, turn, np.int32))
            self.live["fut"] = None
            if gen_routes is not None:
                self.live["routes"] = gen_routes

    def play(self) -> None:
        """Reset the env and run turns until the episode ends (``info["truncated"]`` / ``"answered"``)."""
        self.start()
        budget = int(self.cfg.max_tokens_per_episode)
        for turn in range(int(self.cfg.max_turns)):
            comp = self.generate(turn, budget)
            if comp is None:
                break
            budget -= len(comp.tokens)
            if not self.respond(comp, turn):
                break

    def start(self) -> None:
        """Build the env, reset it, render and append the prompt. Raises _Overlong when the prompt
        leaves no room for one generated token."""
        cfg, tok = self.cfg, self.tok
        env = self.env = self.loop.env_factory()
        self.env_name = self.loop.env_name or getattr(env, "name", "") or type(env).__name__
        ts = time.monotonic()
        messages, tools = env.reset(int(self.task_seed))
        self.info["reset_s"] = time.monotonic() - ts
        self.tool_names = {(t.get("function") or t).get("name") for t in (tools or [])}
        shown_tools = tools if getattr(cfg, "render_tools", True) else None
        prompt, _ = tok.render_chat(messages, shown_tools, add_generation_prompt=True)
        self.append(prompt)
        self.info["prompt_len"] = len(prompt)
        if len(prompt) >= int(cfg.max_cache_len):  # no room for one generated token: never trainable
            self.info["overlong"] = "prompt"
            self.info["truncated"] = "context"
            raise _Overlong(f"prompt of {len(prompt)} tokens leaves no room in rollout.max_cache_len="
                            f"{int(cfg.max_cache_len)}")
        self.stop_ids = tuple(tok.stop_ids)
        if self.session is not None:  # the generator keeps this episode's K/V between its turns
            self.session_kw = {"session": self.session,
                               "prefix_len": shared_prefix_len(tok, messages, shown_tools, prompt)}

    def generate(self, turn: int, budget: int) -> Optional[Completion]:
        """Turn ``turn``'s completion, appended; None when the episode ends first (token budget, context,
        deadline: ``info["truncated"]``). Raises RuntimeError for a broken or aborted generation."""
        info = self.info
        room = int(self.cfg.max_cache_len) - len(self.tokens)
        max_new = min(int(self.cfg.max_new_tokens_per_turn), budget, room)
        if max_new <= 0:
            info["truncated"] = "token_budget" if budget <= 0 else "context"
            return None
        remaining_s = None if self.deadline is None else self.deadline - time.monotonic()
        if remaining_s is not None and remaining_s <= 0:
            info["truncated"] = "time"
            return None
        ts = time.monotonic()
        order_kw = {"order": (int(self.group_id), int(self.sample_idx), turn)} if self.ordered else {}
        if self.gang is not None:
            order_kw["gang"] = self.gang
        fut = self.loop.generator.submit(list(self.tokens), max_new_tokens=max_new,
                                         seed=episode_seed(self.task_seed, self.sample_idx, turn),
                                         stop_ids=self.stop_ids, **self.session_kw, **order_kw)
        self.gang = None  # queued (a submit that raised queued nothing: withdrawn in finish)
        with self.lock:
            self.live["fut"] = fut
        try:
            comp: Completion = fut.result(timeout=remaining_s)
        except FutureTimeout:
            fut.cancel()
            with self.lock:
                self.live["fut"] = None
            info["truncated"] = "time"
            return None
        info["gen_s"] += time.monotonic() - ts
        if len(comp.tokens) > max_new:
            raise RuntimeError(f"generator returned {len(comp.tokens)} tokens > max_new_tokens={max_new}")
        self.record(comp, turn)
        return comp

    def record(self, comp: Completion, turn: int) -> None:
        """Count a completion's engine figures and append its tokens (and routes) as turn ``turn``."""
        info = self.info
        info["finish_reasons"].append(comp.finish_reason)
        info["prefill_tokens"] += int((comp.info or {}).get("prefill_tokens", 0))
        info["prefix_hits"] += int((comp.info or {}).get("prefix_hits", 0))
        for key in ("moe_dropped_copies", "moe_copies"):  # engine-side MoE capacity drops
            if key in (comp.info or {}):
                info[key] = info.get(key, 0) + int(comp.info[key])
        if comp.finish_reason == "aborted":
            raise RuntimeError("generation aborted")
        info["turn_starts"].append(len(self.tokens))
        if getattr(comp, "routes", None) is not None:
            self.routes = _merge_routes(self.routes, comp.routes)
        self.append(comp.tokens, comp, turn, self.routes)
        info["turns"] = turn + 1

    def respond(self, comp: Completion, turn: int) -> bool:
        """Act on turn ``turn``'s text: a final answer is scored, a message goes to the env's user, tool
        calls run. True when the episode goes on."""
        ended = bool(comp.tokens) and comp.tokens[-1] in self.stop_ids
        text = self.tok.decode(comp.tokens[:-1] if ended else comp.tokens)
        if not ended:  # cut off mid-turn: no parseable action
            self.info["truncated"] = "turn_length"
            return False
        if "<tool_call>" not in text:  # a final answer, or a message to the env's user
            reply = self.ask_user(text)
            if reply is None:
                self.score(text)
                return False
            # the user answered: its turn is context, never trained
            return self.append_turn(turn, lambda: self.tok.user_turn_ids(str(reply), add_generation_prompt=True))
        observations = self.run_tools(text)
        return self.append_turn(turn, lambda: self.tok.tool_turn_ids(observations, add_generation_prompt=True))

    def ask_user(self, text: str) -> Optional[str]:
        """The env's user's reply to ``text`` (envs with a user side, tau2), or None (no user, or it ended)."""
        user_reply = getattr(self.env, "user_reply", None)
        if user_reply is None:
            return None
        ts = time.monotonic()
        reply = user_reply(text)
        self.info["user_s"] = self.info.get("user_s", 0.0) + time.monotonic() - ts
        if reply is not None:
            self.info["user_turns"] = self.info.get("user_turns", 0) + 1
        return reply

    def score(self, text: str) -> None:
        """The env's reward for the final answer ``text``, clipped to [0, 1]."""
        ts = time.monotonic()
        r, sinfo = self.env.score(text)
        self.info["tool_s"] += time.monotonic() - ts
        self.reward = float(min(1.0, max(0.0, r)))
        self.info["score"] = sinfo
        self.info["answered"] = True

    def run_tools(self, text: str) -> list[str]:
        """Run the tool calls of ``text``; their observations (errors as ``Error: ...``)."""
        info = self.info
        calls, errors = parse_tool_calls(text)
        observations = [f"Error: {e}" for e in errors]
        ts = time.monotonic()
        for call in calls:
            info["tool_calls"] += 1
            if call["name"] not in self.tool_names:
                observations.append(f"Error: unknown tool {call['name']!r}; available: {', '.join(sorted(self.tool_names))}")
                errors.append(f"unknown tool {call['name']!r}")
                continue
            try:
                observations.append(str(self.env.step(call)))
            except ToolError as e:
                observations.append(f"Error: {e}")
                errors.append(str(e))
        info["tool_s"] += time.monotonic() - ts
        info["tool_errors"].extend(errors)
        return observations

    def append_turn(self, turn: int, render: Callable[[], Sequence[int]]) -> bool:
        """Append the next context turn after turn ``turn`` (``render()``: a user turn's or the tool
        observations' ids, rendered only when there is a next turn); False (and ``info["truncated"]``)
        when ``turn`` was the last one or the new turn does not fit."""
        if turn == int(self.cfg.max_turns) - 1:
            self.info["truncated"] = "max_turns"
            return False
        nxt = render()
        if len(self.tokens) + len(nxt) >= int(self.cfg.max_cache_len):
            self.info["truncated"] = "context"
            return False
        self.append(nxt)
        return True

    def finish(self) -> Trajectory:
        """Release the session, add the env's own measurements, count the outcome, build the Trajectory."""
        loop, info = self.loop, self.info
        if self.gang is not None:  # ended before its first request: the rest of its group does not wait for it
            loop.generator.withdraw(self.gang)
        if self.session is not None:
            loop.generator.release_session(self.session)
        episode_info = getattr(self.env, "episode_info", None) if self.env is not None else None
        if episode_info is not None:  # what the env measured itself (tau2: its user model's tokens and seconds)
            try:
                info.update(episode_info())
            except Exception as e:  # noqa: BLE001 - a measurement never fails the episode
                info["episode_info_error"] = f"{type(e).__name__}: {e}"
        info["total_s"] = time.monotonic() - self.t0
        loop._count("episodes")
        loop._count("tool_calls", info["tool_calls"])
        loop._count("tool_errors", len(info["tool_errors"]))
        loop._count("failed" if info["failed"] else "overlong" if info.get("overlong")
                    else "answered" if info["answered"] else "truncated")
        routes = self.routes
        if routes is not None:  # positions the engine never ran (a last tool turn): no route
            routes = _merge_routes(routes, np.full((len(self.tokens), *routes.shape[1:]), ROUTE_MISSING, routes.dtype))
        traj = Trajectory(tokens=np.asarray(self.tokens, np.int32), loss_mask=_cat(self.mask, bool),
                          behav_logp=_cat(self.behav_logp, np.float32), versions=_cat(self.vers, np.int32),
                          turn_ids=_cat(self.turns, np.int32), reward=self.reward, group_id=self.group_id,
                          env=self.env_name, seed=int(self.task_seed), info=info, routes=routes)
        with self.lock:  # tracked: kept (finished, unscored) until release()
            self.live["final"], self.live["fut"] = traj, None
        return traj


def shared_prefix_len(tok: Any, messages: Sequence[dict], tools: Optional[Sequence[dict]], prompt: Sequence[int]) -> int:
    """Tokens of ``prompt`` every episode of the env shares: the rendered system message (with the tool
    schemas), when the prompt starts with it; 0 otherwise (the generator's prefix cache key)."""
    if not messages or messages[0].get("role") != "system":
        return 0
    ids, _ = tok.render_chat(list(messages[:1]), tools)
    n = len(ids)
    return n if 0 < n < len(prompt) and list(prompt[:n]) == list(ids) else 0


def _cat(chunks: Sequence[np.ndarray], dtype: Any) -> np.ndarray:
    """The pieces of one per-token field as one ``dtype`` array [sum of lengths] (empty when none)."""
    return np.concatenate(chunks).astype(dtype, copy=False) if chunks else np.zeros(0, dtype)


def _merge_routes(old: Optional[np.ndarray], new: np.ndarray) -> np.ndarray:
    """Routes of a longer context (int [len(new), n_moe_layers, k]): a position takes its most
    recent route, ``new``'s, and keeps ``old``'s only where ``new`` has none (``ROUTE_MISSING``, e.g.
    an all-missing padding of a last tool turn). A turn that re-prefills re-runs every earlier
    position, and the turn's tokens were computed from that prefill's K/V, so its routes replace the
    earlier turns' (the ``Generator`` rule: a position holds the route it was run with most
    recently); a turn that kept its K/V (``rollout.keep_kv``) reports, at the kept positions, the
    routes they were computed with, i.e. the earlier turns' own."""
    out = np.array(new, copy=True)
    if old is not None and len(old):
        n = min(len(old), len(out))
        missing = np.any(out[:n] == ROUTE_MISSING, axis=-1, keepdims=True)
        out[:n] = np.where(missing, old[:n], out[:n])
    return out


def demo_chat(env: Env, seed: int, render_tools: bool = True) -> tuple[list[dict], Optional[list[dict]]]:
    """``(messages, tools)`` of a reference demonstration: ``env.reset(seed)``'s prompt messages
    followed by ``env.reference_solution(seed)``; ``tools`` is None unless ``render_tools``."""
    messages, tools = env.reset(int(seed))
    quiet = getattr(env, "no_latency", None)  # a demonstration is not an episode: no simulated tool latency
    with (quiet() if callable(quiet) else contextlib.nullcontext()):
        demo = env.reference_solution(int(seed))
    return list(messages) + list(demo), (tools if render_tools else None)


def build_sft_example(env: Env, seed: int, tokenizer: Any, max_len: Optional[int] = None,
                      render_tools: bool = True) -> dict[str, np.ndarray]:
    """An SFT demonstration: ``env.reset(seed)`` + ``env.reference_solution(seed)`` rendered with the
    same template and token layout the agent loop produces (assistant turn bodies incl. their
    ``<|im_end|>`` in the mask; nothing after the last ``<|im_end|>``).

    Returns:
        ``{"tokens": int32 [T], "loss_mask": bool [T]}``.

    Raises:
        ValueError: the example is longer than ``max_len`` tokens.
    """
    ids, mask = tokenizer.render_chat(*demo_chat(env, seed, render_tools), preserve_thinking=True)
    last = max((i for i, m in enumerate(mask) if m), default=len(ids) - 1)
    ids, mask = ids[: last + 1], mask[: last + 1]
    if max_len is not None and len(ids) > max_len:
        raise ValueError(f"SFT example for seed {seed} has {len(ids)} tokens > max_len={max_len}")
    return {"tokens": np.asarray(ids, np.int32), "loss_mask": np.asarray(mask, bool)}


def sft_example(env: Env, tokenizer: Any, seed: int, render_tools: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens int32 [T], loss_mask bool [T])`` of :func:`build_sft_example` (runtime's calling form)."""
    ex = build_sft_example(env, seed, tokenizer, render_tools=render_tools)
    return ex["tokens"], ex["loss_mask"]
