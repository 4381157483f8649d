"""``loss.ewma_reset`` (issue 42): the paper's ``current`` rule and the ``guarded`` rule, both as the pure
predicate (:func:`jax_rl.learner.correction.proximal.reset_accept`) and through ``PpoEwma.prox_logp`` (the correction registry)."""

from __future__ import annotations

import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jax_rl.config import Config
from jax_rl.learner.correction import make_correction
from jax_rl.learner.correction.proximal import reset_accept

HSET = settings(max_examples=30, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.differing_executors, HealthCheck.too_slow])
SHAPE = (1, 1, 4, 8)  # [U, m, r, T]


def _cfg(rule: str, threshold: float = 0.9, **loss) -> Config:
    return Config.model_validate({"loss": {"correction": "ppo_ewma", "ewma_reset": rule,
                                           "ewma_reset_threshold": threshold, **loss}})


def _step(strategy, lp_bar, lp_theta, behav, lmask):
    """One ``prox_logp`` with a stand-in forward: the 'params' are the log-probs themselves, so
    theta_bar scores ``lp_bar`` and theta scores ``lp_theta`` on every token."""
    batch = types.SimpleNamespace(tokens=jnp.zeros(SHAPE, jnp.int32), attention_mask=jnp.ones(SHAPE, bool),
                                  behav_logp=behav, loss_mask=lmask, turn_ids=jnp.zeros(SHAPE, jnp.int32))
    cstate = strategy.init_state({"lp": lp_bar})
    prox, new, m = strategy.prox_logp(lambda p, t, a: p["lp"], {"lp": lp_theta}, cstate, batch, jnp.int32(3))
    R = lambda lp: strategy._retained(lp, batch)  # noqa: E731
    return prox, new, m, R(lp_bar), R(lp_theta), R(prox)


_JITTED: dict = {}


def _jitted_step(rule: str, threshold: float, cooldown: int):
    """One compiled step per (rule, threshold, cool-down): hypothesis' examples reuse it."""
    key = (rule, threshold, cooldown)
    if key not in _JITTED:
        strat = make_correction(_cfg(rule, threshold, ewma_reset_cooldown=cooldown))
        _JITTED[key] = jax.jit(lambda a, b, c, d: _step(strat, a, b, c, d))
    return _JITTED[key]


class ResetAcceptTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_table(self):
        f = {r: self.variant(lambda t, a, b, r=r: reset_accept(r, t, a, b)) for r in ("current", "guarded")}
        # trigger, R(theta_bar), R(theta) -> current, guarded
        rows = [(True, 0.80, 0.95, True, True), (True, 0.80, 0.60, True, False), (True, 0.80, 0.80, True, False),
                (False, 0.95, 0.99, False, False), (False, 0.50, 1.00, False, False)]
        for trig, ra, rb, want_c, want_g in rows:
            self.assertEqual(bool(f["current"](jnp.bool_(trig), jnp.float32(ra), jnp.float32(rb))), want_c)
            self.assertEqual(bool(f["guarded"](jnp.bool_(trig), jnp.float32(ra), jnp.float32(rb))), want_g)

    def test_unknown_rule(self):
        with pytest.raises(ValueError, match="loss.ewma_reset='mid'"):
            reset_accept("mid", True, 0.5, 0.6)

    def test_config_refuses_unknown_rule(self):
        with pytest.raises(Exception, match="ewma_reset"):
            _cfg("middle")


