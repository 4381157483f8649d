"""Qwen3Engine(kv_layout="paged") against the contiguous engine (issue 46): a GRPO group prefilled
once and shared by page reference, decode and append-prefill on the pages, prefix pages shared by
reference only at the weights that computed them, pool exhaustion preempting a held slot (its next
turn re-prefilled), all with the contiguous engine's tokens and behav_logp (fp32, 1e-5)."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from rollout.engine import Qwen3Engine, SlotPrefill
from rollout.engine.paged.pool import PoolExhausted

S, PS = 64, 8


def _engines(model, **paged):
    p = nnx.state(model, nnx.Param)
    kw = dict(slots=4, max_cache_len=S, dtype="float32")
    return Qwen3Engine(model.config, p, kv_layout="contiguous", **kw), Qwen3Engine(model.config, p, kv_layout="paged", kv_page_size=PS, **paged, **kw)


def _run(eng, rows, steps=5, later=None, swap=None):
    """prefill rows, ``steps`` decode steps (two calls), then optional append rows; (tokens, logp, prefill)."""
    st = eng.init_decode_state()
    st, res = eng.prefill_slots(eng.params, st, rows)
    outs = []
    st, o = eng.decode(eng.params, st)
    outs.append((np.asarray(o.token)[None], np.asarray(o.behav_logp)[None], np.asarray(o.valid)[None]))
    st, o = eng.decode_steps(eng.params, st, steps - 1)
    outs.append((np.asarray(o.token), np.asarray(o.behav_logp), np.asarray(o.valid)))
    res2 = []
    if later is not None:
        rows2 = later(outs)
        st = eng.free_slots(st, [r.slot for r in rows2])
        if swap is not None:
            eng.params = eng.load_params(swap)
        st, res2 = eng.prefill_slots(eng.params, st, rows2)
        st, o = eng.decode_steps(eng.params, st, 3)
        outs.append((np.asarray(o.token), np.asarray(o.behav_logp), np.asarray(o.valid)))
    tok = np.concatenate([a for a, _, _ in outs])
    lp = np.concatenate([b for _, b, _ in outs])
    valid = np.concatenate([c for _, _, c in outs])
    return tok, np.where(valid, lp, 0.0), [r.prefill_tokens for r in res] + [r.prefill_tokens for r in res2]


def _rows(prompt_a, prompt_b):
    return [SlotPrefill(prompt_a, slot=0, seed=1), SlotPrefill(prompt_a, slot=1, seed=2),
            SlotPrefill(prompt_a, slot=2, seed=3), SlotPrefill(prompt_b, slot=3, seed=4, temperature=0.0)]


def test_paged_engine_equals_contiguous_with_a_shared_group_and_decode(model):
    ref, pag = _engines(model)
    rows = _rows(list(range(3, 23)), list(range(40, 51)))  # 20 tokens: 2 full pages + a partial one
    t0, l0, p0 = _run(ref, rows)
    t1, l1, p1 = _run(pag, rows)
    np.testing.assert_array_equal(t1, t0)
    np.testing.assert_allclose(l1, l0, atol=1e-5)
    assert p1 == [19, 0, 0, 10]  # the group's prompt prefilled once
    s = pag.kv.stats()
    # slots 0-2 share the prompt's pages; the first two to write copy the partial last page, the third owns it
    assert s["kv_pages_copied"] == 2
    assert s["kv_pages_in_use"] < 4 * (S // PS)  # no reservation per slot


def test_paged_append_prefill_and_prefix_pages_by_reference_per_weight_version(model, params2):
    ref, pag = _engines(model)
    a = list(range(3, 23))
    rows = _rows(a, list(range(40, 51)))
    # turn 2 of slot 3 (append-prefill on its kept pages), and a fresh request into slot 0 with the
    # group's prompt: its 2 full pages are referenced, not recomputed (same weights)
    def later(outs):
        gen3 = [int(t) for t in np.concatenate([o[0] for o in outs])[:, 3]]
        return [SlotPrefill(list(range(40, 51)) + gen3 + [7, 8, 9], slot=3, seed=4, start=10 + len(gen3)),
                SlotPrefill(a, slot=0, seed=9)]
    t0, l0, p0 = _run(ref, rows, later=later)
    t1, l1, p1 = _run(pag, rows, later=later)
    np.testing.assert_array_equal(t1, t0)
    np.testing.assert_allclose(l1, l0, atol=1e-5)
    assert p1[4:] == [3, 19 - 16] and pag.kv.stats()["kv_prefix_page_hits"] == 2
    # the same with a weight swap before turn 2: no page of the old weights is read by the new request
    ref, pag = _engines(model)
    t0, l0, p0 = _run(ref, rows, later=later, swap=params2)
    t1, l1, p1 = _run(pag, rows, later=later, swap=params2)
    np.testing.assert_array_equal(t1, t0)
    np.testing.assert_allclose(l1, l0, atol=1e-5)
    assert p1[5] == 19 and pag.kv.stats()["kv_prefix_page_hits"] == 0


def test_pool_exhaustion_preempts_a_held_slot_and_reprefills_it(model):
    with pytest.raises(ValueError, match="rollout.kv_pages=7 .* cannot hold one sequence"):
        _engines(model, kv_pages=7)  # 56 positions < max_cache_len 64
    _, pag = _engines(model, kv_pages=8)  # 64 positions (one max_cache_len sequence) for 4 slots
    rows = [SlotPrefill(list(range(3, 20)), slot=0, seed=1), SlotPrefill(list(range(30, 40)), slot=1, seed=2)]
    st = pag.init_decode_state()
    st, _ = pag.prefill_slots(pag.params, st, rows)
    st = pag.free_slots(st, [0])  # slot 0 held between turns (2 pages; slot 1 holds 2)
    big = [SlotPrefill(list(range(50, 90)), slot=2, seed=3)]  # 5 pages: only by preempting slot 0
    st, res = pag.prefill_slots(pag.params, st, big)
    assert pag.kv.stats()["kv_preemptions"] == 1 and 0 not in pag.kv.pool.seqs
    st = pag.free_slots(st, [2])
    st, res = pag.prefill_slots(pag.params, st, [SlotPrefill(list(range(3, 20)) + [5, 6], slot=0, seed=1, start=17)])
    assert res[0].prefill_tokens == 18  # the preempted slot's whole context, re-prefilled
    in_use = pag.kv.stats()["kv_pages_in_use"]
    with pytest.raises(PoolExhausted):  # nothing held left to preempt
        pag.prefill_slots(pag.params, st, [SlotPrefill(list(range(100, 110)), slot=2, seed=5),  # 2 pages: taken
                                           SlotPrefill(list(range(50, 90)), slot=3, seed=3)])  # 5 of 3 left
    # the failed call took back what its rows got: the generator may queue them again (rollout.kv_pressure)
    assert not {2, 3} & set(pag.kv.pool.seqs) and pag.kv.stats()["kv_pages_in_use"] == in_use
    # and unpublished the full page slot 2's row published before its K/V were written
    assert pag.kv.pool.lookup(list(range(100, 110)), pag.kv._kv_epoch) == []


def test_rows_of_one_call_share_prefix_pages_as_rows_of_separate_calls(model):
    """Which pages a row computes must not depend on how the generator batched its admissions into calls
    (a paged K=0 run and its kill -9 resume prefilled 86 and 54 tokens at the same step: the straight run
    admitted two groups sharing the system prompt's pages in one call, the resumed one in two). The
    dependent row computes fewer tokens (a smaller bucket) and must still run after the row whose pages
    it reads."""
    ref, pag = _engines(model)
    a = list(range(3, 23))  # 19 context positions: 2 full pages + 3
    b = a[:16] + list(range(60, 66))  # the same 2 full pages, then 5 of its own
    rows = [SlotPrefill(a, slot=0, seed=1), SlotPrefill(b, slot=1, seed=2)]
    t1, l1, p1 = _run(pag, rows)
    assert p1 == [19, 5] and pag.kv.stats()["kv_prefix_page_hits"] == 2
    _, sep = _engines(model)
    st = sep.init_decode_state()
    st, r0 = sep.prefill_slots(sep.params, st, rows[:1])
    st, r1 = sep.prefill_slots(sep.params, st, rows[1:])
    assert [r0[0].prefill_tokens, r1[0].prefill_tokens] == p1
    t0, l0, _ = _run(ref, rows)
    np.testing.assert_array_equal(t1, t0)
    np.testing.assert_allclose(l1, l0, atol=1e-5)


def test_kv_stats_count_live_positions_once_per_shared_page(model):
    """kv_held_tokens / kv_live_tokens / kv_sequences (issue 46's pages held per live token), by hand:
    pages of 8; a group of 3 sharing a 19-position prompt (pages 8 + 8 + 3) and a 10-position prompt
    (8 + 2)."""
    _, pag = _engines(model)
    st = pag.init_decode_state()
    st, _ = pag.prefill_slots(pag.params, st, _rows(list(range(3, 23)), list(range(40, 51))))
    s = pag.kv.stats()
    assert (s["kv_sequences"], s["kv_pages_in_use"], s["kv_held_tokens"], s["kv_live_tokens"]) == (4, 5, 40, 29)
    st, _ = pag.decode(pag.params, st)
    # one more position each: slots 0 and 1 copy the shared partial page on write (4 positions each),
    # slot 2 keeps the original (4), the full pages stay shared (16), slot 3 has 8 + 3
    s = pag.kv.stats()
    assert (s["kv_sequences"], s["kv_pages_in_use"], s["kv_held_tokens"], s["kv_live_tokens"]) == (4, 7, 56, 39)


def _decode_calls(eng, rows, calls, state=None):
    st = eng.init_decode_state() if state is None else state
    st, _ = eng.prefill_slots(eng.params, st, rows)
    toks, lps = [], []
    for _ in range(calls):
        st, o = eng.decode(eng.params, st)
        toks.append(np.asarray(o.token))
        lps.append(np.asarray(o.behav_logp))
    return np.stack(toks), np.stack(lps)


def test_decode_sends_the_page_table_only_when_a_row_changed(model):
    """A decode call whose slots all stay within their own pages only moves the lengths: the table goes
    to the device after the prefill and on the calls that take a page (the copy on write of the group's
    shared partial page at call 1, slots 0-2's next page at call 6, slot 3's at call 7), and the tokens
    stay the contiguous engine's."""
    ref, pag = _engines(model)
    rows = _rows(list(range(3, 23)), list(range(40, 51)))  # contexts of 19 (a group) and 10 positions
    pushes = []
    set_table = pag._jits["set_table"]
    pag._jits["set_table"] = lambda *a: pushes.append(1) or set_table(*a)
    t0, l0 = _decode_calls(ref, rows, 12)
    t1, l1 = _decode_calls(pag, rows, 12)
    np.testing.assert_array_equal(t1, t0)
    np.testing.assert_allclose(l1, l0, atol=1e-5)
    assert len(pushes) == 4


def test_a_fresh_decode_state_starts_the_host_pool_afresh(model):
    """The generator starts a fresh decode state after a failed step: its device pool holds no K/V, so
    the host pool must forget its pages too. Else a prompt whose first page was published before hits
    that page, reads zeros, and samples other tokens than the contiguous engine."""
    p = nnx.state(model, nnx.Param)
    kw = dict(slots=1, max_cache_len=16, dtype="float32")
    ref = Qwen3Engine(model.config, p, kv_layout="contiguous", **kw)
    pag = Qwen3Engine(model.config, p, kv_layout="paged", kv_page_size=8, kv_pages=2, **kw)
    rows = [SlotPrefill(list(range(3, 13)), slot=0, seed=5)]  # a context of 9: one full page (published) + 1
    t0, l0 = _decode_calls(ref, rows, 3)
    _decode_calls(pag, rows, 3)
    t1, l1 = _decode_calls(pag, rows, 3, state=pag.init_decode_state())
    assert pag.kv.stats()["kv_prefix_page_hits"] == 0
    np.testing.assert_array_equal(t1, t0)
    np.testing.assert_allclose(l1, l0, atol=1e-5)


def test_a_row_too_long_or_empty_is_refused_naming_its_slot(model):
    """Both layouts check the rows before any page or program: the message names the slot and the bound."""
    for eng in _engines(model):
        st = eng.init_decode_state()
        for n in (S + 1, 0):
            with pytest.raises(ValueError, match=rf"the row for slot 2 has {n} tokens; a row needs 1..max_cache_len={S}"):
                eng.prefill_slots(eng.params, st, [SlotPrefill(list(range(3, 3 + n)), slot=2, seed=1)])
        assert eng.kv.name == "contiguous" or eng.kv.stats()["kv_pages_in_use"] == 0
