"""Chunked prefill on the paged engine (``rollout.prefill_chunk_size``, issue 46): the plan
(:func:`rollout.engine.paged.prefill_plan.prefill_programs`) by hand and by property, and a paged engine whose
rows run in chunks of 16 positions against the contiguous engine (tokens exact, ``behav_logp`` and
MoE routes as the unchunked programs give them, fp32)."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings, strategies as st

from jax_rl.config import Config
from jax_rl.models import qwen3 as q
from rollout.engine import Qwen3Engine, SlotPrefill
from rollout.engine.paged.prefill_plan import MAX_ROWS, prefill_programs, rows_per_program

S, PS = 64, 8


def _plan(rows, chunk=2048, slots=8, max_len=12288, **kw):
    return [(p.T, p.pages, p.rows, [(c.row, c.start, c.length, c.last) for c in p.chunks])
            for p in prefill_programs(rows, chunk=chunk, slots=slots, max_len=max_len, **kw)]


def test_two_long_prompts_run_in_chunks_of_few_rows():
    """The tau2 retail shape: two distinct 5,715-position prompts in an 8-slot call. Unchunked it was one
    program of 8 rows x 8,192; in chunks of 2,048: 2 rows a round, the last round at a 2,048 bucket
    (1,619 positions), each chunk's pages up to its own end."""
    pages = lambda end: -(-end // 16)  # noqa: E731 - the page key: pages up to the chunk's end
    plan = _plan([(0, 0, 5715, 0), (3, 0, 5715, 0)], page_key=pages)
    assert plan == [
        (2048, 128, 1, [(0, 0, 2048, False)]), (2048, 128, 1, [(3, 0, 2048, False)]),
        (2048, 256, 1, [(0, 2048, 2048, False)]), (2048, 256, 1, [(3, 2048, 2048, False)]),
        (2048, 358, 1, [(0, 4096, 1619, True)]), (2048, 358, 1, [(3, 4096, 1619, True)])]
    # short appends share a program: 2048 // 16 rows of bucket 16, at most the slots
    assert _plan([(i, 100, 110, 0) for i in range(3)]) == [(16, None, 8, [(i, 100, 10, True) for i in range(3)])]
    assert rows_per_program(16, 2048, 8) == 8 and rows_per_program(4096, 2048, 8) == 1
    assert rows_per_program(16, 2048, 64) == MAX_ROWS == 16  # padding rows cost real compute: capped
    # a row with nothing to compute still runs (its slot armed); a later wave runs after the earlier one
    assert _plan([(1, 0, 40, 1), (0, 32, 32, 0)], chunk=16) == [
        (16, None, 1, [(0, 32, 0, True)]),
        (16, None, 1, [(1, 0, 16, False)]), (16, None, 1, [(1, 16, 16, False)]), (16, None, 1, [(1, 32, 8, True)])]
    # a pool split over shards of slots: every program runs all the slots' rows, the chunks still cut
    assert [p[2] for p in _plan([(0, 0, 40, 0)], chunk=16, rows_at_slots=True)] == [8, 8, 8]
    with pytest.raises(ValueError, match="rollout.prefill_chunk_size=24"):
        prefill_programs([(0, 0, 4, 0)], chunk=24, slots=8, max_len=64)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 300), st.integers(0, 300), st.integers(0, 2)), min_size=1, max_size=6),
       st.sampled_from([16, 32, 64, 512]), st.integers(1, 40))
def test_the_plan_tiles_each_row_in_order_within_its_wave(spec, chunk, slots):
    rows = [(i, min(a, b), max(a, b), w) for i, (a, b, w) in enumerate(spec)]
    progs = prefill_programs(rows, chunk=chunk, slots=slots, max_len=512)
    seen: dict[int, list] = {}
    wave_at = []
    for p in progs:
        assert 1 <= len(p.chunks) <= p.rows <= min(slots, MAX_ROWS) and p.T >= 16
        assert len({c.row for c in p.chunks}) == len(p.chunks)  # a row once per program
        for c in p.chunks:
            assert c.length <= min(chunk, p.T)
            seen.setdefault(c.row, []).append(c)
            wave_at.append(rows[c.row][3])
    assert wave_at == sorted(wave_at)  # waves in order
    for i, s, e, _ in rows:
        cs = seen[i]
        assert cs[0].start == s and cs[-1].end == e and [c.last for c in cs] == [False] * (len(cs) - 1) + [True]
        assert all(a.end == b.start for a, b in zip(cs, cs[1:]))  # contiguous, in order


def test_the_config_refuses_a_chunk_that_is_not_a_power_of_two():
    with pytest.raises(ValueError, match="rollout.prefill_chunk_size=3000: must be a power of two"):
        Config.model_validate({"rollout": {"prefill_chunk_size": 3000}})


def _decode(eng, st, steps=4):
    st, o = eng.decode_steps(eng.params, st, steps)
    return st, np.asarray(o.token), np.where(np.asarray(o.valid), np.asarray(o.behav_logp), 0.0)


