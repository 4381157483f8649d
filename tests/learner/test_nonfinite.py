"""The finite-update guard (through ``Learner.sft_step`` / ``Learner.train_step``): an update
whose loss and gradient are finite but whose new params are not is skipped (params, EWMA params
kept), and ``optim.max_skipped_steps`` all-skipped steps in a row raise NonFiniteTrainingError."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jax_rl.learner.learner import Learner, NonFiniteTrainingError
from jax_rl.sharding import make_mesh

from ._util import host, init_params, make_batch, make_cfg, max_abs_diff


def _all_finite(tree) -> bool:
    return all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(tree))


def test_overflowing_update_is_skipped_and_a_streak_stops_the_run():
    # A finite config whose first AdamW step overflows fp32: |lr * (adam_dir + wd * p)| > 3.4e38 on
    # the matrices, while the loss and the gradient (taken at the old params) are finite.
    cfg = make_cfg("ppo_ewma", optim={"lr": 1e38, "weight_decay": 1e3, "max_skipped_steps": 3},
                   sft={"lr": 1e38})
    lrn = Learner(cfg, mesh=make_mesh(devices=jax.devices()[:1]), init_params=init_params(cfg))
    b = make_batch(0, B=8, T=16)
    p0 = host(lrn.state.params)

    m = lrn.sft_step({k: b[k] for k in ("tokens", "attention_mask", "loss_mask")})
    assert m["nonfinite_updates"] == 1 and m["nonfinite_streak"] == 1 and np.isfinite(m["sft_loss"])
    assert max_abs_diff(host(lrn.state.params), p0) == 0.0

    m = lrn.train_step(b)
    assert m["nonfinite_updates"] == 1 and m["nonfinite_streak"] == 2 and np.isfinite(m["loss"])
    assert m["version"] == 1 and m["step"] == 0  # the version is published, no update applied
    assert max_abs_diff(host(lrn.state.params), p0) == 0.0
    assert _all_finite(lrn.state.correction.params) and m["nonfinite_ewma"] == 0

    with pytest.raises(NonFiniteTrainingError, match=r"3 steps in a row .*optim.max_skipped_steps=0") as e:
        lrn.train_step(b)
    assert isinstance(e.value, RuntimeError) and "\n" not in str(e.value)
    assert _all_finite(lrn.state.params) and _all_finite(lrn.state.correction.params)
