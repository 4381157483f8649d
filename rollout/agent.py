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
from typing import Any, Callable, Optional, Protocol, Sequence

import numpy as np

from .envs.base import Env, ToolError, parse_tool_calls  # parse_tool_calls: re-exported
from .types import ROUTE_MISSING, Completion, Trajectory

__all__ = ["AgentLoop", "GeneratorLike", "parse_tool_calls", "demo_chat", "build_sft_example", "sft_example",
           "episode_seed"]

class _Overlong(Exception):
    """The episode's prompt does not fit ``max_cache_len`` (ends the episode; not a failure)."""


class GeneratorLike(Protocol):
    def submit(self, prompt_ids: list[int], *, max_new_tokens: int, seed: int, stop_ids: Sequence[int]) -> "Future[Completion]": ...


def episode_seed(task_seed: int, sample_idx: int, turn: int) -> int:
    """Deterministic sampling seed of one generation request (non-negative int < 2**31)."""
    return (int(task_seed) * 1_000_003 + int(sample_idx) * 10_007 + int(turn) * 101 + 12345) % (2**31 - 1)


class AgentLoop:
    """Runs episodes concurrently (a thread pool; each episode blocks on generator futures).

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
            :class:`jax_rl.correction.old_logits.RetiringScorer`). Released keys are ``(group_id, sample_idx)``.
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
        partial = getattr(self.generator, "partial_tokens", None)
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
        cfg, tok = self.cfg, self.tok
        t0 = time.monotonic()
        # episode_timeout_s=None: no wall-clock limit (result(timeout=None) waits for good)
        deadline = None if cfg.episode_timeout_s is None else t0 + float(cfg.episode_timeout_s)
        tokens: list[int] = []  # the context the generator is given (a list: it is submitted as one)
        # the per-token fields as one array per appended piece (prompt, generated turn, tool / user turn),
        # concatenated once into the Trajectory: the Completion's behav_logp / versions are never unpacked
        mask: list[np.ndarray] = []
        behav_logp: list[np.ndarray] = []
        vers: list[np.ndarray] = []
        turns: list[np.ndarray] = []
        routes: Optional[np.ndarray] = None  # [<= len(tokens), n_moe_layers, k] (moe.routing_replay)
        info: dict[str, Any] = {"sample_idx": int(sample_idx), "turns": 0, "tool_calls": 0, "tool_errors": [],
                                "truncated": None, "answered": False, "failed": False, "gen_s": 0.0, "tool_s": 0.0,
                                "turn_starts": [], "finish_reasons": []}
        reward = 0.0
        env = None
        env_name = self.env_name or ""
        # a generator with sessions (rollout.Generator) holds the episode's slot between turns
        session = (id(self), next(self._sessions)) if getattr(self.generator, "release_session", None) else None
        session_kw: dict = {}
        ordered = getattr(self.generator, "withdraw", None) is not None  # admits by order key (rollout.admission)
        gang = None  # (key, n) until the first request is submitted
        if ordered and group_size and int(group_size) > 1:
            gang = ((id(self), int(group_id)), int(group_size))
        info["prefill_tokens"] = 0
        info["prefix_hits"] = 0
        live = {"tokens": tokens, "mask": mask, "vers": vers, "fut": None, "final": None, "routes": None}
        lock = self._live_lock if self.track else contextlib.nullcontext()
        if self.track:
            with self._live_lock:
                self._live[(int(group_id), int(sample_idx))] = live

        def append(ids: Sequence[int], gen: Optional[Completion] = None, turn: int = -1,
                   gen_routes: Optional[np.ndarray] = None) -> None:
            with lock:  # tracked: the lists, the routes and the pending request change together
                _append(ids, gen, turn)
                live["fut"] = None
                if gen_routes is not None:
                    live["routes"] = gen_routes

        def _append(ids: Sequence[int], gen: Optional[Completion] = None, turn: int = -1) -> None:
            n = len(ids)
            tokens.extend(int(i) for i in ids)
            if gen is None:
                mask.append(np.zeros(n, bool))
                behav_logp.append(np.zeros(n, np.float32))
                vers.append(np.full(n, -1, np.int32))
                turns.append(np.full(n, -1, np.int32))
            else:
                mask.append(np.ones(n, bool))
                behav_logp.append(gen.behav_logp)
                vers.append(gen.versions)
                turns.append(np.full(n, turn, np.int32))

        try:
            env = self.env_factory()
            env_name = self.env_name or getattr(env, "name", "") or type(env).__name__
            ts = time.monotonic()
            messages, tools = env.reset(int(task_seed))
            info["reset_s"] = time.monotonic() - ts
            tool_names = {(t.get("function") or t).get("name") for t in (tools or [])}
            shown_tools = tools if getattr(self.cfg, "render_tools", True) else None
            prompt, _ = tok.render_chat(messages, shown_tools, add_generation_prompt=True)
            append(prompt)
            info["prompt_len"] = len(prompt)
            if len(prompt) >= int(cfg.max_cache_len):  # no room for one generated token: never trainable
                info["overlong"] = "prompt"
                info["truncated"] = "context"
                raise _Overlong(f"prompt of {len(prompt)} tokens leaves no room in rollout.max_cache_len="
                                f"{int(cfg.max_cache_len)}")
            budget = int(cfg.max_tokens_per_episode)
            stop_ids = tuple(tok.stop_ids)
            if session is not None:  # the generator keeps this episode's K/V between its turns
                session_kw = {"session": session, "prefix_len": shared_prefix_len(tok, messages, shown_tools, prompt)}
            for turn in range(int(cfg.max_turns)):
                room = int(cfg.max_cache_len) - len(tokens)
                max_new = min(int(cfg.max_new_tokens_per_turn), budget, room)
                if max_new <= 0:
                    info["truncated"] = "token_budget" if budget <= 0 else "context"
                    break
                remaining_s = None if deadline is None else deadline - time.monotonic()
                if remaining_s is not None and remaining_s <= 0:
                    info["truncated"] = "time"
                    break
                ts = time.monotonic()
                order_kw = {"order": (int(group_id), int(sample_idx), turn)} if ordered else {}
                if gang is not None:
                    order_kw["gang"] = gang
                fut = self.generator.submit(list(tokens), max_new_tokens=max_new,
                                            seed=episode_seed(task_seed, sample_idx, turn), stop_ids=stop_ids,
                                            **session_kw, **order_kw)
                gang = None  # queued (a submit that raised queued nothing: withdrawn below)
                with lock:
                    live["fut"] = fut
                try:
                    comp: Completion = fut.result(timeout=remaining_s)
                except FutureTimeout:
                    fut.cancel()
                    with lock:
                        live["fut"] = None
                    info["truncated"] = "time"
                    break
                info["gen_s"] += time.monotonic() - ts
                if len(comp.tokens) > max_new:
                    raise RuntimeError(f"generator returned {len(comp.tokens)} tokens > max_new_tokens={max_new}")
                info["finish_reasons"].append(comp.finish_reason)
                info["prefill_tokens"] += int((comp.info or {}).get("prefill_tokens", 0))
                info["prefix_hits"] += int((comp.info or {}).get("prefix_hits", 0))
                for key in ("moe_dropped_copies", "moe_copies"):  # engine-side MoE capacity drops
                    if key in (comp.info or {}):
                        info[key] = info.get(key, 0) + int(comp.info[key])
                if comp.finish_reason == "aborted":
                    raise RuntimeError("generation aborted")
                info["turn_starts"].append(len(tokens))
                if getattr(comp, "routes", None) is not None:
                    routes = _merge_routes(routes, comp.routes)
                append(comp.tokens, comp, turn, routes)
                info["turns"] = turn + 1
                budget -= len(comp.tokens)
                ended = bool(comp.tokens) and comp.tokens[-1] in stop_ids
                body_ids = comp.tokens[:-1] if ended else comp.tokens
                text = tok.decode(body_ids)
                if not ended:  # cut off mid-turn: no parseable action
                    info["truncated"] = "turn_length"
                    break
                if "<tool_call>" not in text:  # a final answer, or a message to the env's user
                    user_reply = getattr(env, "user_reply", None)  # envs with a user side (tau2)
                    if user_reply is not None:
                        ts = time.monotonic()
                        reply = user_reply(text)
                        info["user_s"] = info.get("user_s", 0.0) + time.monotonic() - ts
                        if reply is not None:  # the user answered: its turn is context, never trained
                            info["user_turns"] = info.get("user_turns", 0) + 1
                            if turn == int(cfg.max_turns) - 1:
                                info["truncated"] = "max_turns"
                                break
                            nxt = tok.user_turn_ids(str(reply), add_generation_prompt=True)
                            if len(tokens) + len(nxt) >= int(cfg.max_cache_len):
                                info["truncated"] = "context"
                                break
                            append(nxt)
                            continue
                    ts = time.monotonic()
                    r, sinfo = env.score(text)
                    info["tool_s"] += time.monotonic() - ts
                    reward = float(min(1.0, max(0.0, r)))
                    info["score"] = sinfo
                    info["answered"] = True
                    break
                calls, errors = parse_tool_calls(text)
                observations = [f"Error: {e}" for e in errors]
                ts = time.monotonic()
                for call in calls:
                    info["tool_calls"] += 1
                    if call["name"] not in tool_names:
                        observations.append(f"Error: unknown tool {call['name']!r}; available: {', '.join(sorted(tool_names))}")
                        errors.append(f"unknown tool {call['name']!r}")
                        continue
                    try:
                        observations.append(str(env.step(call)))
                    except ToolError as e:
                        observations.append(f"Error: {e}")
                        errors.append(str(e))
                info["tool_s"] += time.monotonic() - ts
                info["tool_errors"].extend(errors)
                if turn == int(cfg.max_turns) - 1:
                    info["truncated"] = "max_turns"
                    break
                nxt = tok.tool_turn_ids(observations, add_generation_prompt=True)
                if len(tokens) + len(nxt) >= int(cfg.max_cache_len):
                    info["truncated"] = "context"
                    break
                append(nxt)
        except _Overlong as e:  # dropped by the buffer (counted as dropped_overlong), not an env failure
            info["drop_reason"] = str(e)
            reward = 0.0
        except Exception as e:  # env failure (or a broken generator): fail this episode only
            info["failed"] = True
            info["fail_reason"] = f"{type(e).__name__}: {e}"
            info["traceback"] = traceback.format_exc(limit=4)
            reward = 0.0
        if gang is not None:  # ended before its first request: the rest of its group does not wait for it
            self.generator.withdraw(gang)
        if session is not None:
            self.generator.release_session(session)
        episode_info = getattr(env, "episode_info", None) if env is not None else None
        if episode_info is not None:  # what the env measured itself (tau2: its user model's tokens and seconds)
            try:
                info.update(episode_info())
            except Exception as e:  # noqa: BLE001 - a measurement never fails the episode
                info["episode_info_error"] = f"{type(e).__name__}: {e}"
        info["total_s"] = time.monotonic() - t0
        self._count("episodes")
        self._count("tool_calls", info["tool_calls"])
        self._count("tool_errors", len(info["tool_errors"]))
        if info["failed"]:
            self._count("failed")
        elif info.get("overlong"):
            self._count("overlong")
        elif info["answered"]:
            self._count("answered")
        else:
            self._count("truncated")
        if routes is not None:  # positions the engine never ran (a last tool turn): no route
            routes = _merge_routes(routes, np.full((len(tokens), *routes.shape[1:]), ROUTE_MISSING, routes.dtype))
        traj = Trajectory(tokens=np.asarray(tokens, np.int32), loss_mask=_cat(mask, bool),
                          behav_logp=_cat(behav_logp, np.float32), versions=_cat(vers, np.int32),
                          turn_ids=_cat(turns, np.int32), reward=reward, group_id=group_id, env=env_name,
                          seed=int(task_seed), info=info, routes=routes)
        with lock:  # tracked: kept (finished, unscored) until release()
            live["final"], live["fut"] = traj, None
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
