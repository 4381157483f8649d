"""Configs that cannot learn are refused (issue 63 item 3): ``algo.group_size=1`` with a group-baseline advantage
(every advantage 0: loss 0, grad norm 0 every step) is one line naming both keys, exit 2; a K/V page longer than
the cache on the paged layout is refused; the pool keys set with the contiguous layout (not read) are a warning,
and stay valid."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jax_rl.config import ConfigError, load_config
from jax_rl.learner.advantages import check_group_size, compute_advantages

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("adv", ["grpo", "rloo"])
def test_group_of_one_is_why_it_is_refused(adv):
    """What the refusal guards against: one sample a group gives advantages of exactly 0 whatever the rewards."""
    cfg = load_config(None, [f"algo.advantage={adv}", "algo.group_size=2"])
    out = np.asarray(compute_advantages(cfg.algo, np.array([0.0, 1.0, 0.3]), np.array([0, 1, 2])))
    assert np.all(out == 0.0), out
    cfg.algo.group_size = 1
    with pytest.raises(ValueError, match=f"algo.group_size=1 with algo.advantage={adv}") as e:
        check_group_size(cfg.algo)
    assert "\n" not in str(e.value)
    cfg.algo.group_size = 2
    check_group_size(cfg.algo)  # a group of 2 is fine


def test_cli_refuses_group_of_one_in_one_line():
    r = subprocess.run([sys.executable, "-m", "jax_rl.cli", "train", "tiny_cpu", "--dry-run", "algo.group_size=1"],
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"},
                       capture_output=True, text=True, timeout=300)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr[-2000:]
    assert err == ["jax-rl: config error: algo.group_size=1 with algo.advantage=grpo: the advantage is each reward "
                   "minus its group's mean, 0 with one sample a group, so RL would learn nothing; set "
                   "algo.group_size >= 2"], err


def test_page_over_the_cache_is_refused_on_pages():
    with pytest.raises(ConfigError, match=r"rollout.kv_page_size=1000 > rollout.max_cache_len=128"):
        load_config(None, ["rollout.kv_layout=paged", "rollout.max_cache_len=128", "rollout.kv_page_size=1000"])
    load_config(None, ["rollout.kv_layout=paged", "rollout.max_cache_len=128", "rollout.kv_page_size=128"])


def test_pool_keys_with_contiguous_warn_once_and_stay_valid(caplog):
    with caplog.at_level(logging.WARNING, logger="jax_rl.config"):
        for _ in range(2):
            cfg = load_config(None, ["rollout.kv_layout=contiguous", "rollout.kv_pages=41", "rollout.kv_page_size=8"])
    assert cfg.rollout.kv_pages == 41
    msgs = [r.getMessage() for r in caplog.records if "kv_pages=41" in r.getMessage()]
    assert len(msgs) == 1 and "rollout.kv_page_size=8" in msgs[0] and "not read" in msgs[0], msgs
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jax_rl.config"):
        load_config(None, ["rollout.kv_layout=contiguous"])  # the defaults: nothing said
        load_config(None, ["rollout.kv_layout=paged", "rollout.kv_pages=64"])  # read there: nothing said
    assert not [r for r in caplog.records if "not read" in r.getMessage()]
