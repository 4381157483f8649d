"""Non-finite floats (``.inf`` / ``.nan`` in YAML, ``inf`` / ``nan`` on the command line) are
config errors everywhere, with one line naming the key; "no limit" is spelled null."""

from __future__ import annotations

import pytest

from jax_rl.config import ConfigError, load_config


@pytest.mark.parametrize(
    "override, names",
    [
        ("optim.lr=.inf", ["'optim.lr'=inf", "finite"]),  # poisoned the params after step 1
        ("loss.entropy_coef=.nan", ["'loss.entropy_coef'=nan", "finite"]),  # every update skipped, exit 0
        ("loss.dual_clip_c=nan", ["'loss.dual_clip_c'", "finite"]),  # Optional[float], string from the CLI
        ("optim.max_grad_norm=.inf", ["'optim.max_grad_norm'=inf", "use null"]),
        ("rollout.episode_timeout_s=.inf", ["'rollout.episode_timeout_s'=inf", "use null"]),
        ("model.hf_overrides={rope_theta: .inf}", ["model.hf_overrides", "rope_theta=inf", "finite"]),
        ("env.calculator.dataset_config={chain_sum: {x: [1, .nan]}}", ["env.calculator.dataset_config",
                                                                         "chain_sum.x[1]=nan"]),
    ],
)
def test_nonfinite_values_rejected_naming_the_key(override, names):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    msg = str(e.value)
    assert "\n" not in msg
    for n in names:
        assert n in msg, (n, msg)


def test_null_means_no_limit():
    cfg = load_config(None, ["optim.max_grad_norm=null", "rollout.episode_timeout_s=null"])
    assert cfg.optim.max_grad_norm is None and cfg.rollout.episode_timeout_s is None
