"""Proximal policies that stand in for the missing old logits: the log-linear interpolation and the EWMA.

Pure and jit-able. Formula sources: AReaL ``compute_prox_logp_approximations``
(``prox_logp_method="loglinear"``, A-3PO, arXiv 2512.06547); Hilton, Cobbe & Schulman 2021
(arXiv 2110.00641, ``openai/ppo-ewma`` ``EwmaModel.update/reset``); paper 2605.12070 via
docs/design.md §2.3 EWMA proximal (beta from the staleness window, retained-ratio reset).

Version convention (docs/design.md §3.1 Versions and staleness): the learner holds params of
version g (the last published ones, = ``current_version``) and its update produces g + 1.
Behaviour tokens carry v_t <= g.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["RESET_RULES", "loglinear_logp", "ewma_beta", "ewma_update", "ewma_reset", "reset_predicate",
           "reset_accept"]

# ``loss.ewma_reset``: what a triggered reset does (:func:`reset_accept`).
RESET_RULES = ("current", "guarded")


def loglinear_logp(behav_logp, logp, versions, current_version) -> jax.Array:
    """AReaL log-linear proximal log-prob (``loglinear``; A-3PO), no gradient.

        log pi_prox_t = log mu_t + alpha_t * (sg(log pi_theta_t) - log mu_t)
        alpha_t = clamp((v_prox - v_t) / (v_theta - v_t), 0, 1),  v_prox = g, v_theta = g + 1

    i.e. alpha_t = k / (k + 1) with staleness k = g - v_t (0 for fresh tokens, 1/2 for one
    version old, ...). Mapping to AReaL: AReaL labels the policy being trained by the version
    its update will produce, g_A = g + 1, and sets v_prox = g_A - 1 = g; both give the same
    alpha. ``logp`` is the learner's log pi_theta at the params of version g (before the
    update), so pi_prox is the interpolation between mu_{v_t} and pi_g in log space.

    Args:
        behav_logp: float [B, T] log mu.
        logp: float [B, T] log pi_theta (detached here).
        versions: int [B, T], -1 where not generated.
        current_version: int scalar g (may be traced).

    Returns:
        fp32 [B, T]. Where ``versions < 0``: ``behav_logp`` unchanged (0 if it is not finite),
        independent of ``logp`` there (NaN/inf in logp at such positions do not leak). Where
        ``v_t >= g`` (alpha = 0): exactly ``behav_logp``.

    Raises:
        ValueError: shapes differ.
    """
    behav = jnp.asarray(behav_logp, jnp.float32)
    lp = lax.stop_gradient(jnp.asarray(logp, jnp.float32))
    ver = jnp.asarray(versions, jnp.int32)
    if not (behav.shape == lp.shape == ver.shape):
        raise ValueError(
            f"behav_logp {behav.shape}, logp {lp.shape} and versions {ver.shape} must have the same shape"
        )
    g = jnp.asarray(current_version, jnp.int32)
    gen = ver >= 0
    k = jnp.where(gen, jnp.maximum(g - ver, 0), 0).astype(jnp.float32)
    alpha = k / (k + 1.0)
    interp = gen & (alpha > 0)
    b_s = jnp.where(interp, behav, 0.0)
    l_s = jnp.where(interp, lp, 0.0)
    mixed = b_s + alpha * (l_s - b_s)
    untouched = jnp.where(gen | jnp.isfinite(behav), behav, 0.0)
    return jnp.where(interp, mixed, untouched)


def ewma_beta(max_staleness: int, rule: str = "centre", override: Optional[float] = None) -> float:
    """EWMA decay beta from the staleness window K (docs/design.md §2.3 EWMA proximal; rule ``centre``).

    beta is the weight on HISTORY: theta_bar <- beta * theta_bar + (1 - beta) * theta.
    beta -> 1 gives an older, slower proximal; beta = 0 copies theta (pi_prox = the current policy, AReaL recompute).

    Rules (K = max_staleness):
        ``centre``   K / (K + 2): centre of mass beta/(1-beta) = K/2, the mean age of a
                     uniform version mix in [g - K, g] (default; authors' "centre of the window").
        ``window``   K / (K + 1): centre of mass = K.
        ``halflife`` 2 ** (-1 / K): half-life = K versions.
    K = 0 (synchronous) gives 0 for every rule.

    Args:
        max_staleness: K >= 0 (``async.max_staleness``).
        rule: ``centre`` | ``window`` | ``halflife`` (``loss.ewma_beta_rule``).
        override: explicit beta in [0, 1) (``loss.ewma_beta``); wins over the rule.

    Returns:
        Python float in [0, 1).

    Raises:
        ValueError: K < 0, unknown rule, override outside [0, 1).
    """
    if override is not None:
        if not (0.0 <= float(override) < 1.0):
            raise ValueError(f"loss.ewma_beta={override!r} must be in [0, 1)")
        return float(override)
    K = int(max_staleness)
    if K < 0:
        raise ValueError(f"async.max_staleness={max_staleness!r} must be >= 0")
    if rule not in ("centre", "window", "halflife"):
        raise ValueError(f"loss.ewma_beta_rule={rule!r} must be one of ['centre', 'window', 'halflife']")
    if K == 0:
        return 0.0
    if rule == "centre":
        return K / (K + 2.0)
    if rule == "window":
        return K / (K + 1.0)
    return float(2.0 ** (-1.0 / K))


def ewma_update(ewma: Any, params: Any, beta, count, bias_correction: bool = True) -> tuple[Any, jax.Array]:
    """One EWMA step over a pytree (Hilton et al. ``EwmaModel.update``), in fp32.

    With bias correction (count = total weight W)::

        W' = beta * W + 1
        ewma <- (beta * W / W') * ewma + (1 / W') * params

    Start with count = 0 (the first update copies params) or with ewma = params, count = 1
    (Hilton's init). Without bias correction: ewma <- beta * ewma + (1 - beta) * params
    (count is still advanced the same way). Example: beta 0.9, ewma 0, params 1, count 0 ->
    0.1 without and 1.0 with bias correction.

    Elementwise ``jax.tree.map``: each leaf keeps its sharding (GSPMD propagates it under jit;
    eagerly the output has the input's sharding). Leaves are returned as fp32.

    Args:
        ewma: pytree of arrays (fp32 recommended; the trainer's theta_bar).
        params: pytree with the same structure (any float dtype).
        beta: scalar in [0, 1) (Python float or traced).
        count: scalar W (Python float or traced).
        bias_correction: see above (``loss.ewma_bias_correction``).

    Returns:
        (new_ewma pytree of fp32, new_count fp32 scalar).
    """
    beta = jnp.asarray(beta, jnp.float32)
    W = jnp.asarray(count, jnp.float32)
    W_new = beta * W + 1.0
    if bias_correction:
        a = beta * W / W_new
        b = 1.0 / W_new
    else:
        a = beta
        b = 1.0 - beta

    def leaf(e, p):
        return a * jnp.asarray(e, jnp.float32) + b * jnp.asarray(p, jnp.float32)

    return jax.tree.map(leaf, ewma, params), W_new


def ewma_reset(ewma: Any, params: Any, predicate, count=None):
    """theta_bar <- theta where ``predicate`` (Hilton ``reset()`` = update with beta 0), in jit.

    Uses ``jnp.where`` per leaf, so it runs inside jit with no host round-trip.

    Args:
        ewma, params: pytrees of the same structure.
        predicate: bool scalar (traced ok), e.g. from :func:`reset_predicate`.
        count: optional EWMA total weight; when given it is reset to 1 under the predicate.

    Returns:
        new_ewma (fp32 leaves), or (new_ewma, new_count) when ``count`` is given.
    """
    pred = jnp.asarray(predicate, bool)
    new = jax.tree.map(
        lambda e, p: jnp.where(pred, jnp.asarray(p, jnp.float32), jnp.asarray(e, jnp.float32)), ewma, params
    )
    if count is None:
        return new
    return new, jnp.where(pred, jnp.float32(1.0), jnp.asarray(count, jnp.float32))


def reset_predicate(retained, threshold, patience, streak, cooldown=0) -> tuple[jax.Array, jax.Array]:
    """Reset when the train-infer retained ratio R stayed below ``threshold`` ``patience`` steps.

    Args:
        retained: fp32 scalar R (``metrics["train_infer_retained"]`` of the global batch).
        threshold: tau (``loss.ewma_reset_threshold``).
        patience: n >= 1 consecutive steps (``loss.ewma_reset_patience``).
        streak: int32 scalar, consecutive steps with R < tau so far (state; checkpoint it;
            start at 0); negative during a cool-down (-c: c cool-down steps left).
        cooldown: c >= 0 steps after a firing reset during which no reset fires
            (``loss.ewma_reset_cooldown``); R is not counted then, and the streak starts
            from 0 after them. 0: none (a reset may fire again on the next step).

    Returns:
        (predicate bool scalar, new_streak int32). The streak restarts at 0 after a firing
        reset (at -cooldown with a cool-down) and whenever R >= tau. The cool-down lives in the
        streak's sign, so the state (and the checkpoint) has no extra field, and with
        ``cooldown=0`` the streak never goes negative: every number is the same as without it.
    """
    streak = jnp.asarray(streak, jnp.int32)
    cooling = streak < 0
    below = jnp.asarray(retained, jnp.float32) < jnp.asarray(threshold, jnp.float32)
    s = jnp.where(cooling | below, streak + 1, 0).astype(jnp.int32)
    pred = ~cooling & (s >= jnp.asarray(patience, jnp.int32))
    return pred, jnp.where(pred, -jnp.asarray(cooldown, jnp.int32), s).astype(jnp.int32)


def reset_accept(rule: str, trigger, retained_ewma, retained_candidate) -> jax.Array:
    """Whether a triggered reset replaces theta_bar by theta (``loss.ewma_reset``), in jit.

    Rules:
        ``current``  the paper's (2605.12070, reset to the current actor): every trigger resets.
        ``guarded``  a trigger resets only when the candidate reference keeps strictly MORE of the
                     triggering batch's loss tokens inside the train-infer mask than theta_bar does
                     (``retained_candidate > retained_ewma``); otherwise theta_bar stays and the step
                     trains against it. So the reference the mask sees never keeps fewer tokens than
                     the one it replaces, on the batch that triggered it (jax-rl's rule: at a wide
                     staleness window theta, the newest params, is often the reference furthest from
                     the behaviour policy, and ``current`` then hands the mask a worse one).

    Args:
        rule: ``current`` | ``guarded`` (static).
        trigger: bool scalar, :func:`reset_predicate`'s predicate.
        retained_ewma: fp32 scalar R of the batch under pi_{theta_bar} (in [0, 1]).
        retained_candidate: fp32 scalar R of the same batch under pi_theta (``guarded`` only;
            its value is not read under ``current``).

    Returns:
        bool scalar: theta_bar <- theta on this step (pass to :func:`ewma_reset`).

    Raises:
        ValueError: unknown rule.
    """
    if rule not in RESET_RULES:
        raise ValueError(f"loss.ewma_reset={rule!r} must be one of {list(RESET_RULES)}")
    trig = jnp.asarray(trigger, bool)
    if rule == "current":
        return trig
    return trig & (jnp.asarray(retained_candidate, jnp.float32) > jnp.asarray(retained_ewma, jnp.float32))
