"""Deterministic admission to the :class:`rollout.generator.Generator`: what reaches a step
must not depend on thread timing, or the prefill counters (``prefill_tokens``, ``prefix_hits``) of two
identical runs differ.

Two rules:

* **Gangs.** A GRPO group's G samples submit identical first-turn prompts from G agent threads. Had they
  reached the generator in different steps, the group's prompt would be prefilled (or served from the
  prefix cache) once per step it was split over. A request submitted with ``gang=(key, n)`` waits in
  the :class:`GangRoom` until all ``n`` members of its gang are queued, or the missing ones are
  withdrawn (an episode that ends before its first request: a failed env reset, an over-long prompt);
  then the gang enters the queue at once and is admitted in one step, into free slots for all of it
  (:func:`gang_fits`), so its prompt is prefilled once and copied into each sample's slot.
* **Order.** Each step admits queued requests by their ``order`` key (the agent's ``(group id, sample
  index, turn)``), not by arrival: older groups first, a group's samples in index order. Requests
  without a key keep arrival order, after the keyed ones.

Pure bookkeeping over the generator's requests (duck-typed: ``gang``, ``order``, ``future``); the
generator calls it under its own lock.
"""

from __future__ import annotations

import collections
from typing import Any, Hashable, Iterable

__all__ = ["GangRoom", "admission_sorted", "gang_fits"]


class GangRoom:
    """First requests of gangs that are not complete yet. Not thread-safe: the caller holds its lock."""

    def __init__(self) -> None:
        self._rooms: dict[Hashable, list] = {}  # key -> [members still to come, [requests]]

    def __len__(self) -> int:
        return sum(len(r[1]) for r in self._rooms.values())

    def add(self, key: Hashable, n: int, req: Any) -> list:
        """Seat ``req`` of gang ``key`` (``n`` members). Returns the whole gang, in ``order``, once the
        last member arrived (the caller queues them together), else []."""
        room = self._rooms.setdefault(key, [int(n), []])
        room[0] -= 1
        room[1].append(req)
        return self._release(key)

    def withdraw(self, key: Hashable, n: int) -> list:
        """One member of gang ``key`` (``n`` members) will never come. Returns the gang when the rest are
        all seated (as :meth:`add`)."""
        room = self._rooms.setdefault(key, [int(n), []])
        room[0] -= 1
        return self._release(key)

    def _release(self, key: Hashable) -> list:
        need, reqs = self._rooms[key]
        if need > 0:
            return []
        del self._rooms[key]
        return sorted(reqs, key=_order_key)

    def drain(self) -> list:
        """Every seated request (the generator is stopping: it fails them)."""
        out = [r for _, reqs in self._rooms.values() for r in reqs]
        self._rooms.clear()
        return out


def _order_key(req: Any) -> tuple:
    order = getattr(req, "order", None)
    return (0, tuple(order)) if order else (1, ())


def admission_sorted(queue: Iterable[Any]) -> collections.deque:
    """``queue`` in admission order: keyed requests by ``order``, then the unkeyed in arrival order
    (a stable sort)."""
    return collections.deque(sorted(queue, key=_order_key))


def gang_fits(queue: Iterable[Any], head: Any, slots_available: int, max_slots: int) -> bool:
    """Whether the gang of ``head`` (the next request to admit) fits in ``slots_available`` slots now: its
    members still queued, all of them. A gang larger than the engine (``max_slots``) could never fit
    whole: it is admitted piecewise. Requests without a gang always fit."""
    key = getattr(head, "gang", None)
    if key is None:
        return True
    n = sum(1 for r in queue if getattr(r, "gang", None) == key and not r.future.cancelled())
    return n > max_slots or n <= slots_available
