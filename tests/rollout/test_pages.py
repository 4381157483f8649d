"""rollout.engine.paged.pool.PagePool: reference counts, prefix sharing keyed by weight version, copy on write,
LRU eviction and pool exhaustion; invariants under random operation sequences (hypothesis)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from rollout.engine.paged.pool import PagePool, PoolExhausted

PS = 4


def test_group_fork_shares_full_pages_and_copies_the_partial_last_page_on_write():
    pool = PagePool(16, PS)
    prompt = list(range(10))  # 2 full pages + 2 positions
    assert pool.admit("p", prompt, version=0) == 0
    pool.ensure("p", 10)
    for g in range(3):
        pool.fork("p", g)
    assert pool.pages_in_use == 3 and all(pool.refs[p] == 4 for p in pool.seqs["p"].pages)
    copies = pool.ensure(0, 11)  # sample 0 writes its first token into the shared partial page
    assert len(copies) == 1 and copies[0][0] == pool.seqs["p"].pages[2]
    assert pool.seqs[0].pages[:2] == pool.seqs["p"].pages[:2]  # full pages still shared, not copied
    assert pool.seqs[0].pages[2] == copies[0][1] != pool.seqs["p"].pages[2]
    assert pool.ensure(0, 12) == []  # its own page now: no further copy


def test_prefix_hits_only_at_the_same_version_and_never_the_last_token():
    pool = PagePool(16, PS)
    prompt = list(range(100, 113))  # 3 full pages + 1
    pool.admit("a", prompt, version=3)
    pool.ensure("a", len(prompt))
    assert len(pool.publish("a", prompt)) == 3
    pool.free("a")  # its pages stay cached
    assert pool.stats()["kv_pages_cached"] == 3
    assert pool.admit("b", prompt, version=4) == 0  # another version: no hit
    assert pool.admit("c", prompt, version=3) == 12
    assert pool.admit("d", prompt[:12], version=3) == 8  # the last token is always computed
    assert pool.stats()["kv_prefix_page_hits"] == 5
    assert set(pool.seqs["c"].pages[:2]) == set(pool.seqs["d"].pages[:2])


def test_exhaustion_evicts_lru_cached_pages_then_raises_and_preempt_frees():
    pool = PagePool(4, PS)
    pool.admit("a", list(range(8)), version=0)
    pool.ensure("a", 8)
    pool.publish("a", list(range(8)))
    pool.free("a")
    pool.admit("b", [9] * 16, version=0)  # takes the 2 free and evicts the 2 cached pages
    assert pool.stats()["kv_pages_evicted"] == 2 and pool.lookup(list(range(9)), 0) == []
    with pytest.raises(PoolExhausted):
        pool.admit("c", [1, 2], version=0)
    assert "c" not in pool.seqs and pool.pages_in_use == 4
    pool.preempt("b")
    assert pool.stats()["kv_preemptions"] == 1 and pool.pages_available == 4
    pool.admit("c", [1, 2], version=0)


def test_drop_versions_below_frees_stale_cached_pages():
    pool = PagePool(8, PS)
    for v in (1, 2):
        pool.admit(v, list(range(9)), version=v)
        pool.ensure(v, 9)
        pool.publish(v, list(range(9)))
        pool.free(v)
    assert pool.drop_versions_below(2) == 2
    assert pool.lookup(list(range(9)), 1) == [] and len(pool.lookup(list(range(9)), 2)) == 2


def test_a_stale_page_released_after_the_drop_goes_to_the_free_list():
    """A page of an older version still referenced at the drop (a held sequence under
    rollout.partial=continue) is freed, not cached, when its last reference goes: the pool then holds what
    a fresh process would."""
    pool = PagePool(8, PS)
    pool.admit("held", list(range(9)), version=1)
    pool.ensure("held", 9)
    pool.publish("held", list(range(9)))
    assert pool.drop_versions_below(2) == 0  # referenced: kept
    pool.free("held")
    assert pool.stats()["kv_pages_cached"] == 0 and pool.stats()["kv_pages_free"] == 8
    assert pool.lookup(list(range(9)), 1) == []


def test_retract_unpublishes_pages_a_failed_call_published():
    pool = PagePool(8, PS)
    pool.admit("a", list(range(9)), version=0)
    pool.ensure("a", 9)
    pages = pool.publish("a", list(range(9)))
    assert len(pages) == 2 and len(pool.lookup(list(range(9)), 0)) == 2
    pool.retract(pages)
    pool.free("a")
    assert pool.lookup(list(range(9)), 0) == [] and pool.stats()["kv_pages_free"] == 8


class PoolMachine(RuleBasedStateMachine):
    """Random admits (prompts drawn from a few shared prefixes, versions 0-2), forks, writes,
    publishes, frees, preemptions and version drops; the invariants hold after every step."""

    def __init__(self):
        super().__init__()
        self.pool = PagePool(12, PS)
        self.tokens: dict[int, list[int]] = {}
        self.rooms: dict[int, tuple[int, int]] = {}  # sid -> (room, the pool's changes when taken)
        self.n = 0

    def _new_id(self) -> int:
        self.n += 1
        return self.n

    @rule(prefix=st.integers(0, 2), extra=st.lists(st.integers(0, 5), max_size=6), version=st.integers(0, 2))
    def admit(self, prefix, extra, version):
        toks = [prefix] * 9 + extra
        sid = self._new_id()
        try:
            start = self.pool.admit(sid, toks, version)
        except PoolExhausted:
            return
        for p in self.pool.seqs[sid].pages[:start // PS]:  # every hit was published at this version
            assert self.pool._version_of[p] == version
        self.pool.ensure(sid, len(toks))
        self.tokens[sid] = toks

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        child = self._new_id()
        self.pool.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), k=st.integers(1, 6))
    def write(self, data, k):
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        before = list(self.pool.seqs[sid].pages)
        cost = self.pool.ensure_cost(sid, len(self.tokens[sid]) + k)  # what ensure takes, predicted
        avail = self.pool.pages_available
        try:
            copies = self.pool.ensure(sid, len(self.tokens[sid]) + k)
        except PoolExhausted:
            assert self.pool.seqs[sid].pages == before and cost > avail
            return
        assert avail - self.pool.pages_available == cost
        for src, dst in copies:
            assert self.pool.refs[dst] == 1 and src != dst
        self.tokens[sid] += [7] * k

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def publish(self, data):
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.pool.publish(sid, self.tokens[sid])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), preempt=st.booleans())
    def free(self, data, preempt):
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        avail, sole = self.pool.pages_available, self.pool.sole_pages(sid)
        (self.pool.preempt if preempt else self.pool.free)(sid)
        assert self.pool.pages_available - avail == sole  # what freeing it gives back, predicted
        del self.tokens[sid]

    @rule(v=st.integers(0, 3))
    def drop(self, v):
        self.pool.drop_versions_below(v)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def take_room(self, data):
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.rooms[sid] = (self.pool.room(sid), self.pool.changes)

    @precondition(lambda self: self.rooms)
    @rule(data=st.data())
    def grow(self, data):
        """Growing within a room taken at the current ``changes`` is ensure's work with nothing to do."""
        sid = data.draw(st.sampled_from(sorted(self.rooms)))
        room, at = self.rooms[sid]
        if sid not in self.tokens or at != self.pool.changes or room <= len(self.tokens[sid]):
            return
        k = data.draw(st.integers(1, room - len(self.tokens[sid])))
        pages = list(self.pool.seqs[sid].pages)
        self.pool.grow(sid, len(self.tokens[sid]) + k)
        assert self.pool.seqs[sid].pages == pages and self.pool.changes == at
        self.tokens[sid] += [7] * k

    @invariant()
    def rooms_need_nothing(self):
        """A room taken at the pool's current ``changes`` is still free of allocations and copies (a
        change of references that ``changes`` missed would break it: a fork sharing the partial page)."""
        for sid, (room, at) in self.rooms.items():
            if at == self.pool.changes and sid in self.pool.seqs and room > self.pool.seqs[sid].length:
                assert self.pool.ensure_cost(sid, room) == 0

    @invariant()
    def accounting(self):
        pool = self.pool
        assert (pool.refs >= 0).all()
        held = np.zeros(pool.num_pages, np.int32)
        for s in pool.seqs.values():
            for p in s.pages:
                held[p] += 1
            assert len(s.pages) == pool.pages_for(s.length) or len(s.pages) >= pool.pages_for(s.length)
        np.testing.assert_array_equal(held, pool.refs)  # refs == sequences holding the page
        free, cached = set(pool._free), set(pool._cached)
        assert len(free) == len(pool._free) and not free & cached
        assert not any(pool.refs[p] for p in free | cached)  # a referenced page is never free/cached
        assert len(free) + len(cached) + pool.pages_in_use == pool.num_pages
        for p, v in pool._version_of.items():  # published pages: key, page and version agree
            assert pool._page_of[pool._key_of[p]] == p and v in (0, 1, 2)


def test_room_stops_at_a_shared_page_and_a_fork_moves_changes():
    """A sequence's room runs to the end of its sole pages; the page a fork shares ends it (the next
    write copies), and the fork moves ``changes``."""
    pool = PagePool(8, PS)
    pool.admit("a", list(range(PS + 1)), 0, reserve=PS)  # 2 full-page's worth: pages 0, 1 (+1 reserve)
    pool.ensure("a", PS + 1)
    assert pool.room("a") == len(pool.seqs["a"].pages) * PS
    at = pool.changes
    pool.fork("a", "b")
    assert pool.changes != at and pool.room("a") == PS + 1 == pool.room("b")
    with pytest.raises(ValueError, match="grow 'a'"):
        pool.grow("a", len(pool.seqs["a"].pages) * PS + 1)


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow])
