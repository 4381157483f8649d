"""A rollout engine on its own mesh (``Qwen3Engine(mesh=...)``, placement.rollout / rollout.mesh):
params and KV cache really sharded by the learner's logical rules, and the same tokens and
log-probs as the single-device engine and the learner's forward (fp32) at the same params,
published from the learner's mesh through the compiled weight sync (``load_params``)."""

from __future__ import annotations

import chex
import jax
import numpy as np
import pytest
from flax import nnx

from jax_rl.model_builder import rollout_model_kwargs
from jax_rl.models import qwen3 as q
from jax_rl.sharding import make_mesh
from rollout.engine import Qwen3Engine
from tests.learner._util import init_params, make_cfg

S = 32
STEPS = 6
PROMPTS = [[11, 12, 13, 14, 15], [7, 8], [100, 101, 102, 103, 104, 105, 106, 107, 108], [3, 4, 5]]
SEEDS = [101, 102, 103, 104]


def _decode(engine, prompts=PROMPTS, steps=STEPS):
    """Prefill + insert every prompt (slot i, seed SEEDS[i]), then ``steps`` decode steps in one
    ``decode_steps`` call. Returns (tokens [steps, B] int32, logps [steps, B] float32, state)."""
    st = engine.init_decode_state()
    for i, p in enumerate(prompts):
        st = engine.insert(engine.prefill_tokens(engine.params, p, seed=SEEDS[i]), st, i)
    st, out = engine.decode_steps(engine.params, st, steps)
    out = jax.device_get(out)
    return out.token, out.behav_logp, st


def _engine_mesh(devices, **sizes):
    n = int(np.prod(list(sizes.values())))
    return make_mesh(**{"fsdp": 1, **sizes}, devices=devices[8 - n:])  # the last n: not the learner's


@pytest.fixture(scope="module")
def learner(devices):
    """A tiny dense learner on the first 4 devices (placement.learner=4, fsdp=4), scan_layers params."""
    from jax_rl.learner.learner import Learner

    cfg = make_cfg("ppo", placement={"learner": 4}, rollout={"dtype": "float32", "slots": 4, "max_cache_len": S})
    lrn = Learner(cfg, init_params=init_params(cfg))
    yield lrn
    lrn.close()


@pytest.fixture(scope="module")
def single(learner):
    """The colocated single-device engine at the learner's params: the reference."""
    eng = Qwen3Engine(learner.model_config, learner.get_params(), slots=4, max_cache_len=S, dtype="float32",
                      model_kwargs=rollout_model_kwargs(learner.cfg), kv_layout="contiguous")
    return _decode(eng)


