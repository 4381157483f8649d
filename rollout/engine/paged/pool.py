"""Host-side page pool of the paged K/V cache: which sequence holds which pages.

One :class:`PagePool` per engine owns ``num_pages`` fixed-size pages (``page_size`` positions of
every layer's K/V; the device pool is ``jax_rl.models.qwen3.paged.PagedKVCache``). Per sequence it
keeps a page list (its row of the page table); pages carry reference counts, so several sequences
share pages by reference:

- a GRPO group's G samples :meth:`fork` the prompt's sequence: every page is shared, none copied;
  the first write into a shared page (the prompt's partial last page) is copied on write
  (:meth:`ensure`, which returns the ``(src, dst)`` page copies the device must do first);
- full pages are published under a chained hash of their tokens *and the weight version that
  computed them* (:meth:`publish`), so a later sequence whose prompt starts with the same full
  pages at the same version references them (:meth:`admit`; counted in ``kv_prefix_page_hits``):
  a lookup at version w never matches a page computed by version v != w (the chain starts from
  the version);
- a page whose last reference goes is kept, still published, in an LRU of cached pages, and is
  evicted (oldest first) only when an allocation finds no free page;
- an allocation that finds neither free nor cached pages raises :class:`PoolExhausted`; the
  engine's policy is to preempt (:meth:`preempt`: free a sequence's pages, counted in
  ``kv_preemptions``) and re-prefill that sequence later. :meth:`ensure_cost` and :meth:`sole_pages`
  say, without changing anything, what an allocation would take and what freeing a sequence would
  give back (the generator's admission and preemption decide by them).

Invariants (``tests/rollout/test_pages.py`` checks them under random operation sequences):
reference counts are never negative; ``free + cached + in use == num_pages``; a page with
references is never free, cached, evicted or handed out again.
"""

from __future__ import annotations

import collections
import hashlib
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

__all__ = ["PagePool", "PoolExhausted", "page_key"]


class PoolExhausted(RuntimeError):
    """No free or evictable page for an allocation (the caller preempts a sequence or waits)."""


def page_key(prev: bytes | None, version: int, tokens) -> bytes:
    """The key of one full page: blake2b over the previous page's key (or, for a sequence's first
    page, the weight version) and the page's token ids (int64). 16 bytes."""
    h = hashlib.blake2b(digest_size=16)
    h.update(prev if prev is not None else b"v%d:" % int(version))
    h.update(np.asarray(tokens, np.int64).tobytes())
    return h.digest()


@dataclass
class _Seq:
    pages: list[int] = field(default_factory=list)
    length: int = 0  # positions whose K/V the sequence holds
    version: int = 0


