"""Qwen3 over a paged K/V pool (jax_rl.models.qwen3.paged) against the contiguous cache: prefill
(``paged_extend`` from 0), decode steps and an append-prefill give the same logits (fp32, 1e-5)
and, for a MoE model, the same routes; unrolled (per-layer pools) and scanned (stacked pool)."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from flax import nnx

from jax_rl.models.backend_target import target_backend
from jax_rl.models.qwen3 import Qwen3ForCausalLM, get_preset
from jax_rl.models.qwen3.paged import (copy_pages, gather_window, init_paged_cache, paged_decode_step, paged_extend,
                                       write_window)

TOL = 1e-5
PS, M = 4, 6  # page size, pages per row: 24 positions


def _jit(model, fn, **static):
    """``fn(model, *args, **static)`` jitted over the model's state (eager decode is ~10x slower)."""
    gd, st = nnx.split(model)
    f = jax.jit(lambda st, *a: fn(nnx.merge(gd, st), *a, **static))
    return lambda *a: f(st, *a)


def _table(B, pages, rng, P):
    """Row b holds pages[b] distinct random pages of the pool (-1 after)."""
    perm = rng.permutation(P)
    t = np.full((B, M), -1, np.int32)
    at = 0
    for b, n in enumerate(pages):
        t[b, :n] = perm[at:at + n]
        at += n
    return jnp.asarray(t)


@pytest.mark.parametrize("preset,scan", [("tiny_dense", False), ("tiny_moe", True)])
def test_paged_prefill_decode_extend_equal_the_contiguous_cache(preset, scan):
    rng = np.random.default_rng(0)
    model = Qwen3ForCausalLM(get_preset(preset), rngs=nnx.Rngs(0), scan_layers=scan)
    B, T, S = 3, 7, PS * M
    ids = jnp.asarray(rng.integers(1, 300, (B, T)), jnp.int32)
    lens = jnp.array([7, 3, 5], jnp.int32)
    moe = model.config.num_experts > 0

    kw = dict(return_expert_ids=moe)
    ref = _jit(model, Qwen3ForCausalLM.prefill, **kw)(ids, lens, model.init_cache(B, S))
    pc = init_paged_cache(model, B, num_pages=32, page_size=PS, max_pages=M)
    pc = pc.replace(page_table=_table(B, [M, 3, M], rng, 32))  # row 1 holds 12 positions only
    got = _jit(model, paged_extend, num_pages=2, **kw)(ids, jnp.zeros(B, jnp.int32), lens, pc)
    valid = np.asarray(jnp.arange(T)[None] < lens[:, None])
    np.testing.assert_allclose(np.asarray(got.logits)[valid], np.asarray(ref.logits)[valid], atol=TOL, rtol=TOL)
    for a, b in zip(got.expert_ids or (), ref.expert_ids or ()):
        np.testing.assert_array_equal(np.asarray(a)[valid], np.asarray(b)[valid])

    rc, gc = ref.cache, got.cache
    tok = jnp.asarray(rng.integers(1, 300, (B,)), jnp.int32)
    dec_ref = _jit(model, Qwen3ForCausalLM.decode_step, **kw)
    dec = _jit(model, paged_decode_step, num_pages=4, **kw)
    for _ in range(3):  # decode steps: row 0 crosses into its third page
        r, g = dec_ref(tok, rc), dec(tok, gc)
        np.testing.assert_allclose(g.logits, r.logits, atol=TOL, rtol=TOL)
        for a, b in zip(g.expert_ids or (), r.expert_ids or ()):
            np.testing.assert_array_equal(a, b)
        rc, gc, tok = r.cache, g.cache, jnp.argmax(r.logits, -1).astype(jnp.int32)
    np.testing.assert_array_equal(gc.lengths, rc.lengths)

    new = jnp.asarray(rng.integers(1, 300, (B, 4)), jnp.int32)  # append-prefill at the held lengths
    nl = jnp.array([4, 1, 3], jnp.int32)
    r = _jit(model, Qwen3ForCausalLM.extend, **kw)(new, rc.lengths, nl, rc)
    g = _jit(model, paged_extend, num_pages=M, **kw)(new, gc.lengths, nl, gc)
    valid = np.asarray(jnp.arange(4)[None] < nl[:, None])
    np.testing.assert_allclose(np.asarray(g.logits)[valid], np.asarray(r.logits)[valid], atol=TOL, rtol=TOL)
    np.testing.assert_array_equal(g.cache.lengths, r.cache.lengths)


