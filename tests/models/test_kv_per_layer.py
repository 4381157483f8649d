"""The per-layer KV cache (``LayerKVCache``, ``KVCache.per_layer()``) that the rollout engine decodes
with when layers are unrolled: same logits and cache contents as the stacked [L,B,K,S,H]
``StackedKVCache``, one type per layout, and the JetStream-engine path built on it still writes one
position per slot."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_rl.models.qwen3 import KVCache, LayerKVCache, Qwen3ForCausalLM, StackedKVCache, get_preset


def _model(**kw):
    cfg = get_preset("tiny_dense")
    return cfg, Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0), **kw)


def _random_cache(m, B, S, lengths, seed=3):
    rng = np.random.default_rng(seed)
    c = m.init_cache(B, S)
    return c.replace(k=jnp.asarray(rng.normal(size=c.k.shape), c.k.dtype),
                     v=jnp.asarray(rng.normal(size=c.v.shape), c.v.dtype), lengths=jnp.asarray(lengths))


def test_per_layer_round_trip_and_max_len():
    cfg, m = _model()
    c = _random_cache(m, 3, 8, np.array([0, 2, 5], np.int32))
    p = c.per_layer()
    assert type(c) is StackedKVCache and type(p) is LayerKVCache and isinstance(p, KVCache)
    assert p.is_per_layer and not c.is_per_layer
    assert c.stacked() is c and p.per_layer() is p  # each converts to its own type as itself
    assert len(p.k) == cfg.num_hidden_layers and p.k[0].shape == c.k.shape[1:3] + c.k.shape[4:] + c.k.shape[3:4]
    assert p.v[0].shape == c.v.shape[1:]  # keys transposed [B,K,H,S], values [B,K,S,H]
    assert p.max_len == c.max_len == 8
    np.testing.assert_array_equal(np.asarray(p.stacked().k), np.asarray(c.k))
    np.testing.assert_array_equal(np.asarray(p.stacked().v), np.asarray(c.v))


def test_decode_step_per_layer_matches_stacked():
    """Several decode steps from the same random cache: per-layer and stacked give the same
    logits and caches (fp32 rounding of differently fused programs at most)."""
    cfg, m = _model()
    B, S = 4, 8
    lengths = np.array([0, 3, 6, S], np.int32)  # the last slot is full: its write is dropped
    stacked = _random_cache(m, B, S, lengths)
    per = stacked.per_layer()
    step = nnx.jit(lambda m, t, c: m.decode_step(t, c))
    for t in ([5, 17, 99, 3], [1, 2, 3, 4]):
        tok = jnp.asarray(t, jnp.int32)
        out_s, out_p = step(m, tok, stacked), step(m, tok, per)
        (ls, stacked), (lp, per) = (out_s.logits, out_s.cache), (out_p.logits, out_p.cache)
        assert type(per) is LayerKVCache and type(stacked) is StackedKVCache  # the type it was given
        np.testing.assert_allclose(np.asarray(lp), np.asarray(ls), atol=1e-6, rtol=0)
        np.testing.assert_allclose(np.asarray(per.stacked().k), np.asarray(stacked.k), atol=1e-6, rtol=0)
        np.testing.assert_allclose(np.asarray(per.stacked().v), np.asarray(stacked.v), atol=1e-6, rtol=0)
        np.testing.assert_array_equal(np.asarray(per.lengths), np.asarray(stacked.lengths))


def test_per_layer_insert_matches_stacked():
    cfg, m = _model()
    c = _random_cache(m, 3, 8, np.array([1, 2, 3], np.int32))
    other = _random_cache(m, 1, 4, np.array([4], np.int32), seed=9)
    a = c.insert(other, 1)
    b = c.per_layer().insert(other, 1)
    np.testing.assert_array_equal(np.asarray(b.stacked().k), np.asarray(a.k))
    np.testing.assert_array_equal(np.asarray(b.lengths), np.asarray(a.lengths))


def test_scanned_model_refuses_a_per_layer_cache():
    cfg, m = _model(scan_layers=True)
    c = m.init_cache(2, 8).per_layer()
    with pytest.raises(ValueError, match="per-layer"):
        m.decode_step(jnp.zeros((2,), jnp.int32), c)


def test_extend_refuses_a_per_layer_cache_and_the_base_type_is_not_a_cache():
    cfg, m = _model()
    c = m.init_cache(2, 8).per_layer()
    z = jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match="StackedKVCache.*LayerKVCache"):
        m.extend(jnp.zeros((2, 3), jnp.int32), z, z, c)
    with pytest.raises(TypeError):
        KVCache(k=c.k, v=c.v, lengths=c.lengths)


def test_engine_keeps_a_per_layer_cache_only_when_unrolled():
    from rollout.engine import Qwen3Engine

    cfg, m = _model()
    params = nnx.state(m, nnx.Param)
    eng = Qwen3Engine(cfg, params, slots=2, max_cache_len=32, dtype="float32", kv_layout="contiguous")
    st = eng.init_decode_state()
    assert st["cache"].is_per_layer
    st = eng.insert(eng.prefill_tokens(eng.params, [3, 4, 5], seed=1), st, 1)
    st, res = eng.generate(eng.params, st)
    assert st["cache"].is_per_layer and int(st["cache"].lengths[1]) == 3
    off = Qwen3Engine(cfg, params, slots=2, max_cache_len=32, dtype="float32", kv_per_layer=False, kv_layout="contiguous")
    assert not off.init_decode_state()["cache"].is_per_layer
    _, ms = _model(scan_layers=True)
    eng_s = Qwen3Engine(cfg, nnx.state(ms, nnx.Param), slots=2, max_cache_len=32, dtype="float32",
                        model_kwargs=dict(scan_layers=True), kv_per_layer=False, kv_layout="contiguous")
    assert not eng_s.init_decode_state()["cache"].is_per_layer


def test_cpu_engine_unstacks_scanned_params_and_samples_the_same():
    """On the CPU a scan_layers engine runs its own unrolled copy of the weights (load_params
    unstacks the learner's stacked layout, weight swaps included); tokens and log-probs equal
    those of the stacked, scanned engine."""
    from rollout.engine import Qwen3Engine, unpack_result

    cfg, ms = _model(scan_layers=True)
    stacked = nnx.state(ms, nnx.Param)
    engines = [Qwen3Engine(cfg, stacked, slots=2, max_cache_len=32, dtype="float32",
                           model_kwargs=dict(scan_layers=True), kv_per_layer=per, kv_layout="contiguous") for per in (True, False)]
    assert engines[0].init_decode_state()["cache"].is_per_layer
    assert not engines[1].init_decode_state()["cache"].is_per_layer
    outs = []
    for eng in engines:
        p = eng.load_params(stacked)  # a weight swap in the learner's layout
        st = eng.insert(eng.prefill_tokens(p, [3, 4, 5, 6], seed=1), eng.init_decode_state(), 0)
        toks, lps = [], []
        for _ in range(5):
            st, res = eng.generate(p, st)
            r = unpack_result(res)
            toks.append(int(r["tokens"][0]))
            lps.append(float(r["behav_logp"][0]))
        outs.append((toks, lps))
    assert outs[0][0] == outs[1][0]
    np.testing.assert_allclose(outs[0][1], outs[1][1], atol=1e-5)


@pytest.mark.parametrize("backend, per_layer", [("cpu", True), ("gpu", True), ("tpu", False)])
def test_engine_default_cache_form_follows_the_backend(monkeypatch, backend, per_layer):
    """``kv_per_layer=None`` keeps per-layer buffers (and unrolled layers) on every backend but a
    TPU: on a GPU, as on the CPU, XLA copies each layer's K/V (and, scanned, its weights) out of
    stacked buffers before the library dots (``bench/decode_hlo.py``); a TPU fuses those slices."""
    import jax

    from rollout.engine import Qwen3Engine

    cfg, ms = _model(scan_layers=True)
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    eng = Qwen3Engine(cfg, None, slots=2, max_cache_len=16, dtype="float32",
                      model_kwargs=dict(scan_layers=True), kv_layout="contiguous")
    assert eng._per_layer_cache is per_layer
    assert bool(eng._unstack_layers) is per_layer  # the engine's own unrolled copy of the weights