@pytest.mark.parametrize("sizes", [{"data": 1, "tensor": 2}, {"data": 2, "tensor": 2}], ids=["d1t2", "d2t2"])
def test_sharded_dense_engine_equals_single_device_and_learner(sizes, devices, learner, single):
    mesh = _engine_mesh(devices, **sizes)
    eng = Qwen3Engine(learner.model_config, learner.get_params(), slots=4, max_cache_len=S, dtype="float32",
                      model_kwargs=rollout_model_kwargs(learner.cfg), mesh=mesh, kv_layout="contiguous")
    # params: sharded by the learner's logical rules, on the engine's devices only
    attn = eng.params["layers"][0]["attn"]  # unrolled on the CPU (kv_per_layer), unstacked by load_params
    assert attn["q_proj"].sharding.spec == jax.sharding.PartitionSpec(None, "tensor", None)  # [D, q_heads, Dh]
    assert attn["k_proj"].sharding.spec == jax.sharding.PartitionSpec(None, "tensor", None)  # 2 kv heads / 2
    assert eng.params["layers"][0]["mlp"]["gate_proj"].sharding.spec == jax.sharding.PartitionSpec(None, "tensor")
    engine_ids = {d.id for d in mesh.devices.flat}
    assert all({d.id for d in x.sharding.device_set} == engine_ids for x in jax.tree.leaves(eng.params))

    toks, logps, st = _decode(eng)
    # KV cache: per layer k [B, Hkv, Dh, S] / v [B, Hkv, S, Dh], kv heads over tensor, slots over data
    slot_axis = "data" if sizes["data"] > 1 else None
    for k, v in zip(st["cache"].k, st["cache"].v):
        assert k.sharding.spec == jax.sharding.PartitionSpec(slot_axis, "tensor", None, None)
        assert v.sharding.spec == jax.sharding.PartitionSpec(slot_axis, "tensor", None, None)
    assert st["tokens"].sharding.spec == jax.sharding.PartitionSpec(slot_axis)

    ref_toks, ref_logps, _ = single
    np.testing.assert_array_equal(toks, ref_toks)  # same seeds -> same samples
    np.testing.assert_allclose(logps, ref_logps, atol=1e-5, rtol=0)
    assert np.all(logps < 0) and np.all(np.isfinite(logps))

    # the learner's fp32 log-prob forward of prompt + sampled tokens at the same params
    seq = np.zeros((len(PROMPTS), S), np.int32)
    mask = np.zeros_like(seq, bool)
    for i, p in enumerate(PROMPTS):
        row = p + list(toks[:, i])
        seq[i, :len(row)], mask[i, :len(row)] = row, True
    lp = learner.logprobs({"tokens": seq, "attention_mask": mask})
    want = np.stack([lp[i, len(p):len(p) + STEPS] for i, p in enumerate(PROMPTS)], axis=1)
    np.testing.assert_allclose(logps, want, atol=1e-5, rtol=0)


def test_weight_sync_is_one_compiled_cast_reused_and_host_params_agree(devices, learner):
    """load_params from the learner's mesh: the jitted cast compiles once for every publish; the
    params land in rollout.dtype on the engine's devices; host (numpy) params give the same arrays."""
    mesh = _engine_mesh(devices, data=1, tensor=2)
    eng = Qwen3Engine(learner.model_config, None, slots=4, max_cache_len=S, dtype="bfloat16",
                      model_kwargs=rollout_model_kwargs(learner.cfg), mesh=mesh, kv_layout="contiguous")
    p0 = learner.get_params()
    assert {d.id for x in jax.tree.leaves(p0) for d in x.sharding.device_set} == {0, 1, 2, 3}
    traces = []  # _layout runs inside the jitted cast: once per trace (a jit cache's size reads 0 when
    layout = eng._layout  # the persistent compilation cache served the executable, as in make test)
    eng._layout = lambda out: (traces.append(1), layout(out))[1]
    a = eng.load_params(p0)
    b = eng.load_params(jax.tree.map(lambda x: x * 2.0, p0))  # a second publish, new values
    assert len(traces) == 1, f"the publish cast was traced {len(traces)} times for 2 publishes"
    eng._layout = layout
    got = jax.tree.leaves(a)
    assert all(x.dtype == jax.numpy.bfloat16 for x in got)
    assert all({d.id for d in x.sharding.device_set} == {6, 7} for x in got)
    for x, y in zip(got, jax.tree.leaves(b)):
        chex.assert_trees_all_equal(np.asarray(x, np.float32) * 2.0, np.asarray(y, np.float32))
    h = eng.load_params(learner.get_params(host=True))  # the Ray path: numpy leaves, cast on the host
    for x, y in zip(got, jax.tree.leaves(h)):
        assert x.sharding == y.sharding
        chex.assert_trees_all_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


