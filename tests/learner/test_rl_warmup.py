"""``optim.warmup_steps`` counts from the first RL update after SFT (SFT has its own AdamW)."""

from __future__ import annotations

import jax
import numpy as np

from jax_rl.learner.learner import Learner
from jax_rl.sharding import make_mesh

from ._util import host, init_params, make_batch, make_cfg, max_abs_diff


def test_rl_lr_warms_up_from_zero_after_sft():
    cfg = make_cfg("ppo", optim={"lr": 1e-3, "warmup_steps": 4}, sft={"lr": 1e-3})
    lrn = Learner(cfg, mesh=make_mesh(devices=jax.devices()[:1]), init_params=init_params(cfg))
    b = make_batch(0, B=8, T=16)
    sft = {k: b[k] for k in ("tokens", "attention_mask", "loss_mask")}
    for _ in range(3):
        assert np.isclose(lrn.sft_step(sft)["lr"], 1e-3)
    p_sft = host(lrn.state.params)

    lrs = []
    for i in range(3):
        m = lrn.train_step(make_batch(i, B=8, T=16, version=lrn.version))
        lrs.append(m["lr"])
        if i == 0:  # RL update 0 runs at lr 0: the SFT params are untouched
            assert max_abs_diff(host(lrn.state.params), p_sft) == 0.0
    np.testing.assert_allclose(lrs, [0.0, 2.5e-4, 5e-4], rtol=1e-6)
    assert max_abs_diff(host(lrn.state.params), p_sft) > 0.0
