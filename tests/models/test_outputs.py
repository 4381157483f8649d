"""The typed model outputs (``ModelOutput``, ``MoeDrops``, ``LogprobOutput``): every call returns one
type whatever its flags (a flag fills a field, it never changes the arity), the outputs are pytrees
that pass through ``jit``, and the MoE capacity drops come back as a returned field whose counts
equal :func:`capacity_keep` applied by hand to the call's own routes."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_rl.learner.logprobs import LogprobOutput, sequence_logprobs
from jax_rl.models.qwen3 import (ModelOutput, MoeDrops, MoEOptions, Qwen3ForCausalLM, StackedKVCache, count_moe_drops,
                                 get_preset)
from jax_rl.models.qwen3.layers import capacity_keep

CF = 0.25  # tight: drops happen at these sizes (else the count tests could not fail)


def _moe(**kw):
    cfg = get_preset("tiny_moe")
    return cfg, Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0), moe=MoEOptions(capacity_factor=CF, capacity_all_paths=True), **kw)


def _toks(cfg, B=3, T=8, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, cfg.vocab_size, (B, T)), jnp.int32)


def _hand(ids, valid, E):
    """Per-row dropped copies [B] of one call from its per-MoE-layer routes (capacity_keep)."""
    out = 0
    for a in ids:
        keep, _ = capacity_keep(jnp.asarray(a), jnp.asarray(valid), E, CF)
        out = out + np.sum(np.asarray(valid)[..., None] & ~np.asarray(keep), axis=(1, 2))
    return out


class CountMoeDropsTest(chex.TestCase):
    """count_moe_drops by a hand table: 2 MoE layers x 2 rows x 3 tokens, k = 2."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_table(self):
        dropped = jnp.asarray([[[1, 0, 0], [0, 2, 0]], [[0, 0, 1], [1, 0, 0]]], jnp.int32)  # [n_moe, B, T]
        valid = jnp.asarray([[True, True, True], [True, True, False]])
        f = self.variant(lambda d, v: count_moe_drops(d, v, (2, 3), 2, per_row=True))
        out = f(dropped, valid)
        assert isinstance(out, MoeDrops)
        np.testing.assert_array_equal(np.asarray(out.per_row), [2, 3])
        assert out.per_row.dtype == jnp.int32
        assert float(out.dropped) == 5.0 and out.dropped.dtype == jnp.float32
        assert float(out.copies) == 5 * 2 * 2  # 5 valid tokens x k x 2 MoE layers

    @chex.variants(with_jit=True, without_jit=True)
    def test_per_call_and_no_moe_layer(self):
        out = self.variant(lambda d: count_moe_drops(d, None, (4, 5), 2))(jnp.asarray([3, 1], jnp.int32))
        assert out.per_row is None and float(out.dropped) == 4.0 and float(out.copies) == 4 * 5 * 2 * 2
        none = count_moe_drops(None, None, (4, 5), 2, per_row=True)
        assert float(none.dropped) == 0.0 and float(none.copies) == 0.0
        np.testing.assert_array_equal(np.asarray(none.per_row), np.zeros(4, np.int32))


def test_flags_fill_fields_not_arity():
    cfg, m = _moe()
    toks = _toks(cfg)
    am = jnp.arange(8)[None] < jnp.asarray([[8], [6], [3]])
    plain = m.forward(toks, attention_mask=am)
    assert type(plain) is ModelOutput and plain.moe_drops is None and plain.hidden_states is None
    assert plain.logits.shape == (3, 8, cfg.vocab_size) and plain.logits.dtype == jnp.float32
    assert len(plain.expert_ids) == len(cfg.moe_layers)
    full = m.forward(toks, attention_mask=am, output_hidden_states=True, return_moe_drops=True)
    assert type(full) is ModelOutput and len(full.hidden_states) == cfg.num_hidden_layers + 1
    np.testing.assert_array_equal(np.asarray(full.logits), np.asarray(plain.logits))
    # the full forward counts per call; its count equals capacity by hand over its own routes
    assert full.moe_drops.per_row is None
    assert float(full.moe_drops.dropped) == float(_hand(full.expert_ids, am, cfg.num_experts).sum()) > 0
    assert float(full.moe_drops.copies) == float(am.sum()) * cfg.num_experts_per_tok * len(cfg.moe_layers)
    gd, st = nnx.split(m)
    f = jax.jit(lambda st, flag: sequence_logprobs(gd, st, toks, am, return_entropy=flag, return_expert_ids=flag,
                                                     return_moe_drops=flag), static_argnums=1)
    a, b = f(st, False), f(st, True)
    assert type(a) is type(b) is LogprobOutput
    assert a.entropy is None and a.expert_ids is None and a.moe_drops is None
    assert b.entropy.shape == b.logp.shape == (3, 8) and b.entropy.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(a.logp), np.asarray(b.logp))
    assert float(b.moe_drops.dropped) == float(full.moe_drops.dropped)
    for x, y in zip(b.expert_ids, full.expert_ids):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("scan", [False, True])
def test_serving_calls_return_per_row_drops_and_their_cache_type(scan):
    cfg, m = _moe(scan_layers=scan)
    toks = _toks(cfg, seed=1)
    lengths = jnp.asarray([8, 5, 2], jnp.int32)
    valid = np.arange(8)[None] < np.asarray(lengths)[:, None]
    pre = nnx.jit(lambda m, t, l, c: m.prefill(t, l, c, return_expert_ids=True, return_moe_drops=True))
    out = pre(m, toks, lengths, m.init_cache(3, 16))
    assert type(out.cache) is StackedKVCache
    np.testing.assert_array_equal(np.asarray(out.moe_drops.per_row), _hand(out.expert_ids, valid, cfg.num_experts))
    assert int(out.moe_drops.per_row.sum()) == float(out.moe_drops.dropped) > 0
    assert float(out.moe_drops.copies) == valid.sum() * cfg.num_experts_per_tok * len(cfg.moe_layers)
    bare = nnx.jit(lambda m, t, l, c: m.prefill(t, l, c))(m, toks, lengths, m.init_cache(3, 16))
    assert bare.expert_ids is None and bare.moe_drops is None
    np.testing.assert_array_equal(np.asarray(bare.logits), np.asarray(out.logits))
    # decode: the fed tokens of the valid slots take capacity, the others count nothing
    act = jnp.asarray([True, False, True])
    dec = nnx.jit(lambda m, t, c: m.decode_step(t, c, valid=act, return_expert_ids=True, return_moe_drops=True))
    d = dec(m, jnp.asarray([1, 2, 3], jnp.int32), out.cache)
    assert d.logits.shape == (3, cfg.vocab_size) and type(d.cache) is StackedKVCache
    ids = [i[:, None] for i in d.expert_ids]  # [B,k] -> [B,1,k]
    np.testing.assert_array_equal(np.asarray(d.moe_drops.per_row), _hand(ids, np.asarray(act)[:, None], cfg.num_experts))
    assert int(d.moe_drops.per_row[1]) == 0
    # extend: the new positions of each row
    n = jnp.asarray([3, 0, 2], jnp.int32)
    e = nnx.jit(lambda m, t, s, l, c: m.extend(t, s, l, c, return_expert_ids=True, return_moe_drops=True))(
        m, _toks(cfg, T=4, seed=2), lengths, n, out.cache)
    np.testing.assert_array_equal(np.asarray(e.cache.lengths), np.asarray(lengths + n))
    ev = np.arange(4)[None] < np.asarray(n)[:, None]
    np.testing.assert_array_equal(np.asarray(e.moe_drops.per_row), _hand(e.expert_ids, ev, cfg.num_experts))
