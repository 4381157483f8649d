"""Resume is exact (N steps == N/2 + save/restore + N/2, bit for bit on CPU), restores onto
another mesh shape, and refuses a checkpoint of another correction mode."""

from __future__ import annotations

import pytest

from jax_rl.checkpoint import CheckpointMismatchError
from jax_rl.learner.learner import Learner
from jax_rl.sharding import make_mesh

from ._util import host, init_params, layer_leaf, make_batch, make_cfg, max_abs_diff

pytestmark = pytest.mark.slow

_TIMING = {"step_time_s", "tokens_per_s", "old_logits_s"}


def _state(lrn):
    s = lrn.state
    return host({"params": s.params, "correction": s.correction, "opt": s.opt_state, "version": s.version,
                 "step": s.step})


def test_resume_bit_exact_and_reshard(tmp_path, devices):
    cfg = make_cfg("ppo_ewma", mesh={"data": 2, "fsdp": 4}, **{"async": {"max_staleness": 4}},
                   checkpoint={"max_to_keep": 2})
    batches = [make_batch(30 + i, B=8, T=16, version=max(0, i - 1)) for i in range(4)]
    ck = tmp_path / "ck"

    a = Learner(cfg, init_params=init_params(cfg))
    ma = []
    for i, b in enumerate(batches):
        ma.append(a.train_step(b))
        if i == 1:
            a.checkpoints.save(ck, {"buffer": {"consumed": 16}})
            half = _state(a)
    a.checkpoints.wait()
    assert ma[0]["ewma_beta"] == pytest.approx(4 / 6)

    b = Learner(cfg, init_params=init_params(cfg, seed=1))  # different init: all comes from the checkpoint
    meta = b.checkpoints.restore(ck)
    assert meta["version"] == 2 and meta["runtime"] == {"buffer": {"consumed": 16}}
    assert max_abs_diff(_state(b), half) == 0.0
    mb = [b.train_step(x) for x in batches[2:]]
    assert max_abs_diff(_state(b), _state(a)) == 0.0
    for x, y in zip(ma[2:], mb):
        assert {k: v for k, v in x.items() if k not in _TIMING} == {k: v for k, v in y.items() if k not in _TIMING}

    # restore onto a different mesh shape: same values, the new mesh's shardings
    c = Learner(cfg, mesh=make_mesh(1, 2, 2, 2), init_params=init_params(cfg))
    c.checkpoints.restore(ck, step=2)
    assert max_abs_diff(_state(c), half) == 0.0
    leaf = layer_leaf(c.state.params, "mlp", "gate_proj").get_value()
    assert leaf.sharding.mesh.shape == {"data": 1, "fsdp": 2, "tensor": 2, "expert": 2}
    assert leaf.sharding.spec == layer_leaf(c.param_shardings, "mlp", "gate_proj").get_value().spec

    # another correction mode: a clear refusal
    d = Learner(make_cfg("ppo", mesh={"data": 2, "fsdp": 4}), init_params=init_params(cfg))
    with pytest.raises(CheckpointMismatchError, match="correction"):
        d.checkpoints.restore(ck)
    for x in (a, b, c, d):
        x.close()
