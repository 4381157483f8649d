"""1 device vs 8 fake devices on three mesh shapes with the tiny MoE: same loss, grads and
updated params; every leaf sharded as the logical-axis rules say."""

from __future__ import annotations

import jax
import pytest
from flax import nnx

from jax_rl.learner.learner import Learner
from jax_rl.sharding import LOGICAL_RULES, logical_to_pspec, make_mesh

from ._util import host, init_params, make_batch, make_cfg, max_abs_diff

pytestmark = pytest.mark.slow


def _expected_spec(learner, path_leaf):
    """PartitionSpec the rules give a param leaf (from its logical names)."""
    names, shape = path_leaf
    return logical_to_pspec(names, LOGICAL_RULES, shape=shape, mesh=learner.mesh)


def _logical(params):
    """Flat {path: (logical names, shape)} of an nnx.State of Params."""
    out = {}
    for path, v in nnx.to_flat_state(params):
        out[path] = (v.get_metadata().get("out_sharding"), v.get_value().shape)
    return out


@pytest.fixture(scope="module")
def reference():
    cfg = make_cfg("ppo", "tiny_moe", B=8, T=16, hf={"num_hidden_layers": 1})
    lrn = Learner(cfg, mesh=make_mesh(devices=jax.devices()[:1]), init_params=init_params(cfg))
    batch = make_batch(1, B=8, T=16)
    loss, grads, _ = lrn.loss_and_grads(batch)
    m = lrn.train_step(batch)
    return cfg, batch, loss, host(grads), m, host(lrn.state.params)


@pytest.mark.parametrize("shape", [(8, 1, 1, 1), (2, 4, 1, 1), (1, 2, 2, 2)])
def test_mesh_equivalence_and_shardings(reference, shape, devices):
    cfg, batch, loss0, grads0, m0, params0 = reference
    mesh = make_mesh(*shape)
    lrn = Learner(cfg, mesh=mesh, init_params=init_params(cfg))
    loss, grads, _ = lrn.loss_and_grads(batch)
    assert abs(loss - loss0) < 1e-5
    assert max_abs_diff(host(grads), grads0) < 1e-5
    m = lrn.train_step(batch)
    assert abs(m["loss"] - m0["loss"]) < 1e-5 and abs(m["grad_norm"] - m0["grad_norm"]) < 1e-5
    assert max_abs_diff(host(lrn.state.params), params0) < 1e-5

    # every param leaf, its Adam moments and the grads are placed by the rules
    logical = _logical(lrn.state.params)
    sharded = 0
    for path, x in nnx.to_flat_state(lrn.state.params):
        want = _expected_spec(lrn, logical[path])
        assert x.get_value().sharding.spec == want, (path, x.get_value().sharding.spec, want)
        assert x.get_value().sharding.mesh.shape == mesh.shape
        sharded += any(s is not None for s in want)
    if shape[0] < 8:
        assert sharded >= 5
    adam = lrn.state.opt_state[1][0]
    for tree in (adam.mu, adam.nu, grads):
        for path, x in nnx.to_flat_state(tree):
            assert x.get_value().sharding.spec == _expected_spec(lrn, logical[path]), path
    for leaf in (lrn.state.version, lrn.state.step, adam.count):
        assert all(s is None for s in leaf.sharding.spec)
