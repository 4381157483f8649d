"""pi_prox's host-side inputs are decided once (:func:`jax_rl.learner.correction.plan_host_inputs`): the
learner's ``train_step`` and ``loss_and_grads`` hand their jitted programs the same ``prox_logp`` /
``old_logp`` under every correction mode, and the abstract batch of the dry run / ``jax-rl compile``
declares the same fields."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jax_rl.learner.learner as learner_mod
from jax_rl.learner.batch import LearnerBatch
from jax_rl.learner.correction import make_correction, plan_host_inputs
from jax_rl.learner.learner import Learner
from jax_rl.learner.spec import learner_batch_spec
from jax_rl.sharding import make_mesh

from ._util import init_params, make_batch, make_cfg

MEASURE = {"measure_error": True}
DEDICATED = {"route": "dedicated"}

# (loss.correction, old_logits section, the batch carries old_logp, the field the jitted step gets,
#  where its values come from: the batch's old_logp ("given") or the learner's snapshot store ("store"))
CASES = [
    ("ppo", {}, True, None, None),
    ("decoupled", {}, False, None, None),
    ("linear_prox", {}, True, None, None),
    ("ppo_ewma", {}, False, None, None),
    ("decoupled", MEASURE, False, "old_logp", "store"),
    ("linear_prox", MEASURE, True, "old_logp", "given"),
    ("exact", {}, False, "prox_logp", "store"),
    ("exact", {}, True, "prox_logp", "given"),
    ("exact", DEDICATED, True, "prox_logp", "given"),
]
# each mode compiles its own train and grads programs (~30-40 s on a loaded 2-core host): the
# modes whose jitted step reads neither field, beyond ppo, and the second measure_error row run as slow
SLOW = {1, 2, 3, 5}


def _learner(correction, old_logits):
    cfg = make_cfg(correction, old_logits=dict(old_logits), **{"async": {"max_staleness": 2}},
                   optim={"ppo_epochs": 1, "minibatches": 1})
    return Learner(cfg, mesh=make_mesh(devices=jax.devices()[:1]), init_params=init_params(cfg))


class _Recorder:
    """Stands in for ``LearnerBatch`` in :mod:`jax_rl.learner.learner`: records every dict the learner turns
    into the batch of a jitted program."""

    def __init__(self):
        self.seen: list[dict] = []

    def from_dict(self, d):
        self.seen.append(dict(d))
        return LearnerBatch.from_dict(d)


def _host(x, B):
    return np.asarray(x).reshape(B, -1)


@pytest.mark.parametrize("correction,old_logits,given,field,source", [
    pytest.param(*c, id=f"{c[0]}-{'-'.join(c[1]) or 'default'}-{'given' if c[2] else 'none'}",
                 marks=[pytest.mark.slow] if i in SLOW else []) for i, c in enumerate(CASES)])
def test_train_step_and_loss_and_grads_see_the_same_prox_inputs(monkeypatch, correction, old_logits, given, field,
                                                                  source):
    lrn = _learner(correction, old_logits)
    batch = make_batch(7, B=8, T=16)
    B, lm = 8, batch["loss_mask"]
    if given:
        batch["old_logp"] = np.where(lm, batch["behav_logp"] - 0.25, 0.0).astype(np.float32)
    store_logp = lrn.logprobs(batch)  # version 0: what the snapshot store holds, the params both calls start from
    rec = _Recorder()
    monkeypatch.setattr(learner_mod, "LearnerBatch", rec)
    loss, _, _ = lrn.loss_and_grads(batch)  # no state change: both see version 0
    metrics = lrn.train_step(batch)
    grads_in, train_in = rec.seen
    for k in ("prox_logp", "old_logp"):
        assert (k in grads_in) == (k in train_in) == (k == field), k
    if field is not None:
        a, b = _host(grads_in[field], B), _host(train_in[field], B)
        np.testing.assert_array_equal(a, b)
        want = batch["old_logp"] if source == "given" else store_logp
        np.testing.assert_allclose(a[lm], want[lm], rtol=0, atol=1e-6)
        assert not np.allclose(a[lm], batch["behav_logp"][lm], atol=1e-3)  # not the behaviour log-probs
    # the same inputs give the same loss at the same params (one update per step)
    assert metrics["loss"] == pytest.approx(loss, rel=1e-5, abs=1e-7)
    # the abstract batch the dry run and jax-rl compile lower declares the same fields
    spec = learner_batch_spec(lrn.strategy, lrn.routing, lrn.model_config, (1, 1, 8, 16), None)
    assert (spec.prox_logp is not None, spec.old_logp is not None) == (field == "prox_logp", field == "old_logp")


def test_exact_without_old_logp_or_store_is_refused_by_both():
    lrn = _learner("exact", DEDICATED)
    batch = make_batch(7, B=8, T=16)
    for call in (lrn.loss_and_grads, lrn.train_step):
        with pytest.raises(ValueError, match="no old_logp"):
            call(batch)
    assert lrn.version == 0


@pytest.mark.parametrize("correction,old_logits,field", [(c, o, f) for c, o, _, f, _ in CASES])
def test_plan_host_inputs_table(correction, old_logits, field):
    cfg = make_cfg(correction, old_logits=dict(old_logits), **{"async": {"max_staleness": 2}})
    s = make_correction(cfg)
    assert plan_host_inputs(s, given=True, store=False).field == field
    assert not plan_host_inputs(s, given=True, store=True).score  # a given old_logp is used as is
    if field is not None:
        assert plan_host_inputs(s, given=False, store=True).score
    else:
        assert not plan_host_inputs(s, given=False, store=False).score
