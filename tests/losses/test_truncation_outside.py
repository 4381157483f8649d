"""Tokens outside the learner's truncated kept set (top-k / top-p, issue 14 item 7): log pi = -inf
is masked out of the loss and counted, the loss and gradient stay finite (never NaN)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_rl.config import LossConfig
from jax_rl.learner.losses import METRIC_REDUCTIONS, policy_loss, truncation_metrics
from jax_rl.learner.reductions import combine_metrics

F32 = np.float32
LH = math.log(0.5)


def _run(cfg, logp, prox, behav, adv, mask, truncated=True, entropy=None):
    def lf(x):  # the policy group, and the truncation group when truncated (as the train step composes them)
        loss, m, _ = policy_loss(x, prox, behav, adv, mask, cfg, truncated=truncated, entropy=entropy)
        return loss, dict(m, **truncation_metrics(x, prox, mask)) if truncated else m

    (loss, m), g = jax.jit(jax.value_and_grad(lf, has_aux=True))(jnp.asarray(logp))
    return float(loss), np.asarray(g), {k: float(v) for k, v in m.items()}


@pytest.mark.parametrize("keep,Z", [(True, 4.0), (False, 3.0)])
def test_outside_tokens_masked_counted_by_hand(keep, Z):
    # 4 valid tokens, ratio 1, A = +1: each kept token contributes -1/Z.
    # token 1 is outside pi_prox's kept set (prox = -inf): not usable, out of the train-infer
    # statistic, in the denominator iff keep_masked_in_denominator; token 2 is outside
    # pi_theta's only (logp = -inf): out of the policy term, always in the denominator.
    cfg = LossConfig(keep_masked_in_denominator=keep, train_infer_level="token")
    logp = np.full((1, 4), LH, F32)
    prox = logp.copy()
    behav = logp.copy()
    prox[0, 1] = -np.inf
    logp[0, 2] = -np.inf
    adv = np.ones((1, 4), F32)
    mask = np.ones((1, 4), bool)
    loss, g, m = _run(cfg, logp, prox, behav, adv, mask)
    assert loss == pytest.approx(-2.0 / Z, abs=1e-7)
    np.testing.assert_allclose(g, [[-1 / Z, 0.0, 0.0, -1 / Z]], atol=1e-7)
    assert np.all(np.isfinite(g))
    assert m["masked_trunc_outside"] == 2.0 and m["trunc_outside_frac"] == 0.5
    assert m["masked_nonfinite_prox"] == 0.0  # counted as outside, not as non-finite
    assert m["train_infer_retained"] == 0.75  # only pi_prox's outside token is train-infer rejected
    assert all(math.isfinite(v) for v in m.values()), m
    assert m["ratio_max"] == pytest.approx(1.0) and m["kl_drift_k1"] == pytest.approx(0.0, abs=1e-7)
    # the untruncated loss has no such keys and counts the -inf prox as non-finite
    _, _, m0 = _run(cfg, np.where(np.isfinite(logp), logp, LH), prox, behav, adv, mask, truncated=False)
    assert "masked_trunc_outside" not in m0 and m0["masked_nonfinite_prox"] == 1.0


def test_nan_is_not_outside():
    cfg = LossConfig()
    logp = np.full((1, 3), LH, F32)
    prox = logp.copy()
    prox[0, 0] = np.nan
    loss, g, m = _run(cfg, logp, prox, logp, np.ones((1, 3), F32), np.ones((1, 3), bool))
    assert math.isfinite(loss) and m["masked_nonfinite_prox"] == 1.0 and m["masked_trunc_outside"] == 0.0


def test_counts_combine_as_sums():
    parts = [{"masked_trunc_outside": 2.0, "trunc_outside_frac": 0.5, "valid_tokens": 4.0},
             {"masked_trunc_outside": 1.0, "trunc_outside_frac": 0.125, "valid_tokens": 8.0}]
    c = combine_metrics(parts, METRIC_REDUCTIONS)
    assert float(c["masked_trunc_outside"]) == 3.0
    assert float(c["trunc_outside_frac"]) == pytest.approx(3 / 12)


def test_model_loss_and_grads_finite_with_tokens_outside_the_kept_set():
    """Through the model: top_k=200, top_p=0.8 put a part of the random targets outside the kept set; the policy loss
    (with the entropy bonus) and its gradient w.r.t. every param are finite, the outside tokens are
    counted, and they carry no gradient (the loss equals the one with them removed)."""
    from jax_rl.learner.logprobs import HeadOptions, sequence_logprobs
    from jax_rl.models import qwen3 as q

    cfg_m = q.get_preset("tiny_dense")
    model = q.Qwen3ForCausalLM(cfg_m, rngs=nnx.Rngs(0))
    gd, params = nnx.split(model, nnx.Param)
    rng = np.random.default_rng(0)
    B, T = 2, 8
    tokens = jnp.asarray(rng.integers(0, cfg_m.vocab_size, (B, T)), jnp.int32)
    am = jnp.ones((B, T), bool)
    lm = np.zeros((B, T), bool)
    lm[:, 3:] = True
    adv = jnp.asarray(np.where(lm, rng.normal(size=(B, 1)), 0.0), jnp.float32)
    lc = LossConfig(entropy_coef=0.01)

    def logp_ent(p):
        out = sequence_logprobs(nnx.merge(gd, p), tokens, am, temperature=0.7, head=HeadOptions(top_k=200, top_p=0.8),
                                return_entropy=True)
        return out.logp, out.entropy

    lp0, _ = logp_ent(params)
    lp0 = jax.lax.stop_gradient(lp0)
    # mu: the sampler's log-probs; where the learner puts the token outside, mu was finite
    behav = jnp.where(jnp.isfinite(lp0), lp0, math.log(0.3))

    def loss_fn(p, mask):
        lp, ent = logp_ent(p)
        loss, m, _ = policy_loss(lp, lp0, behav, adv, mask, lc, entropy=ent, truncated=True)
        return loss, dict(m, **truncation_metrics(lp, lp0, mask))

    (loss, m), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params, jnp.asarray(lm))
    n_out = int(np.sum(lm & ~np.isfinite(np.asarray(lp0))))
    assert n_out > 0 and n_out < lm.sum()
    assert float(m["masked_trunc_outside"]) == n_out
    assert math.isfinite(float(loss))
    leaves = jax.tree.leaves(grads)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in leaves)
    assert any(float(jnp.max(jnp.abs(x))) > 0 for x in leaves)
    # keep_masked_in_denominator (default): dropping the outside tokens from the advantages gives
    # the same loss and gradient
    adv0 = jnp.where(jnp.isfinite(lp0), adv, 0.0)

    def loss_fn0(p):
        lp, ent = logp_ent(p)
        lp = jnp.where(jnp.isfinite(lp0), lp, math.log(0.3))
        return policy_loss(lp, jnp.where(jnp.isfinite(lp0), lp0, math.log(0.3)), behav, adv0, jnp.asarray(lm), lc,
                           entropy=jnp.where(jnp.isfinite(lp0), ent, 0.0))[0]

    loss0, grads0 = jax.jit(jax.value_and_grad(loss_fn0))(params)
    assert float(loss) == pytest.approx(float(loss0), abs=1e-6)
    for a, b in zip(leaves, jax.tree.leaves(grads0)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
