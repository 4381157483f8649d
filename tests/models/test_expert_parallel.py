"""Expert parallelism (``jax_rl.models.expert_parallel``) on the 8 fake CPU devices.

The tiny MoE in fp32 on a mesh with ``expert=4`` (EP path: shard_map + all_to_all) against
``expert=1`` (single-shard ragged path): same logits and same grads, with and without forced
expert ids, under load imbalance; the lowered program really holds the all-to-all; capacity
drops are counted exactly and drop exactly the copies GShard's priority says."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_rl.models.expert_parallel as EPM
from jax_rl.models.expert_parallel import (EPOptions, ep_capacity, expert_parallel_moe, grouped_matmul,
                                           resolve_moe_matmul)
from jax_rl.models.qwen3 import MoE, MoEOptions, Qwen3ForCausalLM, get_preset
from jax_rl.sharding import make_mesh, state_shardings

EP_MESHES = [(1, 2, 1, 4), (1, 1, 2, 4)]  # (data, fsdp, tensor, expert); the 2nd splits F too
REF_MESH = (1, 8, 1, 1)


def _has_all_to_all(lowered) -> bool:
    return "all_to_all" in lowered.as_text()


def _model(E=4, seed=3, **kw):
    cfg = get_preset("tiny_moe", num_experts=E)
    m = Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(seed), moe=MoEOptions(dispatch="ragged"), scan_layers=True, **kw)
    rng = np.random.default_rng(seed)
    for path, v in nnx.iter_graph(m):  # perturb the norms (init = ones) so they matter
        if isinstance(v, nnx.Param) and path[-1] == "weight":
            v[...] = v[...] + jnp.asarray(rng.normal(0, 0.3, v.shape), v.dtype)
    return cfg, m


_RUNNERS: dict = {}


def _runner(model, mesh_shape):
    """``run(tokens, forced) -> (logits [B,T,V], expert ids, grads (numpy), whether the
    lowered program has an all-to-all)`` of
    sum(logits * c) on a mesh, params placed by the rules; one jit per (model, mesh)."""
    key = (id(model), mesh_shape)
    if key in _RUNNERS:
        return _RUNNERS[key]
    mesh = make_mesh(*mesh_shape)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    params = jax.device_put(params, state_shardings(params, mesh))

    def loss(params, tokens, forced):
        out = nnx.merge(graphdef, params, rest).forward(tokens, forced_expert_ids=forced)
        coef = jax.random.normal(jax.random.key(9), out.logits.shape)
        return jnp.sum(out.logits * coef), (out.logits, out.expert_ids)

    f = jax.jit(jax.value_and_grad(loss, has_aux=True))

    def run(tokens, forced):
        with jax.set_mesh(mesh):
            a2a = _has_all_to_all(f.lower(params, tokens, forced))
            (_, (logits, ids)), grads = f(params, tokens, forced)
        return (np.asarray(logits), [np.asarray(i) for i in ids],
                jax.tree.map(np.asarray, nnx.to_pure_dict(grads)), a2a)

    _RUNNERS[key] = (model, run)  # keep the model alive: its id keys the cache
    return _RUNNERS[key]


def _run_model(model, mesh_shape, tokens, forced):
    return _runner(model, mesh_shape)[1](tokens, forced)


def _max_diff(a, b) -> float:
    """Largest per-leaf max|a - b| / max(1, max|b|): fp32 1e-5 relative to each leaf's scale
    (the loss sums ~10^4 logits, so embedding grads reach ~100; two EP=1 meshes already differ
    by ~5e-5 absolute there, from reduction order)."""
    return max(float(np.abs(np.asarray(x) - np.asarray(y)).max() / max(1.0, np.abs(y).max()))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.fixture(scope="module")
def tiny_moe():
    cfg, model = _model()
    tokens = jax.random.randint(jax.random.key(1), (4, 8), 0, cfg.vocab_size, jnp.int32)
    return cfg, model, tokens


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape", EP_MESHES)
def test_ep4_matches_ep1_logits_and_grads(tiny_moe, mesh_shape, devices):
    cfg, model, tokens = tiny_moe
    ref_logits, ref_ids, ref_g, ref_a2a = _run_model(model, REF_MESH, tokens, None)
    assert not ref_a2a
    logits, ids, g, a2a = _run_model(model, mesh_shape, tokens, None)
    assert a2a  # the EP path ran, not a silent fallback to the gather
    for a, b in zip(ids, ref_ids):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(logits, ref_logits, atol=1e-5, rtol=1e-5)
    assert _max_diff(g, ref_g) < 1e-5
    router_g = g["layers"]["mlp"]["router"]
    assert np.abs(router_g).max() > 1e-4  # the router gets gradient through the gate weights
    assert all(np.abs(x).max() > 0 for x in jax.tree.leaves(g["layers"]["mlp"]))

    # forced ids: other experts than the router's, and all tokens on experts 0 and 1
    # (maximal imbalance: every top-1 copy to expert shard 0, every top-2 copy to shard 1)
    others = jnp.stack([(jnp.asarray(i) + 1) % cfg.num_experts for i in ref_ids])
    piled = jnp.broadcast_to(jnp.array([0, 1], jnp.int32), others.shape)
    for forced in (others, piled):
        r_logits, r_ids, r_g, _ = _run_model(model, REF_MESH, tokens, forced)
        e_logits, e_ids, e_g, a2a = _run_model(model, mesh_shape, tokens, forced)
        assert a2a
        for a, f in zip(e_ids, forced):
            np.testing.assert_array_equal(a, np.asarray(f))
        np.testing.assert_allclose(e_logits, r_logits, atol=1e-5, rtol=1e-5)
        assert _max_diff(e_g, r_g) < 1e-5
        assert np.abs(e_logits - ref_logits).max() > 1e-3  # forcing changed the output


# ---------------------------------------------------------------- the block on its own


def _block(E=8, k=2, seed=1):
    cfg = get_preset("tiny_moe", num_experts=E, num_experts_per_tok=k)
    moe = MoE(cfg, rngs=nnx.Rngs(seed), dtype=jnp.float32, param_dtype=jnp.float32,
              dispatch="ragged")
    return cfg, moe


def _kept_copies(ids: np.ndarray, n_batch: int, ep: int, E: int, capacity: int,
                 split: bool = True, valid: np.ndarray | None = None) -> np.ndarray:
    """Independent reference of the documented capacity rule: keep [B,T,k] bool.

    Source devices: each of the n_batch batch blocks (consecutive rows), flattened, cut into ep
    chunks of ceil(n/ep) tokens (split) or taken whole; per (source, destination shard) the
    first ``capacity`` copies in (choice, token) order are kept. A token with ``valid`` [B,T]
    False takes no slot and is not kept."""
    B, T, k = ids.shape
    keep = np.zeros((B, T, k), bool)
    blocks = ids.reshape(n_batch, (B // n_batch) * T, k)
    vb = (np.ones((B, T), bool) if valid is None else valid).reshape(n_batch, (B // n_batch) * T)
    kb = keep.reshape(n_batch, (B // n_batch) * T, k)
    n = blocks.shape[1]
    chunk = math.ceil(n / ep) if split else n
    for b in range(n_batch):
        for c0 in range(0, n, chunk):
            used = np.zeros(ep, int)
            for j in range(k):
                for t in range(c0, min(c0 + chunk, n)):
                    if not vb[b, t]:
                        continue
                    d = blocks[b, t, j] // (E // ep)
                    if used[d] < capacity:
                        kb[b, t, j] = True
                    used[d] += 1
    return kb.reshape(B, T, k)


_BLOCK_JITS: dict = {}


def _block_fns(moe, mesh_shape, capacity_factor, batch_axes, matmul="ragged_dot"):
    """(mesh, jitted EP value-and-grad, jitted single-shard reference, first use), cached per
    setting."""
    key = (id(moe), mesh_shape, capacity_factor, batch_axes, matmul)
    if key in _BLOCK_JITS:
        return _BLOCK_JITS[key][1:] + (False,)
    graphdef, _ = nnx.split(moe)

    def experts(m):
        return m.gate_proj[...], m.up_proj[...], m.down_proj[...]

    def f(x, params, forced, valid):
        m = nnx.merge(graphdef, params)
        w, ids = m.route(x, forced)
        y, dropped, _ = expert_parallel_moe(x, w, ids, *experts(m), valid=valid, options=EPOptions(
            capacity_factor=capacity_factor, batch_axes=batch_axes, matmul=matmul))
        return jnp.sum(y * jnp.cos(x)), (y, dropped)

    def ref(x, params, forced, keep):
        m = nnx.merge(graphdef, params)
        w, ids = m.route(x, forced)
        y = MoE._ragged(x, w * keep, ids, *experts(m))
        return jnp.sum(y * jnp.cos(x)), y

    vg = functools.partial(jax.value_and_grad, argnums=(0, 1), has_aux=True)
    _BLOCK_JITS[key] = (moe, make_mesh(*mesh_shape), jax.jit(vg(f)), jax.jit(vg(ref)))
    return _BLOCK_JITS[key][1:] + (True,)


def _check_block(moe, x, forced, mesh_shape, capacity_factor=None, batch_axes=None,
                 keep=None, matmul="ragged_dot", valid=None) -> int:
    """Runs the EP block (forced ids [B,T,k], token ``valid`` [B,T], default all) on a mesh,
    checks that it lowers to an all-to-all (first use of a setting) and that y and the grads wrt
    (x, params) of sum(y * cos x) match the single-shard ragged path whose combine weights are
    masked by ``keep`` [B,T,k] (default: all kept); returns the dropped-copies count."""
    mesh, ep_fn, ref_fn, first = _block_fns(moe, mesh_shape, capacity_factor, batch_axes, matmul)
    _, params = nnx.split(moe)
    valid = jnp.ones(x.shape[:2], bool) if valid is None else jnp.asarray(valid)
    with jax.set_mesh(mesh):
        if first:  # (the lowering is the same for every call of one setting)
            assert _has_all_to_all(ep_fn.lower(x, params, forced, valid))
        (_, (y, dropped)), grads = ep_fn(x, params, forced, valid)
    keep = np.ones(forced.shape, bool) if keep is None else keep
    (_, y_ref), g_ref = ref_fn(x, params, forced, jnp.asarray(keep, jnp.float32))
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), atol=1e-5, rtol=1e-5)
    assert _max_diff(grads, g_ref) < 1e-5
    return int(dropped)


@pytest.mark.parametrize("B,T", [(4, 8), (2, 1)])  # (2, 1): a decode step, chunks padded
def test_block_dropless_under_imbalance_and_tiny_capacity_counts_drops(B, T, devices):
    cfg, moe = _block()
    E, k, ep = cfg.num_experts, cfg.num_experts_per_tok, 4
    x = jax.random.normal(jax.random.key(2), (B, T, cfg.hidden_size))
    routed = moe.route(x)[1]  # the router's own top-k (forced = same routing, no ties)
    piled = jnp.broadcast_to(jnp.array([0, 1], jnp.int32), (B, T, k))  # all on shard 0
    mesh_shape = (1, 2, 1, ep)  # batch over fsdp=2: each device takes 1/4 of its shard's tokens
    for forced in (routed, piled):
        assert _check_block(moe, x, forced, mesh_shape) == 0
    # a deliberately tiny capacity: counted drops, and exactly those copies are missing
    cap = ep_capacity(math.ceil(B // 2 * T / ep) * k, ep, 0.5)
    for forced in (routed, piled):
        keep = _kept_copies(np.asarray(forced), 2, ep, E, cap)
        dropped = _check_block(moe, x, forced, mesh_shape, capacity_factor=0.5, keep=keep)
        assert dropped == int((~keep).sum())
        assert dropped > 0 or forced is routed
    # a factor of EP is enough for any routing: no drops
    assert _check_block(moe, x, piled, mesh_shape, capacity_factor=float(ep)) == 0


def test_block_padding_takes_no_capacity(devices):
    """Right padding (valid False) takes no slot and gets y = 0: with every copy piled on one
    shard, exactly the reference's real copies are kept (a chunk whose real copies fit keeps
    them all). Counted as all valid, the same batch drops more real copies: the pads' first
    choices come before the real tokens' second choices."""
    cfg, moe = _block()
    E, k, ep = cfg.num_experts, cfg.num_experts_per_tok, 4
    B, T = 4, 8
    x = jax.random.normal(jax.random.key(3), (B, T, cfg.hidden_size))
    piled = jnp.broadcast_to(jnp.array([0, 1], jnp.int32), (B, T, k))  # all on shard 0
    lengths = np.array([2, 6, 1, 8])  # chunks of 4 tokens: 2,0 | 4,2 | 1,0 | 4,4 real
    valid = np.arange(T)[None, :] < lengths[:, None]
    mesh_shape = (1, 2, 1, ep)
    cap = ep_capacity(math.ceil(B // 2 * T / ep) * k, ep, 2.0)  # 4 slots per (device, shard)
    keep = _kept_copies(np.asarray(piled), 2, ep, E, cap, valid=valid)
    assert not keep[~valid].any()
    dropped = _check_block(moe, x, piled, mesh_shape, capacity_factor=2.0, keep=keep, valid=valid)
    assert dropped == int((~keep[valid]).sum()) == 3 * (4 * k - cap)  # the three full chunks
    all_valid = _kept_copies(np.asarray(piled), 2, ep, E, cap)
    assert int((~all_valid[valid]).sum()) > dropped  # pads would have pushed real copies out


def test_block_tokens_already_sharded_over_expert(devices):
    cfg, moe = _block()
    x = jax.random.normal(jax.random.key(5), (8, 3, cfg.hidden_size))
    routed = moe.route(x)[1]
    axes = ("fsdp", "expert")
    assert _check_block(moe, x, routed, (1, 2, 1, 4), batch_axes=axes) == 0
    # capacity per source device when each device's tokens are its own (no 1/EP chunking)
    keep = _kept_copies(np.asarray(routed), 8, 4, cfg.num_experts, ep_capacity(3 * 2, 4, 0.25),
                        split=False)
    dropped = _check_block(moe, x, routed, (1, 2, 1, 4), capacity_factor=0.25, batch_axes=axes,
                           keep=keep)
    assert dropped == int((~keep).sum()) > 0


@pytest.mark.parametrize("M,sizes", [(40, [7, 0, 20, 5]), (300, [120, 100, 0, 80])])
def test_megablox_grouped_matmul_matches_ragged_dot(M, sizes, monkeypatch):
    """The megablox kernels (Pallas interpreter on CPU) under our VJP against ragged_dot, fp32:
    outputs, dx and dw, with an empty group, rows past the last group (must come out 0, with
    0 gradient, not the kernel's unwritten memory) and M not a multiple of the row tile."""
    monkeypatch.setattr(EPM, "MEGABLOX_INTERPRET", True)
    K, N = 24, 40
    r = np.random.default_rng(M)
    x = jnp.asarray(r.normal(size=(M, K)), jnp.float32)
    w = jnp.asarray(r.normal(size=(len(sizes), K, N)), jnp.float32)
    gs = jnp.asarray(sizes, jnp.int32)
    c = jnp.asarray(r.normal(size=(M, N)), jnp.float32)

    def loss(kind):
        return lambda x, w: jnp.sum(jnp.sin(grouped_matmul(x, w, gs, kind)) * c)

    y_mb, y_rd = grouped_matmul(x, w, gs, "megablox"), grouped_matmul(x, w, gs, "ragged_dot")
    np.testing.assert_allclose(np.asarray(y_mb), np.asarray(y_rd), atol=1e-4, rtol=1e-5)
    assert not np.asarray(y_mb[sum(sizes):]).any()
    g_mb = jax.jit(jax.grad(loss("megablox"), argnums=(0, 1)))(x, w)
    g_rd = jax.grad(loss("ragged_dot"), argnums=(0, 1))(x, w)
    for a, b in zip(g_mb, g_rd):
        assert np.isfinite(np.asarray(a)).all()
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=1e-5)
    assert not np.asarray(g_mb[0][sum(sizes):]).any()


def test_block_megablox_matches_single_shard(devices, monkeypatch):
    """The EP block with the megablox grouped matmul (interpreted; the shard_map without
    vma checks) equals the single-shard ragged path: y and grads, dropless and with drops."""
    monkeypatch.setattr(EPM, "MEGABLOX_INTERPRET", True)
    cfg, moe = _block()
    E, k, ep = cfg.num_experts, cfg.num_experts_per_tok, 4
    x = jax.random.normal(jax.random.key(2), (4, 8, cfg.hidden_size))
    routed = moe.route(x)[1]
    assert _check_block(moe, x, routed, (1, 2, 1, ep), matmul="megablox") == 0
    keep = _kept_copies(np.asarray(routed), 2, ep, E, ep_capacity(math.ceil(2 * 8 / ep) * k, ep, 0.5))
    assert _check_block(moe, x, routed, (1, 2, 1, ep), capacity_factor=0.5, keep=keep,
                        matmul="megablox") == int((~keep).sum())


def test_moe_matmul_names():
    assert resolve_moe_matmul("auto") == ("megablox" if jax.default_backend() == "tpu" else "ragged_dot")
    assert resolve_moe_matmul("megablox") == "megablox"
    with pytest.raises(ValueError, match="moe_matmul must be one of"):
        resolve_moe_matmul("gmm")
    with pytest.raises(ValueError, match="'ragged_dot' or 'megablox'"):
        grouped_matmul(jnp.ones((2, 2)), jnp.ones((1, 2, 2)), jnp.ones((1,), jnp.int32), "auto")


def test_megablox_weight_gradient_costs_one_pass_on_tpu():
    """libtpu's cost analysis of the experts' weight gradient (v5e, one chip): ragged_dot's is
    G times the 2 M K N of a grouped matmul (lowered densely), megablox's tgmm exactly 1x."""
    pytest.importorskip("libtpu")
    from jax_rl import compile as aot

    dev = aot.get_topology("v5e:2x2").devices[0]
    sh = jax.sharding.SingleDeviceSharding(dev)
    M, G = 1000, 8  # M: not a multiple of the row tile
    for K, N in ((256, 256), (192, 640)):  # (192, 640): a non-128 dim, and tiles swap in dx
        args = (jax.ShapeDtypeStruct((M, K), jnp.bfloat16, sharding=sh),
                jax.ShapeDtypeStruct((G, K, N), jnp.bfloat16, sharding=sh),
                jax.ShapeDtypeStruct((G,), jnp.int32, sharding=sh))
        ratio = {}
        for kind in ("ragged_dot", "megablox"):
            def f(x, w, gs):
                return grouped_matmul(x, w, gs, kind).astype(jnp.float32).sum()
            for argnums, name in ((1, "dw"), ((0, 1), "dx+dw")):
                # as jax-rl compile lowers (bf16 MXU passes), with no persistent cache (as it does)
                with jax.default_matmul_precision("default"), aot.no_persistent_cache():
                    cost = jax.jit(jax.grad(f, argnums=argnums)).lower(*args).compile().cost_analysis()
                cost = cost[0] if isinstance(cost, list) else cost
                ratio[kind, name] = cost["flops"] / (2 * M * K * N)
        assert ratio["ragged_dot", "dw"] > G - 1, ratio
        assert 0.9 < ratio["megablox", "dw"] < 1.3, ratio  # rows padded to 1024: <= 1.024x
        assert 1.9 < ratio["megablox", "dx+dw"] < 2.5, ratio


def test_ep_errors(devices):
    cfg, moe = _block(E=6)
    x = jnp.ones((2, 2, cfg.hidden_size))
    w, ids = moe.route(x)
    args = (x, w, ids, moe.gate_proj[...], moe.up_proj[...], moe.down_proj[...])
    with jax.set_mesh(make_mesh(1, 2, 1, 4)):
        with pytest.raises(ValueError, match="not divisible by mesh.expert=4"):
            expert_parallel_moe(*args)
    with pytest.raises(ValueError, match="'expert' axis"):
        expert_parallel_moe(*args)
    with pytest.raises(ValueError, match="> 0"):
        ep_capacity(8, 4, 0.0)
    with pytest.raises(ValueError, match="> 0"):
        MoE(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32, param_dtype=jnp.float32,
            dispatch="ragged", capacity_factor=-1.0)
    assert ep_capacity(8, 4, None) == 8 and ep_capacity(8, 4, 1.0) == 2
    assert ep_capacity(8, 4, 100.0) == 8 and ep_capacity(1, 4, 0.01) == 1


@pytest.mark.slow
def test_learner_step_expert_parallel_matches_one_device(devices, monkeypatch):
    """The learner's own loss and grads (moe_dispatch: ragged) on one device vs a mesh with
    expert=4: the EP path inside the real train step (scan, remat, chunked LM head)."""
    from jax_rl.learner.learner import Learner
    from jax_rl.models.qwen3 import layers as qwen3_layers
    from tests.learner._util import host, init_params, make_batch, make_cfg, max_abs_diff

    traced = []  # trace-time calls of the EP path

    def spy(*a, **kw):
        traced.append(jax.sharding.get_abstract_mesh().shape)
        return expert_parallel_moe(*a, **kw)

    monkeypatch.setattr(qwen3_layers, "expert_parallel_moe", spy)

    cfg = make_cfg("ppo", "tiny_moe", B=8, T=16, hf={"num_hidden_layers": 1},
                   model={"moe_dispatch": "ragged", "remat": True})
    batch = make_batch(1, B=8, T=16)
    ref = Learner(cfg, mesh=make_mesh(devices=jax.devices()[:1]), init_params=init_params(cfg))
    loss0, grads0, _ = ref.loss_and_grads(batch)
    assert not traced
    lrn = Learner(cfg, mesh=make_mesh(1, 2, 1, 4), init_params=init_params(cfg))
    loss, grads, _ = lrn.loss_and_grads(batch)
    assert traced and all(m["expert"] == 4 for m in traced)
    assert abs(loss - loss0) < 1e-5
    assert max_abs_diff(host(grads), host(grads0)) < 1e-5


def test_per_token_drops_are_the_hand_references_missing_copies(devices):
    """``per_token=True`` (the rollout engine's per-slot count): each token's dropped copies, laid
    out [B, T] like x, are the copies the hand reference ``_kept_copies`` leaves out (padding never
    counted), they sum to the scalar count, and y is the per_token=False program's."""
    cfg, moe = _block()
    E, k, ep = cfg.num_experts, cfg.num_experts_per_tok, 4
    B, T = 4, 8
    x = jax.random.normal(jax.random.key(3), (B, T, cfg.hidden_size))
    piled = jnp.broadcast_to(jnp.array([0, 1], jnp.int32), (B, T, k))
    valid = np.arange(T)[None, :] < np.array([2, 6, 1, 8])[:, None]
    cap = ep_capacity(math.ceil(B // 2 * T / ep) * k, ep, 2.0)
    keep = _kept_copies(np.asarray(piled), 2, ep, E, cap, valid=valid)
    w = jnp.full((B, T, k), 0.5, x.dtype)
    wg, wu, wd = moe.gate_proj[...], moe.up_proj[...], moe.down_proj[...]
    with jax.set_mesh(make_mesh(1, 2, 1, ep)):
        y, dropped, tok = jax.jit(lambda *a: expert_parallel_moe(
            *a, valid=valid, options=EPOptions(capacity_factor=2.0, per_token=True)))(x, w, piled, wg, wu, wd)
        y0, d0, none = jax.jit(lambda *a: expert_parallel_moe(*a, valid=valid, options=EPOptions(capacity_factor=2.0)))(
            x, w, piled, wg, wu, wd)
    want = np.sum(valid[..., None] & ~keep, axis=-1)
    assert tok.shape == (B, T) and want.sum() > 0 and none is None  # the flag fills the field, never the arity
    np.testing.assert_array_equal(np.asarray(tok), want)
    assert int(dropped) == int(d0) == int(want.sum())
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y0))
