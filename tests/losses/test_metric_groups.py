"""The policy loss's metric groups (jax_rl.learner.loss_metrics): every function's keys are fixed (they do not
depend on which optional inputs it was given), each group's keys are the ones METRIC_GROUPS declares, the values
match hand tables, and the train step composes the groups its config enables. With and without jit."""

from __future__ import annotations

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_rl.config import LossConfig
from jax_rl.learner.batch import LearnerBatch
from jax_rl.learner.loss_metrics import _union, fixed
from jax_rl.learner.losses import (
    BatchTerms,
    METRIC_GROUPS,
    STALENESS_MAX_BUCKET,
    PolicyTokens,
    entropy_metrics,
    policy_loss,
    prox_error_metrics,
    staleness_metrics,
    train_infer_factor,
    truncation_metrics,
)
from jax_rl.learner.train_step import group_metrics

F32 = np.float32
INF, NAN = np.inf, np.nan


def _floats(m) -> dict[str, float]:
    return {k: float(v) for k, v in m.items()}


def _assert_group(m, group: str) -> None:
    assert sorted(m) == sorted(METRIC_GROUPS[group])  # jit returns a dict sorted by key
    assert all(jnp.shape(v) == () and jnp.asarray(v).dtype == jnp.float32 for v in m.values())


class MetricGroupsTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_policy_loss_keys_do_not_depend_on_optional_inputs(self):
        """The same keys with no optional input and with every one (turn_ids, denominator, entropy, truncation,
        a precomputed train-infer factor); before the groups, entropy / truncation added keys."""
        rng = np.random.default_rng(0)
        B, T = 2, 5
        mask = rng.random((B, T)) < 0.8
        lp = (rng.normal(size=(B, T)) - 2).astype(F32)
        adv = rng.normal(size=(B, T)).astype(F32)
        tid = np.where(mask, 0, -1).astype(np.int32)
        cfg = LossConfig(dual_clip_c=3.0)

        def bare(logp, prox, behav, adv, mask):
            return policy_loss(logp, prox, behav, adv, mask, cfg)

        def every(logp, prox, behav, adv, mask, tid, ent):
            ti = train_infer_factor(prox, behav, mask, cfg, turn_ids=tid)
            return policy_loss(logp, prox, behav, adv, mask, cfg, turn_ids=tid, entropy=ent, truncated=True,
                               batch=BatchTerms(denominator=jnp.float32(3.0), train_infer=ti))

        _, m0, tok0 = self.variant(bare)(lp, lp - 0.1, lp + 0.1, adv, mask)
        _, m1, tok1 = self.variant(every)(lp, lp - 0.1, lp + 0.1, adv, mask, tid, np.ones((B, T), F32))
        _assert_group(m0, "policy")
        _assert_group(m1, "policy")
        for x in (*tok0, *tok1):
            chex.assert_shape(x, (B, T))
            assert x.dtype == jnp.bool_

    @chex.variants(with_jit=True, without_jit=True)
    def test_staleness_by_hand(self):
        # g = 12; staleness [[0, 1, -, 3, 9], [0, 2, 0, (masked), 12]]: row 0 col 2 has no version, row 1 col 3 is
        # not a loss token (its version 0 would land in bucket 8+ if counted)
        g = 12
        versions = np.array([[12, 11, -1, 9, 3], [12, 10, 12, 0, 0]], np.int32)
        mask = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 1]], bool)
        kept = np.array([[1, 0, 1, 1, 0], [1, 1, 0, 0, 1]], bool)
        clipped = np.array([[0, 0, 1, 0, 1], [1, 0, 0, 1, 0]], bool)
        m = self.variant(staleness_metrics)(versions, np.int32(g), mask, kept, clipped)
        _assert_group(m, "staleness")
        m = _floats(m)
        top = f"staleness/{STALENESS_MAX_BUCKET}+"
        assert m["staleness_tokens"] == 8.0
        assert m["staleness_mean"] == (0 + 1 + 3 + 9 + 0 + 2 + 0 + 12) / 8
        assert m["staleness_max"] == 12.0
        tokens = {0: 3.0, 1: 1.0, 2: 1.0, 3: 1.0}
        for k in range(STALENESS_MAX_BUCKET):
            assert m[f"staleness/{k}/tokens"] == tokens.get(k, 0.0), k
        assert m[f"{top}/tokens"] == 2.0
        assert m["staleness/0/retained"] == pytest.approx(2 / 3) and m["staleness/0/clip_frac"] == pytest.approx(1 / 3)
        assert m["staleness/1/retained"] == 0.0 and m["staleness/2/retained"] == 1.0
        assert m[f"{top}/retained"] == 0.5 and m[f"{top}/clip_frac"] == 0.5
        assert m["staleness/5/retained"] == 1.0 and m["staleness/5/clip_frac"] == 0.0  # an empty bucket

    @chex.variants(with_jit=True, without_jit=True)
    def test_prox_error_by_hand(self):
        prox = np.full((2, 3), math.log(0.5), F32)
        prox[1, 2] = NAN  # not a loss token: never reaches arithmetic
        old = prox + np.array([[0.5, -0.25, NAN], [INF, 0.1, 7.0]], F32)
        mask = np.array([[1, 1, 1], [1, 1, 0]], bool)
        usable = np.array([[1, 1, 1], [1, 0, 0]], bool)  # row 1 col 1: non-finite behav, say
        m = self.variant(prox_error_metrics)(prox, old, mask, usable)
        _assert_group(m, "prox_error")
        m = _floats(m)
        assert m["prox_abs_err_mean"] == pytest.approx((0.5 + 0.25) / 5)  # over the 5 valid tokens
        assert m["prox_abs_err_max"] == pytest.approx(0.5)

    @chex.variants(with_jit=True, without_jit=True)
    def test_entropy_by_hand(self):
        ent = np.array([[1.0, 2.0, NAN], [3.0, INF, 0.5]], F32)
        mask = np.array([[1, 1, 0], [1, 0, 1]], bool)
        m = self.variant(entropy_metrics)(ent, mask)
        _assert_group(m, "entropy")
        assert float(m["entropy_mean"]) == (1.0 + 2.0 + 3.0 + 0.5) / 4

    @chex.variants(with_jit=True, without_jit=True)
    def test_truncation_by_hand(self):
        logp = np.array([[-1.0, -INF, -1.0, NAN], [-1.0, -1.0, -INF, -1.0]], F32)
        prox = np.array([[-INF, -1.0, -1.0, -1.0], [-1.0, -INF, -1.0, -1.0]], F32)
        mask = np.array([[1, 1, 1, 1], [1, 1, 0, 1]], bool)
        m = self.variant(truncation_metrics)(logp, prox, mask)
        _assert_group(m, "truncation")
        # outside: row 0 col 0 (prox), row 0 col 1 (logp), row 1 col 1 (prox); a NaN is not outside, nor a
        # -inf at a padding token
        assert float(m["masked_trunc_outside"]) == 3.0
        assert float(m["trunc_outside_frac"]) == pytest.approx(3 / 7)

    @chex.variants(with_jit=True, without_jit=True)
    def test_groups_on_an_empty_mask_are_finite(self):
        z = np.zeros((2, 3), F32)
        none = np.zeros((2, 3), bool)
        outs = {"staleness": self.variant(staleness_metrics)(np.zeros((2, 3), np.int32), np.int32(1), none, none, none),
                "prox_error": self.variant(prox_error_metrics)(z, z, none, none),
                "entropy": self.variant(entropy_metrics)(z, none),
                "truncation": self.variant(truncation_metrics)(z, z, none)}
        for group, m in outs.items():
            _assert_group(m, group)
            assert all(math.isfinite(v) for v in _floats(m).values()), (group, m)

    def test_groups_are_detached(self):
        """A group's metrics carry no gradient into their float inputs (the train step calls them inside
        ``value_and_grad``)."""
        mask = np.array([[1, 1, 0]], bool)
        x = jnp.asarray([[-1.0, -2.0, -3.0]], jnp.float32)
        grads = [
            jax.grad(lambda e: sum(entropy_metrics(e, mask).values()))(x),
            jax.grad(lambda p: sum(prox_error_metrics(p, x + 1.0, mask, mask).values()))(x),
            jax.grad(lambda lp: sum(truncation_metrics(lp, x, mask).values()))(x),
        ]
        for gr in grads:
            np.testing.assert_array_equal(np.asarray(gr), 0.0)


