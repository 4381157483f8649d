"""``model.scan_layers`` end to end: one helper derives the learner's and the rollout engines'
model kwargs from the config, both sides build the same layer layout (the learner's params load
into the engine as published), HF import and user-given init params land in that layout, and a
mixed dense/MoE stack stays unrolled."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_rl.checkpoint import saved_layer_layout
from jax_rl.model_builder import layers_stacked, model_kwargs_for, resolve_model_config
from jax_rl.models import qwen3 as q
from tests.learner._util import init_params, make_batch, make_cfg


def _layers(tree) -> dict:
    return nnx.to_pure_dict(tree)["layers"] if isinstance(tree, nnx.State) else tree["layers"]


def _is_stacked(tree) -> bool:
    return not all(str(k).isdigit() for k in _layers(tree))


def test_model_kwargs_for_both_sides_from_one_config():
    cfg = make_cfg("ppo", model={"dtype": "bfloat16", "remat": True, "moe_dispatch": "ragged"})
    lk, rk = model_kwargs_for(cfg, "learner"), model_kwargs_for(cfg, "rollout")
    moe = q.MoEOptions(dispatch="ragged", capacity_factor=None, matmul="ragged_dot")
    assert lk == dict(dtype=jnp.bfloat16, param_dtype=jnp.float32, moe=moe, remat_policy="full",
                      scan_layers=True, scan_unroll="auto", attention="xla")
    # the engine sets its own dtypes (rollout.dtype) and never differentiates
    assert rk == dict(moe=moe, scan_layers=True, scan_unroll="auto", attention="xla")
    off = make_cfg("ppo", model={"scan_layers": False, "attention": "xla"})
    assert model_kwargs_for(off, "learner")["scan_layers"] is False
    assert model_kwargs_for(off, "rollout")["scan_layers"] is False
    with pytest.raises(ValueError, match="role"):
        model_kwargs_for(cfg, "engine")


def test_attention_auto_resolves_by_backend(monkeypatch):
    cfg = make_cfg("ppo")
    assert cfg.model.attention == "auto" and jax.default_backend() == "cpu"
    assert model_kwargs_for(cfg)["attention"] == "xla"
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert model_kwargs_for(cfg)["attention"] == "splash"
    assert model_kwargs_for(cfg)["moe"].matmul == "megablox"
    assert model_kwargs_for(cfg, "rollout")["attention"] == "splash"
    assert model_kwargs_for(make_cfg("ppo", model={"attention": "xla"}))["attention"] == "xla"


def test_a_mixed_dense_moe_stack_stays_unrolled():
    cfg = make_cfg("ppo", "tiny_moe", hf={"decoder_sparse_step": 2})
    mc = resolve_model_config(cfg.model)
    assert len({mc.layer_is_moe(i) for i in range(mc.num_hidden_layers)}) == 2
    assert not layers_stacked(mc, True)
    model = nnx.eval_shape(lambda: q.Qwen3ForCausalLM(mc, rngs=nnx.Rngs(0), **model_kwargs_for(cfg)))
    assert model.scan_layers is False and not _is_stacked(nnx.state(model, nnx.Param))
    assert layers_stacked(resolve_model_config(make_cfg("ppo", "tiny_moe").model), True)


@pytest.mark.parametrize("scan", [True, False])
def test_learner_and_engine_share_the_layout(scan, devices):
    """The learner's params (device and host copies) load into the engine that
    ``build_generator`` builds, for either ``model.scan_layers``; the engine's log-probs of a
    sampled continuation match the learner's forward (fp32 rollout)."""
    from jax_rl.learner.learner import Learner
    from jax_rl.runtime.engines import build_generator

    cfg = make_cfg("ppo", model={"scan_layers": scan}, rollout={"dtype": "float32", "slots": 2})
    lrn = Learner(cfg, init_params=init_params(cfg))
    try:
        params = lrn.get_params()
        assert _is_stacked(params) is scan
        if scan:
            q_proj = _layers(params)["attn"]["q_proj"]
            assert q_proj.shape[0] == lrn.model_config.num_hidden_layers
        gen = build_generator(cfg, lrn.model_config, params, lrn.version, temperature=1.0)
        try:
            eng = gen.engine
            if eng._unstack_layers:  # CPU: a scan_layers engine decodes its own unrolled copy (kv_per_layer)
                assert scan and not _is_stacked(eng.params)
                assert jax.tree.structure(eng.params) == jax.tree.structure(eng._unstacked(params))
            else:
                assert jax.tree.structure(eng.params) == jax.tree.structure(params)
            gen.update_params(lrn.get_params(host=True), 1)  # the Ray path: numpy leaves
            out = gen.generate([[5, 6, 7, 8]], max_new_tokens=4)[0]
        finally:
            gen.stop()
        toks = np.asarray([[5, 6, 7, 8] + list(out.tokens)], np.int32)
        want = lrn.logprobs({"tokens": toks, "attention_mask": np.ones_like(toks, bool)})[0, 4:]
        np.testing.assert_allclose(np.asarray(out.behav_logp), want, atol=2e-5)
    finally:
        lrn.close()