def test_a_chunked_paged_engine_equals_the_contiguous_one(model):
    """A group of 3 on a 40-position prompt (chunks 16 + 16 + 8), a fresh 10-position prompt, decode, then
    an append of 25 positions (16 + 9) and a fresh request hitting the group's prefix pages."""
    p = nnx.state(model, nnx.Param)
    kw = dict(slots=4, max_cache_len=S, dtype="float32")
    ref = Qwen3Engine(model.config, p, kv_layout="contiguous", **kw)
    pag = Qwen3Engine(model.config, p, kv_layout="paged", kv_page_size=PS, prefill_chunk_size=16, **kw)
    # the largest append-prefill program (what jax-rl compile builds): the contiguous [slots, positions], the first chunk
    assert ref.kv.append_prefill_shape(40) == (4, 40) and pag.kv.append_prefill_shape(40) == (1, 16)
    a, b = list(range(3, 44)), list(range(50, 61))
    rows = [SlotPrefill(a, slot=0, seed=1), SlotPrefill(a, slot=1, seed=2), SlotPrefill(a, slot=2, seed=3),
            SlotPrefill(b, slot=3, seed=4, temperature=0.0)]
    out = {}
    for name, eng in (("ref", ref), ("pag", pag)):
        st = eng.init_decode_state()
        st, res = eng.prefill_slots(eng.params, st, rows)
        st, t0, l0 = _decode(eng, st)
        more = b + [int(t) for t in t0[:, 3]] + list(range(70, 91))  # 10 + 4 + 21 = 35 positions, 25 new
        st = eng.free_slots(st, [0, 3])
        st, res2 = eng.prefill_slots(eng.params, st, [SlotPrefill(more, slot=3, seed=4, start=14),
                                                      SlotPrefill(a, slot=0, seed=9)])
        st, t1, l1 = _decode(eng, st)
        out[name] = (np.concatenate([t0, t1]), np.concatenate([l0, l1]),
                     [r.prefill_tokens for r in res + res2])
    np.testing.assert_array_equal(out["pag"][0], out["ref"][0])
    np.testing.assert_allclose(out["pag"][1], out["ref"][1], atol=1e-5)
    # 21 = 35 - 14 appended; slot 0: 4 of the 5 full pages referenced (the last page is computed: its logits)
    assert out["pag"][2] == [40, 0, 0, 10, 21, 8]
    assert pag.kv.stats()["kv_prefix_page_hits"] == 4


def test_a_chunked_rows_values_do_not_depend_on_what_shares_its_call(model):
    """A 40-position row prefilled alone and beside a 30-position one (each in chunks of 16): the same
    decode tokens and behav_logp bit for bit (a program's row count is a function of its bucket alone)."""
    p = nnx.state(model, nnx.Param)
    got = []
    for rows in ([SlotPrefill(list(range(3, 44)), slot=0, seed=1)],
                 [SlotPrefill(list(range(3, 44)), slot=0, seed=1), SlotPrefill(list(range(60, 91)), slot=1, seed=2)]):
        eng = Qwen3Engine(model.config, p, slots=4, max_cache_len=S, dtype="float32", kv_layout="paged",
                          kv_page_size=PS, prefill_chunk_size=16)
        st, _ = eng.prefill_slots(eng.params, eng.init_decode_state(), rows)
        _, t, lp = _decode(eng, st, 3)
        got.append((t[:, 0], lp[:, 0]))
    np.testing.assert_array_equal(got[1][0], got[0][0])
    np.testing.assert_array_equal(got[1][1], got[0][1])


def test_chunked_moe_rows_record_the_routes_of_every_position():
    """Routing replay on pages: a chunked row's recorded routes are the contiguous engine's, position by
    position (the chunks' routes concatenated), for a fresh row (40 positions: 3 chunks) and an append (21)."""
    cfg = q.get_preset("tiny_moe")
    params = nnx.state(q.Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0), scan_layers=True), nnx.Param)
    kw = dict(slots=2, max_cache_len=S, dtype="float32", record_routes=True, model_kwargs=dict(scan_layers=True))
    got = []
    for extra in (dict(kv_layout="contiguous"), dict(kv_layout="paged", kv_page_size=PS, prefill_chunk_size=16)):
        eng = Qwen3Engine(cfg, params, **kw, **extra)
        st, r0 = eng.prefill_slots(eng.params, eng.init_decode_state(), [SlotPrefill(list(range(3, 44)), slot=0, seed=1)])
        st = eng.free_slots(st, [0])
        st, r1 = eng.prefill_slots(eng.params, st, [SlotPrefill(list(range(3, 44)) + list(range(70, 92)), slot=0,
                                                                seed=1, start=40)])
        got.append((r0[0], r1[0]))
    for ref, pag in zip(*got):
        assert pag.prefill_tokens == ref.prefill_tokens and pag.routes.shape == ref.routes.shape
        np.testing.assert_array_equal(pag.routes, ref.routes)
