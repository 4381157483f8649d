"""jax_rl.learner.losses.policy_loss: hand tables, the issue-4 bug-class list, float64 reference.

Every test runs with and without jit (chex.variants). Jitted callables are cached per
(test variant, config, optional-arg pattern) so hypothesis examples do not recompile.
"""

from __future__ import annotations

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jax_rl.config import LossConfig
from jax_rl.learner.losses import (
    BatchTerms,
    METRIC_GROUPS,
    METRIC_REDUCTIONS,
    STALENESS_MAX_BUCKET,
    entropy_metrics,
    loss_denominator,
    policy_loss,
    prox_error_metrics,
    staleness_metrics,
)
from jax_rl.learner.reductions import combine_metrics
from tests.losses._reference import plain_pg_loss, ref_policy_loss

F32 = np.float32
HSET = settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.differing_executors, HealthCheck.too_slow],
    derandomize=True,
)
HSET_SMALL = settings(HSET, max_examples=10)
AGGS = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]

_FNS: dict = {}


def run(tc, cfg, logp, prox, behav, adv, mask, *, turn_ids=None, versions=None, g=None, exact=None,
        denominator=None, entropy=None):
    """(loss, d loss / d logp, metrics) through tc.variant: policy_loss's metrics and, as the train step
    composes them, the metric groups of the optional inputs given (versions + g, exact, entropy).

    The raw function is cached per (config, optional-arg pattern), so jax's jit cache (keyed on
    the function) is shared by all tests and hypothesis examples: one compile per config/shape.
    """
    opt = (turn_ids, versions, g, exact, denominator, entropy)
    key = (cfg.model_dump_json(), tuple(o is None for o in opt))
    if key not in _FNS:

        def f(logp, prox, behav, adv, mask, turn_ids, versions, g, exact, denominator, entropy):
            def lf(x):
                loss, m, tok = policy_loss(x, prox, behav, adv, mask, cfg, turn_ids=turn_ids,
                                           entropy=entropy, batch=BatchTerms(denominator=denominator))
                m = dict(m)
                if versions is not None:
                    m.update(staleness_metrics(versions, g, mask, tok.kept, tok.clipped))
                if exact is not None:
                    m.update(prox_error_metrics(prox, exact, mask, tok.usable))
                if entropy is not None:
                    m.update(entropy_metrics(entropy, mask))
                return loss, m

            (loss, m), grad = jax.value_and_grad(lf, has_aux=True)(logp)
            return loss, grad, m

        _FNS[key] = f
    arr = lambda x: None if x is None else jnp.asarray(x)  # noqa: E731
    loss, grad, m = tc.variant(_FNS[key])(arr(logp), arr(prox), arr(behav), arr(adv), arr(mask), arr(turn_ids),
                                          arr(versions), arr(g), arr(exact), arr(denominator), arr(entropy))
    return float(loss), np.asarray(grad), {k: float(v) for k, v in m.items()}


def make_batch(seed, B=4, T=6, noise=0.3, pad_row=True):
    rng = np.random.default_rng(seed)
    behav = rng.uniform(-3.0, -0.1, (B, T))
    prox = behav + rng.normal(0, noise, (B, T))
    logp = prox + rng.normal(0, noise, (B, T))
    adv = rng.normal(size=(B, T))
    adv[rng.random((B, T)) < 0.1] = 0.0
    mask = rng.random((B, T)) < 0.75
    if pad_row and rng.random() < 0.4:
        mask[rng.integers(B)] = False
    turn_ids = np.where(mask, np.sort(rng.integers(0, 3, (B, T)), axis=1), -1)
    turn_ids[(rng.random((B, T)) < 0.1) & mask] = -1  # a valid token without a turn id
    g = 5
    versions = np.where(mask, g - rng.integers(0, 11, (B, T)), -1)
    return dict(logp=logp.astype(F32), prox=prox.astype(F32), behav=behav.astype(F32),
                adv=adv.astype(F32), mask=mask, turn_ids=turn_ids.astype(np.int32),
                versions=versions.astype(np.int32), g=np.int32(g))


REF_CFGS = [
    # together they cover every mode, level, aggregation, both denominators, dual clip,
    # catastrophic drop, clip-higher, low = 0, seq_sum_norm_len and a tiny max_log_ratio
    LossConfig(clip_eps_high=0.28),
    LossConfig(train_infer_level="sequence", agg="seq_mean_token_mean", keep_masked_in_denominator=False,
               train_infer_high=3.0),
    LossConfig(train_infer_level="turn", agg="seq_mean_token_sum_norm", keep_masked_in_denominator=False,
               dual_clip_c=1.2, train_infer_low=0.0, train_infer_high=1.3, seq_sum_norm_len=4),
    LossConfig(train_infer_mode="truncate", train_infer_level="geometric", agg="seq_mean_token_sum",
               dual_clip_c=1.5, train_infer_low=0.3, train_infer_high=1.5),
    LossConfig(train_infer_mode="truncate", train_infer_level="turn", agg="token_mean", catastrophic_logratio=-0.3,
               keep_masked_in_denominator=False),
    LossConfig(train_infer_mode="none", train_infer_level="sequence", agg="seq_mean_token_mean",
               max_log_ratio=0.25, clip_eps_low=0.1, catastrophic_logratio=-0.2),
]