def test_init_params_of_either_layout_land_in_the_learners(devices):
    """User-given params (here unrolled, as ``Qwen3ForCausalLM``'s default builds them) are
    restacked for a scan_layers learner and give the same train step as an unrolled learner."""
    from jax_rl.learner.learner import Learner
    from jax_rl.placement import _match_layer_layout

    on, off = make_cfg("ppo"), make_cfg("ppo", model={"scan_layers": False})
    p0 = init_params(on)
    assert not _is_stacked(p0)
    a, b = Learner(on, init_params=p0), Learner(off, init_params=p0)
    try:
        assert _is_stacked(a.params) and not _is_stacked(b.params)
        np.testing.assert_array_equal(np.asarray(_layers(a.params)["mlp"]["up_proj"][1]),
                                      p0["layers"][1]["mlp"]["up_proj"])
        ma, mb = a.train_step(make_batch(1)), b.train_step(make_batch(1))
        for k in ("loss", "grad_norm", "kl_drift_k1"):
            assert ma[k] == pytest.approx(mb[k], rel=1e-5), k
        # and back: a stacked tree into an unrolled learner
        c = Learner(off, init_params=a.get_params(host=True))
        np.testing.assert_array_equal(np.asarray(_layers(c.params)[1]["mlp"]["up_proj"]),
                                      np.asarray(_layers(a.params)["mlp"]["up_proj"][1]))
        c.close()
    finally:
        a.close()
        b.close()
    ref = {"layers": {"w": np.zeros((2, 3))}}
    with pytest.raises(ValueError, match="layer keys"):
        _match_layer_layout({"layers": {"0": {"w": np.zeros(3)}, "2": {"w": np.zeros(3)}}}, ref)
    with pytest.raises(ValueError, match="2 layers"):
        _match_layer_layout({"layers": {"w": np.zeros((3, 3))}}, {"layers": {"0": {"w": 0}, "1": {"w": 0}}})


def test_hf_checkpoint_import_lands_stacked(tmp_path, devices):
    """``model.checkpoint``: HF's per-layer tensors are stacked for a scan_layers learner, with
    the values of the unrolled import."""
    from jax_rl.models import hf_io
    from jax_rl.runtime.context import _load_hf_params

    mc = q.get_preset("tiny_dense")
    src = q.Qwen3ForCausalLM(mc, rngs=nnx.Rngs(3))
    hf_io.save_pretrained(src, mc, tmp_path / "hf")
    on = make_cfg("ppo", model={"checkpoint": str(tmp_path / "hf")})
    off = make_cfg("ppo", model={"checkpoint": str(tmp_path / "hf"), "scan_layers": False})
    ps, _ = _load_hf_params(on, mc)
    pu, _ = _load_hf_params(off, mc)
    assert _is_stacked(ps) and not _is_stacked(pu)
    restacked = q.stack_layer_params(nnx.to_pure_dict(pu), mc.num_hidden_layers)
    for a, b in zip(jax.tree.leaves(restacked), jax.tree.leaves(nnx.to_pure_dict(ps))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_saved_layer_layout_reads_the_tree_metadata(tmp_path, devices):
    from jax_rl.learner.learner import Learner

    assert saved_layer_layout(tmp_path / "none") is None
    for scan in (False, True):
        cfg = make_cfg("ppo", model={"scan_layers": scan})
        lrn = Learner(cfg, init_params=init_params(cfg))
        d = tmp_path / f"ck_{scan}"
        lrn.checkpoints.save(d)
        lrn.checkpoints.wait()
        lrn.close()
        want = "stacked" if scan else "unrolled (one subtree per layer)"
        assert saved_layer_layout(d) == want and saved_layer_layout(d, 0) == want
        assert saved_layer_layout(d, 7) is None


def test_weight_decay_skips_norms_in_either_layout():
    """A stacked norm weight is [L, H]: still a vector per layer, so not decayed."""
    from jax_rl.learner.train_step import _decay_mask

    mc = q.get_preset("tiny_dense")

    def decayed(scan):
        st = nnx.state(nnx.eval_shape(lambda: q.Qwen3ForCausalLM(mc, rngs=nnx.Rngs(0), scan_layers=scan)), nnx.Param)
        flat = jax.tree_util.tree_flatten_with_path(_decay_mask(nnx.to_pure_dict(st)))[0]
        names = {tuple(str(getattr(k, "key", k)) for k in p if not str(getattr(k, "key", k)).isdigit()): v
                 for p, v in flat}
        return names

    off, on = decayed(False), decayed(True)
    assert on == off
    assert not on[("layers", "input_layernorm", "weight")] and on[("layers", "attn", "q_proj")]
    assert not on[("norm", "weight")] and on[("embed_tokens",)]