def test_kv_heads_that_do_not_divide_tensor_are_replicated(devices):
    """1 kv head on tensor=2 (configs/tiny_cpu.yaml): the rules drop 'tensor' from the kv-head dim
    (each tensor shard keeps the whole cache), the q heads still split."""
    mc = q.get_preset("tiny_dense", num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    eng = Qwen3Engine(mc, None, slots=4, max_cache_len=S, dtype="float32", mesh=_engine_mesh(devices, data=2, tensor=2), kv_layout="contiguous")
    for k in eng.state_shardings["cache"].k:
        assert k.spec == jax.sharding.PartitionSpec("data", None, None, None)
    assert eng.param_shardings["layers"][0]["attn"]["k_proj"].get_value().spec == jax.sharding.PartitionSpec(None, None, None)
    assert eng.param_shardings["layers"][0]["attn"]["q_proj"].get_value().spec == jax.sharding.PartitionSpec(
        None, "tensor", None)


@pytest.mark.parametrize("dispatch", ["ragged", "dense"])
def test_sharded_moe_engine_expert_parallel(dispatch, devices):
    """MoE on (tensor 2, expert 2): experts sharded over 'expert'; with moe_dispatch=ragged the decode
    step runs the expert-parallel all_to_all path (jax_rl.models.expert_parallel), with dense GSPMD
    partitions the one-hot dispatch. Same tokens, log-probs and recorded routes as one device."""
    model = q.Qwen3ForCausalLM(q.get_preset("tiny_moe"), rngs=nnx.Rngs(0), moe=q.MoEOptions(dispatch=dispatch))
    params = nnx.state(model, nnx.Param)
    kw = dict(slots=4, max_cache_len=S, dtype="float32", model_kwargs={"moe": q.MoEOptions(dispatch=dispatch)}, record_routes=True,
              kv_layout="contiguous")
    mesh = _engine_mesh(devices, data=1, tensor=2, expert=2)
    ref, eng = Qwen3Engine(model.config, params, **kw), Qwen3Engine(model.config, params, mesh=mesh, **kw)
    gate = eng.params["layers"][0]["mlp"]["gate_proj"]  # [E, D, F]
    assert gate.sharding.spec == jax.sharding.PartitionSpec("expert", None, "tensor")
    t0, l0, s0 = _decode(ref)
    t1, l1, s1 = _decode(eng)
    np.testing.assert_array_equal(t1, t0)
    np.testing.assert_allclose(l1, l0, atol=1e-5, rtol=0)
    pre0 = ref.prefill_tokens(ref.params, PROMPTS[2], seed=1)
    pre1 = eng.prefill_tokens(eng.params, PROMPTS[2], seed=1)
    np.testing.assert_array_equal(pre1["routes"], pre0["routes"])
    with jax.set_mesh(mesh):  # as the engine traces it
        text = eng.programs["decode"].lower(eng.params, s1).as_text()
    assert ("all_to_all" in text or "all-to-all" in text) is (dispatch == "ragged")


def test_sharded_engine_batched_group_and_kept_kv_prefill(devices, learner):
    """The RL path's prefill on a sharded engine (data=2, tensor=2): a batched burst with a GRPO
    group (one shared prefill) and a second turn appended on kept K/V give the colocated engine's
    tokens and log-probs (fp32, 1e-5), the decode state keeping its shardings."""
    from rollout.generator import Generator

    kw = dict(slots=4, max_cache_len=S, dtype="float32", model_kwargs=rollout_model_kwargs(learner.cfg),
              kv_layout="contiguous")
    ref = Qwen3Engine(learner.model_config, learner.get_params(), **kw)
    eng = Qwen3Engine(learner.model_config, learner.get_params(), mesh=_engine_mesh(devices, data=2, tensor=2), **kw)

    def run(e):
        gen = Generator(e)
        futs = [gen.submit(p, max_new_tokens=4, seed=s, session=i)
                for i, (p, s) in enumerate(zip([PROMPTS[0]] * 2 + PROMPTS[1:3], SEEDS))]
        gen.run_until_idle()
        first = [f.result(timeout=0) for f in futs]
        ctx = PROMPTS[0] + first[0].tokens + [9, 10]
        f = gen.submit(ctx, max_new_tokens=4, seed=7, session=0)
        gen.run_until_idle()
        return first + [f.result(timeout=0)], gen

    got, gen = run(eng)
    want, _ = run(ref)
    assert gen.stats["shared_prefills"] == 1 and got[-1].info["kv_reused"] > 0
    for g, w in zip(got, want):
        assert g.tokens == w.tokens
        np.testing.assert_allclose(g.behav_logp, w.behav_logp, atol=1e-5, rtol=0)
    assert gen.table.state["tokens"].sharding.spec == jax.sharding.PartitionSpec("data")