class PpoEwmaResetRuleTest(chex.TestCase):
    def _arrays(self, seed, far_bar, far_theta):
        rng = np.random.default_rng(seed)
        behav = jnp.asarray(rng.normal(-2.0, 0.3, SHAPE), jnp.float32)
        lmask = jnp.asarray(rng.random(SHAPE) < 0.8)
        # a token is inside the default mask [1/2, 2] when |log pi_prox - log mu| < log 2 ~ 0.69
        bar = behav + jnp.asarray(np.where(rng.random(SHAPE) < far_bar, 3.0, 0.1), jnp.float32)
        theta = behav + jnp.asarray(np.where(rng.random(SHAPE) < far_theta, 3.0, 0.1), jnp.float32)
        return bar, theta, behav, lmask

    @chex.variants(with_jit=True, without_jit=True)
    def test_hand_cases(self):
        """theta worse than theta_bar: current takes it (R falls), guarded keeps theta_bar; theta
        better: both take it."""
        bar = jnp.full(SHAPE, -2.0).at[..., :2].set(1.0)  # 2 of 8 tokens per row out of the mask: R = 0.75
        worse = jnp.full(SHAPE, -2.0).at[..., :4].set(1.0)  # R = 0.5
        better = jnp.full(SHAPE, -2.0).at[..., :1].set(1.0)  # R = 0.875
        behav, lmask = jnp.full(SHAPE, -2.0), jnp.ones(SHAPE, bool)
        for rule, theta, want_reset, want_R in [("current", worse, 1.0, 0.5), ("guarded", worse, 0.0, 0.75),
                                                ("current", better, 1.0, 0.875), ("guarded", better, 1.0, 0.875)]:
            strat = make_correction(_cfg(rule))
            out = self.variant(lambda a, b, c, d, s=strat: _step(s, a, b, c, d))(bar, theta, behav, lmask)
            _, new, m, r_bar, r_theta, r_prox = out
            self.assertAlmostEqual(float(r_bar), 0.75)
            self.assertEqual(float(m["ewma_reset"]), want_reset, rule)
            self.assertAlmostEqual(float(r_prox), want_R, places=6)
            chex.assert_trees_all_close(new.params["lp"], theta if want_reset else bar)
            self.assertEqual(int(new.resets), int(want_reset))
            self.assertEqual(float(new.count), 1.0)
            self.assertEqual(float(m["ewma_reset_rejected"]), 1.0 - want_reset if rule == "guarded" else 0.0)
            self.assertAlmostEqual(float(m["ewma_retained_candidate"]),
                                   float(r_theta) if rule == "guarded" else float(r_bar), places=6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_no_trigger_is_the_old_step(self):
        """R above the threshold: no candidate is taken; both rules return theta_bar's log-probs bit for bit."""
        bar, theta, behav, lmask = self._arrays(0, 0.0, 0.9)
        for rule in ("current", "guarded"):
            strat = make_correction(_cfg(rule))
            prox, new, m, r_bar, _, _ = self.variant(lambda a, b, c, d, s=strat: _step(s, a, b, c, d))(
                bar, theta, behav, lmask)
            self.assertEqual(float(r_bar), 1.0)
            np.testing.assert_array_equal(np.asarray(prox), np.asarray(bar))
            self.assertEqual(float(m["ewma_reset"]), 0.0)
            self.assertEqual(float(m["ewma_reset_rejected"]), 0.0)
            self.assertEqual(float(m["ewma_retained_candidate"]), 1.0)
            np.testing.assert_array_equal(np.asarray(new.params["lp"]), np.asarray(bar))

    @HSET
    @given(seed=st.integers(0, 2**31 - 1), far_bar=st.floats(0.0, 0.6), far_theta=st.floats(0.0, 0.6),
           threshold=st.sampled_from([0.5, 0.9, 1.0]), cooldown=st.sampled_from([0, 3]))
    def test_guarded_never_hands_a_worse_reference(self, seed, far_bar, far_theta, threshold, cooldown):
        """On every batch, the reference guarded trains against keeps at least as many tokens as
        theta_bar's; it is theta exactly when a trigger found theta strictly better; ``current``
        instead takes theta on every trigger (and is worse whenever theta is)."""
        bar, theta, behav, lmask = self._arrays(seed, far_bar, far_theta)
        out = {rule: _jitted_step(rule, threshold, cooldown)(bar, theta, behav, lmask) for rule in ("current", "guarded")}
        prox, new, m, r_bar, r_theta, r_prox = out["guarded"]
        self.assertGreaterEqual(float(r_prox), float(r_bar))
        trigger = float(r_bar) < threshold
        took = trigger and float(r_theta) > float(r_bar)
        self.assertEqual(bool(m["ewma_reset"]), took)
        np.testing.assert_array_equal(np.asarray(prox), np.asarray(theta if took else bar))
        np.testing.assert_array_equal(np.asarray(new.params["lp"]), np.asarray(theta if took else bar))
        self.assertEqual(int(new.streak), -cooldown if trigger else 0)
        c_prox, _, c_m, _, _, c_r = out["current"]
        self.assertEqual(bool(c_m["ewma_reset"]), trigger)
        np.testing.assert_array_equal(np.asarray(c_prox), np.asarray(theta if trigger else bar))
        if trigger and float(r_theta) < float(r_bar):
            self.assertLess(float(c_r), float(r_bar))

    def test_describe_and_cost(self):
        self.assertIn("ewma_reset=guarded", make_correction(_cfg("guarded")).describe())
        self.assertIn("each triggering step", str(make_correction(_cfg("guarded")).cost))
        self.assertIn("only on a reset", str(make_correction(_cfg("current")).cost))
        self.assertIn("reset off", str(make_correction(_cfg("guarded", 0.0)).cost))
