"""JetStream's adapter (``insert`` / ``generate``, what ``jax-rl serve`` runs) on the paged K/V layout
against the contiguous one (issue 61): the same tokens and behav_logp for prompts whose prefixes end inside a
page, on a page boundary and with no cached position, decoded across page boundaries, with a slot re-used by an
insert over its previous request (the new prefix taking a page that request left); a prefix the pool cannot
hold is refused with a clear error and the other slots decode on untouched."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from rollout.engine import Qwen3Engine, unpack_result
from rollout.engine.paged.pool import PoolExhausted

S, PS = 32, 8
A = list(range(3, 23))  # 19 cached positions: 2 full pages + 3
B = list(range(40, 49))  # 8: exactly one page (its first decode writes position 8, a new page)
C = list(range(60, 73))  # 12, inserted over A's slot
D = [90]  # 0 cached positions: no page until its first decode


def _engines(model, **paged):
    kw = dict(slots=2, max_cache_len=S, max_prefill_length=S, dtype="float32", temperature=0.0)
    p = nnx.state(model, nnx.Param)
    return (Qwen3Engine(model.config, p, kv_layout="contiguous", **kw),
            Qwen3Engine(model.config, p, kv_layout="paged", kv_page_size=PS, **paged, **kw))


def _steps(eng, st, n, out):
    for _ in range(n):
        st, res = eng.generate(eng.params, st)
        r = unpack_result(res)
        out.append((r["tokens"].copy(), r["valid"].copy(), np.where(r["valid"], r["behav_logp"], 0.0)))
    return st


def _insert(eng, st, prompt, slot, seed, temperature):
    return eng.insert(eng.prefill_tokens(eng.params, prompt, seed=seed, temperature=temperature), st, slot)


def test_insert_and_generate_on_pages_equal_contiguous_with_a_reused_slot(model):
    runs = []
    for eng in _engines(model):
        out: list = []
        st = eng.init_decode_state()
        st = _insert(eng, st, A, 0, seed=1, temperature=0.0)  # greedy
        st = _insert(eng, st, B, 1, seed=2, temperature=1.0)  # sampled: its tokens follow every logit
        st = _steps(eng, st, 10, out)  # A to 29 positions (4 pages), B to 18 (3): 1 page of 8 left
        old = list(eng.kv.pool.seqs[0].pages) if hasattr(eng.kv, "pool") else None
        st = _insert(eng, st, C, 0, seed=3, temperature=0.0)  # over A: frees its 4 pages, takes 2
        if old is not None:  # the smallest input exposing a stale page: C's pages include one A left
            assert set(eng.kv.pool.seqs[0].pages) & set(old), (eng.kv.pool.seqs[0].pages, old)
        st = _steps(eng, st, 6, out)  # C crosses into its 3rd page
        st = _insert(eng, st, D, 1, seed=5, temperature=1.0)  # over B, no cached position
        st = _steps(eng, st, 9, out)  # D's first page at its first step, its 2nd at the 9th
        runs.append(out)
    (ctg, pag) = runs
    for i, ((t0, v0, l0), (t1, v1, l1)) in enumerate(zip(ctg, pag)):
        np.testing.assert_array_equal(v0, v1, err_msg=f"step {i}")
        np.testing.assert_array_equal(t0[v0], t1[v1], err_msg=f"step {i}")
        np.testing.assert_allclose(l0, l1, atol=1e-5, rtol=0, err_msg=f"step {i}")
    assert all(v.all() for _, v, _ in ctg)  # every step decoded both slots (none ran out of cache)


def test_a_prefix_the_pool_cannot_hold_is_refused_and_the_others_decode_on(model):
    ctg, pag = _engines(model, kv_pages=S // PS)  # one sequence's pages
    st_c, st_p = ctg.init_decode_state(), pag.init_decode_state()
    st_c, st_p = _insert(ctg, st_c, A, 0, 1, 0.0), _insert(pag, st_p, A, 0, 1, 0.0)  # 3 of the 4 pages
    with pytest.raises(PoolExhausted, match=r"insert: a prefix of 12 positions needs 2 pages in slot 1's shard"):
        _insert(pag, st_p, C, 1, 3, 0.0)
    assert 1 not in pag.kv.pool.seqs  # the refused slot holds nothing
    out_c, out_p = [], []
    _steps(ctg, st_c, 10, out_c)
    _steps(pag, st_p, 10, out_p)  # slot 0 takes the 4th page
    for (t0, v0, l0), (t1, v1, l1) in zip(out_c, out_p):
        assert v0[0] and v1[0] and not v1[1]
        assert t0[0] == t1[0]
        np.testing.assert_allclose(l0[0], l1[0], atol=1e-5, rtol=0)
