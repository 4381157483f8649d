"""A bf16 contiguous K/V cache kept as its uint16 bits on XLA:CPU (``jax_rl.models.kv_storage``; its bf16
scatters and dynamic-update-slices ran in f32 over the whole cache) gives the values of the bf16 cache a GPU
engine keeps, bit for bit: the model's prefill, decode and extend on both layouts, and the engine's
programs (batched prefill, append-prefill, JetStream prefill + insert, copy_slot, decode)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_rl.models import qwen3 as q
from jax_rl.models.backend_target import target_backend
from rollout.engine import Qwen3Engine
from rollout.engine.slots import SlotPrefill

BF16 = dict(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)


def _bits(tree) -> list[np.ndarray]:
    """Every K/V leaf as its uint16 bits (a float bf16 buffer bitcast; a buffer of bits as it is)."""
    return [np.asarray(x if x.dtype == jnp.uint16 else jax.lax.bitcast_convert_type(x, jnp.uint16))
            for x in jax.tree.leaves((tree.k, tree.v))]


def _assert_same(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)


def _cache_pair(m, B, S):
    """(bits, float) empty caches of the same bf16 values: the CPU's storage and a GPU engine's."""
    bits = m.init_cache(B, S, backend_storage=True)
    with target_backend("gpu"):
        flt = m.init_cache(B, S, backend_storage=True)
    assert bits.k.dtype == jnp.uint16 and bits.kv_dtype == flt.kv_dtype == flt.k.dtype == jnp.bfloat16
    return bits, flt


def test_model_prefill_decode_extend_insert_on_bits_equal_the_bf16_cache():
    """Unrolled layers: a stacked cache (a static layer index) and its per-layer form (the scanned model's
    traced index: the engine test below)."""
    m = q.Qwen3ForCausalLM(q.get_preset("tiny_dense"), rngs=nnx.Rngs(0), **BF16)
    B, T, S = 2, 6, 16
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(1, 300, (B, T)), jnp.int32)
    lens = jnp.array([6, 4], jnp.int32)
    pre = nnx.jit(lambda m, x, c: m.prefill(x, lens, c))
    dec = nnx.jit(lambda m, t, c: m.decode_step(t, c))
    ext = nnx.jit(lambda m, x, c: m.extend(x, c.lengths, jnp.array([3, 2], jnp.int32), c))
    outs = []
    for cache in _cache_pair(m, B, S):
        o = pre(m, ids, cache)
        d = [dec(m, jnp.array([3, 4], jnp.int32), c) for c in (o.cache, o.cache.per_layer())]
        e = ext(m, ids[:, :3], d[0].cache)
        ins = e.cache.insert(m.init_cache(1, S).insert(o.cache, 0, row=1), 0)  # a float row into either
        ins_l = d[1].cache.insert(o.cache, 1)
        outs.append(([np.asarray(x.logits) for x in (o, *d, e)],
                     _bits(o.cache) + sum((_bits(x.cache.stacked()) for x in d), []) + _bits(e.cache)
                     + _bits(ins) + _bits(ins_l.stacked())))
    assert outs[0][1][0].any()  # something was written
    _assert_same(outs[0][0], outs[1][0])
    _assert_same(outs[0][1], outs[1][1])


@pytest.mark.parametrize("per_layer", [True, False])
def test_engine_programs_on_bits_equal_the_bf16_cache(per_layer):
    """prefill_slots (a shared row), append-prefill, JetStream prefill + insert, copy_slot and decode on a
    bits cache give the bf16 cache's tokens, ``behav_logp`` and K/V bits; per-layer buffers (unrolled) and
    the stacked cache of a scanned model."""
    m = q.Qwen3ForCausalLM(q.get_preset("tiny_dense"), rngs=nnx.Rngs(0), scan_layers=not per_layer)
    a, b = [5, 6, 7, 8, 9, 10, 11], [20, 21, 22]
    outs = []
    for backend in ("cpu", "gpu"):  # an engine each: a jitted init_state keeps its first trace's storage
        eng = Qwen3Engine(m.config, nnx.state(m, nnx.Param), slots=4, max_cache_len=64, max_prefill_length=32,
                          dtype="bfloat16", temperature=0.8, kv_per_layer=per_layer,
                          model_kwargs=dict(scan_layers=not per_layer), kv_layout="contiguous")
        with target_backend(backend):
            st = eng.init_decode_state()
        assert st["cache"].is_per_layer == per_layer
        assert (jax.tree.leaves(st["cache"].k)[0].dtype == jnp.uint16) == (backend == "cpu")
        st, _ = eng.prefill_slots(eng.params, st, [SlotPrefill(a, 0, seed=1), SlotPrefill(a, 1, seed=2),
                                                   SlotPrefill(b, 2, seed=3)])
        st, _ = eng.prefill_slots(eng.params, st, [SlotPrefill(b + [30, 31, 32, 33], 2, seed=3, start=len(b) - 1)])
        st = eng.insert(eng.prefill_tokens(eng.params, [40, 41, 42, 43, 44], seed=4), st, 3)
        st, o1 = eng.decode_steps(eng.params, st, 3)
        st = eng.copy_slot(st, 2, 1, token=7, seed=9)
        st, o2 = eng.decode_steps(eng.params, st, 3)
        outs.append(([np.asarray(x) for o in (o1, o2) for x in (o.token, o.behav_logp)], _bits(st["cache"])))
    _assert_same(outs[0][0], outs[1][0])
    _assert_same(outs[0][1], outs[1][1])
    assert all(x.any() for x in outs[0][1])


def test_fp32_caches_and_tpu_targets_store_the_values():
    """Only a 16-bit float cache traced for XLA:CPU holds bits: fp32 does not, nor a bf16 one traced for a
    TPU (``jax-rl compile``), nor a cache built without ``backend_storage`` (the model API's default)."""
    m = q.Qwen3ForCausalLM(q.get_preset("tiny_dense"), rngs=nnx.Rngs(0))
    c32 = m.init_cache(1, 4, backend_storage=True)
    assert c32.k.dtype == jnp.float32 and c32.dtype is None
    assert m.init_cache(1, 4, dtype=jnp.bfloat16).k.dtype == jnp.bfloat16
    with target_backend("tpu"):
        assert m.init_cache(1, 4, dtype=jnp.bfloat16, backend_storage=True).k.dtype == jnp.bfloat16
