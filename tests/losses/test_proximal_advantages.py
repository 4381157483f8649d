"""jax_rl.learner.correction.proximal (linear_prox, EWMA, reset) and jax_rl.learner.advantages (GRPO, RLOO, broadcast)."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jax_rl.learner.advantages import broadcast_advantages, grpo_advantages, rloo_advantages
from jax_rl.config import LossConfig
from jax_rl.learner.correction.proximal import ewma_beta, ewma_reset, ewma_update, loglinear_logp, reset_predicate

HSET = settings(max_examples=25, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.differing_executors, HealthCheck.too_slow])


class ProximalTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_linear_prox_table(self):
        behav = np.array([[-2.0, -2.0, -2.0, -2.0, 0.0, -1.0]], np.float32)
        logp = np.array([[-1.0, -1.0, -1.0, -1.0, np.nan, -4.0]], np.float32)
        ver = np.array([[10, 9, 8, 6, -1, 11]], np.int32)  # g = 10: alpha = 0, 1/2, 2/3, 4/5, -, 0 (future)
        out = np.asarray(self.variant(loglinear_logp)(behav, logp, ver, 10))
        want = [-2.0, -1.5, -2 + 2 / 3, -2 + 0.8, 0.0, -1.0]
        np.testing.assert_allclose(out[0], want, rtol=1e-6)
        self.assertEqual(out[0, 0], behav[0, 0])  # alpha = 0: exactly mu
        self.assertTrue(np.all(np.isfinite(out)))
        # version -1 with a non-finite behav stays finite; no gradient flows to logp
        behav2 = behav.copy()
        behav2[0, 4] = -np.inf
        out2 = np.asarray(self.variant(loglinear_logp)(behav2, logp, ver, 10))
        self.assertEqual(out2[0, 4], 0.0)
        g = jax.grad(lambda lp: jnp.sum(loglinear_logp(behav, lp, ver, 10)))(jnp.zeros_like(logp))
        np.testing.assert_array_equal(np.asarray(g), 0.0)

    def test_linear_prox_shape_error(self):
        with pytest.raises(ValueError, match="same shape"):
            loglinear_logp(np.zeros((2, 3)), np.zeros((2, 4)), np.zeros((2, 3), np.int32), 0)

    def test_ewma_beta_rules(self):
        for K, c, w, h in [(1, 1 / 3, 0.5, 0.5), (2, 0.5, 2 / 3, 2**-0.5), (4, 2 / 3, 0.8, 2**-0.25),
                           (8, 0.8, 8 / 9, 2**-0.125)]:
            self.assertAlmostEqual(ewma_beta(K), c)
            self.assertAlmostEqual(ewma_beta(K, "window"), w)
            self.assertAlmostEqual(ewma_beta(K, "halflife"), h)
        for rule in ("centre", "window", "halflife"):
            self.assertEqual(ewma_beta(0, rule), 0.0)
        self.assertEqual(ewma_beta(4, override=0.3), 0.3)
        with pytest.raises(ValueError, match="ewma_beta_rule"):
            ewma_beta(2, "bogus")
        with pytest.raises(ValueError, match="ewma_beta"):
            ewma_beta(2, override=1.0)
        with pytest.raises(ValueError, match="max_staleness"):
            ewma_beta(-1)
        # the LossConfig knobs feed it: rule and explicit beta change the value
        a, b = LossConfig(ewma_beta_rule="centre"), LossConfig(ewma_beta_rule="window")
        self.assertNotEqual(ewma_beta(2, a.ewma_beta_rule, a.ewma_beta), ewma_beta(2, b.ewma_beta_rule, b.ewma_beta))
        c = LossConfig(ewma_beta=0.9)
        self.assertEqual(ewma_beta(2, c.ewma_beta_rule, c.ewma_beta), 0.9)

    @chex.variants(with_jit=True, without_jit=True)
    def test_8_ewma_direction_and_bias_correction(self):
        ewma = {"w": jnp.zeros((3,)), "b": {"c": jnp.zeros(())}}
        params = {"w": jnp.ones((3,), jnp.bfloat16), "b": {"c": jnp.ones(())}}
        upd_nb = self.variant(lambda e, p, c: ewma_update(e, p, 0.9, c, bias_correction=False))
        upd_bc = self.variant(lambda e, p, c: ewma_update(e, p, 0.9, c, bias_correction=True))
        e1, c1 = upd_nb(ewma, params, 0.0)
        np.testing.assert_allclose(np.asarray(e1["w"]), 0.1, rtol=1e-6)
        self.assertEqual(e1["w"].dtype, jnp.float32)
        e2, c2 = upd_bc(ewma, params, 0.0)
        np.testing.assert_allclose(np.asarray(e2["w"]), 1.0, rtol=1e-6)
        np.testing.assert_allclose(np.asarray(e2["b"]["c"]), 1.0, rtol=1e-6)
        self.assertEqual(float(c2), 1.0)
        # bias-corrected EWMA == weighted average of the history with weights beta^age
        e, c = ewma, 0.0
        xs = [1.0, 3.0, -2.0, 5.0]
        for x in xs:
            e, c = upd_bc(e, {"w": jnp.full((3,), x), "b": {"c": jnp.asarray(x)}}, c)
        wts = np.array([0.9**3, 0.9**2, 0.9, 1.0])
        np.testing.assert_allclose(np.asarray(e["w"]), np.dot(wts, xs) / wts.sum(), rtol=1e-5)
        np.testing.assert_allclose(float(c), wts.sum(), rtol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_ewma_reset_and_predicate(self):
        ewma = {"w": jnp.zeros((2,))}
        params = {"w": jnp.full((2,), 7.0)}
        reset = self.variant(lambda e, p, pred, c: ewma_reset(e, p, pred, count=c))
        e, c = reset(ewma, params, True, 5.0)
        np.testing.assert_array_equal(np.asarray(e["w"]), 7.0)
        self.assertEqual(float(c), 1.0)
        e, c = reset(ewma, params, False, 5.0)
        np.testing.assert_array_equal(np.asarray(e["w"]), 0.0)
        self.assertEqual(float(c), 5.0)
        # patience 2, threshold 0.9: R = 0.8, 0.95, 0.8, 0.8 (fire), 0.8, 0.8 (fire)
        pred_fn = self.variant(lambda r, s: reset_predicate(r, 0.9, 2, s))
        streak, fired = jnp.int32(0), []
        for r in [0.8, 0.95, 0.8, 0.8, 0.8, 0.8]:
            p, streak = pred_fn(jnp.float32(r), streak)
            fired.append(bool(p))
        self.assertEqual(fired, [False, False, False, True, False, True])
        p, s = reset_predicate(0.5, 0.9, 1, 0)
        self.assertTrue(bool(p))
        self.assertEqual(int(s), 0)
        # threshold / patience knobs change the decision
        self.assertFalse(bool(reset_predicate(0.5, 0.4, 1, 0)[0]))
        self.assertFalse(bool(reset_predicate(0.5, 0.9, 2, 0)[0]))

    @chex.variants(with_jit=True, without_jit=True)
    def test_reset_cooldown_table(self):
        """``loss.ewma_reset_cooldown``: c steps after a reset fire nothing and do not count R."""
        def run(rs, patience, cooldown):
            fn = self.variant(lambda r, s: reset_predicate(r, 0.9, patience, s, cooldown))
            streak, out = jnp.int32(0), []
            for r in rs:
                p, streak = fn(jnp.float32(r), streak)
                out.append((bool(p), int(streak)))
            return out
        low = [0.5] * 7
        # patience 1, cooldown 2: fire, 2 quiet steps, fire, ...
        self.assertEqual(run(low, 1, 2), [(True, -2), (False, -1), (False, 0), (True, -2), (False, -1), (False, 0),
                                          (True, -2)])
        # without the cool-down every low step fires (the rule before the option)
        self.assertEqual([p for p, _ in run(low, 1, 0)], [True] * 7)
        # R back above tau during the cool-down changes nothing; patience counts from its end
        self.assertEqual(run([0.5, 0.95, 0.5, 0.5, 0.5], 2, 1),
                         [(False, 1), (False, 0), (False, 1), (True, -1), (False, 0)])

    @HSET
    @given(rs=st.lists(st.floats(0.0, 1.0, width=32), min_size=1, max_size=30), patience=st.integers(1, 3),
           cooldown=st.integers(0, 4))
    def test_reset_cooldown_properties(self, rs, patience, cooldown):
        """Cool-down 0 is the rule before the option (streak never negative); with a cool-down c two
        resets are at least c + patience steps apart."""
        def ref(rs):  # the predicate before loss.ewma_reset_cooldown, in Python
            s, out = 0, []
            for r in rs:
                s = s + 1 if np.float32(r) < np.float32(0.9) else 0
                out.append(s >= patience)
                s = 0 if out[-1] else s
            return out
        streak, fired = jnp.int32(0), []
        for r in rs:
            p, streak = reset_predicate(jnp.float32(r), 0.9, patience, streak, cooldown)
            fired.append(bool(p))
            self.assertGreaterEqual(int(streak), -cooldown)
        if cooldown == 0:
            self.assertEqual(fired, ref(rs))
        idx = [i for i, f in enumerate(fired) if f]
        self.assertTrue(all(b - a >= cooldown + patience for a, b in zip(idx, idx[1:])))

    def test_ewma_keeps_sharding(self):
        devs = np.array(jax.devices())
        mesh = jax.sharding.Mesh(devs, ("fsdp",))
        sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
        x = jax.device_put(jnp.arange(16, dtype=jnp.float32), sh)
        y = jax.device_put(jnp.ones(16, jnp.bfloat16), sh)
        e, _ = ewma_update({"x": x}, {"x": y}, 0.5, 1.0)
        self.assertTrue(e["x"].sharding.is_equivalent_to(sh, 1))
        e2, _ = jax.jit(lambda a, b: ewma_update(a, b, 0.5, 1.0))({"x": x}, {"x": y})
        self.assertTrue(e2["x"].sharding.is_equivalent_to(sh, 1))
        r = ewma_reset({"x": x}, {"x": y}, jnp.bool_(True))
        self.assertTrue(r["x"].sharding.is_equivalent_to(sh, 1))


class AdvantagesTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_grpo_table(self):
        r = np.array([1.0, 0.0, 0.3, 0.3, 0.3, 2.0, 4.0], np.float32)
        gid = np.array([42, 42, -7, -7, -7, 1000, 1000])
        a = np.asarray(self.variant(grpo_advantages)(r, gid))
        s = np.std([1.0, 0.0], ddof=1)
        np.testing.assert_allclose(a[:2], [0.5 / (s + 1e-6), -0.5 / (s + 1e-6)], rtol=1e-5)
        np.testing.assert_array_equal(a[2:5], 0.0)  # 5. equal rewards -> exactly 0
        np.testing.assert_allclose(a[5:], [-1 / (np.std([2.0, 4.0], ddof=1) + 1e-6), 1 / (np.sqrt(2) + 1e-6)],
                                   rtol=1e-5)
        a2 = np.asarray(self.variant(lambda r, g: grpo_advantages(r, g, normalize_std=False))(r, gid))
        np.testing.assert_allclose(a2, [0.5, -0.5, 0, 0, 0, -1, 1], atol=1e-7)

    @chex.variants(with_jit=True, without_jit=True)
    def test_rloo_table(self):
        r = np.array([1.0, 0.0, 0.5, 0.2, 0.2, 3.0], np.float32)
        gid = np.array([5, 5, 5, 9, 9, 11])
        a = np.asarray(self.variant(rloo_advantages)(r, gid))
        np.testing.assert_allclose(a[:3], [1 - 0.25, 0 - 0.75, 0.5 - 0.5], atol=1e-6)
        np.testing.assert_array_equal(a[3:], 0.0)  # equal rewards, group of one

    @chex.variants(with_jit=True, without_jit=True)
    @HSET
    @given(rewards=st.lists(st.sampled_from([0.0, 0.25, 1.0, -3.5, 0.1]) | st.floats(-5, 5, width=32),
                            min_size=12, max_size=12),
           gid=st.lists(st.integers(-3, 3), min_size=12, max_size=12))
    def test_5_equal_rewards_and_invariants(self, rewards, gid):
        n = len(rewards)  # fixed shape: no recompiles across examples
        gid = np.asarray(gid)
        r = np.asarray(rewards, np.float32)
        a = np.asarray(self.variant(grpo_advantages)(r, gid))
        b = np.asarray(self.variant(rloo_advantages)(r, gid))
        self.assertTrue(np.all(np.isfinite(a)) and np.all(np.isfinite(b)))
        for g in np.unique(gid):
            sel = gid == g
            np.testing.assert_allclose(a[sel].sum(), 0.0, atol=1e-3)
            np.testing.assert_allclose(b[sel].sum(), 0.0, atol=1e-3)
            if np.all(r[sel] == r[sel][0]):
                np.testing.assert_array_equal(a[sel], 0.0)
                np.testing.assert_array_equal(b[sel], 0.0)
        same = np.asarray(self.variant(grpo_advantages)(np.full(n, 0.7, np.float32), gid))
        np.testing.assert_array_equal(same, 0.0)

    @chex.variants(with_jit=True, without_jit=True)
    def test_broadcast(self):
        mask = np.array([[0, 1, 1], [0, 0, 0], [1, 0, 1]], bool)
        out = np.asarray(self.variant(broadcast_advantages)(np.array([2.0, 3.0, -1.0], np.float32), mask))
        np.testing.assert_array_equal(out, [[0, 2, 2], [0, 0, 0], [-1, 0, -1]])
        with pytest.raises(ValueError, match="adv must be"):
            broadcast_advantages(np.zeros(2), mask)


def test_advantage_registry_dispatches_by_algo_advantage():
    """``compute_advantages`` asks the registry: grpo honours ``advantage_std_normalize``, rloo is the
    leave-one-out baseline, an unregistered name is one line naming ``algo.advantage``."""
    from types import SimpleNamespace

    from jax_rl.learner.advantages import REGISTRY, compute_advantages

    r = jnp.array([1.0, 0.0, 0.0, 3.0])
    g = jnp.array([7, 7, 7, 7])
    algo = SimpleNamespace(advantage="grpo", advantage_std_normalize=False)
    np.testing.assert_allclose(compute_advantages(algo, r, g), r - 1.0)  # centred only: mean 1
    algo.advantage_std_normalize = True
    np.testing.assert_allclose(compute_advantages(algo, r, g), grpo_advantages(r, g))
    algo.advantage = "rloo"
    np.testing.assert_allclose(compute_advantages(algo, r, g), [1 - 1, 0 - 4 / 3, 0 - 4 / 3, 3 - 1 / 3], rtol=1e-6)
    assert set(REGISTRY) == {"grpo", "rloo"}
    algo.advantage = "gae"
    with pytest.raises(ValueError, match="unknown algo.advantage 'gae'"):
        compute_advantages(algo, r, g)
