"""The MoE options a rollout engine may set differently from the learner (issue 27):
``capacity_keep`` (GShard capacity on one device: hand tables, jit and eager, a hypothesis
property), a dropping MoE block against a hand-built reference, and the bf16 router (the default
fp32 router is the program it always was)."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jax_rl.models.qwen3 import MoE, MoEOptions, Qwen3ForCausalLM, get_preset
from jax_rl.models.qwen3.layers import capacity_keep

HSET = settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


class CapacityKeepTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_first_choice_priority(self):
        # E=4, k=2, 3 tokens: C = ceil(1.0 * 6 / 4) = 2. First choices: t0->1, t1->0, t2->0 (all
        # fit); second choices: t0->0 (expert 0 already has 2: dropped), t1->1, t2->2. Token order
        # alone would have kept t0's second choice and dropped t2's first.
        ids = jnp.asarray([[[1, 0], [0, 1], [0, 2]]], jnp.int32)
        keep, dropped = self.variant(lambda i: capacity_keep(i, None, 4, 1.0))(ids)
        np.testing.assert_array_equal(np.asarray(keep), [[[True, False], [True, True], [True, True]]])
        assert int(dropped) == 1

    @chex.variants(with_jit=True, without_jit=True)
    def test_invalid_tokens_take_no_slot(self):
        ids = jnp.asarray([[[1, 0], [0, 1], [0, 2]]], jnp.int32)
        valid = jnp.asarray([[True, False, True]])
        keep, dropped = self.variant(lambda i, v: capacity_keep(i, v, 4, 1.0))(ids, valid)
        # without t1, expert 0 gets t2 (first choice) and t0 (second choice): both fit
        np.testing.assert_array_equal(np.asarray(keep), [[[True, True], [False, False], [True, True]]])
        assert int(dropped) == 0

    @chex.variants(with_jit=True, without_jit=True)
    def test_one_expert_takes_everything(self):
        # k=1, 4 tokens all to expert 0 of 2: C = ceil(0.5 * 4 / 2) = 1 -> only the first kept
        ids = jnp.zeros((2, 2, 1), jnp.int32)
        keep, dropped = self.variant(lambda i: capacity_keep(i, None, 2, 0.5))(ids)
        np.testing.assert_array_equal(np.asarray(keep)[..., 0], [[True, False], [False, False]])
        assert int(dropped) == 3


@HSET
@given(B=st.integers(1, 3), T=st.integers(1, 5), E=st.integers(2, 6), data=st.data(),
       cf=st.sampled_from([0.25, 0.5, 1.0, 1.25, 2.0, 100.0]))
def test_capacity_property(B, T, E, data, cf):
    k = data.draw(st.integers(1, min(E, 3)))
    ids = np.stack([np.stack([data.draw(st.permutations(range(E)))[:k] for _ in range(T)]) for _ in range(B)])
    valid = np.asarray(data.draw(st.lists(st.booleans(), min_size=B * T, max_size=B * T))).reshape(B, T)
    keep, dropped = capacity_keep(jnp.asarray(ids, jnp.int32), jnp.asarray(valid), E, cf)
    keep = np.asarray(keep)
    cap = max(1, min(B * T * k, math.ceil(cf * B * T * k / E)))
    assert not keep[~valid].any()  # invalid copies are never kept
    for e in range(E):  # no expert over capacity; an expert with a drop is full
        took = int(np.sum(keep & (ids == e)))
        assert took <= cap
        if np.any(valid[..., None] & (ids == e) & ~keep):
            assert took == cap
    assert int(dropped) == int(np.sum(valid[..., None] & ~keep))
    if cf >= E:  # capacity >= every copy: nothing dropped
        assert int(dropped) == 0


def _moe(cfg, **kw):
    return MoE(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32, param_dtype=jnp.float32, **kw)


def test_dropping_moe_matches_zeroed_gates():
    cfg = get_preset("tiny_moe")
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 5, cfg.hidden_size), jnp.float32)
    ref, drop = _moe(cfg), _moe(cfg, capacity_factor=0.5, capacity_all_paths=True)
    y_ref, ids, _ = ref(x)
    y, ids2, dropped = drop(x)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(ids2))  # drops change no choice
    keep, n = capacity_keep(ids, None, cfg.num_experts, 0.5)
    assert int(dropped) == int(n) > 0
    # reference: the dense block with the dropped copies' gates zeroed by hand
    w, _ = ref.route(x)
    w = jnp.where(keep, w, 0.0)
    combine = jnp.einsum("btk,btke->bte", w, jax.nn.one_hot(ids, cfg.num_experts))
    g = jnp.einsum("btd,edf->btef", x, ref.gate_proj[...])
    u = jnp.einsum("btd,edf->btef", x, ref.up_proj[...])
    want = jnp.einsum("btef,efd->btd", jax.nn.silu(g) * u * combine[..., None], ref.down_proj[...])
    chex.assert_trees_all_close(y, want, rtol=1e-5, atol=1e-6)
    assert float(jnp.max(jnp.abs(y - y_ref))) > 1e-4
    # ragged (single shard) drops the same copies
    rag = _moe(cfg, dispatch="ragged", capacity_factor=0.5, capacity_all_paths=True)
    chex.assert_trees_all_close(rag(x)[0], y, rtol=1e-5, atol=1e-5)
    # the capacity factor alone (the learner's model.moe_capacity_factor) is the EP path's only
    y_ep_only, _, d0 = _moe(cfg, capacity_factor=0.5)(x)
    chex.assert_trees_all_close(y_ep_only, y_ref)
    assert int(d0) == 0


def test_router_dtype():
    cfg = get_preset("tiny_moe")
    x = jax.random.normal(jax.random.PRNGKey(2), (2, 7, cfg.hidden_size), jnp.float32)
    f32, bf16 = _moe(cfg), _moe(cfg, router_dtype=jnp.bfloat16)
    w32, i32 = f32.route(x)
    w16, i16 = bf16.route(x)
    assert w16.dtype == jnp.float32 and i16.dtype == jnp.int32
    # the bf16 router's logits are the fp32 ones rounded (inputs and output to bf16)
    lo = jnp.einsum("btd,de->bte", x.astype(jnp.bfloat16), bf16.router[...].astype(jnp.bfloat16))
    top_w, top_i = jax.lax.top_k(jax.nn.softmax(lo.astype(jnp.float32), axis=-1), cfg.num_experts_per_tok)
    if cfg.norm_topk_prob:
        top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
    chex.assert_trees_all_close(w16, top_w)
    np.testing.assert_array_equal(np.asarray(i16), np.asarray(top_i))
    assert float(jnp.max(jnp.abs(w16 - w32))) > 0  # it does differ
    # the default is the fp32 program: identical to an explicit float32 router
    m_default = Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0))
    m_f32 = Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0), moe=MoEOptions(router_dtype="float32"))
    ids = jnp.asarray([[1, 2, 3, 4, 5]], jnp.int32)
    np.testing.assert_array_equal(np.asarray(m_default(ids)), np.asarray(m_f32(ids)))
