"""In-process continuous batching over a :class:`rollout.engine.Qwen3Engine`, with version tags.

This is the RL rollout loop (MaxText ``offline_engine`` style; JetStream's Driver does not carry
log-probs). One loop iteration (:meth:`Generator.step`):

1. apply a pending ``update_params(params, version)`` (weights swap only here, between decode
   steps) and treat the sequences already in slots according to ``partial``;
2. admit queued requests into slots and prefill them all in ONE ``engine.prefill_slots`` call (one
   jitted program per length bucket; "Prefill" below), with the *current* params;
3. one jitted ``engine.decode`` for all slots (``decode_steps`` = n > 1: one
   ``engine.generate_steps`` of at most n steps, no more than the live slots can use); its
   ``StepOutput`` comes back in ONE host transfer;
4. record per slot (token, behav_logp, version), step by step, finish sequences that hit a stop id,
   their token budget or the cache capacity, and resolve their futures (with n > 1 the tokens a
   finished slot decoded later in the same call are discarded).

Version semantics: ``engine.decode`` feeds each slot's pending token and samples the next one
in the same call, so a token is produced by exactly the params of the step that emitted it; its
version is the generator's version at that step. A request waiting in the queue while weights
change is prefilled with the new weights, and all its tokens carry the new version.

``partial`` decides what happens to sequences in slots when weights change:

* ``continue``: keep their KV cache (built by older weights); new tokens carry the new version.
* ``recompute_kv``: re-prefill prompt + generated-so-far under the new weights, then continue.
  Tokens generated before the swap keep their old version and log-prob.
* ``abort``: drop the partial turn (its tokens, log-probs and versions) and re-issue it from the
  prompt with the *remaining* budget ``max_new_tokens - dropped``; the dropped tokens count
  against the budget, so re-issues terminate. A request whose budget is exhausted this way
  finishes with ``finish_reason="aborted"`` (possibly with zero tokens).
  ``info["reissues"]`` / ``info["dropped_tokens"]`` count it.

Completion ``info`` keys: ``reissues``, ``dropped_tokens``, ``recomputes``, ``prompt_len``,
``budget`` (tokens allowed after re-issues), ``queue_s``, ``gen_s`` (and the prefill keys below);
``moe_dropped_copies`` / ``moe_copies`` (int) when the engine can drop MoE token copies for capacity
(``engine.counts_moe_drops``): the copies of the request's prefilled and fed tokens the MoE layers
dropped (``PrefillResult.moe_dropped``, ``StepOutput.moe_dropped``), and all the copies they routed.

Engine interface: the generator reads the engine's typed :class:`rollout.engine.StepOutput` (token,
valid, ``behav_logp``, version, route, ``moe_dropped`` per slot; one host transfer per engine call)
and hands the agent :class:`rollout.types.Completion` records (``tokens``, ``behav_logp``,
``versions``, ``routes``): the behaviour log-prob keeps one name from the engine to the Trajectory.
JetStream's bit-cast ``ResultTokens`` rows are only ``Qwen3Engine.generate``'s adapter for serving. A
slot whose request ended (or that is held) is deactivated before the next decode call.

Routing replay (an engine built with ``record_routes``, MoE): ``Completion.routes`` holds the
expert ids the engine's MoE layers chose at every position of prompt + generated tokens: the
prefill's for the prompt, each decode step's for the token it fed; the last token (never fed)
is ``ROUTE_MISSING``. A position holds the route it was run with MOST RECENTLY: a re-prefill
(``recompute_kv`` after a swap, ``abort``'s re-issue) overwrites the routes of every position it
recomputes, because the K/V every later token attends to are the re-prefill's (so an r3 forward at
the new params reproduces the tokens generated after the swap). The tokens generated before a
``recompute_kv`` swap lose the routes they were computed with (one route per position cannot serve
both); under ``continue`` nothing is re-run, so every position keeps the route that produced its
cached K/V (docs/correction.md, "Routing replay across a weight swap").

Prefill (an engine with ``prefill_slots``; ``Qwen3Engine`` has it). Every request admitted in a step
goes into one ``prefill_slots`` call: fresh prompts batched per length bucket (``[n, bucket]`` rows,
per-row lengths), identical prompts (a GRPO group's G samples) prefilled once and their K/V copied
into each sample's slot with its own seed, and continuing sessions appended (below). Tokens and
log-probs are those of one prefill per request (a token's key depends only on its seed and absolute
position). Starvation bound: while any slot is decoding, a step admits requests FIFO only until their
prefill tokens reach ``prefill_budget`` (``rollout.prefill_tokens_per_step``; the first request of
a step is always admitted, a prompt identical to one already admitted in the step costs nothing),
so a burst of new requests delays the decoding slots by at most one bounded prefill per step; with
no slot decoding every request that finds a slot is admitted at once.

Kept K/V (``keep_kv``, ``rollout.keep_kv``; sessions). A request submitted with ``session=key`` (the
agent passes one per episode) that finishes (stop id or budget) leaves its slot *held*: the slot's
cache holds ``prompt + tokens[:-1]`` (the last sampled token was never fed). The session's next
request whose prompt starts with that context takes the held slot and runs only its new tokens
(the last sampled token, the tool output and the generation prompt) through an append-prefill at
the cache's current length (``SlotPrefill.start``); its ``Completion.routes`` keep, at every held
position, the route that position's K/V was computed with. Holding policy: a held slot is not
decoding a request and not free; it is given up (its session's next turn then re-prefills the
whole conversation; each counted in ``stats``) when

* a queued request finds no free slot: the least recently held slot is evicted (``kv_evictions``),
  so slow tools never starve the fleet of slots;
* (no bound in decode steps: a held slot is deactivated in the engine, ``Qwen3Engine.free_slots``,
  so it neither decodes nor writes its cache while the tool runs; its K/V stay as they were);
* its session's next prompt does not extend the held context (``kv_mismatch``), or the session is
  released (:meth:`Generator.release_session`, at the end of the episode);
* a weight swap under ``partial=recompute_kv`` or ``abort`` (``kv_dropped_swap``): the next turn
  re-prefills the conversation under the new params, as the re-prefill path does. Under
  ``continue`` the held K/V stay (computed by older weights, as a ``continue`` slot's within a turn)
  and the new turn's tokens carry the new version.

Prefix cache (``prefix_cache`` entries, ``rollout.prefix_cache``). A request submitted with
``prefix_len=p`` (the agent passes the length of the env's rendered system prompt + tool schemas,
shared by every episode) starts from the K/V of ``prompt[:p]`` kept in an LRU cache keyed by those
tokens and the weight version: a miss prefills them once (``prefix_misses``; counted in that
request's ``prefill_tokens``), a hit (``prefix_hits``) copies them into the slot (one ``insert``),
and the request's row appends only ``prompt[p:]``; the other requests of the step with the same
whole prompt (a GRPO group's samples) copy that slot's row after the prefill
(``engine.copy_slot``, each armed with its own seed). A weight swap changes the key, so no request
ever starts from another version's prefix. Entries are K/V rows of the prefix's length bucket on
the engine's device(s).

Counters (``stats``): ``prefills`` (requests prefilled), ``prefill_calls``, ``prefill_tokens``
(cache positions run through prefill, re-prefills included), ``shared_prefills``, ``kv_holds``,
``kv_reused_tokens``, the eviction counters above, ``prefix_hits`` / ``prefix_misses``. Each ``Completion.info`` has its request's
``prefill_tokens``, ``kv_reused``, ``shared_prefill`` and ``prefix_hits``.

Admission order (``rollout.admission``): requests with an ``order`` key are admitted by it, not by
arrival, and a ``gang`` (a GRPO group's first requests) waits until all its members are queued (or
withdrawn, :meth:`Generator.withdraw`) and is admitted in one step, so which requests share a prefill
never depends on thread timing.

Use it synchronously (``submit`` then ``run_until_idle`` / ``generate``), or ``start()`` a
background decode thread and block on the futures from any thread.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import logging
import threading
import time
from typing import Any, Collection, Optional, Sequence

import jax
import numpy as np

from rollout.admission import GangRoom, admission_sorted, gang_fits
from rollout.engine import SlotPrefill
from rollout.types import ROUTE_MISSING, Completion  # tokens, behav_logp, versions, finish_reason, info

__all__ = ["Completion", "Generator", "PARTIAL_MODES"]

log = logging.getLogger(__name__)

PARTIAL_MODES = ("continue", "recompute_kv", "abort")


@dataclasses.dataclass
class _Req:
    request_id: int
    prompt: list[int]
    max_new_tokens: int
    seed: int
    stop_ids: frozenset
    temperature: Optional[float]
    future: concurrent.futures.Future
    t_submit: float
    budget: int = 0
    tokens: list = dataclasses.field(default_factory=list)
    # float32 / int32 [capacity]: the step outputs' columns written in place per generated token
    # (:meth:`Generator._consume_step`); the first len(tokens) entries are real (set at admission)
    behav_logp: Optional[np.ndarray] = None
    versions: Optional[np.ndarray] = None
    routes: list = dataclasses.field(default_factory=list)  # [n_moe_layers, k] per context position
    reissues: int = 0
    dropped: int = 0
    recomputes: int = 0
    t_start: float = 0.0
    session: Any = None
    prefill_tokens: int = 0  # cache positions this request's prefills ran (re-prefills included)
    kv_reused: int = 0  # cache positions reused from its session's held slot at admission
    shared_prefill: bool = False  # its prompt's K/V came from another request's prefill (a GRPO group)
    prefix_len: int = 0  # the shared prefix (env system prompt + tools) the prefix cache may serve
    prefix_hits: int = 0  # admissions whose first prefix_len positions came from the prefix cache
    moe_dropped: int = 0  # MoE token copies the engine dropped for capacity on this request's tokens
    moe_copies: int = 0  # MoE token copies its tokens routed (prefilled + fed positions x MoE layers x k)
    order: tuple = ()  # the admission order key (rollout.admission): the agent's (group id, sample, turn)
    gang: Any = None  # the gang this first request belongs to until it is admitted (rollout.admission)


@dataclasses.dataclass
class _Held:
    """A finished turn's slot kept for its session's next turn (module docstring, "Kept K/V")."""
    slot: int
    context: list  # the tokens whose K/V the slot holds, at positions 0..len-1
    routes: list  # their routes (record_routes), one [n_moe_layers, k] per position
    t: float  # when it was held (the least recently held one is evicted first)


class Generator:
    """Continuous-batching generator over a JetStream-style engine.

    Args:
      engine: a :class:`rollout.engine.Qwen3Engine`, or any engine with its RL interface:
        ``prefill_slots`` / ``copy_slot`` / ``prefill_tokens`` + ``insert`` (prefix cache) /
        ``decode`` / ``generate_steps`` (returning :class:`rollout.engine.StepOutput`) /
        ``free_slots`` / ``load_params`` / ``init_decode_state`` / ``max_concurrent_decodes`` /
        ``max_cache_len``.
      partial: ``"continue" | "recompute_kv" | "abort"`` (see module doc).
      params: initial params (already loaded with ``engine.load_params``); default
        ``engine.params``.
      version: version of the initial params.
      decode_steps: the most decode steps per engine call (``rollout.decode_steps``, >= 1). 1:
        one ``engine.decode`` per step. n > 1: one ``engine.generate_steps(params, state, m)``
        (one dispatch, one host transfer) per step, where m is the smallest of
        :attr:`step_counts` (the powers of two below n, and n: at most ``floor(log2 n) + 2``
        compiled decode programs, m = 1 being ``engine.decode``) that covers the largest number
        of tokens a live slot can still emit (its remaining ``max_new_tokens`` budget, capped by
        its cache room): a call never runs steps that no slot can use (a 1-token request runs
        one step, not n). A stop id cannot be foreseen: the m tokens of each slot are consumed
        in order and a slot that finishes mid-chunk (stop id, or a budget shorter than
        another slot's) keeps the tokens up to and including its last one, the rest are
        discarded (counted in ``stats["discarded_tokens"]``). Weight swaps and admissions
        happen between calls, so a swap waits at most n - 1 tokens; every token carries the
        version of the params that produced it. The tokens and log-probs equal decode_steps=1's
        (keys are per request seed and position); only the batching of later requests shifts.
      keep_kv: hold a finished session's slot for its next turn (module docstring, "Kept K/V");
        False: every request is prefilled from scratch (the re-prefill reference path).
      prefill_budget: prefill tokens per step while a slot decodes (module docstring, "Prefill");
        None: ``4 * engine.max_prefill_length``.
      prefix_cache: shared prefixes kept (module docstring, "Prefix cache"); 0: off.

    Raises:
      ValueError: unknown ``partial``, no params, ``decode_steps < 1`` or ``prefill_budget < 1``.
    """

    def __init__(self, engine: Any, *, partial: str = "continue", params: Any = None, version: int = 0,
                 decode_steps: int = 1, keep_kv: bool = True, prefill_budget: Optional[int] = None,
                 prefix_cache: int = 4) -> None:
        if partial not in PARTIAL_MODES:
            raise ValueError(f"partial must be one of {PARTIAL_MODES}, got {partial!r}")
        if int(decode_steps) < 1:
            raise ValueError(f"decode_steps must be >= 1, got {decode_steps}")
        if prefill_budget is not None and int(prefill_budget) < 1:
            raise ValueError(f"prefill_budget must be >= 1 token, got {prefill_budget}")
        self.decode_steps = int(decode_steps)
        self.step_counts = tuple(sorted({1 << i for i in range(self.decode_steps.bit_length())
                                         if 1 << i < self.decode_steps} | {self.decode_steps}))
        """The decode-step counts an engine call may run (:meth:`_call_steps`): the powers of two
        below ``decode_steps``, and ``decode_steps``; one compiled program each."""
        self.keep_kv = bool(keep_kv)
        self.prefill_budget = int(prefill_budget if prefill_budget is not None
                                  else 4 * int(getattr(engine, "max_prefill_length", 256)))
        self._moe_drops = bool(getattr(engine, "counts_moe_drops", False))  # engine docstring, "MoE capacity drops"
        self._moe_cpt = int(getattr(engine, "moe_copies_per_token", 0))
        self.prefix_cache = int(prefix_cache)
        self._prefixes: collections.OrderedDict = collections.OrderedDict()  # (tokens, version) -> prefix (LRU)
        self.engine = engine
        self.partial = partial
        self._params = params if params is not None else engine.params
        if self._params is None:
            raise ValueError("Generator needs params (engine.params is None)")
        self._version = int(version)
        self._B = int(engine.max_concurrent_decodes)
        self._S = int(engine.max_cache_len)

        self._lock = threading.Lock()  # guards queue, pending params, counters read by others
        self._wake = threading.Condition(self._lock)
        self._queue: collections.deque[_Req] = collections.deque()
        self._gangs = GangRoom()  # first requests waiting for the rest of their gang (rollout.admission)
        self._pending: Optional[tuple[Any, int]] = None
        self._step_lock = threading.RLock()  # one step at a time (re-entrant: paused() then apply_update_now())
        self._slots: list[Optional[_Req]] = [None] * self._B
        self._held: dict[Any, _Held] = {}  # session -> its held slot (keep_kv)
        self._held_slot: dict[int, Any] = {}  # slot -> the session holding it
        self._releases: list = []  # sessions ended by release_session (applied at the next step)
        self._finished: list[int] = []  # slots whose request ended since the last decode (deactivated)
        self._state = engine.init_decode_state()
        self._ids = itertools.count()
        self._thread: Optional[threading.Thread] = None
        self._running = False
        self.stats = collections.Counter()

    # ------------------------------------------------------------------ public API
    @property
    def version(self) -> int:
        """Version of the params that produce tokens now (a pending update is not counted)."""
        return self._version

    @property
    def num_active(self) -> int:
        return sum(r is not None for r in self._slots)

    @property
    def num_queued(self) -> int:
        with self._lock:
            return len(self._queue)

    def submit(
        self,
        prompt_ids: Sequence[int],
        *,
        max_new_tokens: int,
        seed: int = 0,
        stop_ids: Collection[int] = (),
        temperature: Optional[float] = None,
        session: Any = None,
        prefix_len: int = 0,
        order: tuple = (),
        gang: Optional[tuple] = None,
    ) -> concurrent.futures.Future:
        """Queue a request; thread-safe. Returns a Future resolving to a :class:`Completion`.

        Args:
          prompt_ids: >= 1 token ids; ``len < max_cache_len`` (room for one generated token).
          max_new_tokens: budget of generated tokens for this turn (>= 0).
          seed: sampling seed (token at absolute position p uses ``fold_in(PRNGKey(seed), p)``).
          stop_ids: generation stops after sampling any of these (e.g. <|im_end|>, EOS).
          temperature: per-request override of the engine temperature (<= 0: greedy).
          session: a hashable key naming the conversation this request continues (an episode);
            with ``keep_kv`` its finished slot is held and the next request of the same session
            whose prompt extends the held context runs only its new tokens (module docstring,
            "Kept K/V"). End it with :meth:`release_session`. None: no reuse.
          prefix_len: the length of a prefix of ``prompt_ids`` that many requests share (an env's
            system prompt and tool schemas): with ``prefix_cache`` its K/V are prefilled once per
            weight version and copied into every request that starts with it (module docstring,
            "Prefix cache"). 0: none.
          order: admission order key (``rollout.admission``): queued requests are admitted by it, not
            by arrival; () (default): arrival order, after the keyed ones.
          gang: ``(key, n)``: this request is one of ``n`` (a GRPO group's first turns) held back until
            all are queued (or withdrawn, :meth:`withdraw`), then admitted together in one step.

        Raises:
          ValueError: empty or too long prompt, negative budget.
        """
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt_ids must hold at least one token")
        if len(prompt) >= self._S:
            raise ValueError(f"prompt of {len(prompt)} tokens leaves no room in max_cache_len={self._S}")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        req = _Req(
            request_id=next(self._ids),
            prompt=prompt,
            max_new_tokens=int(max_new_tokens),
            seed=int(seed),
            stop_ids=frozenset(int(s) for s in stop_ids),
            temperature=temperature,
            future=fut,
            t_submit=time.monotonic(),
            budget=int(max_new_tokens),
            session=session,
            prefix_len=int(prefix_len) if 0 < int(prefix_len) < len(prompt) else 0,
            order=tuple(order),
            gang=gang[0] if gang else None,
        )
        fut.request_id = req.request_id  # type: ignore[attr-defined]
        if max_new_tokens == 0:
            self._resolve(req, "length")
            return fut
        with self._lock:
            if getattr(self, "_closed", False):  # stopped: never leave a caller waiting forever
                fut.set_exception(RuntimeError("generator stopped"))
                return fut
            if gang:  # queued once its whole gang is here (rollout.admission)
                self._queue.extend(self._gangs.add(gang[0], int(gang[1]), req))
            else:
                self._queue.append(req)
            self._wake.notify_all()
        return fut

    def withdraw(self, gang: tuple) -> None:
        """One member of ``gang`` = ``(key, n)`` will submit nothing (its episode ended before its first
        request): the rest of the gang no longer waits for it. Thread-safe."""
        with self._lock:
            self._queue.extend(self._gangs.withdraw(gang[0], int(gang[1])))
            self._wake.notify_all()

    def update_params(self, params: Any, version: int) -> float:
        """Swap weights before the next decode step; thread-safe.

        ``params`` are cast/placed by ``engine.load_params`` in the caller's thread, so the
        decode loop only swaps a reference. A second update before the swap replaces the first.

        Returns:
            the seconds of that cast/reshard (``engine.load_params``, blocked with
            ``jax.block_until_ready`` so async dispatch does not hide it): the ``weight_sync_cast_s``
            of a publish.
        """
        t0 = time.perf_counter()
        loaded = jax.block_until_ready(self.engine.load_params(params))
        cast_s = time.perf_counter() - t0
        with self._lock:
            self._pending = (loaded, int(version))
            self._wake.notify_all()
        return cast_s

    def release_session(self, session: Any) -> None:
        """The conversation ``session`` is over: its held slot (if any) is freed at the next step.
        Thread-safe; an unknown session is ignored."""
        if session is None:
            return
        with self._lock:
            self._releases.append(session)
            self._wake.notify_all()

    @property
    def num_held(self) -> int:
        """Slots held for a session's next turn (not decoding, not free)."""
        return len(self._held)

    def apply_update_now(self) -> None:
        """Apply a pending :meth:`update_params` now (waits for the decode step in progress): when
        this returns, every later token carries the new version (the exact old-logit routes
        ``interrupt`` / ``retire`` need the moment the fleet leaves a version)."""
        with self._step_lock:
            self._apply_pending()

    def paused(self):
        """Context manager: no step runs while it is held (the ``interrupt`` route's pause);
        :meth:`apply_update_now` and :meth:`partial_tokens` may be called inside it."""
        return self._step_lock

    def partial_tokens(self, request_id: int) -> Optional[tuple[list, list, Optional[np.ndarray]]]:
        """``(tokens, versions, routes)`` so far of the request in a decode slot, copies; None when
        the request is not in a slot (queued, finished or unknown).

        ``tokens`` / ``versions``: the generated tokens and the version of each. ``routes``: an
        engine built with ``record_routes``, the expert ids recorded so far at every position of
        prompt + ``tokens`` (int [len(prompt) + len(tokens), n_moe_layers, k], the
        ``Completion.routes`` convention: the last token is never fed yet, ``ROUTE_MISSING``);
        None otherwise."""
        with self._step_lock:
            for req in self._slots:
                if req is not None and req.request_id == request_id:
                    return list(req.tokens), req.versions[:len(req.tokens)].tolist(), self._routes_array(req)
        return None

    def step(self) -> bool:
        """One loop iteration (swap, admit, decode ``decode_steps`` tokens for all slots, finish).

        Returns True if work remains (active slots, queued requests or a pending swap).
        """
        with self._step_lock:
            self._apply_pending()
            self._admit()
            if self.num_active:
                self._decode()
            with self._lock:
                return bool(self.num_active or self._queue or self._pending)

    def run_until_idle(self, max_steps: Optional[int] = None) -> int:
        """Call :meth:`step` until nothing is left (or ``max_steps``). Returns steps taken."""
        n = 0
        while max_steps is None or n < max_steps:
            n += 1
            if not self.step():
                break
        return n

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        seeds: Optional[Sequence[int]] = None,
        stop_ids: Collection[int] = (),
        temperature: Optional[float] = None,
        timeout: Optional[float] = None,
    ) -> list[Completion]:
        """Run a list of prompts to completion (synchronous helper for eval and tests).

        Uses the background thread when started, else steps the loop in this thread.
        Returns completions in prompt order. Seeds default to ``0..n-1``.
        """
        seeds = list(range(len(prompts))) if seeds is None else list(seeds)
        futs = [
            self.submit(p, max_new_tokens=max_new_tokens, seed=s, stop_ids=stop_ids, temperature=temperature)
            for p, s in zip(prompts, seeds)
        ]
        if self._thread is None:
            while not all(f.done() for f in futs):
                self.step()
        return [f.result(timeout=timeout) for f in futs]

    def start(self) -> "Generator":
        """Start the background decode thread (idempotent)."""
        if self._thread is not None:
            return self
        self._closed = False
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="rollout-generator", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: Optional[float] = 30.0) -> None:
        """Stop the background thread; unfinished requests fail with RuntimeError."""
        with self._lock:
            self._running = False
            self._closed = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        with self._step_lock:
            self._fail_all(RuntimeError("generator stopped"))

    def __enter__(self) -> "Generator":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ------------------------------------------------------------------ internals
    def _loop(self) -> None:
        while True:
            with self._lock:
                while self._running and not (self._queue or self._pending or self.num_active):
                    self._wake.wait(timeout=1.0)
                if not self._running:
                    return
            try:
                self.step()
            except Exception as e:  # noqa: BLE001 - keep the loop alive; fail affected requests
                log.exception("generator step failed")
                with self._step_lock:
                    self._fail_all(e)
                    self._state = self.engine.init_decode_state()

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            queued, self._queue = list(self._queue) + self._gangs.drain(), collections.deque()
        for r in queued + [r for r in self._slots if r is not None]:
            if not r.future.done():
                r.future.set_exception(exc)
        self._slots = [None] * self._B
        self._finished = list(range(self._B))  # deactivated at the next decode unless re-armed
        self._held.clear()  # the decode state is rebuilt: nothing is held any more
        self._held_slot.clear()

    def _routes_array(self, req: _Req) -> Optional[np.ndarray]:
        """[len(prompt) + len(tokens), n_moe_layers, k] compact ids (ROUTE_MISSING where none)."""
        shape = getattr(self.engine, "route_shape", None)
        if shape is None:
            return None
        n = len(req.prompt) + len(req.tokens)
        out = np.full((n, *shape), ROUTE_MISSING, self.engine.route_dtype)
        m = min(n, len(req.routes))
        if m:
            out[:m] = np.stack(req.routes[:m])
        return out

    # ------------------------------------------------------------------ slots: prefill, holds
    def _free_slots(self) -> list[int]:
        return [s for s in range(self._B) if self._slots[s] is None and s not in self._held_slot]

    def _drop_hold(self, session: Any, reason: str = "") -> Optional[int]:
        """Forget ``session``'s held slot (counted under ``reason``); returns the freed slot."""
        h = self._held.pop(session, None)
        if h is None:
            return None
        self._held_slot.pop(h.slot, None)
        if reason:
            self.stats[reason] += 1
        return h.slot

    def _hold(self, req: _Req, slot: int) -> None:
        """A finished turn of a session: keep its slot, whose cache holds ``prompt + tokens[:-1]``
        (the last sampled token was never fed), for the session's next turn."""
        ctx = req.prompt + req.tokens[:-1]
        if not req.tokens or len(ctx) >= self._S - 1:
            return
        self._drop_hold(req.session)
        self._held[req.session] = _Held(slot, ctx, list(req.routes[: len(ctx)]), time.monotonic())
        self._held_slot[slot] = req.session
        self.stats["kv_holds"] += 1

    def _apply_releases(self) -> None:
        with self._lock:
            rel, self._releases = self._releases, []
        for session in rel:
            self._drop_hold(session)

    def _prefill_batch(self, items: list) -> None:
        """Prefill ``items`` = [(slot, req, context tokens, start)] into their slots: one
        ``engine.prefill_slots`` call (one program per length bucket; a GRPO group's identical
        prompts once).
        Each request is in its slot afterwards; a failing row fails its own request only (the
        batch is retried row by row when a batched call raises)."""
        if not items:
            return

        rows = [SlotPrefill(toks, slot, req.seed, req.temperature, start) for slot, req, toks, start in items]
        try:
            self._state, res = self.engine.prefill_slots(self._params, self._state, rows)
            self.stats["prefill_calls"] += 1
        except Exception as e:  # noqa: BLE001 - find the culprit: row by row
            if len(items) == 1:
                self._prefill_failed(items[0][0], items[0][1], e)
                return
            log.warning("batched prefill of %d requests failed (%r): retrying one by one", len(items), e)
            for it in items:
                self._prefill_batch([it])
            return
        for (slot, req, toks, start), r in zip(items, res):  # r: a rollout.engine.PrefillResult
            n = int(r.prefill_tokens)
            req.prefill_tokens += n
            req.shared_prefill = req.shared_prefill or bool(r.shared)
            if self._moe_drops:
                req.moe_dropped += int(r.moe_dropped or 0)
                req.moe_copies += n * self._moe_cpt
            self.stats["prefill_tokens"] += n
            self.stats["prefills"] += 1
            self.stats["shared_prefills"] += int(bool(r.shared))
            routes = r.routes
            if routes is not None:  # the positions it ran take their new routes (module docstring)
                del req.routes[start:]
                req.routes.extend(np.asarray(routes))
            self._slots[slot] = req

    def _prefill_failed(self, slot: int, req: _Req, e: BaseException) -> None:
        log.warning("prefill of request %d (%d tokens) failed: %r", req.request_id, len(req.prompt), e)
        self.stats["prefill_errors"] += 1
        if self._slots[slot] is req:
            self._slots[slot] = None
        self._finished.append(slot)
        if not req.future.done():
            req.future.set_exception(e)

    def _apply_pending(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is None:
            return
        self._params, self._version = pending
        self.stats["updates"] += 1
        if self.partial == "continue":
            return  # held slots keep their K/V too: the next turn's new tokens carry the new version
        for session in list(self._held):  # K/V of older weights: the next turn re-prefills (module doc)
            self._drop_hold(session, "kv_dropped_swap")
        items = []
        for slot, req in enumerate(self._slots):
            if req is None:
                continue
            if self.partial == "recompute_kv":
                req.recomputes += 1
                self.stats["recomputes"] += 1
                items.append((slot, req, req.prompt + req.tokens, 0))
            else:  # abort: drop the partial turn, re-issue with the remaining budget
                n = len(req.tokens)
                req.dropped += n
                req.budget -= n
                req.reissues += 1
                req.tokens = []  # its behav_logp / versions buffers are overwritten from index 0
                del req.routes[max(0, len(req.prompt) - 1):]  # the dropped turn's routes go with it
                self.stats["reissues"] += 1
                if req.budget <= 0:
                    self._end(slot, req, "aborted")
                else:
                    items.append((slot, req, req.prompt, 0))
        for slot, *_ in items:
            self._slots[slot] = None  # re-armed by the prefill (a failed one leaves the slot free)
            self._finished.append(slot)
        self._prefill_batch(items)

    def _admit(self) -> None:
        """Admit queued requests (FIFO) into slots, then prefill them all in one batched call.

        Slots: a request of a session with a held slot whose context its prompt extends takes that
        slot and runs only its new tokens; otherwise a free slot, else the least recently held slot
        is evicted (``kv_evictions``; its session's next turn re-prefills). Starvation bound: while
        any slot is decoding, a step admits requests only until their prefill tokens reach
        ``prefill_budget`` (the first request of a step is always admitted, and a prompt identical
        to one admitted in the same step costs nothing: its K/V are copied); with no slot decoding
        there is nothing to starve and every request that finds a slot is admitted.
        """
        self._apply_releases()
        decoding = self.num_active > 0
        free = self._free_slots()
        items: list = []
        copies: list = []  # (slot, req, index in items of the identical prompt it copies after the prefill)
        pre_first: dict = {}  # full prompt -> index in items of its first prefix-route request this step
        seen: set = set()
        spent = 0
        with self._lock:  # by order key (group, sample, turn), not by arrival (rollout.admission)
            self._queue = admission_sorted(self._queue)
        while True:
            with self._lock:
                if not self._queue:
                    break
                req = self._queue[0]
                if req.future.cancelled():
                    self._queue.popleft()
                    continue
                if not gang_fits(self._queue, req, len(free) + len(self._held), self._B):
                    break  # its whole gang next step (slots free as sequences finish)
            slot, start = None, 0
            held = self._held.get(req.session) if req.session is not None else None
            if held is not None:
                c = len(held.context)
                if self.keep_kv and c < len(req.prompt) and req.prompt[:c] == held.context:
                    slot, start = held.slot, c
                else:  # a prompt that does not extend the held context: nothing to reuse
                    free.append(self._drop_hold(req.session, "kv_mismatch"))
            key = tuple(req.prompt) if start == 0 else None
            pre = copy_of = None
            if start == 0 and self.prefix_cache and req.prefix_len and key not in seen:
                if key in pre_first:  # a GRPO group's next sample: copy the first one's slot
                    copy_of = pre_first[key]
                else:
                    pre = (tuple(req.prompt[: req.prefix_len]), self._version)
                    start = req.prefix_len
            cost = 0 if (key in seen or copy_of is not None) else len(req.prompt) - 1 - start
            if pre is not None and pre not in self._prefixes:
                cost += start
            if decoding and items and spent + cost > self.prefill_budget:
                break
            if slot is None:
                if not free:
                    if not self._held:
                        break
                    victim = min(self._held.values(), key=lambda h: h.t)
                    free.append(self._drop_hold(self._held_slot[victim.slot], "kv_evictions"))
                slot = free.pop(0)
            else:
                self._drop_hold(req.session)  # the slot is the request's now
                req.routes = list(held.routes)  # the kept positions keep the routes their K/V came from
                req.kv_reused += start
                self.stats["kv_reused_tokens"] += start
            with self._lock:
                self._queue.popleft()
            req.gang = None  # admitted: the rest of its gang is checked without it
            if key is not None and pre is None and copy_of is None:  # a fresh row: later copies dedupe in the engine
                seen.add(key)
            spent += cost
            req.t_start = time.monotonic()
            if req.behav_logp is None:  # the most tokens it can generate: its budget, capped by the cache room
                cap = min(req.max_new_tokens, self._S - len(req.prompt))
                req.behav_logp, req.versions = np.empty(cap, np.float32), np.empty(cap, np.int32)
            if copy_of is not None:
                copies.append((slot, req, copy_of))
                continue
            if pre is not None:
                if not self._use_prefix(pre, req, slot):
                    continue  # the prefix's prefill failed: the request is failed (counted)
                pre_first[key] = len(items)
            items.append((slot, req, req.prompt, start))
        self._prefill_batch(items)
        for slot, req, i in copies:
            src, first = items[i][0], items[i][1]
            if self._slots[src] is not first:  # its first sample's prefill failed: try again next step
                with self._lock:
                    self._queue.appendleft(req)
                continue
            self._state = self.engine.copy_slot(self._state, src, slot, token=req.prompt[-1], seed=req.seed,
                                                temperature=req.temperature)
            req.routes = list(first.routes)
            req.shared_prefill = True
            self.stats["prefills"] += 1
            self.stats["shared_prefills"] += 1
            self._slots[slot] = req

    def _use_prefix(self, pre: tuple, req: _Req, slot: int) -> bool:
        """Copy the cached K/V of the shared prefix ``pre`` = (tokens, version) into ``slot`` (prefilled
        now on a miss, ``prefix_misses``; else ``prefix_hits``); the request's rows then append the
        rest of its prompt. Returns False when the prefix's prefill failed (the request is failed)."""
        prefix = self._prefixes.get(pre)
        if prefix is None:
            toks = list(pre[0]) + [req.prompt[len(pre[0])]]
            try:
                prefix = self.engine.prefill_tokens(self._params, toks, seed=req.seed, temperature=req.temperature)
            except Exception as e:  # noqa: BLE001 - this request's fault: fail it alone
                self._prefill_failed(slot, req, e)
                return False
            self._prefixes[pre] = prefix
            while len(self._prefixes) > self.prefix_cache:
                self._prefixes.popitem(last=False)
            n = len(pre[0])
            req.prefill_tokens += n
            if self._moe_drops:
                req.moe_dropped += int(prefix.get("moe_dropped", 0))
                req.moe_copies += n * self._moe_cpt
            self.stats["prefill_tokens"] += n
            self.stats["prefix_misses"] += 1
        else:
            self._prefixes.move_to_end(pre)
            req.prefix_hits += 1
            self.stats["prefix_hits"] += 1
        self._state = self.engine.insert(prefix, self._state, slot)  # positions [0, len(prefix)) of the slot
        routes = prefix.get("routes")
        req.routes = [] if routes is None else list(np.asarray(routes))
        return True

    def _call_steps(self) -> int:
        """Decode steps of the next engine call: the fewest of :attr:`step_counts` that cover the
        largest number of tokens any live slot can still emit (its remaining budget, capped by its
        cache room), so a call never runs steps no slot can use (a 1-token request runs a 1-step
        program, not a ``decode_steps`` scan whose later tokens would all be discarded)."""
        need = 1
        for req in self._slots:
            if req is not None:
                left = min(req.budget - len(req.tokens), self._S - len(req.prompt) - len(req.tokens))
                need = max(need, left)
        return next(n for n in self.step_counts if n >= need) if need < self.decode_steps else self.decode_steps

    def _decode(self) -> None:
        """One engine call (``decode``, or ``generate_steps`` of n <= ``decode_steps`` steps:
        :meth:`_call_steps`) for all slots, its :class:`rollout.engine.StepOutput` brought to the
        host in ONE transfer, then consumed step by step; the slots that finished are deactivated
        before the next call."""
        self._free_finished()
        v = self._version  # every token of the call is produced by self._params
        n = self._call_steps()
        if n == 1:
            self._state, out = self.engine.decode(self._params, self._state, version=v)
            steps = [jax.device_get(out)]  # the one host sync of the step
        else:  # n steps in one call: [n, B] leaves, one host sync for all of them
            self._state, out = self.engine.generate_steps(self._params, self._state, n, version=v)
            out = jax.device_get(out)
            steps = [out.at(i) for i in range(n)]
        self.stats["calls"] += 1
        live = [req is not None for req in self._slots]  # slots with a request when the call began
        for r in steps:
            self._consume_step(r, live)

    def _free_finished(self) -> None:
        """Deactivate the slots whose request ended since the last call and that no request took
        since (one ``engine.free_slots``):
        a finished or held slot does not decode, and its cached K/V (a held context) stay intact."""
        done = [s for s in self._finished if self._slots[s] is None]
        self._finished = []
        if done:
            self._state = self.engine.free_slots(self._state, sorted(set(done)))

    def _consume_step(self, r: Any, live: list) -> None:
        """Append one decode step's outputs (a host :class:`rollout.engine.StepOutput` of [B]
        arrays) to the live requests in slots, finishing those that stop. ``live`` [B] bool: the
        slot held a request when the call began (a valid token of such a slot whose request
        finished earlier in the call is discarded and counted)."""
        toks, valid, behav_logp, versions = r.token, r.valid, r.behav_logp, r.version
        routes = r.route
        drops = r.moe_dropped  # None unless the engine counts MoE capacity drops
        self.stats["steps"] += 1
        for slot, req in enumerate(self._slots):
            if req is None:
                if live[slot] and valid[slot]:
                    self.stats["discarded_tokens"] += 1
                continue
            if not valid[slot]:  # cache full before this token (should not happen: see below)
                self._end(slot, req, "length")
                continue
            tok = int(toks[slot])
            if drops is not None:  # the fed token's copies (engine docstring, "MoE capacity drops")
                req.moe_dropped += int(drops[slot])
                req.moe_copies += self._moe_cpt
            i = len(req.tokens)
            req.tokens.append(tok)
            req.behav_logp[i] = behav_logp[slot]  # float32 -> float32 in place: no Python float
            req.versions[i] = versions[slot]
            if routes is not None:  # the route of the token this step fed (position len(context) - 2)
                req.routes.append(np.asarray(routes[slot]))
            self.stats["tokens"] += 1
            if tok in req.stop_ids:
                reason = "stop"
            elif len(req.tokens) >= req.budget or len(req.prompt) + len(req.tokens) >= self._S:
                reason = "length"  # budget, or the sequence fills the cache
            else:
                continue
            if self.keep_kv and req.session is not None:
                self._slots[slot] = None
                self._hold(req, slot)
            self._end(slot, req, reason)

    def _end(self, slot: int, req: _Req, reason: str) -> None:
        """``req`` leaves ``slot`` (deactivated before the next decode call) and resolves."""
        self._slots[slot] = None
        self._finished.append(slot)
        self._resolve(req, reason)

    def _resolve(self, req: _Req, reason: str) -> None:
        now = time.monotonic()
        info = {
            "reissues": req.reissues,
            "dropped_tokens": req.dropped,
            "recomputes": req.recomputes,
            "prompt_len": len(req.prompt),
            "budget": req.budget,
            "queue_s": (req.t_start or now) - req.t_submit,
            "gen_s": now - (req.t_start or now),
            "prefill_tokens": req.prefill_tokens,
            "kv_reused": req.kv_reused,
            "shared_prefill": req.shared_prefill,
            "prefix_hits": req.prefix_hits,
        }
        if self._moe_drops:
            info["moe_dropped_copies"] = req.moe_dropped
            info["moe_copies"] = req.moe_copies
        # the record's behav_logp / versions are views of the request's buffers (no copy); a request
        # resolved before admission (max_new_tokens=0) has none
        n = len(req.tokens)
        behav_logp = req.behav_logp[:n] if req.behav_logp is not None else np.zeros(0, np.float32)
        versions = req.versions[:n] if req.versions is not None else np.zeros(0, np.int32)
        comp = Completion(req.request_id, req.tokens, behav_logp, versions, reason, info,
                          routes=self._routes_array(req))
        if not req.future.done():
            req.future.set_result(comp)
