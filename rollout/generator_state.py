"""The :class:`rollout.generator.Generator`'s state as declared objects, handed to its collaborators
(:class:`rollout.kv_pressure.KVPressure`) instead of attributes a mixin reads without setting them.

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

from rollout.admission import GangRoom

__all__ = ["SlotTable", "RequestQueue", "HeldEpisodes"]


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
