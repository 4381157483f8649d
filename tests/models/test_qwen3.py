"""Qwen3 NNX model: config, presets, cache decode, padding, MoE dispatch and log-probs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_rl.learner.logprobs import HeadOptions, sequence_logprobs, token_logprobs
from jax_rl.models.qwen3 import (
    MLP,
    MoE,
    MoEOptions,
    PRESETS,
    Qwen3Config,
    Qwen3ForCausalLM,
    count_params,
    get_preset,
)


def _model(name="tiny_dense", seed=0, **kw):
    over = kw.pop("over", {})
    cfg = get_preset(name, **over)
    m = Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(seed), **kw)
    # Perturb norm weights (init = ones) so q_norm/k_norm/layer norms matter in comparisons.
    rng = np.random.default_rng(seed)
    for path, v in nnx.iter_graph(m):
        if isinstance(v, nnx.Param) and path[-1] == "weight":
            v[...] = v[...] + jnp.asarray(rng.normal(0, 0.3, v.shape), v.dtype)
    return cfg, m


@nnx.jit
def _fwd(m, ids, mask=None):
    """Jitted full forward (eager op-by-op dispatch is slow on the shared CPU)."""
    return m(ids, attention_mask=mask)


def _ids(key, shape, vocab):
    return jax.random.randint(jax.random.key(key), shape, 0, vocab, dtype=jnp.int32)


# ---------------------------------------------------------------- config / presets


def test_preset_param_counts_match_released_models():
    # Released parameter counts (HF safetensors totals; tied embeddings counted once).
    assert count_params(PRESETS["qwen3_0p6b"]()) == 596_049_920
    assert count_params(PRESETS["qwen3_4b"]()) == 4_022_468_096
    assert count_params(PRESETS["qwen3_30b_a3b"]()) == 30_532_122_624


def test_preset_count_formula_tiny():
    c = get_preset("tiny_moe")
    D, N, K, H, V = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size
    E, Fm = c.num_experts, c.moe_intermediate_size
    per_layer = D * N * H * 2 + D * K * H * 2 + 2 * H + 2 * D + D * E + 3 * E * D * Fm
    assert count_params(c) == V * D + c.num_hidden_layers * per_layer + D


def test_get_preset_overrides_and_errors():
    c = get_preset("tiny_dense", hidden_size=32, head_dim=8)
    assert c.hidden_size == 32 and c.head_dim == 8 and c.vocab_size == 384
    with pytest.raises(ValueError, match="bogus"):
        get_preset("tiny_dense", bogus=1)
    with pytest.raises(ValueError, match="unknown model preset"):
        get_preset("nope")


def test_from_hf_forms_and_roundtrip():
    base = dict(model_type="qwen3", vocab_size=100, hidden_size=32, intermediate_size=64,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                rms_norm_eps=1e-6, max_position_embeddings=64, tie_word_embeddings=False)
    c1 = Qwen3Config.from_hf({**base, "rope_theta": 1e6, "torch_dtype": "bfloat16"})
    c2 = Qwen3Config.from_hf({**base, "rope_parameters": {"rope_type": "default",
                                                          "rope_theta": 1e6},
                              "dtype": "float32", "layer_types": ["full_attention"] * 2})
    assert c1.rope_theta == c2.rope_theta == 1e6
    assert c1.dtype == "bfloat16" and c2.dtype == "float32"
    assert not c1.is_moe
    assert Qwen3Config.from_hf(c2.to_hf()) == c2
    moe = get_preset("tiny_moe", decoder_sparse_step=2, mlp_only_layers=(1,), norm_topk_prob=False)
    assert Qwen3Config.from_hf(moe.to_hf()) == moe
    # HF Qwen3MoeConfig default norm_topk_prob is False when the key is absent
    d = moe.replace(norm_topk_prob=True).to_hf()
    del d["norm_topk_prob"]
    assert Qwen3Config.from_hf(d).norm_topk_prob is False


@pytest.mark.parametrize("extra, field", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e6}}, "rope_parameters.rope_type"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
    ({"quantization_config": {"bits": 4}}, "quantization_config"),
    ({"model_type": "llama"}, "model_type"),
])
def test_from_hf_rejects_unsupported_values(extra, field):
    d = {**get_preset("tiny_dense").to_hf(), **extra}
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        Qwen3Config.from_hf(d)


def test_moe_layer_selection_sparse_step_and_mlp_only():
    cfg = get_preset("tiny_moe", num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=(3,))
    assert cfg.moe_layers == (1,)
    m = nnx.eval_shape(lambda: Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0)))
    kinds = [type(layer.mlp) for layer in m.layers]
    assert kinds == [MLP, MoE, MLP, MLP]


# ---------------------------------------------------------------- forward / cache


@pytest.mark.parametrize("name", ["tiny_dense", "tiny_moe"])
def test_cache_decode_matches_full_forward_with_slots_at_different_positions(name):
    cfg, m = _model(name)
    B, T, S, n_new = 3, 6, 16, 5
    lengths = np.array([3, 6, 1], np.int32)
    full = np.asarray(_ids(1, (B, T + n_new), cfg.vocab_size))
    prompt = full[:, :T].copy()
    prompt[np.arange(T)[None, :] >= lengths[:, None]] = 0  # right padding
    cache = m.init_cache(B, S)
    out = nnx.jit(lambda m, x, l, c: m.prefill(x, l, c))(m, prompt, lengths, cache)
    logits_p, cache = out.logits, out.cache
    np.testing.assert_array_equal(np.asarray(cache.lengths), lengths)

    # Reference: the full forward on each row's true sequence (prompt then decoded tokens).
    # (right padding is exact for a causal model at valid positions; tested separately)
    seqs = np.zeros((B, T + n_new), np.int32)
    for b in range(B):
        seqs[b, :lengths[b] + n_new] = np.concatenate([full[b, :lengths[b]], full[b, T:]])
    ref = np.asarray(_fwd(m, seqs))
    for b in range(B):
        np.testing.assert_allclose(np.asarray(logits_p)[b, :lengths[b]], ref[b][:lengths[b]],
                                   atol=1e-5, rtol=0)
    step = nnx.jit(lambda m, t, c: m.decode_step(t, c))
    for j in range(n_new):
        out = step(m, jnp.asarray(full[:, T + j]), cache)
        logits_d, cache = out.logits, out.cache
        for b in range(B):
            np.testing.assert_allclose(np.asarray(logits_d)[b], ref[b][lengths[b] + j],
                                       atol=1e-5, rtol=0)
    np.testing.assert_array_equal(np.asarray(cache.lengths), lengths + n_new)


def _decode_rewriting_whole_cache(m, tokens, cache):
    """The decode step before issue 13 item 1 (every layer's cache rewritten with jnp.where
    and restacked), kept as the numerics reference for the in-place write."""
    from jax_rl.models.qwen3 import StackedKVCache, attend

    S = cache.max_len
    pos = cache.lengths.astype(jnp.int32)
    write = (jnp.arange(S)[None, :] == pos[:, None])[:, :, None, None]
    mask = (jnp.arange(S)[None, :] <= pos[:, None])[:, None, :]

    def layer_attend(q, k, v, kv_i):
        ck, cv = (c.swapaxes(1, 2) for c in kv_i)  # [B,K,S,H] -> [B,S,K,H]
        ki = jnp.where(write, k.astype(ck.dtype), ck)
        vi = jnp.where(write, v.astype(cv.dtype), cv)
        out = attend(q, ki.astype(q.dtype), vi.astype(q.dtype), mask)
        return out, (ki.swapaxes(1, 2), vi.swapaxes(1, 2))

    t = m._trunk(m.embed(tokens[:, None]), pos[:, None], layer_attend, (cache.k, cache.v))
    k, v = t.ys
    return m.lm_logits(t.h)[:, 0], StackedKVCache(k=k, v=v, lengths=pos + 1)


@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decode_writes_only_each_slots_position_and_matches_the_whole_cache_rewrite(scan, dtype):
    """Issue 13 item 1: after a decode step only (layer, slot, :, lengths[slot]) changed in
    the cache (a slot at capacity writes nothing); logits and the cache equal the old
    whole-cache jnp.where rewrite (to fp32 rounding)."""
    cfg, m = _model("tiny_dense", dtype=dtype, param_dtype=dtype, scan_layers=scan)
    B, S = 4, 8
    L, K, H = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    rng = np.random.default_rng(7)
    cache = m.init_cache(B, S)
    lengths = np.array([0, 3, 7, S], np.int32)  # the last slot is full: its write is dropped
    cache = cache.replace(k=jnp.asarray(rng.normal(size=cache.k.shape), cache.k.dtype),
                          v=jnp.asarray(rng.normal(size=cache.v.shape), cache.v.dtype),
                          lengths=jnp.asarray(lengths))
    tokens = jnp.asarray([5, 17, 99, 3], jnp.int32)
    k0, v0 = np.asarray(cache.k), np.asarray(cache.v)
    out = nnx.jit(lambda m, t, c: m.decode_step(t, c))(m, tokens, cache)
    new_logits, new = out.logits, out.cache
    ref_logits, ref = nnx.jit(_decode_rewriting_whole_cache)(m, tokens, cache)
    # XLA:CPU fuses the new k/v (norm, RoPE) differently into the two programs: fp32
    # rounding (<= 3e-7 seen) in the written entries and the logits; bf16 is bit-equal here.
    # The greedy token must agree.
    tol = 1e-6 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(new_logits), np.asarray(ref_logits), atol=tol, rtol=0)
    np.testing.assert_array_equal(np.argmax(np.asarray(new_logits), -1),
                                  np.argmax(np.asarray(ref_logits), -1))
    np.testing.assert_allclose(np.asarray(new.k), np.asarray(ref.k), atol=tol, rtol=0)
    np.testing.assert_allclose(np.asarray(new.v), np.asarray(ref.v), atol=tol, rtol=0)
    np.testing.assert_array_equal(np.asarray(new.lengths), lengths + 1)
    for before, after in ((k0, np.asarray(new.k)), (v0, np.asarray(new.v))):
        assert after.shape == (L, B, K, S, H)
        changed = np.any(before != after, axis=(2, 4))  # [L,B,S]
        want = np.zeros((L, B, S), bool)
        for b, p in enumerate(lengths):
            if p < S:
                want[:, b, p] = True
        np.testing.assert_array_equal(changed, want)


def test_cache_insert_moves_a_prefilled_row_into_a_slot():
    cfg, m = _model("tiny_dense")
    prompt = _ids(2, (1, 4), cfg.vocab_size)
    small = m.init_cache(1, 8)
    small = nnx.jit(lambda m, x, c: m.prefill(x, jnp.array([4]), c))(m, prompt, small).cache
    big = m.init_cache(3, 8)
    big = big.insert(small, 2)
    np.testing.assert_array_equal(np.asarray(big.lengths), [0, 0, 4])
    logits = nnx.jit(lambda m, t, c: m.decode_step(t, c))(m, jnp.array([5, 5, 5]), big).logits
    ref = _fwd(m, jnp.concatenate([prompt, jnp.array([[5]])], axis=1))[0, -1]
    np.testing.assert_allclose(np.asarray(logits[2]), np.asarray(ref), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["tiny_dense", "tiny_moe"])
def test_right_padded_batch_matches_unpadded_rows(name):
    cfg, m = _model(name, seed=3)
    B, T = 3, 7
    lengths = np.array([7, 4, 2])
    ids = np.asarray(_ids(4, (B, T), cfg.vocab_size))
    mask = np.arange(T)[None] < lengths[:, None]
    ids = np.where(mask, ids, 0)
    out = np.asarray(_fwd(m, ids, mask))
    assert out.dtype == np.float32 and out.shape == (B, T, cfg.vocab_size)
    # row 0 is unpadded; run it alone
    np.testing.assert_allclose(out[0], np.asarray(_fwd(m, ids[:1], mask[:1]))[0], atol=1e-5,
                               rtol=0)
    # the pad token ids must not change valid positions (keys masked and causal)
    ids2 = np.where(mask, ids, 7)
    np.testing.assert_allclose(np.asarray(_fwd(m, ids2, mask))[mask], out[mask], atol=1e-5,
                               rtol=0)
    # rows 1, 2: equal to their unpadded prefix, computed in a batch of the prefix length
    short = np.asarray(_fwd(m, ids[:, :lengths[1]], mask[:, :lengths[1]]))
    np.testing.assert_allclose(out[1, :lengths[1]], short[1], atol=1e-5, rtol=0)
    np.testing.assert_allclose(out[2, :lengths[2]], short[2, :lengths[2]], atol=1e-5, rtol=0)


def test_bf16_compute_gives_fp32_logits_close_to_fp32():
    cfg, m32 = _model("tiny_dense")
    _, m16 = _model("tiny_dense", dtype=jnp.bfloat16)
    ids = _ids(5, (2, 8), cfg.vocab_size)
    l16 = _fwd(m16, ids)
    assert l16.dtype == jnp.float32
    diff = np.abs(np.asarray(l16) - np.asarray(_fwd(m32, ids))).max()
    assert 0 < diff < 0.1


# ---------------------------------------------------------------- MoE


def _numpy_moe(moe: MoE, x, norm_topk_prob, top_k):
    """Token-by-token reference of HF Qwen3MoeSparseMoeBlock in float64."""
    x = np.asarray(x, np.float64)
    r = np.asarray(moe.router[...], np.float64)
    wg, wu, wd = (np.asarray(moe.gate_proj[...], np.float64), np.asarray(moe.up_proj[...], np.float64),
                  np.asarray(moe.down_proj[...], np.float64))
    out = np.zeros_like(x)
    ids_all = np.zeros(x.shape[:-1] + (top_k,), np.int64)
    for idx in np.ndindex(*x.shape[:-1]):
        xt = x[idx]
        lg = xt @ r
        p = np.exp(lg - lg.max())
        p /= p.sum()
        ids = np.argsort(-p, kind="stable")[:top_k]
        w = p[ids]
        if norm_topk_prob:
            w = w / w.sum()
        for e, we in zip(ids, w):
            g = xt @ wg[e]
            u = xt @ wu[e]
            out[idx] += we * ((g / (1 + np.exp(-g)) * u) @ wd[e])
        ids_all[idx] = ids
    return out, ids_all


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("dispatch", ["dense", "ragged"])
def test_moe_block_matches_reference(norm_topk_prob, dispatch):
    cfg = get_preset("tiny_moe", norm_topk_prob=norm_topk_prob, num_experts=6,
                     num_experts_per_tok=3)
    moe = MoE(cfg, rngs=nnx.Rngs(1), dtype=jnp.float32, param_dtype=jnp.float32, dispatch=dispatch)
    moe.router[...] = moe.router[...] * 50  # make routing decisive (no near-ties)
    x = jax.random.normal(jax.random.key(2), (2, 5, cfg.hidden_size))
    y, ids, _ = moe(x)
    ref_y, ref_ids = _numpy_moe(moe, x, norm_topk_prob, 3)
    np.testing.assert_array_equal(np.asarray(ids), ref_ids)
    np.testing.assert_allclose(np.asarray(y), ref_y, atol=1e-5, rtol=1e-5)


def test_moe_dense_and_ragged_dispatch_agree_and_forced_ids():
    cfg, md = _model("tiny_moe", seed=5)
    _, mr = _model("tiny_moe", seed=5, moe=MoEOptions(dispatch="ragged"))
    ids = _ids(6, (2, 9), cfg.vocab_size)
    fwd = nnx.jit(lambda m, ids, forced=None: m.forward(ids, forced_expert_ids=forced))
    od, orr = fwd(md, ids), fwd(mr, ids)
    np.testing.assert_allclose(np.asarray(od.logits), np.asarray(orr.logits), atol=1e-5)
    assert len(od.expert_ids) == 2
    for a, b in zip(od.expert_ids, orr.expert_ids):
        assert a.shape == (2, 9, 2) and a.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # forcing the router's own choice reproduces the logits
    again = fwd(md, ids, od.expert_ids)
    np.testing.assert_allclose(np.asarray(again.logits), np.asarray(od.logits), atol=1e-6)
    # forcing other experts changes the output, identically in both dispatch paths
    other = [(e + 1) % cfg.num_experts for e in od.expert_ids]
    fd = fwd(md, ids, other)
    fr = fwd(mr, ids, jnp.stack(other))
    for a, b in zip(fd.expert_ids, other):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_allclose(np.asarray(fd.logits), np.asarray(fr.logits), atol=1e-5)
    assert np.abs(np.asarray(fd.logits) - np.asarray(od.logits)).max() > 1e-3


# ---------------------------------------------------------------- log-probs


def test_token_logprobs_chunked_equals_direct_with_grad():
    logits = jax.random.normal(jax.random.key(0), (2, 12, 50)) * 3
    tg = _ids(1, (2, 12), 50)
    direct = jax.nn.log_softmax(logits / 0.7, -1)
    direct = jnp.take_along_axis(direct, tg[..., None], -1)[..., 0]
    full = token_logprobs(logits, tg, 0.7)
    chunked = token_logprobs(logits, tg, 0.7, chunk_elems=2 * 3 * 50)  # 4 chunks of T=3
    assert full.dtype == jnp.float32 and full.shape == (2, 12)
    np.testing.assert_allclose(np.asarray(full), np.asarray(direct), atol=1e-5)
    np.testing.assert_allclose(np.asarray(chunked), np.asarray(direct), atol=1e-5)
    g1 = jax.jit(jax.grad(lambda l: token_logprobs(l, tg, 0.7).sum()))(logits)
    g2 = jax.jit(jax.grad(lambda l: token_logprobs(l, tg, 0.7, chunk_elems=300).sum()))(logits)
    np.testing.assert_allclose(np.asarray(g1), np.asarray(g2), atol=1e-6)


def test_sequence_logprobs_alignment_masking_and_graphdef_form():
    cfg, m = _model("tiny_moe", seed=2)
    B, T = 2, 8
    toks = _ids(3, (B, T), cfg.vocab_size)
    mask = jnp.arange(T)[None] < jnp.array([[8], [5]])
    logits = _fwd(m, toks, mask)
    ref = token_logprobs(logits[:, :-1], toks[:, 1:], 1.3)
    out = nnx.jit(lambda m, t, msk: sequence_logprobs(m, t, msk, temperature=1.3).logp)(m, toks, mask)
    assert out.shape == (B, T) and out.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out[:, 0]), 0.0)
    np.testing.assert_allclose(np.asarray(out[0, 1:]), np.asarray(ref[0]), atol=1e-5)
    np.testing.assert_allclose(np.asarray(out[1, 1:5]), np.asarray(ref[1, :4]), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(out[1, 5:]), 0.0)
    gd, st = nnx.split(m)
    jitted = jax.jit(lambda st, t, msk: sequence_logprobs(
        gd, st, t, msk, 1.3, head=HeadOptions(chunk_elems=3 * B * cfg.vocab_size)).logp)
    np.testing.assert_allclose(np.asarray(jitted(st, toks, mask)), np.asarray(out), atol=1e-5)
    # differentiable w.r.t. params
    grads = jax.jit(jax.grad(lambda st: jnp.sum(sequence_logprobs(gd, st, toks, mask).logp)))(st)
    gn = sum(float(jnp.sum(jnp.square(g))) for g in jax.tree.leaves(grads))
    assert np.isfinite(gn) and gn > 0


def test_remat_forward_and_grad_match():
    cfg, m = _model("tiny_dense")
    _, mr = _model("tiny_dense", remat=True)
    toks = _ids(4, (2, 6), cfg.vocab_size)
    gd, st = nnx.split(m)
    gdr, str_ = nnx.split(mr)
    f = lambda gd: (lambda st: jnp.sum(sequence_logprobs(gd, st, toks).logp))  # noqa: E731
    v1, g1 = jax.jit(jax.value_and_grad(f(gd)))(st)
    v2, g2 = jax.jit(jax.value_and_grad(f(gdr)))(str_)
    np.testing.assert_allclose(float(v1), float(v2), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)


def test_sequence_logprobs_entropy_matches_softmax_formula_chunked_and_direct():
    """H_t = -sum_v p_v log p_v of softmax(logits_t / temperature), aligned like logp (the
    distribution at t-1 that predicts tokens[t]), zero on padding; chunking does not change it."""
    cfg, m = _model("tiny_dense", seed=4)
    B, T, temp = 2, 8, 0.8
    toks = _ids(5, (B, T), cfg.vocab_size)
    mask = jnp.arange(T)[None] < jnp.array([[8], [6]])
    logp_np = np.asarray(jax.nn.log_softmax(_fwd(m, toks, mask).astype(jnp.float32) / temp, axis=-1))
    want = -(np.exp(logp_np) * logp_np).sum(-1)  # [B,T] entropy of the distribution at t
    gd, st = nnx.split(m)
    for chunk in (1 << 22, 3 * B * cfg.vocab_size):  # direct, and 3-token chunks
        out = jax.jit(lambda st, t, msk: sequence_logprobs(gd, st, t, msk, temp, return_entropy=True,
                                                            head=HeadOptions(chunk_elems=chunk)))(st, toks, mask)
        lp, ent = out.logp, out.entropy
        assert out.expert_ids is None and out.moe_drops is None  # not asked for
        assert ent.shape == (B, T) and ent.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(lp), np.asarray(sequence_logprobs(gd, st, toks, mask, temp).logp), atol=1e-6)
        np.testing.assert_allclose(np.asarray(ent[0, 1:]), want[0, :-1], atol=1e-4)
        np.testing.assert_allclose(np.asarray(ent[1, 1:6]), want[1, :5], atol=1e-4)
        np.testing.assert_array_equal(np.asarray(ent[:, 0]), 0.0)
        np.testing.assert_array_equal(np.asarray(ent[1, 6:]), 0.0)
    assert 0 < float(ent.max()) <= np.log(cfg.vocab_size) + 1e-4
