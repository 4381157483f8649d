"""In-process continuous batching over a :class:`rollout.engine.Qwen3Engine`, with version tags.

This is the RL rollout loop (MaxText ``offline_engine`` style; JetStream's Driver does not carry
log-probs). One loop iteration (:meth:`Generator.step`):

1. apply a pending ``update_params(params, version)`` (weights swap only here, between decode
   steps) and treat the sequences already in slots according to ``partial``;
2. admit queued requests into slots and prefill them all in ONE ``engine.prefill_slots`` call (one
   jitted program per length bucket; "Prefill" below), with the *current* params;
3. one jitted ``engine.decode`` for all slots (``decode_steps`` = n > 1: one
   ``engine.decode_steps`` of at most n steps, no more than the live slots can use); its
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

Completion ``info`` keys: ``reissues``, ``dropped_tokens``, ``recomputes``, ``preemptions`` (a paged
pool's, :mod:`rollout.kv_pressure`), ``prompt_len``,
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
a step is always admitted, a prompt identical to one already admitted in the step costs nothing and
comes past the budget), so a burst of new requests delays the decoding slots by at most one bounded
prefill per step; with no slot decoding every request that finds a slot is admitted at once.

Kept K/V (``keep_kv``, ``rollout.keep_kv``; sessions: a finished turn's slot held for the session's next
turn, which appends only its new tokens) and the prefix cache (``prefix_cache``: the K/V of the env's shared
system prompt + tools, keyed by tokens and weight version): :mod:`rollout.kv_holds`.

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

from rollout.admission import admission_sorted
from rollout.decode_loop import Completions, DecodeLoop
from rollout.generator_state import GeneratorOptions, HeldEpisodes, RequestQueue, SlotTable, Weights
from rollout.kv_holds import KVHolds
from rollout.kv_pressure import KVPressure
from rollout.types import Completion, DecodeEngine  # Completion: tokens, behav_logp, versions, finish_reason, info

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
    # (:meth:`rollout.decode_loop.DecodeLoop.consume_step`); the first len(tokens) entries are real (set at
    # admission)
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
    admit_seq: int = -1  # when it was last admitted (the most recent is preempted first: rollout.kv_pressure)
    preemptions: int = 0  # times its slot's K/V were taken back for pages (rollout.kv_pressure)


class Generator:
    """Continuous-batching generator over a JetStream-style engine.

    Args:
      engine: a :class:`rollout.engine.Qwen3Engine`, or any engine with its RL interface:
        ``prefill_slots`` / ``copy_slot`` / ``prefill_tokens`` + ``insert`` (prefix cache) /
        ``decode`` / ``decode_steps`` (returning :class:`rollout.engine.StepOutput`) /
        ``free_slots`` / ``load_params`` / ``init_decode_state`` / ``max_concurrent_decodes`` /
        ``max_cache_len``.
      partial: ``"continue" | "recompute_kv" | "abort"`` (see module doc).
      params: initial params (already loaded with ``engine.load_params``); default
        ``engine.params``.
      version: version of the initial params.
      decode_steps: the most decode steps per engine call (``rollout.decode_steps``, >= 1). 1:
        one ``engine.decode`` per step. n > 1: one ``engine.decode_steps(params, state, m)``
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

    def __init__(self, engine: DecodeEngine, *, partial: str = "continue", params: Any = None, version: int = 0,
                 decode_steps: int = 1, keep_kv: bool = True, prefill_budget: Optional[int] = None,
                 prefix_cache: int = 4) -> None:
        if partial not in PARTIAL_MODES:
            raise ValueError(f"partial must be one of {PARTIAL_MODES}, got {partial!r}")
        if int(decode_steps) < 1:
            raise ValueError(f"decode_steps must be >= 1, got {decode_steps}")
        if prefill_budget is not None and int(prefill_budget) < 1:
            raise ValueError(f"prefill_budget must be >= 1 token, got {prefill_budget}")
        n = int(decode_steps)
        self.opts = GeneratorOptions(
            partial=partial, keep_kv=bool(keep_kv), decode_steps=n,
            # the decode-step counts an engine call may run (DecodeLoop.call_steps): the powers of two below
            # decode_steps, and decode_steps; one compiled program each
            step_counts=tuple(sorted({1 << i for i in range(n.bit_length()) if 1 << i < n} | {n})),
            prefill_budget=int(prefill_budget if prefill_budget is not None else 4 * int(engine.max_prefill_length)),
            prefix_cache=int(prefix_cache), max_cache_len=int(engine.max_cache_len),
            moe_drops=bool(engine.counts_moe_drops),  # engine docstring, "MoE capacity drops"
            moe_copies_per_token=int(engine.moe_copies_per_token))
        """The generator's settings (:class:`rollout.generator_state.GeneratorOptions`)."""
        self.decode_steps, self.step_counts, self.keep_kv = n, self.opts.step_counts, self.opts.keep_kv
        self.prefill_budget, self.prefix_cache, self.partial = self.opts.prefill_budget, self.opts.prefix_cache, partial
        self.engine = engine
        if (params if params is not None else engine.params) is None:
            raise ValueError("Generator needs params (engine.params is None)")
        self.weights = Weights(params if params is not None else engine.params, int(version))
        """The params that produce tokens now and their version (replaced at a swap, between decode steps)."""

        # the generator's state, declared (rollout.generator_state) and handed to its collaborators
        self.table = SlotTable(int(engine.max_concurrent_decodes), engine.init_decode_state())
        """The slots: their requests, the ones that ended, the engine's decode state."""
        self.requests = RequestQueue()
        """The queue, the gangs, and the lock that guards them, the pending params and counters read by others."""
        self.holds = HeldEpisodes()
        """Slots held for an episode's next turn (``keep_kv``)."""
        self._lock = self.requests.lock
        self._wake = self.requests.wake
        self._pending: Optional[tuple[Any, int]] = None
        self._step_lock = threading.RLock()  # one step at a time (re-entrant: paused() then apply_update_now())
        self.stats = collections.Counter()
        self.pressure = KVPressure(engine, self.table, self.requests, self.holds, self.stats, self.decode_steps)
        """What the generator does when a pooled K/V layout runs short (:mod:`rollout.kv_pressure`)."""
        self.completions = Completions(engine, self.opts)
        self.kv = KVHolds(engine, self.table, self.requests, self.holds, self.weights, self.opts, self.stats,
                          self.completions)
        """Slots, prefills, held slots and the prefix cache (:mod:`rollout.kv_holds`)."""
        self.loop = DecodeLoop(engine, self.table, self.weights, self.opts, self.stats, self.pressure, self.kv,
                               self.completions)
        """Engine calls and per-token records (:mod:`rollout.decode_loop`)."""
        self._ids = itertools.count()
        self._admits = itertools.count()
        self._thread: Optional[threading.Thread] = None
        self._running = False

    # ------------------------------------------------------------------ public API
    @property
    def version(self) -> int:
        """Version of the params that produce tokens now (a pending update is not counted)."""
        return self.weights.version

    @property
    def _params(self) -> Any:
        """The params that produce tokens now (``weights.params``)."""
        return self.weights.params

    def kv_stats(self) -> dict[str, int]:
        """The K/V layout's counters and the generator's (:meth:`rollout.kv_pressure.KVPressure.kv_stats`);
        {} for a layout without a pool."""
        return self.pressure.kv_stats()

    @property
    def num_active(self) -> int:
        return self.loop.num_active

    @property
    def num_queued(self) -> int:
        with self._lock:
            return len(self.requests.queue)

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
        if len(prompt) >= self.opts.max_cache_len:
            raise ValueError(f"prompt of {len(prompt)} tokens leaves no room in "
                             f"max_cache_len={self.opts.max_cache_len}")
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
            self.completions.resolve(req, "length")
            return fut
        with self._lock:
            if getattr(self, "_closed", False):  # stopped: never leave a caller waiting forever
                fut.set_exception(RuntimeError("generator stopped"))
                return fut
            if gang:  # queued once its whole gang is here (rollout.admission)
                self.requests.queue.extend(self.requests.gangs.add(gang[0], int(gang[1]), req))
            else:
                self.requests.queue.append(req)
            self._wake.notify_all()
        return fut

    def withdraw(self, gang: tuple) -> None:
        """One member of ``gang`` = ``(key, n)`` will submit nothing (its episode ended before its first
        request): the rest of the gang no longer waits for it. Thread-safe."""
        with self._lock:
            self.requests.queue.extend(self.requests.gangs.withdraw(gang[0], int(gang[1])))
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
            self.holds.releases.append(session)
            self._wake.notify_all()

    @property
    def num_held(self) -> int:
        """Slots held for a session's next turn (not decoding, not free)."""
        return len(self.holds.by_session)

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
        """``(tokens, versions, routes)`` so far of the request in a decode slot (or queued again after a
        preemption with tokens), copies; None when it has none (queued, finished or unknown).

        ``tokens`` / ``versions``: the generated tokens and the version of each. ``routes``: an
        engine built with ``record_routes``, the expert ids recorded so far at every position of
        prompt + ``tokens`` (int [len(prompt) + len(tokens), n_moe_layers, k], the
        ``Completion.routes`` convention: the last token is never fed yet, ``ROUTE_MISSING``);
        None otherwise."""
        with self._step_lock:
            with self._lock:  # a preempted request waits in the queue with its tokens (rollout.kv_pressure)
                waiting = [r for r in self.requests.queue if r.tokens]
            for req in self.table.reqs + waiting:
                if req is not None and req.request_id == request_id:
                    return list(req.tokens), req.versions[:len(req.tokens)].tolist(), self.completions.routes_array(req)
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
                return bool(self.num_active or self.requests.queue or self._pending)

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
    def _apply_pending(self) -> None:
        """Swap in the params of a pending :meth:`update_params` (``stats["updates"]``); the sequences in slots,
        held or preempted are then treated by ``partial`` (:meth:`rollout.kv_holds.KVHolds.after_swap`)."""
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is None:
            return
        self.weights.params, self.weights.version = pending
        self.stats["updates"] += 1
        self.kv.after_swap()

    def _decode(self) -> None:
        """One engine call for all slots and its tokens recorded (:meth:`rollout.decode_loop.DecodeLoop.decode`)."""
        self.loop.decode()

    def _loop(self) -> None:
        while True:
            with self._lock:
                while self._running and not (self.requests.queue or self._pending or self.num_active):
                    self._wake.wait(timeout=1.0)
                if not self._running:
                    return
            try:
                self.step()
            except Exception as e:  # noqa: BLE001 - keep the loop alive; fail affected requests
                log.exception("generator step failed")
                with self._step_lock:
                    self._fail_all(e)
                    self.table.state = self.engine.init_decode_state()

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            queued, self.requests.queue = list(self.requests.queue) + self.requests.gangs.drain(), collections.deque()
        for r in queued + [r for r in self.table.reqs if r is not None]:
            if not r.future.done():
                r.future.set_exception(exc)
        self.table.reqs = [None] * self.table.size
        self.table.finished = list(range(self.table.size))  # deactivated at the next decode unless re-armed
        self.holds.by_session.clear()  # the decode state is rebuilt: nothing is held any more
        self.holds.by_slot.clear()

    def _admit(self) -> None:
        """Admit queued requests (in admission order) into slots, then prefill them all in one batched call.

        Slots: a request of a session with a held slot whose context its prompt extends takes that
        slot and runs only its new tokens; otherwise a free slot, else the least recently held slot
        is evicted (``kv_evictions``; its session's next turn re-prefills). Starvation bound: while
        any slot is decoding, a step admits requests only until their prefill tokens reach
        ``prefill_budget`` (the first request of a step is always admitted, and a prompt identical
        to one admitted in the same step costs nothing, its K/V copied, and comes past the budget); with no
        slot decoding there is nothing to starve and every request that finds a slot is admitted. A paged engine
        admits a request only when its pool can hold it (:mod:`rollout.kv_pressure`); a request
        preempted before re-prefills its prompt and the tokens it generated.
        """
        self.kv.apply_releases()
        decoding = self.num_active > 0
        free = self.kv.free_slots()
        items: list = []
        copies: list = []  # (slot, req, index in items of the identical prompt it copies after the prefill)
        pre_first: dict = {}  # full prompt -> index in items of its first prefix-route request this step
        seen: dict = {}  # a fresh row's context -> its slot (a later identical row forks its pages)
        spent = 0
        pages = self.pressure.page_budget(self.loop.free_finished)  # None: an engine without pages
        with self._lock:  # by order key (group, sample, turn), not by arrival (rollout.admission)
            self.requests.queue = admission_sorted(self.requests.queue)
        while (req := self.requests.head(len(free) + len(self.holds.by_session), self.table.size)) is not None:
            ctx = req.prompt + req.tokens  # a preempted request re-prefills what it generated too
            slot, start, held = self.kv.held_slot_for(req, free)
            key = tuple(ctx) if start == 0 else None
            pre = copy_of = None
            if start == 0 and self.prefix_cache and req.prefix_len and key not in seen:
                if key in pre_first:  # a GRPO group's next sample: copy the first one's slot
                    copy_of = pre_first[key]
                else:
                    pre = (tuple(req.prompt[: req.prefix_len]), self.weights.version)
                    start = req.prefix_len
            cost = 0 if (key in seen or copy_of is not None) else len(ctx) - 1 - start
            if pre is not None and pre not in self.kv.prefixes:
                cost += start
            # a copy of a row of this step costs nothing and never waits (else it re-runs the prompt's tail later)
            if decoding and items and cost and spent + cost > self.prefill_budget:
                break
            need, shard = self.pressure.page_cost(pages, ctx, slot, start, seen.get(key), free)
            if self.pressure.pages_wait(pages, need, shard, not (decoding or items)):
                break
            if held is not None:
                self.kv.take_held(req, held, start)
            elif (slot := self.kv.take_slot(free)) is None:
                break
            if pages is not None:
                pages[shard] -= need
            with self._lock:
                self.requests.queue.popleft()
            req.gang = None  # admitted: the rest of its gang is checked without it
            if key is not None and pre is None and copy_of is None:  # a fresh row: later copies dedupe in the engine
                seen[key] = slot
            spent += cost
            req.t_start, req.admit_seq = time.monotonic(), next(self._admits)
            if req.tokens:  # re-admitted after a preemption (rollout.kv_pressure)
                self.stats["kv_reprefill_tokens"] += len(ctx) - 1 - start
            if req.behav_logp is None:  # the most tokens it can generate: its budget, capped by the cache room
                cap = min(req.max_new_tokens, self.opts.max_cache_len - len(req.prompt))
                req.behav_logp, req.versions = np.empty(cap, np.float32), np.empty(cap, np.int32)
            if copy_of is not None:
                copies.append((slot, req, copy_of))
                continue
            if pre is not None:
                if not self.kv.use_prefix(pre, req, slot):
                    continue  # the prefix's prefill failed: the request is failed (counted)
                pre_first[key] = len(items)
            items.append((slot, req, ctx, start))
        self.kv.prefill_batch(items)
        self.kv.copy_firsts(copies, items)
