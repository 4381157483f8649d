"""``loss.ewma_reset=guarded`` through the Learner's jitted step (issue 42): a trigger whose candidate
(the current params) keeps no more tokens than theta_bar leaves theta_bar in place and trains against it."""

from __future__ import annotations

import pytest

from jax_rl.learner.correction import proximal
from jax_rl.learner.learner import Learner

from ._util import host, init_params, make_batch, make_cfg, max_abs_diff


@pytest.mark.slow
def test_guarded_rejects_a_candidate_that_keeps_no_more_tokens():
    cfg = make_cfg("ppo_ewma", loss={"ewma_reset": "guarded"}, **{"async": {"max_staleness": 2}})
    lrn = Learner(cfg, init_params=init_params(cfg))
    m1 = lrn.train_step(make_batch(7, B=8, T=16, version=0))
    assert m1["ewma_reset"] == 0.0 and m1["ewma_reset_rejected"] == 0.0 and m1["ewma_retained"] == 1.0
    e1, p1 = host(lrn.state.correction.params), host(lrn.state.params)
    # behaviour log-probs far from every policy: theta_bar and theta both keep nothing (R = 0): the trigger
    # fires, the candidate is no better, theta_bar stays (the paper's rule would have reset it to theta_1)
    m2 = lrn.train_step(make_batch(8, B=8, T=16, version=1, behav_offset=-10.0))
    assert m2["ewma_retained"] == 0.0 and m2["ewma_retained_candidate"] == 0.0
    assert m2["ewma_reset"] == 0.0 and m2["ewma_reset_rejected"] == 1.0 and m2["ewma_resets"] == 0.0
    W1 = proximal.ewma_update(0.0, 0.0, 0.5, 1.0)[1]  # theta_bar's weight after step 1 (no reset: not back to 1)
    want, _ = proximal.ewma_update(e1, host(lrn.state.params), 0.5, W1)
    assert max_abs_diff(host(lrn.state.correction.params), host(want)) < 1e-6
    assert max_abs_diff(e1, p1) > 0  # theta_bar != theta_1: keeping theta_bar is observable
