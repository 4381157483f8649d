"""Mesh creation, logical-axis rules and sharded model creation/loading on 8 fake CPUs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jax_rl.models.hf_io import load_pretrained, save_pretrained
from jax_rl.models.qwen3 import Qwen3ForCausalLM, get_preset
from jax_rl.model_builder import create_sharded_model
from jax_rl.sharding import (
    LOGICAL_RULES,
    logical_to_pspec,
    make_mesh,
)


def test_make_mesh_auto_axes_and_wildcard(devices):
    m = make_mesh(data=2, fsdp=-1)
    assert m.axis_names == ("data", "fsdp", "tensor", "expert")
    assert dict(m.shape) == {"data": 2, "fsdp": 4, "tensor": 1, "expert": 1}
    assert all(t == AxisType.Auto for t in m.axis_types)
    with pytest.raises(ValueError):
        make_mesh(data=3, fsdp=-1)
    with pytest.raises(ValueError):
        make_mesh(data=2, fsdp=2, tensor=1, expert=1)
    with pytest.raises(ValueError):
        make_mesh(data=-1, fsdp=-1)


def test_logical_to_pspec_rules_dedup_and_divisibility(devices):
    assert logical_to_pspec(("embed", "q_heads", "head_dim")) == P("fsdp", "tensor", None)
    assert logical_to_pspec(("activation_batch", None)) == P(("data", "fsdp", "expert"), None)
    # the batch goes over expert too where it divides (MaxText): 8 rows on data 2 x expert 4
    ep_mesh = make_mesh(2, 1, 1, 4)
    assert logical_to_pspec(("activation_batch",), shape=(8,), mesh=ep_mesh) == P(("data", "expert"))
    assert logical_to_pspec(("activation_batch",), shape=(6,), mesh=ep_mesh) == P("data")
    # a mesh axis is used at most once
    assert logical_to_pspec(("mlp", "vocab")) == P("tensor", None)
    mesh = make_mesh(1, 2, 4, 1)
    # 2 kv heads cannot split 4 ways -> replicated; embed 64 over fsdp=2 kept
    assert logical_to_pspec(("embed", "kv_heads", "head_dim"), shape=(64, 2, 16),
                            mesh=mesh) == P("fsdp", None, None)
    # size-1 mesh axes are dropped
    assert logical_to_pspec(("expert", "embed", "mlp"), shape=(4, 64, 32),
                            mesh=mesh) == P(None, "fsdp", "tensor")
    with pytest.raises(ValueError, match="no sharding rule"):
        logical_to_pspec(("nonexistent",))
    assert dict(LOGICAL_RULES)["expert"] == "expert"


EXPECTED = {
    # mesh shape -> {param path: spec}
    (8, 1, 1, 1): {"embed": P(None, None), "q": P(None, None, None),
                   "experts": P(None, None, None), "norm": P(None)},
    (1, 2, 2, 2): {"embed": P("tensor", "fsdp"), "q": P("fsdp", "tensor", None),
                   "experts": P("expert", "fsdp", "tensor"), "norm": P(None)},
    (2, 4, 1, 1): {"embed": P(None, "fsdp"), "q": P("fsdp", None, None),
                   "experts": P(None, "fsdp", None), "norm": P(None)},
}


def _specs(m):
    return {"embed": m.embed_tokens[...].sharding, "q": m.layers[0].attn.q_proj[...].sharding,
            "experts": m.layers[1].mlp.gate_proj[...].sharding,
            "norm": m.layers[0].input_layernorm.weight[...].sharding}


@pytest.mark.parametrize("shape", list(EXPECTED))
def test_sharded_model_matches_unsharded(shape, devices, tmp_path):
    cfg = get_preset("tiny_moe")
    ref_model = Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0))
    gd, ref_state = nnx.split(ref_model)
    ids = jax.random.randint(jax.random.key(0), (8, 8), 0, cfg.vocab_size)
    mask = jnp.arange(8)[None] < jnp.array([8, 3, 5, 8, 1, 8, 7, 2])[:, None]

    def fwd(state, ids, mask):
        return nnx.merge(gd, state)(ids, attention_mask=mask)

    ref = np.asarray(jax.jit(fwd)(ref_state, ids, mask))

    mesh = make_mesh(*shape)
    sm = create_sharded_model(cfg, mesh, seed=0)
    for name, sh in _specs(sm).items():
        assert isinstance(sh, NamedSharding) and sh.mesh.shape == mesh.shape
        assert sh.spec == EXPECTED[shape][name], (name, sh.spec)
    # same init values as the unsharded model (jit vs eager sampling: ~1 ulp)
    for a, b in zip(jax.tree.leaves(nnx.state(sm)), jax.tree.leaves(ref_state)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-9)
    with jax.set_mesh(mesh):
        out = jax.jit(fwd)(nnx.state(sm), ids, mask)
    np.testing.assert_allclose(np.asarray(out), ref, atol=1e-5, rtol=0)

    # loading a checkpoint onto the mesh puts every param straight into its sharding
    save_pretrained(ref_model, cfg, tmp_path)
    lm, _ = load_pretrained(tmp_path, mesh=mesh)
    assert {k: v.spec for k, v in _specs(lm).items()} == EXPECTED[shape]
    for a, b in zip(jax.tree.leaves(nnx.state(lm)), jax.tree.leaves(ref_state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert a.sharding.mesh.shape == mesh.shape