def test_fixed_refuses_keys_against_the_declaration():
    with pytest.raises(ValueError, match=r"'entropy'.*\['extra'\]"):
        fixed("entropy", {"entropy_mean": jnp.float32(0.0), "extra": jnp.float32(1.0)})
    with pytest.raises(ValueError, match=r"\['entropy_mean'\]"):
        fixed("entropy", {})


def test_a_key_declared_in_two_groups_is_refused():
    from jax_rl.learner.reductions import SUM

    with pytest.raises(ValueError, match=r"'b' declares \['x'\] again"):
        _union({"a": {"x": SUM}, "b": {"x": SUM, "y": SUM}})


@pytest.mark.parametrize("old,ent,truncated", [(False, False, False), (True, False, False), (False, True, True),
                                                (True, True, True)])
def test_train_step_groups_follow_the_config(old, ent, truncated):
    """The train step's groups: staleness always, prox_error with ``old_logp``, entropy with an entropy,
    truncation when the sampler truncates; the keys are the declared groups' and nothing else."""
    B, T = 2, 4
    f = np.zeros((B, T), F32)
    mask = np.ones((B, T), bool)
    x = LearnerBatch(tokens=np.zeros((B, T), np.int32), attention_mask=mask, loss_mask=mask, behav_logp=f,
                     versions=np.zeros((B, T), np.int32), turn_ids=np.zeros((B, T), np.int32), advantages=f,
                     old_logp=f if old else None)
    tok = PolicyTokens(usable=mask, kept=mask, clipped=~mask)
    m = group_metrics(x, f, f, f if ent else None, jnp.int32(1), tok, truncated)
    want = ["staleness"] + ["prox_error"] * old + ["entropy"] * ent + ["truncation"] * truncated
    assert set(m) == {k for g in want for k in METRIC_GROUPS[g]}