def test_paged_decode_writes_nothing_for_a_row_without_a_page():
    """A row whose table has no page at its position (-1) leaves the pool untouched; the other
    rows write exactly one position per layer."""
    model = Qwen3ForCausalLM(get_preset("tiny_dense"), rngs=nnx.Rngs(0))
    pc = init_paged_cache(model, 2, num_pages=8, page_size=PS, max_pages=M)
    pc = pc.replace(page_table=jnp.array([[3] + [-1] * (M - 1), [-1] * M], jnp.int32))
    out = _jit(model, paged_decode_step, num_pages=1)(jnp.array([5, 6], jnp.int32), pc)
    for layer in out.cache.kv:
        nz = np.argwhere(np.any(np.asarray(layer) != 0, axis=(2, 3)))
        assert [tuple(x) for x in nz] == [(3, 0)]


def test_paged_decode_write_mask_and_copy_pages():
    """``write`` False: the row's K/V are not written (an inactive engine slot); ``copy_pages``
    copies whole pages in every layer and skips -1."""
    model = Qwen3ForCausalLM(get_preset("tiny_dense"), rngs=nnx.Rngs(0))
    pc = init_paged_cache(model, 2, num_pages=8, page_size=PS, max_pages=M)
    pc = pc.replace(page_table=jnp.array([[3] + [-1] * (M - 1), [5] + [-1] * (M - 1)], jnp.int32))
    step = _jit(model, lambda m, t, c, w: paged_decode_step(m, t, c, num_pages=1, write=w))
    out = step(jnp.array([5, 6], jnp.int32), pc, jnp.array([True, False]))
    for layer in out.cache.kv:
        assert np.any(np.asarray(layer[3]) != 0) and not np.any(np.asarray(layer[5]) != 0)
    cp = copy_pages(out.cache, jnp.array([3, 3]), jnp.array([6, -1]))
    for a, b in zip(cp.kv, out.cache.kv):
        np.testing.assert_array_equal(a[6], b[3])
        np.testing.assert_array_equal(np.delete(np.asarray(a), 6, 0), np.delete(np.asarray(b), 6, 0))


def test_scanned_decode_for_a_tpu_reads_the_stacked_pool_in_place():
    """A scanned model's decode step compiled for a TPU (v5e:2x2, one chip; the TPU kernel): the kernel
    reads the stacked pool [L, P, ps, 2K, H] in place (seen as L*P pages, the table offset by layer), so
    no instruction materialises a layer's pool [P, ps, 2K, H] (given the layer's slice, XLA copied
    every layer's whole pool out of the stack each step)."""
    pytest.importorskip("libtpu")
    import re

    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from jax_rl import tpu
    from jax_rl.models.backend_target import target_backend
    from jax_rl.models.qwen3.paged import PagedKVCache

    mc = get_preset("tiny_dense", head_dim=128)
    model = nnx.eval_shape(lambda: Qwen3ForCausalLM(mc, rngs=nnx.Rngs(0), scan_layers=True, dtype=jnp.bfloat16,
                                                    param_dtype=jnp.bfloat16))
    gd, st = nnx.split(model)
    topo = tpu.get_topology("v5e:2x2")
    mesh = Mesh(np.array(topo.devices[:1]), ("d",))
    rep = NamedSharding(mesh, P())
    B, Pg, L, K = 8, 64, mc.num_hidden_layers, mc.num_key_value_heads
    layer = (Pg, 16, 2 * K, mc.head_dim)
    sds = lambda s, d: jax.ShapeDtypeStruct(s, d, sharding=rep)  # noqa: E731
    cache = PagedKVCache(kv=sds((L, *layer), jnp.bfloat16), page_table=sds((B, 8), jnp.int32),
                         lengths=sds((B,), jnp.int32))
    fn = jax.jit(lambda st, tok, c: paged_decode_step(nnx.merge(gd, st), tok, c).logits, donate_argnums=(2,))
    args = (jax.tree.map(lambda a: sds(a.shape, a.dtype), st), sds((B,), jnp.int32), cache)
    with tpu.no_persistent_cache(), jax.set_mesh(mesh), target_backend("tpu"), jax.default_matmul_precision("default"):
        txt = fn.lower(*args).compile().as_text()
    assert "ragged_paged_attention" in txt
    shape = r"bf16\[%s\]" % ",".join(map(str, layer))
    copies = [x for x in txt.splitlines() if re.search(rf"= {shape}\S* (fusion|copy|dynamic-slice)", x)]
    assert not copies, copies[0][:200]


