"""Rollout-engine options that make its numerics differ from the learner's (issue 27):
``rollout.quantize`` (weights stored quantised, dequantised in the engine's programs) and the
MoE engine options (``rollout.moe_router_dtype``, ``rollout.moe_capacity_factor``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_rl.models import qwen3 as q
from jax_rl.sharding import make_mesh
from rollout.engine import Qwen3Engine
from rollout.quantize import dequantize_params, is_qarray, quantize_params

S = 48
PROMPTS = [[11, 12, 13, 14, 15], [7, 8], [100, 101, 102, 103, 104, 105, 106]]
STEPS = 6


def _decode(engine, prompts=PROMPTS, steps=STEPS, chunk=1):
    st = engine.init_decode_state()
    for i, p in enumerate(prompts):
        st = engine.insert(engine.prefill_tokens(engine.params, p, seed=10 + i), st, i)
    toks, logps = [], []
    for _ in range(steps // chunk):
        if chunk == 1:
            st, out = engine.decode(engine.params, st)
            rows = [jax.device_get(out)]
        else:
            st, out = engine.decode_steps(engine.params, st, chunk)
            out = jax.device_get(out)
            rows = [out.at(i) for i in range(chunk)]
        for r in rows:
            toks.append(r.token[: len(prompts)])
            logps.append(r.behav_logp[: len(prompts)])
    return np.stack(toks), np.stack(logps)


@pytest.fixture(scope="module")
def dense():
    cfg = q.get_preset("tiny_dense")
    model = q.Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0), scan_layers=True)
    return cfg, nnx.state(model, nnx.Param)


def test_quantized_engine_is_an_engine_holding_the_dequantized_weights(dense):
    # int8 here; fp8 and int4 differ only in quantize_weight (tests/rollout/test_quantize.py)
    mode = "int8"
    cfg, params = dense
    kw = dict(slots=4, max_cache_len=S, max_prefill_length=16, dtype="bfloat16", temperature=0.8,
              model_kwargs=dict(scan_layers=True), kv_layout="contiguous")
    eng = Qwen3Engine(cfg, params, quantize=mode, **kw)
    # storage: the decoder layers' matmul weights are QArrays of 1-byte values; the rest bf16
    leaves = jax.tree.leaves(eng.params, is_leaf=is_qarray)
    quant = [x for x in leaves if is_qarray(x)]
    assert len(quant) == 7 * cfg.num_hidden_layers  # q/k/v/o + gate/up/down per (unstacked) layer
    assert all(x.qvalue.dtype.itemsize == 1 and x.scale.dtype == jnp.float32 for x in quant)
    assert all(x.dtype == jnp.bfloat16 for x in leaves if not is_qarray(x))
    # reference: the unquantised bf16 engine loaded with dequantize(quantize(params)) in bf16
    ref_params = dequantize_params(quantize_params(params, mode, jnp.bfloat16), jnp.bfloat16)
    ref = Qwen3Engine(cfg, ref_params, **kw)
    t, lp = _decode(eng)
    t_ref, lp_ref = _decode(ref)
    np.testing.assert_array_equal(t, t_ref)
    np.testing.assert_allclose(lp, lp_ref, rtol=0, atol=1e-6)
    # the scanned decode (rollout.decode_steps) dequantises once per call: same tokens and logps
    t2, lp2 = _decode(eng, chunk=3)
    np.testing.assert_array_equal(t2, t)
    np.testing.assert_allclose(lp2, lp, rtol=0, atol=1e-6)
    # and it differs from the plain bf16 engine (the gap it is there to make)
    _, lp_bf16 = _decode(Qwen3Engine(cfg, params, **kw))
    assert np.max(np.abs(lp - lp_bf16)) > 1e-4


def test_quantized_engine_republish_and_none(dense):
    cfg, params = dense
    kw = dict(slots=2, max_cache_len=S, max_prefill_length=16, dtype="bfloat16", model_kwargs=dict(scan_layers=True),
              kv_layout="contiguous")
    eng = Qwen3Engine(cfg, params, quantize="int4", **kw)
    moved = jax.tree.map(lambda x: x * 1.01, params)
    new = eng.load_params(moved)  # a publish: quantised from the new values
    a = jax.tree.leaves(eng.params, is_leaf=is_qarray)
    b = jax.tree.leaves(new, is_leaf=is_qarray)
    assert jax.tree.structure(eng.params, is_leaf=is_qarray) == jax.tree.structure(new, is_leaf=is_qarray)
    assert any(is_qarray(x) and not np.array_equal(np.asarray(x.scale), np.asarray(y.scale)) for x, y in zip(a, b))
    # host (numpy) params, as the Ray runtime ships them, give the same engine params
    host = eng.load_params(jax.tree.map(np.asarray, moved))
    for x, y in zip(jax.tree.leaves(new), jax.tree.leaves(host)):
        np.testing.assert_array_equal(np.asarray(x.astype(jnp.float32)), np.asarray(y.astype(jnp.float32)))
    with pytest.raises(ValueError, match="rollout.quantize must be one of"):
        Qwen3Engine(cfg, None, quantize="int2", **kw)
    # "none": the engine's params are the plain cast (no QArray anywhere)
    plain = Qwen3Engine(cfg, params, **kw)
    assert not any(is_qarray(x) for x in jax.tree.leaves(plain.params, is_leaf=is_qarray))


def test_sharded_quantized_engine_equals_colocated(devices, dense):
    cfg, params = dense
    kw = dict(slots=4, max_cache_len=S, max_prefill_length=16, dtype="bfloat16", temperature=0.8,
              model_kwargs=dict(scan_layers=True), quantize="int8", kv_layout="contiguous")
    mesh = make_mesh(data=1, fsdp=1, tensor=2, expert=1, devices=devices[6:])
    sharded, single = Qwen3Engine(cfg, params, mesh=mesh, **kw), Qwen3Engine(cfg, params, **kw)
    qs = [x for x in jax.tree.leaves(sharded.params, is_leaf=is_qarray) if is_qarray(x)]
    assert qs and all({d.id for d in x.qvalue.sharding.device_set} == {6, 7} for x in qs)
    t, lp = _decode(sharded)
    t1, lp1 = _decode(single)
    np.testing.assert_array_equal(t, t1)
    np.testing.assert_allclose(lp, lp1, rtol=0, atol=2e-2)  # tensor-parallel bf16 sums in another order


@pytest.fixture(scope="module")
def moe():
    cfg = q.get_preset("tiny_moe")
    model = q.Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0), scan_layers=True)
    return cfg, nnx.state(model, nnx.Param)


def test_moe_engine_router_dtype_and_capacity(moe):
    cfg, params = moe
    base = dict(slots=4, max_cache_len=S, max_prefill_length=16, dtype="float32", temperature=0.8,
                record_routes=True, kv_layout="contiguous")
    kw = lambda **m: dict(base, model_kwargs=dict(scan_layers=True, moe=q.MoEOptions(**m)))  # noqa: E731
    ref = Qwen3Engine(cfg, params, **kw())  # the learner's routing (fp32 router, dropless)
    _, lp0 = _decode(ref)
    _, lp16 = _decode(Qwen3Engine(cfg, params, **kw(router_dtype="bfloat16")))
    assert np.max(np.abs(lp16 - lp0)) > 0
    drop = Qwen3Engine(cfg, params, **kw(capacity_factor=0.25, capacity_all_paths=True))
    _, lp_drop = _decode(drop)
    assert np.max(np.abs(lp_drop - lp0)) > 1e-3
    # an idle slot takes no capacity: one active one-token prompt (nothing to prefill) at factor 0.25
    # of 4 slots x 2 copies / 4 experts (C = 1 per expert) keeps both its copies at every step, so
    # it decodes as the dropless engine does
    t_one, lp_one = _decode(drop, prompts=[[5]])
    t_ref, lp_ref = _decode(ref, prompts=[[5]])
    np.testing.assert_array_equal(t_one, t_ref)
    np.testing.assert_allclose(lp_one, lp_ref, rtol=0, atol=1e-6)


def test_config_keys_reach_the_engine_and_bad_combinations_name_the_key():
    from jax_rl.config import ConfigError, load_config
    from jax_rl.model_builder import rollout_model_kwargs
    from jax_rl.model_builder import build_model_config

    base = load_config("configs/tiny_moe_cpu.yaml")
    assert rollout_model_kwargs(base)["moe"] == q.MoEOptions()  # unset: the learner's routing, dropless
    cfg = load_config("configs/tiny_moe_cpu.yaml", ["rollout.moe_router_dtype=bfloat16",
                                                    "rollout.moe_capacity_factor=1.25", "rollout.quantize=int8"])
    kw = rollout_model_kwargs(cfg)
    assert kw["moe"] == q.MoEOptions(router_dtype="bfloat16", capacity_factor=1.25, capacity_all_paths=True)
    build_model_config(cfg)  # an MoE model: accepted
    for key, val in (("rollout.moe_router_dtype", "bfloat16"), ("rollout.moe_capacity_factor", "2.0")):
        dense = load_config("configs/tiny_cpu.yaml", [f"{key}={val}", "model.tokenizer=compact"])
        with pytest.raises(ConfigError, match=f"^{key}=.*no MoE layer"):
            build_model_config(dense)
    with pytest.raises(ConfigError, match="rollout.quantize"):
        load_config("configs/tiny_cpu.yaml", ["rollout.quantize=int2"])
    with pytest.raises(ConfigError, match="rollout.moe_capacity_factor"):
        load_config("configs/tiny_moe_cpu.yaml", ["rollout.moe_capacity_factor=0"])
