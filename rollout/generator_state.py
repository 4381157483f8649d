"""The :class:`rollout.generator.Generator`'s state as declared objects, handed to its collaborators
(:class:`rollout.kv_pressure.KVPressure`, :class:`rollout.kv_holds.KVHolds`, :class:`rollout.decode_loop.DecodeLoop`)
instead of attributes a mixin reads without setting them.

* :class:`GeneratorOptions`: the generator's fixed settings (``partial``, ``keep_kv``, ``decode_steps``, ...);
* :class:`Weights`: the params that produce tokens now and their version (replaced at a weight swap);

* :class:`SlotTable`: which request each engine slot serves, the slots whose request ended since the last
  decode call, and the engine's decode state for those slots;
* :class:`RequestQueue`: the requests waiting for a slot, the gangs waiting for their members
  (:mod:`rollout.admission`), and the lock / condition that guard them (and the generator's pending swap);
* :class:`HeldEpisodes`: the slots held for an episode's next turn (``keep_kv``), by session and by slot,
  and the sessions released since the last step.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Any, Optional

from rollout.admission import GangRoom, gang_fits

__all__ = ["GeneratorOptions", "Weights", "SlotTable", "RequestQueue", "HeldEpisodes"]


@dataclasses.dataclass(frozen=True)
class GeneratorOptions:
    """The generator's settings, fixed at construction (:class:`rollout.generator.Generator`'s Args).

    Attributes:
      partial: ``continue | recompute_kv | abort``: the sequences in slots at a weight swap.
      keep_kv: hold a finished session's slot for its next turn.
      decode_steps: the most decode steps per engine call; ``step_counts`` the counts a call may run.
      prefill_budget: prefill tokens per step while a slot decodes.
      prefix_cache: shared prefixes kept (0: off).
      max_cache_len: the engine's K/V positions per slot (``engine.max_cache_len``).
      moe_drops: the engine counts MoE capacity drops; ``moe_copies_per_token`` its copies per token.
    """

    partial: str
    keep_kv: bool
    decode_steps: int
    step_counts: tuple
    prefill_budget: int
    prefix_cache: int
    max_cache_len: int
    moe_drops: bool
    moe_copies_per_token: int


@dataclasses.dataclass
class Weights:
    """The params that produce tokens now (``params``, loaded by ``engine.load_params``) and their ``version``;
    both replaced together at a weight swap, between decode steps."""

    params: Any
    version: int


@dataclasses.dataclass
class SlotTable:
    """The engine's B slots as the generator sees them.

    Attributes:
      size: B (``engine.max_concurrent_decodes``).
      reqs: [B] the request each slot serves (None: free or held for a session).
      finished: slots whose request ended since the last decode call (deactivated before it).
      state: the engine's decode state (a dict pytree; each engine call donates and replaces it).
    """

    size: int
    state: Any = None
    reqs: list = dataclasses.field(default_factory=list)
    finished: list = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.reqs:
            self.reqs = [None] * self.size

    def release(self, slot: int) -> None:
        """``slot``'s request left it: free, and deactivated at the next decode call unless re-armed."""
        self.reqs[slot] = None
        self.finished.append(slot)

    def clear(self) -> None:
        """Every slot free; all of them deactivated at the next decode call unless re-armed."""
        self.reqs = [None] * self.size
        self.finished = list(range(self.size))


@dataclasses.dataclass
class RequestQueue:
    """Requests waiting for a slot (``queue``, admitted in :func:`rollout.admission.admission_sorted` order),
    first requests waiting for the rest of their gang (``gangs``), and the lock and condition guarding them
    (the generator's pending weight swap and the counters other threads read share the lock)."""

    queue: collections.deque = dataclasses.field(default_factory=collections.deque)
    gangs: GangRoom = dataclasses.field(default_factory=GangRoom)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    wake: Optional[threading.Condition] = None

    def __post_init__(self) -> None:
        if self.wake is None:
            self.wake = threading.Condition(self.lock)

    def head(self, room: int, slots: int) -> Any:
        """The next queued request to admit (cancelled ones dropped), or None: the queue is empty, or its head's
        gang does not fit ``room`` free or held slots of the engine's ``slots`` yet (its whole gang next step:
        :mod:`rollout.admission`)."""
        with self.lock:
            while self.queue and self.queue[0].future.cancelled():
                self.queue.popleft()
            if not self.queue:
                return None
            req = self.queue[0]
            return req if gang_fits(self.queue, req, room, slots) else None

    def push_front(self, req: Any) -> None:
        """``req`` back at the head of the queue (a preempted request: it goes first)."""
        with self.lock:
            self.queue.appendleft(req)


@dataclasses.dataclass
class HeldEpisodes:
    """Slots held for an episode's next turn (``keep_kv``).

    Attributes:
      by_session: session -> its :class:`rollout.kv_holds.HeldSlot`.
      by_slot: slot -> the session holding it.
      releases: sessions ended by ``release_session`` (applied at the next step).
    """

    by_session: dict = dataclasses.field(default_factory=dict)
    by_slot: dict = dataclasses.field(default_factory=dict)
    releases: list = dataclasses.field(default_factory=list)
