"""scan_layers, remat policies and splash attention (model.scan_layers / remat_policy /
attention). Tiny configs; the TPU compile test needs libtpu (the ``tpu`` / ``test`` extra)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_rl import compile as aot
from jax_rl.learner.logprobs import sequence_logprobs
from jax_rl.models import attention as A
from jax_rl.models.qwen3 import (REMAT_POLICIES, Qwen3ForCausalLM, attend, get_preset, stack_layer_params,
                                 unstack_layer_params)


def _pair(name, **kw):
    cfg = get_preset(name, **kw)
    return (cfg, Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0)),
            Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0), scan_layers=True))


def _batch(cfg, B=2, T=12, lengths=(12, 7)):
    toks = jax.random.randint(jax.random.key(1), (B, T), 0, cfg.vocab_size)
    return toks, jnp.arange(T)[None] < jnp.array(lengths)[:, None]


@pytest.mark.parametrize("name", ["tiny_dense", "tiny_moe"])
def test_scan_layers_same_params_logits_cache_as_unrolled(name):
    cfg, mu, ms = _pair(name)
    assert ms.scan_layers and not mu.scan_layers
    L = cfg.num_hidden_layers
    q = nnx.state(ms)["layers"]["attn"]["q_proj"]
    assert q.shape[0] == L and q.get_metadata()["out_sharding"][0] == "layers"
    # same init (layer i of the stack == layer i unrolled), so the same function
    pu, ps = nnx.to_pure_dict(nnx.state(mu)), nnx.to_pure_dict(nnx.state(ms))
    restacked = stack_layer_params(pu, L)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), restacked, ps))
    assert jax.tree.structure(unstack_layer_params(ps, L)) == jax.tree.structure(pu)
    toks, mask = _batch(cfg)
    fwd = nnx.jit(lambda m, t, k: m(t, attention_mask=k))
    np.testing.assert_array_equal(np.asarray(fwd(mu, toks, mask)), np.asarray(fwd(ms, toks, mask)))
    lc = lambda o: (o.logits, o.cache)  # noqa: E731
    pre = nnx.jit(lambda m, t: lc(m.prefill(t, jnp.array([8, 5]), m.init_cache(2, 16))))
    dec = nnx.jit(lambda m, t, c: lc(m.decode_step(t, c)))
    (lu, cu), (ls, cs) = pre(mu, toks[:, :8]), pre(ms, toks[:, :8])
    np.testing.assert_array_equal(np.asarray(lu), np.asarray(ls))
    (du, cu), (ds, cs) = dec(mu, toks[:, 8], cu), dec(ms, toks[:, 8], cs)
    np.testing.assert_array_equal(np.asarray(du), np.asarray(ds))
    np.testing.assert_array_equal(np.asarray(cu.k), np.asarray(cs.k))
    hs_u = mu.forward(toks, output_hidden_states=True).hidden_states
    hs_s = ms.forward(toks, output_hidden_states=True).hidden_states
    assert len(hs_s) == len(hs_u) == L + 1
    for a, b in zip(hs_u, hs_s):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_mixed_dense_moe_stack_stays_unrolled():
    cfg = get_preset("tiny_moe", decoder_sparse_step=2)
    assert not Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0), scan_layers=True).scan_layers


@pytest.mark.parametrize("policy", ["full", "minimal", "save_dot_except_mlp"])
def test_remat_policies_give_the_unrematerialised_gradient(policy):
    cfg, mu, _ = _pair("tiny_moe")
    ms = Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0), scan_layers=True, remat_policy=policy)
    toks, mask = _batch(cfg)

    def vg(m):
        gd, st = nnx.split(m)
        return jax.jit(jax.value_and_grad(lambda s: jnp.sum(sequence_logprobs(gd, s, toks, mask).logp)))(st)

    (v1, g1), (v2, g2) = vg(mu), vg(ms)
    np.testing.assert_allclose(float(v1), float(v2), rtol=1e-6)
    g1 = stack_layer_params(nnx.to_pure_dict(g1), cfg.num_hidden_layers)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(nnx.to_pure_dict(g2))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("policy", ["none", pytest.param("full", marks=pytest.mark.slow)])
def test_scan_unroll_changes_no_value_only_the_loop(policy):
    """3 layers: unroll 1 (a 3-trip loop), 2 (a loop with a remainder) and full (no loop) give
    the same logits and gradients (to fp32 rounding); only unroll=1 and 2 lower to a while loop."""
    cfg = get_preset("tiny_dense", num_hidden_layers=3)
    toks, mask = _batch(cfg)
    out = {}
    for u in (1, 2, "full"):
        m = Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0), scan_layers=True, scan_unroll=u, remat_policy=policy)
        assert m.scan_unroll == {1: 1, 2: 2, "full": 3}[u]
        gd, st = nnx.split(m)
        f = jax.jit(jax.value_and_grad(lambda s: jnp.sum(sequence_logprobs(gd, s, toks, mask).logp)))
        hlo = f.lower(st).as_text()
        assert ("while" in hlo) == (u != "full"), u
        out[u] = f(st)
    for u in (2, "full"):
        np.testing.assert_allclose(float(out[u][0]), float(out[1][0]), rtol=1e-6)
        for a, b in zip(jax.tree.leaves(out[u][1]), jax.tree.leaves(out[1][1])):
            # fp32 summation order only (XLA fuses the written-out stack differently)
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=5e-6, rtol=1e-5)


def test_resolve_scan_unroll_table():
    from jax_rl.models.qwen3 import resolve_scan_unroll

    assert jax.default_backend() == "cpu"
    table = [("auto", 4, 4), ("full", 4, 4), (True, 4, 4), (False, 4, 1), (1, 4, 1), (3, 4, 3),
             (9, 4, 4), ("auto", 1, 1)]  # a list: as dict keys (True, 4) and (1, 4) collide
    for u, L, want in table:
        assert resolve_scan_unroll(u, L) == want, (u, L)
    for bad in (0, -2, "half"):
        with pytest.raises(ValueError, match="scan_unroll"):
            resolve_scan_unroll(bad, 4)


def test_scan_unroll_config_key():
    from jax_rl.config import ConfigError, ModelConfig, load_config

    assert ModelConfig().scan_unroll == "auto"
    assert ModelConfig(scan_unroll=2).scan_unroll == 2
    for bad in (0, True, "half"):
        with pytest.raises(Exception, match="scan_unroll"):
            ModelConfig(scan_unroll=bad)
    assert load_config(None, ["model.scan_unroll=3"]).model.scan_unroll == 3
    with pytest.raises(ConfigError, match="scan_unroll"):
        load_config(None, ["model.scan_unroll=0"])


def test_bad_remat_policy_and_attention_names():
    cfg = get_preset("tiny_dense")
    assert "save_dot_except_mlp" in REMAT_POLICIES and "full" in REMAT_POLICIES
    with pytest.raises(ValueError, match="remat_policy"):
        Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0), remat_policy="everything")
    with pytest.raises(ValueError, match="attention"):
        Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0), attention="flash")
    assert Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0), attention="auto").attention == "xla"  # CPU


def test_splash_kernel_matches_xla_attention_in_the_pallas_interpreter():
    """Causal + right padding (segment ids), GQA, T not a multiple of the block: forward and
    dq match the XLA path on valid query rows."""
    B, T, N, K, H = 2, 40, 4, 2, 16
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (B, T, N, H))
    k = jax.random.normal(kk, (B, T, K, H))
    v = jax.random.normal(kv, (B, T, K, H))
    valid = jnp.arange(T)[None] < jnp.array([[T], [29]])
    mask = Qwen3ForCausalLM._full_mask(B, T, valid)
    sel = valid[:, :, None, None]

    def loss(fn):
        return lambda a: jnp.sum(jnp.where(sel, fn(a), 0.0) ** 2)

    splash = lambda a: A.splash_attend(a, k, v, valid.astype(jnp.int32), interpret=True)  # noqa: E731
    xla = lambda a: attend(a, k, v, mask)  # noqa: E731
    assert np.abs(np.where(sel, splash(q) - xla(q), 0)).max() < 2e-6
    np.testing.assert_allclose(jax.grad(loss(splash))(q), jax.grad(loss(xla))(q), atol=2e-5)


def test_model_with_splash_attention_matches_xla_on_cpu(monkeypatch):
    monkeypatch.setattr(A, "INTERPRET", True)
    cfg = get_preset("tiny_dense")
    mx = Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0), scan_layers=True)
    ms = Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0), scan_layers=True, attention="splash")
    toks, mask = _batch(cfg)
    a, b = np.asarray(mx(toks, attention_mask=mask)), np.asarray(ms(toks, attention_mask=mask))
    assert np.abs(a - b)[np.asarray(mask)].max() < 1e-5
    la, lb = (m.prefill(toks[:, :8], jnp.array([8, 5]), m.init_cache(2, 16)).logits for m in (mx, ms))
    valid = np.arange(8)[None] < np.array([[8], [5]])
    assert np.abs(np.asarray(la) - np.asarray(lb))[valid].max() < 1e-5


def _tpu_topology(name="v5e:2x2"):
    pytest.importorskip("libtpu", reason="libtpu not installed (pip install -e '.[tpu]')")
    from jax.experimental import topologies

    return topologies.get_topology_desc(platform="tpu", topology_name=name)


def test_splash_scanned_forward_and_grad_compile_for_tpu_v5e_2x2():
    """The real TPU compiler (libtpu, AOT from this CPU host) compiles the scanned, splash,
    remat'd learner-style forward+backward of a tiny config on a 2x2 v5e mesh, and the Mosaic
    kernel is in the compiled program. Compile-time figures only; nothing runs on a TPU."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jax_rl.model_builder import abstract_model

    topo = _tpu_topology()
    mesh = jax.sharding.Mesh(np.array(topo.devices).reshape(1, 4, 1, 1),
                             ("data", "fsdp", "tensor", "expert"))
    cfg = get_preset("tiny_dense", head_dim=128)  # splash wants a lane-sized head_dim
    B, T = 4, 256
    gd, st, sh = abstract_model(cfg, mesh, dtype=jnp.bfloat16, scan_layers=True,
                                remat_policy="full", attention="splash")
    with jax.set_mesh(mesh):
        st_abs = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), st, sh)
        data = NamedSharding(mesh, P(("data", "fsdp"), None))
        toks = jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=data)
        mask = jax.ShapeDtypeStruct((B, T), jnp.bool_, sharding=data)

        def step(s, t, m):
            return jax.value_and_grad(lambda s: jnp.sum(sequence_logprobs(gd, s, t, m).logp))(s)

        # conftest sets jax_default_matmul_precision="highest" (fp32 parity); Mosaic rejects
        # fp32-precision dots of bf16 operands, and a real run uses the default precision
        with jax.default_matmul_precision("default"), aot.no_persistent_cache():
            compiled = jax.jit(step).lower(st_abs, toks, mask).compile()
    out_loss, out_grads = compiled.output_shardings[0], compiled.output_shardings[1]
    assert out_loss is not None and out_grads is not None
    assert "tpu_custom_call" in compiled.as_text()  # the splash kernel, not the XLA fallback
    mem = compiled.memory_analysis()
    assert mem.argument_size_in_bytes > 0 and mem.temp_size_in_bytes >= 0


