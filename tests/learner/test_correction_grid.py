"""Every ``loss.correction`` x ``loss.keep_masked_in_denominator`` x ``optim.ppo_epochs`` (x
``optim.microbatches``) trains one finite step (issue 39: ``linear_prox`` with
``keep_masked_in_denominator=false`` and one update per step died at its first RL step, because
the kept-token denominator needed a ``prox_logp`` the mode computes only inside the gradient
forward).

The fast tests run ``linear_prox`` (the one mode whose pi_prox comes from the gradient forward
when a step makes one update: the denominator then comes from that forward); the full grid, every
mode, is ``slow`` (a learner compile is 15-40 s on this 2-core host)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from jax_rl.learner.learner import Learner

from ._util import init_params, make_batch, make_cfg

MODES = ["ppo", "decoupled", "linear_prox", "ppo_ewma", "exact"]


def _step(mode: str, keep: bool, epochs: int, micro: int) -> dict:
    cfg = make_cfg(mode, B=8, loss={"keep_masked_in_denominator": keep},
                   optim={"ppo_epochs": epochs, "microbatches": micro})
    lrn = Learner(cfg, init_params=init_params(cfg))
    lrn.train_step(make_batch(2, B=8, T=16))
    # tokens one version stale (so linear_prox's pi_prox is not mu) with behav far from pi: the
    # train-infer mask drops tokens, so the kept set != the valid set
    m = lrn.train_step(make_batch(3, B=8, T=16, behav_offset=2.0))
    assert lrn.version == 2 and np.isfinite(m["loss"]) and np.isfinite(m["grad_norm"]), (mode, keep, epochs, micro)
    if not keep:  # the denominator counts kept tokens only: never more than the valid ones
        assert m["denominator"] <= m["valid_tokens"] + 1e-6
    return m


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ppo", "decoupled", "ppo_ewma", "exact"])
def test_one_update_kept_denominator(mode):
    """Each other mode at the configuration that broke ``linear_prox``."""
    _step(mode, keep=False, epochs=1, micro=1)


def test_linear_prox_one_update_kept_denominator():
    """The smallest config that exposed the crash (``linear_prox``, one update, one microbatch,
    kept-token denominator: ``loss_denominator needs prox_logp ...``) trains, and its denominator
    is the kept set's."""
    a = _step("linear_prox", keep=False, epochs=1, micro=1)
    assert a["denominator"] < a["valid_tokens"]  # the mask dropped tokens: the kept set was used


@pytest.mark.slow
def test_linear_prox_kept_denominator_matches_microbatched():
    """With one update, the kept-token denominator from the gradient forward (no extra forward)
    equals the one the microbatched path gets from its no-grad forward (the params at the step's
    start are the gradient forward's params): same loss and denominator."""
    a = _step("linear_prox", keep=False, epochs=1, micro=1)
    b = _step("linear_prox", keep=False, epochs=1, micro=2)
    assert a["denominator"] == pytest.approx(b["denominator"], abs=1e-6)
    assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
    assert a["denominator"] < a["valid_tokens"]


@pytest.mark.slow
@pytest.mark.parametrize("mode,keep,epochs,micro",
                         [(m, k, e, u) for m, k, e, u in itertools.product(MODES, (True, False), (1, 2), (1, 2))
                          if not (k is False and e == 1 and u == 1)])
def test_grid(mode, keep, epochs, micro):
    _step(mode, keep=keep, epochs=epochs, micro=micro)