MB_CFGS = [
    LossConfig(agg=agg, keep_masked_in_denominator=keep, train_infer_level="turn", dual_clip_c=1.5,
               train_infer_high=1.5)
    for agg, keep in [("token_mean", True), ("seq_mean_token_mean", False), ("seq_mean_token_sum", True),
                      ("seq_mean_token_sum_norm", False)]
]


def _cfg(**kw):
    return LossConfig(**kw)


class PolicyLossTest(chex.TestCase):
    # ---------------- hand tables ----------------

    @chex.variants(with_jit=True, without_jit=True)
    def test_clip_table(self):
        # ratios 0.5, 1.0, 1.5 with A = +1 then A = -1; eps 0.2
        logp = np.log(np.array([[0.5, 1.0, 1.5], [0.5, 1.0, 1.5]], F32)).astype(F32)
        zeros = np.zeros((2, 3), F32)
        adv = np.array([[1, 1, 1], [-1, -1, -1]], F32)
        mask = np.ones((2, 3), bool)
        cfg = _cfg(train_infer_mode="none", agg="seq_mean_token_sum")  # Z = 2 sequences
        loss, grad, m = run(self, cfg, logp, zeros, zeros, adv, mask)
        # row 0: [-0.5, -1.0, -1.2]; row 1: [0.8, 1.0, 1.5]
        np.testing.assert_allclose(loss, (-0.5 - 1.0 - 1.2 + 0.8 + 1.0 + 1.5) / 2, rtol=1e-6)
        np.testing.assert_allclose(grad, np.array([[-0.5, -1.0, 0.0], [0.0, 1.0, 1.5]]) / 2, rtol=1e-6)
        # clip_frac = active (zero-gradient) tokens: (A=+1, 1.5) and (A=-1, 0.5);
        # ratio_out_of_band_frac = rho outside [0.8, 1.2] whatever A: the four 0.5 / 1.5 tokens
        self.assertAlmostEqual(m["clip_frac"], 2 / 6, places=6)
        self.assertAlmostEqual(m["clip_active_frac"], 2 / 6, places=6)
        self.assertAlmostEqual(m["ratio_out_of_band_frac"], 4 / 6, places=6)
        self.assertAlmostEqual(m["dual_clip_frac"], 0.0, places=6)
        self.assertAlmostEqual(m["ratio_min"], 0.5, places=6)
        self.assertAlmostEqual(m["ratio_max"], 1.5, places=5)
        cfg = _cfg(train_infer_mode="none", agg="seq_mean_token_sum", dual_clip_c=1.2)
        loss, grad, m = run(self, cfg, logp, zeros, zeros, adv, mask)
        np.testing.assert_allclose(loss, (-0.5 - 1.0 - 1.2 + 0.8 + 1.0 + 1.2) / 2, rtol=1e-6)
        np.testing.assert_allclose(grad, np.array([[-0.5, -1.0, 0.0], [0.0, 1.0, 0.0]]) / 2, rtol=1e-6)
        # dual clip: (A=-1, 1.5 > c) is capped too, so 3 of 6 tokens have zero gradient
        self.assertAlmostEqual(m["dual_clip_frac"], 1 / 6, places=6)
        self.assertAlmostEqual(m["clip_active_frac"], 2 / 6, places=6)
        self.assertAlmostEqual(m["clip_frac"], 3 / 6, places=6)
        self.assertAlmostEqual(m["ratio_out_of_band_frac"], 4 / 6, places=6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_clip_frac_table(self):
        # one row per case: (ratio, A) -> (clip active, dual active, out of band); eps 0.2, c = 3
        table = [  # ratio, A,  active, dual, band
            (0.5, 1.0, 0, 0, 1),   # below the band, A > 0: unclipped, gradient flows
            (0.5, -1.0, 1, 0, 1),  # below the band, A < 0: clipped at 0.8
            (1.1, 1.0, 0, 0, 0),   # inside the band
            (1.1, -1.0, 0, 0, 0),
            (1.5, 1.0, 1, 0, 1),   # above the band, A > 0: clipped at 1.2
            (1.5, -1.0, 0, 0, 1),  # above the band, A < 0, rho < c: unclipped
            (4.0, -1.0, 0, 1, 1),  # A < 0, rho > c: dual clip
            (4.0, 0.0, 0, 0, 1),   # A = 0: nothing is clipped
        ]
        n = len(table)
        logp = np.log(np.array([[r for r, *_ in table]], F32)).astype(F32)
        adv = np.array([[a for _, a, *_ in table]], F32)
        z = np.zeros((1, n), F32)
        cfg = _cfg(train_infer_mode="none", dual_clip_c=3.0)
        _, grad, m = run(self, cfg, logp, z, z, adv, np.ones((1, n), bool))
        act = sum(t[2] for t in table)
        dual = sum(t[3] for t in table)
        self.assertAlmostEqual(m["clip_active_frac"], act / n, places=6)
        self.assertAlmostEqual(m["dual_clip_frac"], dual / n, places=6)
        self.assertAlmostEqual(m["clip_frac"], (act + dual) / n, places=6)
        self.assertAlmostEqual(m["ratio_out_of_band_frac"], sum(t[4] for t in table) / n, places=6)
        zero_grad = np.asarray(grad[0]) == 0.0
        np.testing.assert_array_equal(zero_grad, [bool(t[2] or t[3] or t[1] == 0.0) for t in table])

    @chex.variants(with_jit=True, without_jit=True)
    def test_train_infer_table(self):
        # one row, 3 tokens, ratio 1, A = +1 (token loss -1); pi_prox/mu = [3, 1, 0.25]; band [0.5, 2]
        behav = np.zeros((1, 3), F32)
        prox = np.log(np.array([[3.0, 1.0, 0.25]])).astype(F32)
        logp = prox.copy()
        adv = np.ones((1, 3), F32)
        mask = np.ones((1, 3), bool)
        tid = np.array([[0, 0, 1]], np.int32)
        sq3 = math.sqrt(3.0)
        g = 0.75 ** (1 / 3)
        table = [
            # (mode, level, keep_masked, expected loss, expected retained)
            ("mask", "token", True, -1 / 3, 1 / 3),
            ("mask", "token", False, -1.0, 1 / 3),
            ("truncate", "token", True, -(2 + 1 + 0.5) / 3, 1.0),
            ("mask", "sequence", True, -1.0, 1.0),
            ("truncate", "sequence", True, -0.75, 1.0),
            ("mask", "geometric", True, -1.0, 1.0),
            ("truncate", "geometric", True, -g, 1.0),
            ("mask", "turn", True, -2 / 3, 2 / 3),
            ("mask", "turn", False, -1.0, 2 / 3),
            ("truncate", "turn", True, -(sq3 + sq3 + 0.5) / 3, 1.0),
            ("none", "token", True, -1.0, 1.0),
        ]
        cfgs = [_cfg(train_infer_mode=mo, train_infer_level=lv, keep_masked_in_denominator=kp)
                for mo, lv, kp, _, _ in table]

        def all_cfgs(logp, prox, behav, adv, mask, tid):  # one compile for the whole table
            outs = [policy_loss(logp, prox, behav, adv, mask, c, turn_ids=tid) for c in cfgs]
            return jnp.stack([o[0] for o in outs]), jnp.stack([o[1]["train_infer_retained"] for o in outs])

        losses, rets = self.variant(all_cfgs)(logp, prox, behav, adv, mask, tid)
        for (mode, level, keep, want, ret), loss, r in zip(table, np.asarray(losses), np.asarray(rets)):
            np.testing.assert_allclose(loss, want, rtol=1e-5, err_msg=f"{mode}/{level}/{keep}")
            np.testing.assert_allclose(r, ret, rtol=1e-6, err_msg=f"{mode}/{level}")
        # catastrophic: log 0.25 = -1.386 < -1 drops the row
        cfg = _cfg(train_infer_mode="none", catastrophic_logratio=-1.0)
        loss, grad, m = run(self, cfg, logp, prox, behav, adv, mask)
        self.assertEqual(loss, 0.0)
        self.assertEqual(m["train_infer_retained"], 0.0)
        self.assertEqual(m["train_infer_catastrophic_frac"], 1.0)
        np.testing.assert_array_equal(grad, 0.0)
        # k1/k3 of train-infer (prox vs mu) and drift (theta vs prox)
        cfg = _cfg(train_infer_mode="none")
        loss, grad, m = run(self, cfg, logp + F32(0.1), prox, behav, adv, mask)
        lr = np.log([3.0, 1.0, 0.25])
        np.testing.assert_allclose(m["kl_train_infer_k1"], np.mean(-lr), rtol=1e-5)
        np.testing.assert_allclose(m["kl_train_infer_k3"], np.mean(np.exp(lr) - 1 - lr), rtol=1e-5)
        np.testing.assert_allclose(m["kl_drift_k1"], -0.1, rtol=1e-4)
        np.testing.assert_allclose(m["kl_drift_k3"], math.exp(0.1) - 1.1, rtol=1e-3)
        w = np.array([3.0, 1.0, 0.25])
        np.testing.assert_allclose(m["is_weight_mean"], w.mean(), rtol=1e-5)
        np.testing.assert_allclose(m["is_weight_max"], 3.0, rtol=1e-5)
        np.testing.assert_allclose(m["ess_frac"], w.mean() ** 2 / np.mean(w**2), rtol=1e-5)

    @chex.variants(with_jit=True, without_jit=True)
    def test_staleness_and_prox_error_metrics(self):
        mask = np.array([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], bool)
        versions = np.array([[10, 9, 9, 1, -1], [10, 10, 8, -1, 0]], np.int32)  # g = 10
        z = np.zeros((2, 5), F32)
        prox = z.copy()
        prox[0, 1] = np.log(3.0)  # out of band -> masked
        logp = prox.copy()
        logp[1, 0] = np.log(1.5)  # clipped (ratio 1.5 > 1.2)
        exact = prox + F32(0.5)
        exact[1, 1] = -np.inf  # non-finite exact: ignored
        cfg = _cfg()
        _, _, m = run(self, cfg, logp, prox, z, np.ones((2, 5), F32), mask, versions=versions,
                      g=np.int32(10), exact=exact)
        self.assertEqual(m["staleness_tokens"], 8.0)  # the valid version -1 token is excluded
        self.assertEqual(m["staleness/0/tokens"], 3.0)
        self.assertEqual(m["staleness/1/tokens"], 2.0)
        self.assertEqual(m["staleness/2/tokens"], 1.0)
        self.assertEqual(m[f"staleness/{STALENESS_MAX_BUCKET}+/tokens"], 2.0)  # 9 and 10
        self.assertEqual(m["staleness/1/retained"], 0.5)
        self.assertAlmostEqual(m["staleness/0/clip_frac"], 1 / 3, places=6)
        self.assertEqual(m["staleness/3/retained"], 1.0)  # empty bucket reports 1
        self.assertEqual(m["staleness_max"], 10.0)
        self.assertAlmostEqual(m["staleness_mean"], (0 + 1 + 1 + 9 + 0 + 0 + 2 + 10) / 8, places=5)
        self.assertAlmostEqual(m["prox_abs_err_mean"], 0.5 * 8 / 9, places=6)
        self.assertAlmostEqual(m["prox_abs_err_max"], 0.5, places=6)
        keys = set(m)
        _, _, m2 = run(self, cfg, logp, prox, z, np.ones((2, 5), F32), mask)
        self.assertFalse(any(k.startswith("staleness") or k.startswith("prox_abs") for k in m2))
        self.assertTrue(set(m2) < keys)

    # ---------------- 1. padding row ----------------

    @chex.variants(with_jit=True, without_jit=True)
    def test_1_padding_row(self):
        d = make_batch(1, B=4, T=8, pad_row=False, noise=0.4)
        d["mask"][:, 0] = True
        d["mask"][2] = False
        keep_rows = [0, 1, 3]
        for k in ("logp", "prox", "behav", "adv"):
            d[k][2] = np.nan
        d["turn_ids"][2] = 99
        for cfg in MB_CFGS:
            loss, grad, m = run(self, cfg, d["logp"], d["prox"], d["behav"], d["adv"], d["mask"],
                                turn_ids=d["turn_ids"])
            self.assertTrue(np.isfinite(loss) and np.all(np.isfinite(grad)), cfg.agg)
            np.testing.assert_array_equal(grad[2], 0.0)
            sub = {k: v[keep_rows] for k, v in d.items() if isinstance(v, np.ndarray) and v.ndim == 2}
            want, want_g, _ = ref_policy_loss(sub["logp"], sub["prox"], sub["behav"], sub["adv"], sub["mask"], cfg,
                                              turn_ids=sub["turn_ids"])
            np.testing.assert_allclose(loss, want, rtol=2e-5, atol=1e-6, err_msg=cfg.agg)
            np.testing.assert_allclose(grad[keep_rows], want_g, rtol=2e-5, atol=1e-6)
            if cfg.agg != "token_mean":
                self.assertEqual(m["denominator"], float(loss_denominator(sub["mask"], cfg, prox_logp=sub["prox"],
                                                                          behav_logp=sub["behav"],
                                                                          turn_ids=sub["turn_ids"])))
                self.assertLessEqual(m["denominator"], 3.0)  # the padding row is not a sequence
            self.assertEqual(m["valid_tokens"], float(sub["mask"].sum()))

    # ---------------- 2. -inf / NaN behav ----------------

    @chex.variants(with_jit=True, without_jit=True)
    def test_2_nonfinite_behav(self):
        d = make_batch(2, B=2, T=6, pad_row=False, noise=0.05)
        d["mask"][:] = True
        d["mask"][0, 3] = False
        for keep in (True, False):
            cfg = _cfg(keep_masked_in_denominator=keep, train_infer_level="geometric")
            base = run(self, cfg, d["logp"], d["prox"], d["behav"], d["adv"], d["mask"])
            # masked position: bit-identical loss and gradients
            behav = d["behav"].copy()
            behav[0, 3] = -np.inf
            out = run(self, cfg, d["logp"], d["prox"], behav, d["adv"], d["mask"])
            self.assertEqual(np.float32(out[0]).tobytes(), np.float32(base[0]).tobytes())
            self.assertEqual(out[1].tobytes(), base[1].tobytes())
            self.assertEqual(out[2], base[2])
            for bad in (-np.inf, np.nan, np.inf):
                behav = d["behav"].copy()
                behav[1, 2] = bad
                loss, grad, m = run(self, cfg, d["logp"], d["prox"], behav, d["adv"], d["mask"])
                self.assertTrue(np.isfinite(loss) and np.all(np.isfinite(grad)))
                self.assertEqual(m["masked_nonfinite_behav"], 1.0)
                self.assertEqual(grad[1, 2], 0.0)
                self.assertAlmostEqual(m["train_infer_retained"], 10 / 11, places=6)
                # equals: token kept in the denominator with no contribution (AReaL), or removed (ROLL)
                adv, mask = d["adv"].copy(), d["mask"].copy()
                if keep:
                    adv[1, 2] = 0.0
                else:
                    mask[1, 2] = False
                # geometric level: the bad token also leaves the row's mean
                ref = ref_policy_loss(d["logp"], d["prox"], behav, adv, mask, cfg)[0]
                np.testing.assert_allclose(loss, ref, rtol=1e-5, atol=1e-7)
        # a non-finite prox_logp at a valid token is masked and counted as well
        prox = d["prox"].copy()
        prox[1, 1] = np.nan
        loss, grad, m = run(self, _cfg(), d["logp"], prox, d["behav"], d["adv"], d["mask"])
        self.assertTrue(np.isfinite(loss))
        self.assertEqual(m["masked_nonfinite_prox"], 1.0)
        self.assertEqual(grad[1, 1], 0.0)

    # ---------------- 3. lengths 2 and 8, microbatches ----------------

    @chex.variants(with_jit=True, without_jit=True)
    def test_3_lengths_and_microbatches(self):
        T = 8
        mask = np.zeros((2, T), bool)
        mask[0, :2] = True
        mask[1, :] = True
        lp = np.full((2, T), -1.3, F32)
        adv = np.ones((2, T), F32)
        tid = np.zeros((2, T), np.int32)
        hand = {  # agg: (loss, grad of a row-0 token, grad of a row-1 token)
            "token_mean": (-1.0, -0.1, -0.1),
            "seq_mean_token_mean": (-1.0, -0.25, -0.0625),
            "seq_mean_token_sum": (-5.0, -0.5, -0.5),
            "seq_mean_token_sum_norm": (-10 / 16, -1 / 16, -1 / 16),
        }
        rnd = make_batch(3, B=2, T=T, pad_row=False, noise=0.4)
        full = dict(logp=np.concatenate([lp, rnd["logp"]]), prox=np.concatenate([lp, rnd["prox"]]),
                    behav=np.concatenate([lp, rnd["behav"]]), adv=np.concatenate([adv, rnd["adv"]]),
                    mask=np.concatenate([mask, rnd["mask"]]), turn_ids=np.concatenate([tid, rnd["turn_ids"]]))
        for cfg in MB_CFGS:
            want, g0, g1 = hand[cfg.agg]
            Zh = loss_denominator(mask, cfg, prox_logp=lp, behav_logp=lp, turn_ids=tid)
            loss, grad, _ = run(self, cfg, lp, lp, lp, adv, mask, turn_ids=tid, denominator=Zh)
            np.testing.assert_allclose(loss, want, rtol=1e-6, err_msg=cfg.agg)
            np.testing.assert_allclose(grad[0, :2], g0, rtol=1e-6)
            np.testing.assert_allclose(grad[1], g1, rtol=1e-6)
            np.testing.assert_array_equal(grad[0, 2:], 0.0)
            # split into two microbatches of two rows, each with the global denominator
            f = [full[k] for k in ("logp", "prox", "behav", "adv", "mask")]
            full_l, full_g, full_m = run(self, cfg, *f, turn_ids=full["turn_ids"])
            Z = loss_denominator(full["mask"], cfg, prox_logp=full["prox"], behav_logp=full["behav"],
                                 turn_ids=full["turn_ids"])
            self.assertEqual(float(Z), full_m["denominator"])
            parts = [run(self, cfg, *[x[s] for x in f], turn_ids=full["turn_ids"][s], denominator=Z)
                     for s in (slice(0, 2), slice(2, 4))]
            np.testing.assert_allclose(sum(p[0] for p in parts), full_l, atol=1e-6, rtol=1e-6)
            np.testing.assert_allclose(np.concatenate([p[1] for p in parts]), full_g, atol=1e-6)
            comb = combine_metrics([p[2] for p in parts], METRIC_REDUCTIONS)
            for k, v in full_m.items():
                np.testing.assert_allclose(float(comb[k]), v, rtol=1e-5, atol=1e-6, err_msg=k)

    def test_loss_denominator_requires_logps_for_roll(self):
        cfg = _cfg(keep_masked_in_denominator=False)
        with pytest.raises(ValueError, match="prox_logp and behav_logp"):
            loss_denominator(np.ones((2, 3), bool), cfg)
        self.assertEqual(float(loss_denominator(np.ones((2, 3), bool), _cfg())), 6.0)

    # ---------------- 4. clip boundary gradients ----------------

    @chex.variants(with_jit=True, without_jit=True)
    def test_4_clip_boundary_gradient(self):
        z = np.zeros((1, 1), F32)
        mask = np.ones((1, 1), bool)
        x_hi = F32(0.18)
        r_hi = float(jnp.exp(jnp.float32(x_hi)))  # exactly representable boundary 1 + eps_high
        x_lo = F32(-0.25)
        r_lo = float(jnp.exp(jnp.float32(x_lo)))
        cfg = _cfg(train_infer_mode="none", clip_eps_high=r_hi - 1.0, clip_eps_low=1.0 - r_lo)
        # A = +1 at rho = 1 + eps_high: unclipped branch, d loss / d logp = -rho
        loss, grad, m = run(self, cfg, np.full((1, 1), x_hi), z, z, np.ones((1, 1), F32), mask)
        self.assertEqual(loss, -r_hi)
        self.assertEqual(float(grad[0, 0]), np.float32(-r_hi))
        self.assertEqual(m["clip_frac"], 0.0)
        self.assertEqual(m["clip_active_frac"], 0.0)
        # A = -1 at rho = 1 - eps_low: d loss / d logp = +rho
        loss, grad, m = run(self, cfg, np.full((1, 1), x_lo), z, z, -np.ones((1, 1), F32), mask)
        self.assertEqual(loss, r_lo)
        self.assertEqual(float(grad[0, 0]), np.float32(r_lo))
        self.assertEqual(m["clip_frac"], 0.0)
        # one ulp outside: clipped branch, zero gradient
        out_hi = np.nextafter(x_hi, F32(1))
        loss, grad, m = run(self, cfg, np.full((1, 1), out_hi, F32), z, z, np.ones((1, 1), F32), mask)
        if float(jnp.exp(jnp.float32(out_hi))) > r_hi:
            self.assertEqual(float(grad[0, 0]), 0.0)
            self.assertEqual(m["clip_active_frac"], 1.0)
            self.assertEqual(m["clip_frac"], 1.0)
            self.assertAlmostEqual(loss, -r_hi, places=6)
        # A = +1 below the band / A = -1 above it: never clipped (PPO's sign rule), full gradient
        loss, grad, m = run(self, cfg, np.full((1, 1), -0.5, F32), z, z, np.ones((1, 1), F32), mask)
        np.testing.assert_allclose(grad[0, 0], -math.exp(-0.5), rtol=1e-6)
        self.assertEqual(m["clip_frac"], 0.0)
        self.assertEqual(m["ratio_out_of_band_frac"], 1.0)
        self.assertEqual(m["clip_active_frac"], 0.0)
        # dual clip boundary rho == c exactly: unclipped, gradient +rho
        x_c = F32(0.4)
        r_c = float(jnp.exp(jnp.float32(x_c)))
        cfg = _cfg(train_infer_mode="none", dual_clip_c=r_c)
        loss, grad, m = run(self, cfg, np.full((1, 1), x_c), z, z, -np.ones((1, 1), F32), mask)
        self.assertEqual(float(grad[0, 0]), np.float32(r_c))
        self.assertEqual(m["dual_clip_frac"], 0.0)

    # ---------------- 6. 2000 tokens ----------------

    @chex.variants(with_jit=True, without_jit=True)
    def test_6_long_sequence_levels(self):
        T = 2000
        behav = np.full((1, T), -1.0, F32)
        prox = behav + F32(0.01)
        mask = np.ones((1, T), bool)
        adv = np.ones((1, T), F32)
        loss, grad, m = run(self, _cfg(train_infer_level="sequence"), prox, prox, behav, adv, mask)
        # sum of log ratios ~ 20 > log 2: masked; the weight saturates at exp(max_log_ratio)
        self.assertTrue(np.isfinite(loss) and np.all(np.isfinite(grad)))
        self.assertEqual(m["train_infer_retained"], 0.0)
        self.assertEqual(loss, 0.0)
        self.assertTrue(np.isfinite(m["is_weight_max"]))
        np.testing.assert_allclose(m["is_weight_max"], math.exp(20.0), rtol=1e-3)
        # truncate at sequence level: finite weight = high
        loss, _, m = run(self, _cfg(train_infer_level="sequence", train_infer_mode="truncate"), prox, prox,
                         behav, adv, mask)
        np.testing.assert_allclose(loss, -2.0, rtol=1e-6)
        # geometric: exp(0.01), all kept
        loss, grad, m = run(self, _cfg(train_infer_level="geometric"), prox, prox, behav, adv, mask)
        self.assertEqual(m["train_infer_retained"], 1.0)
        np.testing.assert_allclose(m["is_weight_mean"], math.exp(0.01), rtol=1e-4)
        np.testing.assert_allclose(loss, -1.0, rtol=1e-6)

    # ---------------- 7. dual clip ----------------

    @chex.variants(with_jit=True, without_jit=True)
    def test_7_dual_clip(self):
        z = np.zeros((1, 1), F32)
        loss, grad, m = run(self, _cfg(dual_clip_c=1.5, train_infer_mode="none"), np.full((1, 1), math.log(3), F32),
                            z, z, -np.ones((1, 1), F32), np.ones((1, 1), bool))
        np.testing.assert_allclose(loss, 1.5, rtol=1e-6)
        self.assertEqual(float(grad[0, 0]), 0.0)
        self.assertEqual(m["dual_clip_frac"], 1.0)
        self.assertEqual(m["clip_frac"], 1.0)  # the dual clip is an active clip (zero gradient)
        loss, grad, m = run(self, _cfg(train_infer_mode="none"), np.full((1, 1), math.log(3), F32),
                            z, z, -np.ones((1, 1), F32), np.ones((1, 1), bool))
        np.testing.assert_allclose(loss, 3.0, rtol=1e-6)
        self.assertEqual(m["clip_frac"], 0.0)  # out of band but unclipped (A < 0 above the band)
        self.assertEqual(m["ratio_out_of_band_frac"], 1.0)

    # ---------------- 9. step-0 identity (property) ----------------

    @chex.variants(with_jit=True, without_jit=True)
    @HSET
    @given(seed=st.integers(0, 2**31 - 1), ci=st.integers(0, len(REF_CFGS) - 1))
    def test_9_step0_identity(self, seed, ci):
        cfg = REF_CFGS[ci]
        d = make_batch(seed)
        lp = d["behav"]
        loss, grad, m = run(self, cfg, lp, lp, lp, d["adv"], d["mask"], turn_ids=d["turn_ids"])
        want, want_g = plain_pg_loss(d["adv"], d["mask"], cfg.agg, cfg.seq_sum_norm_len)
        np.testing.assert_allclose(loss, want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(grad, want_g, rtol=1e-5, atol=1e-6)
        if m["valid_tokens"] > 0:
            self.assertEqual(m["ratio_mean"], 1.0)
            self.assertEqual(m["ratio_min"], 1.0)
            self.assertEqual(m["ratio_max"], 1.0)
        self.assertEqual(m["clip_frac"], 0.0)
        self.assertEqual(m["train_infer_retained"], 1.0)
        self.assertEqual(m["kl_drift_k1"], 0.0)
        self.assertEqual(m["kl_train_infer_k1"], 0.0)

    # ---------------- 10. garbage in masked positions (property) ----------------

    @chex.variants(with_jit=True, without_jit=True)
    @HSET_SMALL
    @given(seed=st.integers(0, 2**31 - 1), ci=st.sampled_from([0, 2, 3, 5]),
           garbage=st.lists(st.sampled_from([np.nan, np.inf, -np.inf, 1e30, -7.0]), min_size=5, max_size=5))
    def test_10_garbage_in_masked_positions(self, seed, ci, garbage):
        cfg = REF_CFGS[ci]
        d = make_batch(seed)
        kw = dict(turn_ids=d["turn_ids"], versions=d["versions"], g=d["g"], exact=d["prox"] + F32(0.1),
                  entropy=np.abs(d["adv"]))
        base = run(self, cfg, d["logp"], d["prox"], d["behav"], d["adv"], d["mask"], **kw)
        rng = np.random.default_rng(seed + 1)
        off = ~d["mask"]
        g = {}
        for i, k in enumerate(["logp", "prox", "behav", "adv"]):
            g[k] = np.where(off, np.where(rng.random(off.shape) < 0.5, F32(garbage[i]), rng.normal(0, 50, off.shape)),
                            d[k]).astype(F32)
        ex = np.where(off, F32(garbage[4]), kw["exact"]).astype(F32)
        tid = np.where(off, rng.integers(-5, 100, off.shape), d["turn_ids"]).astype(np.int32)
        ver = np.where(off, rng.integers(-5, 100, off.shape), d["versions"]).astype(np.int32)
        ent = np.where(off, F32(garbage[0]), kw["entropy"]).astype(F32)
        out = run(self, cfg, g["logp"], g["prox"], g["behav"], g["adv"], d["mask"], turn_ids=tid, versions=ver,
                  g=d["g"], exact=ex, entropy=ent)
        self.assertEqual(np.float32(out[0]).tobytes(), np.float32(base[0]).tobytes())
        self.assertEqual(out[1].tobytes(), base[1].tobytes())
        self.assertEqual(out[2], base[2])
        self.assertTrue(np.isfinite(out[0]))

    # ---------------- float64 reference (property) ----------------

    @chex.variants(with_jit=True, without_jit=True)
    @HSET
    @given(seed=st.integers(0, 2**31 - 1), ci=st.integers(0, len(REF_CFGS) - 1))
    def test_reference_float64(self, seed, ci):
        cfg = REF_CFGS[ci]
        d = make_batch(seed, noise=0.35)
        loss, grad, m = run(self, cfg, d["logp"], d["prox"], d["behav"], d["adv"], d["mask"], turn_ids=d["turn_ids"])
        want, want_g, kept = ref_policy_loss(d["logp"], d["prox"], d["behav"], d["adv"], d["mask"], cfg,
                                             turn_ids=d["turn_ids"])
        np.testing.assert_allclose(loss, want, rtol=2e-5, atol=1e-6)
        np.testing.assert_allclose(grad, want_g, rtol=2e-5, atol=1e-6)
        nv = d["mask"].sum()
        np.testing.assert_allclose(m["train_infer_retained"], kept.sum() / nv if nv else 1.0, rtol=1e-6)

    # ---------------- 11. every knob is wired ----------------

    @chex.variants(with_jit=True, without_jit=True)
    def test_11_every_knob_changes_the_loss(self):
        d = make_batch(11, B=4, T=8, noise=0.5, pad_row=False)
        ent = np.abs(d["adv"]) + 0.5
        knobs = {
            "clip_eps_low": [0.2, 0.05],
            "clip_eps_high": [0.2, 0.4],
            "dual_clip_c": [None, 1.1],
            "train_infer_mode": ["mask", "truncate", "none"],
            "train_infer_level": ["token", "sequence", "geometric", "turn"],
            "train_infer_high": [2.0, 1.2],
            "train_infer_low": [None, 0.9],
            "catastrophic_logratio": [None, -0.6],
            "agg": AGGS,
            "keep_masked_in_denominator": [True, False],
            "max_log_ratio": [20.0, 0.2],
            "entropy_coef": [0.0, 0.1],
            "seq_sum_norm_len": [None, 3],
        }
        # knobs that do not act on policy_loss; they are tested in test_proximal.py
        elsewhere = {"correction", "ewma_beta_rule", "ewma_beta", "ewma_bias_correction",
                     "ewma_reset_threshold", "ewma_reset_patience", "ewma_reset_cooldown", "ewma_reset"}
        self.assertEqual(set(LossConfig.model_fields), set(knobs) | elsewhere)
        cfgs, names = [], []
        for knob, values in knobs.items():
            for v in values:
                kw = {"train_infer_level": "turn", "train_infer_high": 1.3} if knob == "train_infer_level" else {}
                if knob == "seq_sum_norm_len":
                    kw["agg"] = "seq_mean_token_sum_norm"
                kw[knob] = v
                cfgs.append(_cfg(**kw))
                names.append(knob)

        def all_losses(logp, prox, behav, adv, mask, tid, ent):  # one compile for every config
            return jnp.stack([policy_loss(logp, prox, behav, adv, mask, c, turn_ids=tid, entropy=ent)[0]
                              for c in cfgs])

        out = np.asarray(self.variant(all_losses)(d["logp"], d["prox"], d["behav"], d["adv"], d["mask"],
                                                  d["turn_ids"], ent))
        for knob, values in knobs.items():
            ls = [float(x) for x, n in zip(out, names) if n == knob]
            self.assertEqual(len(set(ls)), len(values), f"{knob}: {ls}")
        sn = [float(x) for x, n in zip(out, names) if n == "seq_sum_norm_len"]
        np.testing.assert_allclose(sn[1], sn[0] * 8 / 3, rtol=1e-5)

    # ---------------- 12. row permutation ----------------

    @chex.variants(with_jit=True, without_jit=True)
    @HSET_SMALL
    @given(seed=st.integers(0, 2**31 - 1), ci=st.integers(0, len(REF_CFGS) - 1))
    def test_12_row_permutation(self, seed, ci):
        cfg = REF_CFGS[ci]
        d = make_batch(seed)
        perm = np.random.default_rng(seed).permutation(4)
        keys = ["logp", "prox", "behav", "adv", "mask", "turn_ids"]
        a = run(self, cfg, *[d[k] for k in keys[:5]], turn_ids=d["turn_ids"])
        b = run(self, cfg, *[d[k][perm] for k in keys[:5]], turn_ids=d["turn_ids"][perm])
        np.testing.assert_allclose(b[0], a[0], rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(b[1], a[1][perm], rtol=1e-6, atol=1e-8)

    # ---------------- misc ----------------

    def test_errors(self):
        z = np.zeros((2, 3), F32)
        mask = np.ones((2, 3), bool)
        with pytest.raises(ValueError, match="turn_ids"):
            policy_loss(z, z, z, z, mask, _cfg(train_infer_level="turn"))
        with pytest.raises(ValueError, match="advantages"):
            policy_loss(z, z, z, np.zeros((2, 4), F32), mask, _cfg())
        with pytest.raises(ValueError, match="versions"):
            staleness_metrics(np.zeros((2, 4), np.int32), 0, mask, mask, mask)

    def test_config_errors_name_key_value_constraint(self):
        from pydantic import ValidationError

        with pytest.raises(ValidationError, match="dual_clip_c"):
            LossConfig(dual_clip_c=0.5)
        with pytest.raises(ValidationError, match=r"train_infer_low=3.0 must be <= loss.train_infer_high=2.0"):
            LossConfig(train_infer_low=3.0)
        with pytest.raises(ValidationError, match="seq_sum_norm_len"):
            LossConfig(seq_sum_norm_len=0)

    def test_gradient_is_fp32_and_shapes(self):
        lp = jnp.zeros((2, 3), jnp.bfloat16)
        mask = np.ones((2, 3), bool)
        loss, m, tok = policy_loss(lp, lp, lp, lp, mask, _cfg())
        self.assertEqual(loss.dtype, jnp.float32)
        self.assertTrue(all(x.shape == (2, 3) and x.dtype == jnp.bool_ for x in tok))
        self.assertTrue(all(v.shape == () and v.dtype == jnp.float32 for v in m.values()))


# ---------------- declared metric reductions ----------------


def test_a_name_alone_decides_no_reduction():
    """``foo_max`` is not max-combined because of its name: undeclared, it is refused by name; declared
    a mean, it is a weighted mean; declared a max, a max."""
    from jax_rl.learner.reductions import SUM, Reduction

    parts = [{"valid_tokens": 1.0, "foo_max": 4.0}, {"valid_tokens": 3.0, "foo_max": 0.0}]
    with pytest.raises(ValueError, match=r"\['foo_max'\] have no declared reduction"):
        combine_metrics(parts, METRIC_REDUCTIONS)
    as_mean = {"valid_tokens": SUM, "foo_max": Reduction("mean", "valid_tokens")}
    assert float(combine_metrics(parts, as_mean)["foo_max"]) == 1.0  # (1*4 + 3*0) / 4
    as_max = {"valid_tokens": SUM, "foo_max": Reduction("max")}
    assert float(combine_metrics(parts, as_max)["foo_max"]) == 4.0
    with pytest.raises(ValueError, match="weighted by 'count'"):
        combine_metrics(parts, {"valid_tokens": SUM, "foo_max": Reduction("mean", "count")})


def test_every_metric_declares_its_reduction():
    """policy_loss returns exactly the ``policy`` group's keys (all optional inputs given, truncation on), every
    group is in METRIC_REDUCTIONS, and the train step declares every key one of its updates adds."""
    from jax_rl.learner.train_step import STEP_REDUCTIONS

    rng = np.random.default_rng(0)
    B, T = 2, 5
    mask = np.ones((B, T), bool)
    lp = rng.normal(size=(B, T)).astype(np.float32) - 2
    _, m, _ = policy_loss(lp, lp - 0.1, lp + 0.1, np.ones((B, T), np.float32), mask, _cfg(dual_clip_c=3.0),
                          entropy=np.ones((B, T), np.float32), truncated=True)
    assert sorted(m) == sorted(METRIC_GROUPS["policy"])
    assert set(METRIC_REDUCTIONS) == {k for g in METRIC_GROUPS.values() for k in g}
    assert sum(map(len, METRIC_GROUPS.values())) == len(METRIC_REDUCTIONS)  # no key in two groups
    assert {f"staleness/{STALENESS_MAX_BUCKET}+/tokens", "prox_abs_err_max", "entropy_mean",
            "masked_trunc_outside"} <= set(METRIC_REDUCTIONS)
    assert set(METRIC_REDUCTIONS) <= set(STEP_REDUCTIONS)
    assert STEP_REDUCTIONS["nonfinite_updates"].over_updates == "sum"