def test_checkpoint_of_the_other_layer_layout_fails_in_one_line_naming_scan_layers(tmp_path):
    from jax_rl.checkpoint import Checkpointer, CheckpointMismatchError, abstract_like

    cfg, mu, ms = _pair("tiny_dense")
    pu, ps = nnx.to_pure_dict(nnx.state(mu)), nnx.to_pure_dict(nnx.state(ms))
    ck = Checkpointer(tmp_path / "ck", async_save=False)
    unrolled = {"params": {**pu, "layers": {str(i): v for i, v in pu["layers"].items()}}}
    ck.save(1, state=unrolled, metadata={"rl_step": 1})
    ck.wait()
    with pytest.raises(CheckpointMismatchError) as e:
        ck.restore(1, state=abstract_like({"params": ps}))
    msg = str(e.value)
    assert "\n" not in msg and "model.scan_layers=false" in msg and "unrolled" in msg, msg
    back = ck.restore(1, state=abstract_like(unrolled))["state"]  # same layout: restores
    np.testing.assert_array_equal(back["params"]["layers"]["1"]["attn"]["q_proj"],
                                  pu["layers"][1]["attn"]["q_proj"])
    ck.close()


def test_model_kwargs_from_the_model_config_section():
    from jax_rl.config import Config
    from jax_rl.models import MoEOptions, model_kwargs

    m = Config().model
    assert model_kwargs(m) == dict(moe=MoEOptions(dispatch="dense", capacity_factor=None, matmul="auto"),
                                   remat_policy="none", scan_layers=True, scan_unroll="auto",
                                   attention="auto")
    assert model_kwargs(m.model_copy(update={"moe_capacity_factor": 1.25}))["moe"].capacity_factor == 1.25
    assert model_kwargs(m.model_copy(update={"moe_dispatch": "ragged", "moe_matmul": "megablox"}))["moe"] == \
        MoEOptions(dispatch="ragged", matmul="megablox")
    assert model_kwargs(m.model_copy(update={"remat": True}))["remat_policy"] == "full"
    assert model_kwargs(m.model_copy(update={"remat": True, "remat_policy": "minimal"}))[
        "remat_policy"] == "minimal"
