"""A paged engine's host page pool split like its device pool: one :class:`rollout.engine.paged.pool.PagePool` per
shard of slots.

On a rollout mesh whose slots are split over ``data`` / ``expert`` (D shards, slot b in shard
``b // (B / D)``), the device pool's pages are split over the same axes, D sub-pools of P / D pages each
numbered from 0 (``jax_rl.models.qwen3.paged``: each shard reads and writes only its own). So a slot
may hold only pages of its own shard: :class:`ShardedPagePool` keeps one :class:`PagePool` per shard and
sends each call about a sequence (a slot) to its shard's. What follows from it:

- prefix pages (published full pages, :meth:`PagePool.admit`'s hits) and forks are shared only within
  a shard: a prompt computed in shard 0 is computed again by a slot of shard 1 (no K/V crosses shards);
- page ids are per shard: :meth:`publish` returns ``(shard, page)`` pairs and :meth:`ensure` returns
  ``(shard, src, dst)`` copies;
- what is free, cached or needed is per shard (:meth:`pages_available`): a slot never takes another
  shard's free pages; :meth:`stats` sums the shards' counters (``kv_pages_in_use`` etc. are the
  engine's totals).

With one shard (a colocated engine, or a mesh that does not split the slots) it is one
:class:`PagePool` with the same behaviour.
"""

from __future__ import annotations

import collections
from typing import Optional

from rollout.engine.paged.pool import PagePool

__all__ = ["ShardedPagePool"]


class ShardedPagePool:
    """``num_shards`` :class:`PagePool` of ``pages_per_shard`` pages each, for ``slots`` sequences (slot
    ids as sequence ids; slot b in shard ``b // (slots / num_shards)``).

    Raises:
        ValueError: ``slots`` does not divide by ``num_shards``, or a size < 1."""

    def __init__(self, num_shards: int, pages_per_shard: int, page_size: int, slots: int):
        if num_shards < 1 or slots % num_shards:
            raise ValueError(f"{slots} slots do not split into {num_shards} shards")
        self.num_shards, self.pages_per_shard = int(num_shards), int(pages_per_shard)
        self.shards = [PagePool(pages_per_shard, page_size) for _ in range(self.num_shards)]
        self._rows = int(slots) // self.num_shards
        self.page_size = self.shards[0].page_size

    @property
    def num_pages(self) -> int:
        """All shards' pages (the device pool's page axis)."""
        return self.num_shards * self.pages_per_shard

    def shard_of(self, slot: int) -> int:
        """The shard of ``slot`` (-1, a slot not chosen yet: shard 0)."""
        return max(int(slot), 0) // self._rows

    def of(self, slot: int) -> PagePool:
        """The pool of ``slot``'s shard."""
        return self.shards[self.shard_of(slot)]

    @property
    def seqs(self) -> collections.ChainMap:
        """Every shard's sequences (slot -> its pages, length, version)."""
        return collections.ChainMap(*(p.seqs for p in self.shards))

    @property
    def pages_in_use(self) -> int:
        return sum(p.pages_in_use for p in self.shards)

    def pages_available(self, shard: int) -> int:
        """Pages an allocation in ``shard`` can take now (its free + cached)."""
        return self.shards[shard].pages_available

    def pages_for(self, length: int) -> int:
        return self.shards[0].pages_for(length)

    def stats(self) -> dict[str, int]:
        """:meth:`PagePool.stats` summed over the shards."""
        out: collections.Counter = collections.Counter()
        for p in self.shards:
            out.update(p.stats())
        return dict(out)

    def drop_versions_below(self, version: int) -> int:
        return sum(p.drop_versions_below(version) for p in self.shards)

    def lookup(self, tokens, version: int, slot: int = 0) -> list[int]:
        """:meth:`PagePool.lookup` in ``slot``'s shard (its page ids)."""
        return self.of(slot).lookup(tokens, version)

    def admit(self, slot: int, tokens, version: int, reserve: int = 0, lookup: bool = True) -> int:
        return self.of(slot).admit(slot, tokens, version, reserve=reserve, lookup=lookup)

    def fork(self, parent: int, child: int) -> None:
        """:meth:`PagePool.fork` within a shard.

        Raises:
            ValueError: ``parent`` and ``child`` are in different shards (no page crosses shards)."""
        if self.shard_of(parent) != self.shard_of(child):
            raise ValueError(f"fork {parent} -> {child}: slots of different shards cannot share pages")
        self.of(parent).fork(parent, child)

    def ensure(self, slot: int, length: int) -> list[tuple[int, int, int]]:
        """:meth:`PagePool.ensure`; the copies as ``(shard, src, dst)``."""
        d = self.shard_of(slot)
        return [(d, s, t) for s, t in self.shards[d].ensure(slot, length)]

    def ensure_cost(self, slot: int, length: int, refs: Optional[dict] = None) -> int:
        return self.of(slot).ensure_cost(slot, length, refs)

    @property
    def changes(self) -> int:
        """The shards' :attr:`PagePool.changes` summed (it moves when any shard's does)."""
        return sum(p.changes for p in self.shards)

    def room(self, slot: int) -> int:
        return self.of(slot).room(slot)

    def grow(self, slot: int, length: int) -> None:
        self.of(slot).grow(slot, length)

    def sole_pages(self, slot: int) -> int:
        return self.of(slot).sole_pages(slot)

    def refs(self, slot: int, page: int) -> int:
        """References to ``page`` of ``slot``'s shard."""
        return int(self.of(slot).refs[page])

    def table(self, slot: int, max_pages: int):
        return self.of(slot).table(slot, max_pages)

    def publish(self, slot: int, tokens) -> list[tuple[int, int]]:
        """:meth:`PagePool.publish`; the pages as ``(shard, page)`` (what :meth:`retract` takes)."""
        d = self.shard_of(slot)
        return [(d, p) for p in self.shards[d].publish(slot, tokens)]

    def retract(self, pages) -> None:
        """:meth:`PagePool.retract` of ``(shard, page)`` pairs."""
        for d, p in pages:
            self.shards[d].retract([p])

    def free(self, slot: int) -> None:
        self.of(slot).free(slot)

    def clear(self) -> None:
        """:meth:`PagePool.clear` of every shard."""
        for p in self.shards:
            p.clear()

    def preempt(self, slot: int) -> None:
        self.of(slot).preempt(slot)