@pytest.mark.parametrize("scan", [False, True])
def test_a_bf16_pool_kept_as_its_bits_on_cpu_equals_the_float_pool(scan):
    """XLA:CPU keeps a bf16 pool as its uint16 bits (``pool_storage_dtype``: its bf16 scatters ran in
    f32 over the whole pool): prefill, decode and ``copy_pages`` on it give the logits and pool bits of
    the same calls on a bf16 pool (the storage a GPU engine keeps), bit for bit."""
    rng = np.random.default_rng(0)
    model = Qwen3ForCausalLM(get_preset("tiny_dense"), rngs=nnx.Rngs(0), scan_layers=scan, dtype=jnp.bfloat16,
                             param_dtype=jnp.bfloat16)
    B, T = 2, 7
    table = _table(B, [M, 3], rng, 16)
    free = min(set(range(16)) - set(np.asarray(table).ravel().tolist()))  # a page no row holds
    bits = init_paged_cache(model, B, num_pages=16, page_size=PS, max_pages=M).replace(page_table=table)
    with target_backend("gpu"):
        flt = init_paged_cache(model, B, num_pages=16, page_size=PS, max_pages=M).replace(page_table=table)
    assert bits.kv_dtype == flt.kv_dtype == jnp.bfloat16
    assert all(x.dtype == jnp.uint16 for x in jax.tree.leaves(bits.kv))
    ids = jnp.asarray(rng.integers(1, 300, (B, T)), jnp.int32)
    lens = jnp.array([7, 5], jnp.int32)
    ext = _jit(model, paged_extend, num_pages=2)
    dec = _jit(model, paged_decode_step, num_pages=2)
    outs = []
    for pc in (bits, flt):
        o = ext(ids, jnp.zeros(B, jnp.int32), lens, pc)
        d = dec(jnp.array([3, 4], jnp.int32), o.cache)
        cp = copy_pages(d.cache, jnp.array([table[0, 0]]), jnp.array([free]))
        pools = [np.asarray(jax.lax.bitcast_convert_type(x, jnp.uint16)) if x.dtype != jnp.uint16 else np.asarray(x)
                 for x in jax.tree.leaves(cp.kv)]
        outs.append((np.asarray(o.logits), np.asarray(d.logits), pools))
    np.testing.assert_array_equal(outs[0][0], outs[1][0])
    np.testing.assert_array_equal(outs[0][1], outs[1][1])
    for a, b in zip(outs[0][2], outs[1][2]):
        np.testing.assert_array_equal(a, b)
    assert any(np.any(p != 0) for p in outs[0][2])


@pytest.mark.parametrize("scan,dtype", [(False, jnp.bfloat16), (True, jnp.float32)])
def test_decode_on_a_gathered_window_equals_decode_on_the_pages(scan, dtype):
    """The XLA:CPU engine's decode call: ``gather_window`` (each row's first pages as a contiguous cache),
    the contiguous ``decode_step`` n times on it, ``write_window`` (the call's new entries back through
    the table) give the logits, lengths and pool (bit for bit) of n ``paged_decode_step`` calls; per-layer
    pools of bf16 bits and a stacked fp32 pool. Rows 0 and 2 cross into a new page; row 1 fills its last."""
    rng = np.random.default_rng(1)
    model = Qwen3ForCausalLM(get_preset("tiny_dense"), rngs=nnx.Rngs(0), scan_layers=scan, dtype=dtype,
                             param_dtype=dtype)
    B, T, n, pages = 3, 10, 3, 4
    pc = init_paged_cache(model, B, num_pages=24, page_size=PS, max_pages=M)
    pc = pc.replace(page_table=_table(B, [M, 3, 4], rng, 24))
    lens = jnp.array([7, 9, 4], jnp.int32)
    ids = jnp.asarray(rng.integers(1, 300, (B, T)), jnp.int32)
    pc = _jit(model, paged_extend, num_pages=M)(ids, jnp.zeros(B, jnp.int32), lens, pc).cache
    win = gather_window(pc, pages)
    assert win.max_len == pages * PS and win.is_per_layer == (not scan)
    step_pages = _jit(model, paged_decode_step, num_pages=pages)
    step_win = _jit(model, Qwen3ForCausalLM.decode_step)
    tok = jnp.asarray(rng.integers(1, 300, (B,)), jnp.int32)
    ref = pc
    for _ in range(n):
        r, w = step_pages(tok, ref), step_win(tok, win)
        np.testing.assert_array_equal(np.asarray(w.logits), np.asarray(r.logits))
        ref, win, tok = r.cache, w.cache, jnp.argmax(r.logits, -1).astype(jnp.int32)
    got = jax.jit(lambda c, w: write_window(c, w, c.lengths, n))(pc, win)
    np.testing.assert_array_equal(got.lengths, ref.lengths)
    np.testing.assert_array_equal(got.lengths, lens + n)
    for a, b in zip(jax.tree.leaves(got.kv), jax.tree.leaves(ref.kv)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(jax.tree.leaves(got.kv),
                                                                             jax.tree.leaves(pc.kv)))


def test_gather_window_refuses_a_pool_split_over_pages():
    model = Qwen3ForCausalLM(get_preset("tiny_dense"), rngs=nnx.Rngs(0))
    pc = init_paged_cache(model, 2, num_pages=8, page_size=PS, max_pages=M,
                          pool_spec=jax.sharding.PartitionSpec("data", None, None, None))
    with pytest.raises(ValueError, match="split over pages"):
        gather_window(pc, 2)
