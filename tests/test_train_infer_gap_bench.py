"""bench/train_infer_gap.py's statistics (a hand table) and its rows (every row's overrides load)."""

import math

import numpy as np
import pytest

from jax_rl.config import LossConfig, load_config
from tests.bench_module import load_bench

tig = load_bench("train_infer_gap")


def test_gap_stats_hand_table():
    # 4 loss tokens with log(pi/mu) = 0, ln 3, -ln 3, 0.5 (mask [1/2, 2]); one prompt token, one pad
    logp = np.asarray([[0.0, -1.0, -1.0 + math.log(3), -2.0, -2.0 - math.log(3), -0.5, 0.0]], np.float32)
    behav = np.asarray([[0.0, 0.0, -1.0, -2.0, -2.0, -1.0, 0.0]], np.float32)
    mask = np.asarray([[False, False, True, True, True, True, False]])
    s = tig.gap_stats(logp, behav, mask, LossConfig())
    lr = np.asarray([math.log(3), 0.0, -math.log(3), 0.5])
    assert s["loss_tokens"] == 4
    assert s["abs_dlogp_mean"] == pytest.approx(np.mean(np.abs(lr)), rel=1e-5)
    assert s["R"] == pytest.approx(0.5)  # ln 3 > ln 2 and -ln 3 < -ln 2 are masked
    assert s["above_high_frac"] == pytest.approx(0.25) and s["below_low_frac"] == pytest.approx(0.25)
    assert s["ratio_max"] == pytest.approx(3.0, rel=1e-5) and s["ratio_min"] == pytest.approx(1 / 3, rel=1e-5)
    assert s["ratio_mean"] == pytest.approx(np.mean(np.exp(lr)), rel=1e-5)
    assert s["kl_k3"] == pytest.approx(np.mean(np.exp(lr) - 1 - lr), rel=1e-5)


@pytest.mark.parametrize("name,config,overrides", tig.ROWS, ids=[r[0] for r in tig.ROWS])
def test_rows_are_valid_configs(name, config, overrides):
    load_config(tig.ROOT / config, overrides)