class PagePool:
    """Fixed-size pages, reference counts, prefix sharing by version-keyed hashes, LRU eviction.

    Args:
        num_pages: P, the pool's pages (>= 1).
        page_size: positions per page (>= 1).

    Raises:
        ValueError: a size < 1.
    """

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"PagePool needs num_pages >= 1 and page_size >= 1, got {num_pages}, {page_size}")
        self.num_pages, self.page_size = int(num_pages), int(page_size)
        self.refs = np.zeros(self.num_pages, np.int32)
        self._free: collections.deque[int] = collections.deque(range(self.num_pages))
        self._cached: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU, oldest first
        self._key_of: dict[int, bytes] = {}  # published page -> key
        self._page_of: dict[bytes, int] = {}  # key -> page
        self._version_of: dict[int, int] = {}  # published page -> the version that computed it
        self.seqs: dict[object, _Seq] = {}
        self._floor = 0  # pages of versions below it are stale (drop_versions_below)
        self.changes = 0  # bumped by every change of a page's references or a sequence's pages (not lengths)
        self.metrics = collections.Counter(kv_preemptions=0, kv_prefix_page_hits=0, kv_pages_evicted=0,
                                           kv_pages_copied=0)

    # ---- accounting -------------------------------------------------------------------------
    @property
    def pages_in_use(self) -> int:
        """Pages with at least one reference."""
        return int(np.count_nonzero(self.refs))

    @property
    def pages_available(self) -> int:
        """Pages an allocation can take now (free + cached, unreferenced)."""
        return len(self._free) + len(self._cached)

    def live_positions(self) -> int:
        """Distinct positions whose K/V the sequences' pages hold: per page in use, the most positions
        of it any sequence referencing it holds (a page shared by a group's G samples counts once). A
        sequence's length includes the positions :meth:`ensure` made writable for a decode call in flight."""
        filled: dict[int, int] = {}
        ps = self.page_size
        for s in list(self.seqs.values()):  # a snapshot: another thread may log while the engine runs
            length = s.length
            for j, p in enumerate(list(s.pages)):
                n = min(ps, length - j * ps)
                if n > filled.get(p, 0):
                    filled[p] = n
        return sum(filled.values())

    def stats(self) -> dict[str, int]:
        """``kv_pages_in_use`` (pages with a reference), ``kv_held_tokens`` (their positions:
        ``kv_pages_in_use x page_size``), ``kv_live_tokens`` (:meth:`live_positions`), ``kv_sequences``
        (sequences holding pages), ``kv_pages_free``, ``kv_pages_cached`` and the counters.
        ``kv_held_tokens / kv_live_tokens`` is the pool's overhead: partial last pages and pages made
        writable ahead of a decode call (at most ``page_size - 1 + decode_steps`` positions a sequence)."""
        in_use = self.pages_in_use
        return dict(kv_pages_in_use=in_use, kv_held_tokens=in_use * self.page_size,
                    kv_live_tokens=self.live_positions(), kv_sequences=len(self.seqs),
                    kv_pages_free=len(self._free), kv_pages_cached=len(self._cached), **self.metrics)

    def pages_for(self, length: int) -> int:
        """Pages holding ``length`` positions."""
        return -(-int(length) // self.page_size)

    def table(self, seq_id, max_pages: int) -> np.ndarray:
        """The sequence's page-table row, int32 [max_pages], -1 past its pages.

        Raises:
            ValueError: it holds more than ``max_pages`` pages."""
        pages = self.seqs[seq_id].pages
        if len(pages) > max_pages:
            raise ValueError(f"sequence {seq_id!r} holds {len(pages)} pages > max_pages {max_pages}")
        row = np.full(max_pages, -1, np.int32)
        row[:len(pages)] = pages
        return row

    # ---- allocation ---------------------------------------------------------------------------
    def _take(self, n: int) -> list[int]:
        if n > self.pages_available:
            raise PoolExhausted(f"need {n} pages, {len(self._free)} free + {len(self._cached)} cached "
                                f"of {self.num_pages}")
        out = []
        if n:
            self.changes += 1
        for _ in range(n):
            if self._free:
                p = self._free.popleft()
            else:  # evict the least recently used cached page
                p, _ = self._cached.popitem(last=False)
                self._unpublish(p)
                self.metrics["kv_pages_evicted"] += 1
            self.refs[p] = 1
            out.append(p)
        return out

    def _unpublish(self, p: int) -> None:
        key = self._key_of.pop(p, None)
        if key is not None and self._page_of.get(key) == p:
            del self._page_of[key]
        self._version_of.pop(p, None)

    def _ref(self, p: int) -> None:
        self.changes += 1
        if self.refs[p] == 0:
            self._cached.pop(p)  # a cached page comes back into use
        self.refs[p] += 1

    def _unref(self, p: int) -> None:
        if self.refs[p] <= 0:
            raise AssertionError(f"page {p} released with no reference")
        self.changes += 1
        self.refs[p] -= 1
        if self.refs[p] == 0:
            if p in self._key_of and self._version_of.get(p, self._floor) < self._floor:
                self._unpublish(p)  # computed by weights older than the last drop: never matched again
            if p in self._key_of:
                self._cached[p] = None  # most recently used at the end
            else:
                self._free.append(p)

    # ---- sequences ----------------------------------------------------------------------------
    def lookup(self, tokens, version: int) -> list[int]:
        """Published pages that hold ``tokens``' leading full pages at ``version`` (in order; stops
        at the first miss). Never more than ``(len(tokens) - 1) // page_size`` pages, so at least
        one token is left to compute (its logits start the generation)."""
        out, prev, ps = [], None, self.page_size
        for j in range((len(tokens) - 1) // ps if len(tokens) else 0):
            prev = page_key(prev, version, tokens[j * ps:(j + 1) * ps])
            p = self._page_of.get(prev)
            if p is None or self._version_of.get(p) != version:
                break
            out.append(p)
        return out

    def admit(self, seq_id, tokens, version: int, reserve: int = 0, lookup: bool = True) -> int:
        """Start a sequence of prompt ``tokens`` at weight ``version``: reference the published
        pages of its leading full pages (no copy; ``kv_prefix_page_hits``) and allocate pages for
        the rest of the prompt plus ``reserve`` more positions (``lookup`` False: no shared pages).
        Returns how many leading positions already hold K/V (the prefill starts there).

        Raises:
            ValueError: ``seq_id`` is already admitted.
            PoolExhausted: not enough pages (nothing is taken then)."""
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id!r} is already admitted")
        hits = self.lookup(tokens, version) if lookup else []
        need = self.pages_for(len(tokens) + reserve) - len(hits)
        cached_hits = sum(1 for p in hits if self.refs[p] == 0)
        if need > self.pages_available - cached_hits:
            raise PoolExhausted(f"sequence {seq_id!r} needs {need} pages, {self.pages_available - cached_hits} "
                                f"available of {self.num_pages}")
        for p in hits:
            self._ref(p)
        self.changes += 1
        self.metrics["kv_prefix_page_hits"] += len(hits)
        self.seqs[seq_id] = _Seq(pages=hits + self._take(need), length=len(hits) * self.page_size,
                                 version=int(version))
        return len(hits) * self.page_size

    def fork(self, parent, child) -> None:
        """``child`` references every page of ``parent`` (a GRPO sample of a group's prompt); the
        first write into a shared page is copied then (:meth:`ensure`).

        Raises:
            ValueError: ``child`` exists or ``parent`` does not."""
        if child in self.seqs or parent not in self.seqs:
            raise ValueError(f"fork {parent!r} -> {child!r}: parent must exist and child must not")
        src = self.seqs[parent]
        self.changes += 1
        for p in src.pages:
            self._ref(p)
        self.seqs[child] = _Seq(pages=list(src.pages), length=src.length, version=src.version)

    def ensure(self, seq_id, length: int) -> list[tuple[int, int]]:
        """Make positions ``[seqs[seq_id].length, length)`` writable: allocate the pages they need,
        and copy on write a shared page among them (the partial last page after a fork). Returns the
        ``(src, dst)`` page copies the device must do before writing; sets the sequence's length.

        Raises:
            PoolExhausted: not enough pages (the sequence keeps what it had)."""
        s = self.seqs[seq_id]
        first = s.length // self.page_size
        shared = [j for j in range(first, min(len(s.pages), self.pages_for(length))) if self.refs[s.pages[j]] > 1]
        extra = max(0, self.pages_for(length) - len(s.pages))
        if extra + len(shared) > self.pages_available:
            raise PoolExhausted(f"sequence {seq_id!r} needs {extra + len(shared)} pages, "
                                f"{self.pages_available} available of {self.num_pages}")
        copies = []
        for j in shared:
            (dst,) = self._take(1)
            self._unref(s.pages[j])
            copies.append((s.pages[j], dst))
            s.pages[j] = dst
        s.pages += self._take(extra)
        s.length = max(s.length, int(length))
        self.metrics["kv_pages_copied"] += len(copies)
        return copies

    def ensure_cost(self, seq_id, length: int, refs: Optional[dict] = None) -> int:
        """Pages :meth:`ensure` ``(seq_id, length)`` would take now (new pages + copies on write), changing
        nothing. ``refs``: a scratch ``{page: references}`` shared by calls that model several ensures in
        a row (a shared page is copied by all but its last writer); None: this call alone."""
        s = self.seqs[seq_id]
        refs = {} if refs is None else refs
        n = max(0, self.pages_for(length) - len(s.pages))
        for j in range(s.length // self.page_size, min(len(s.pages), self.pages_for(length))):
            p = s.pages[j]
            r = refs.setdefault(p, int(self.refs[p]))
            if r > 1:
                refs[p] = r - 1
                n += 1
        return n

    def room(self, seq_id) -> int:
        """Positions the sequence may reach with no allocation and no copy: the end of the run of pages
        only it references, from the page its next position falls in (its length if that page is shared
        or missing). Valid until :attr:`changes` moves; :meth:`grow` to a length past the sequence's and
        within it is :meth:`ensure` with nothing to allocate or copy."""
        s, ps = self.seqs[seq_id], self.page_size
        j = s.length // ps
        while j < len(s.pages) and self.refs[s.pages[j]] == 1:
            j += 1
        return max(s.length, j * ps)

    def grow(self, seq_id, length: int) -> None:
        """Set the sequence's length to ``length`` within its pages (:meth:`ensure` of a length at most
        :meth:`room`, with none of its work: the caller checked the room at the same :attr:`changes`).

        Raises:
            ValueError: ``length`` is past the sequence's pages."""
        s = self.seqs[seq_id]
        if length > len(s.pages) * self.page_size:
            raise ValueError(f"grow {seq_id!r} to {length}: it holds {len(s.pages)} pages of {self.page_size}")
        s.length = max(s.length, int(length))

    def sole_pages(self, seq_id) -> int:
        """Pages only ``seq_id`` references: what :meth:`free` of it would return to the free/cached pages."""
        return sum(1 for p in self.seqs[seq_id].pages if self.refs[p] == 1)

    def publish(self, seq_id, tokens) -> list[int]:
        """Publish the sequence's full pages under its version's chained keys (``tokens``: the
        positions it holds, at least its full pages' worth), so later sequences at the same
        version share them. A key already published keeps its page. Returns the pages it published
        (what :meth:`retract` takes back)."""
        s = self.seqs[seq_id]
        prev, out = None, []
        for j in range(min(len(tokens), s.length) // self.page_size):
            prev = page_key(prev, s.version, tokens[j * self.page_size:(j + 1) * self.page_size])
            p = s.pages[j]
            if prev in self._page_of or p in self._key_of:
                continue
            self._page_of[prev], self._key_of[p], self._version_of[p] = p, prev, s.version
            out.append(p)
        return out

    def retract(self, pages) -> None:
        """Unpublish ``pages`` (published before their K/V were written, by a call that then failed): no
        lookup finds them again; an unreferenced one goes back to the free list."""
        for p in pages:
            self._unpublish(p)
            if p in self._cached:
                del self._cached[p]
                self._free.append(p)

    def free(self, seq_id) -> None:
        """Drop the sequence's references (its published pages stay cached until evicted)."""
        self.changes += 1
        for p in self.seqs.pop(seq_id).pages:
            self._unref(p)

    def clear(self) -> None:
        """Forget every sequence and every published page: all pages free (the device pool they described
        was started afresh, its K/V gone). The counters are kept."""
        self.refs[:] = 0
        self._free = collections.deque(range(self.num_pages))
        for d in (self._cached, self._key_of, self._page_of, self._version_of, self.seqs):
            d.clear()
        self.changes += 1

    def preempt(self, seq_id) -> None:
        """Free the sequence's pages to make room (the engine re-prefills it later);
        ``kv_preemptions`` += 1."""
        self.free(seq_id)
        self.metrics["kv_preemptions"] += 1

    def drop_versions_below(self, version: int) -> int:
        """Return the unreferenced cached pages of versions < ``version`` to the free list (after a
        weight swap they can never be matched again), and from now on such a page whose last reference
        goes (a held sequence's, ``rollout.partial=continue``) goes to the free list too, not to the
        LRU of cached pages, where it would take room a fresh process does not spend. Returns how
        many were freed now."""
        self._floor = max(self._floor, int(version))
        stale = [p for p in self._cached if self._version_of.get(p, version) < version]
        for p in stale:
            del self._cached[p]
            self._unpublish(p)
            self._free.append(p)
        return len(stale)
