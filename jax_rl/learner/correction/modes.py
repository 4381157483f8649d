"""The correction modes beyond ``ppo`` (the base, :class:`jax_rl.learner.correction.base.Correction`):
``decoupled``, ``linear_prox``, ``ppo_ewma`` (its state :class:`EwmaState`) and ``exact``, each registered under its
``loss.correction`` name (the package's docstring is the table of them)."""

from __future__ import annotations

from typing import Any

import flax
import jax
import jax.numpy as jnp
from jax import lax

from jax_rl.config import Config
from jax_rl.learner import losses
from jax_rl.learner.correction import proximal
from jax_rl.learner.correction.base import Correction, Cost, register
from jax_rl.learner.correction.old_logits.routes import Route, make_route
from jax_rl.learner.trees import tree_finite, tree_where

__all__ = ["Decoupled", "LinearProx", "EwmaState", "PpoEwma", "Exact"]


@register("decoupled")
class Decoupled(Correction):
    cost = Cost(extra_forwards="1 (no-grad, params at the start of the step)")
    approximate = True  # pi_g stands in for pi_v: old_logits.measure_error measures how far

    def prox_logp(self, logprobs, params, cstate, batch, version):
        return lax.stop_gradient(logprobs(params, batch.tokens, batch.attention_mask)), cstate, {}


@register("linear_prox")
class LinearProx(Correction):
    approximate = True

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        o = cfg.optim
        self.forward = o.ppo_epochs * o.minibatches > 1 or (o.microbatches > 1 and not cfg.loss.keep_masked_in_denominator)
        self.cost = Cost(extra_forwards="1 (several updates per step)" if self.forward else "0")

    def prox_logp(self, logprobs, params, cstate, batch, version):
        if not self.forward:
            return None, cstate, {}
        tokens = batch.tokens
        T = tokens.shape[-1]
        lp0 = lax.stop_gradient(logprobs(params, tokens, batch.attention_mask))
        prox = proximal.loglinear_logp(
            batch.behav_logp.reshape(-1, T), lp0.reshape(-1, T), batch.versions.reshape(-1, T), version,
        ).reshape(tokens.shape)
        return prox, cstate, {}

    def micro_prox(self, logp, x, version):
        return proximal.loglinear_logp(x.behav_logp, logp, x.versions, version)


@flax.struct.dataclass
class EwmaState:
    """``ppo_ewma`` state: theta_bar (fp32, sharded like the params), the EWMA weight W (Hilton
    bias correction; f32 scalar), the streak of low-R steps (int32) and resets so far (int32)."""

    params: Any
    count: jax.Array
    streak: jax.Array
    resets: jax.Array


@register("ppo_ewma")
class PpoEwma(Correction):
    """PPO-EWMA: pi_prox under theta_bar, an EWMA of the params, with an automatic reset.

    The reset (``loss.ewma_reset``, :func:`jax_rl.learner.correction.proximal.reset_accept`): a step whose batch R under
    theta_bar triggers :func:`jax_rl.learner.correction.proximal.reset_predicate` scores the batch once more with the
    current params theta (the candidate reference). ``current`` takes theta on every trigger (the
    paper's); ``guarded`` takes it only when theta's R on this batch is higher than theta_bar's, so
    the step's reference never keeps fewer tokens than theta_bar would have. Either way the chosen
    reference is pi_prox for the triggering step itself. A rejected candidate consumes the trigger
    like a reset does (the streak restarts; the cool-down applies), so the candidate forward runs at
    most once per ``patience`` low-R steps. Metrics: ``ewma_reset`` (theta_bar replaced),
    ``ewma_reset_rejected`` (triggered, candidate kept fewer or equal tokens), ``ewma_retained`` (R
    under theta_bar), ``ewma_retained_candidate`` (R under theta on a triggering step, else R).
    """

    approximate = True

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        lc = cfg.loss
        self.beta = proximal.ewma_beta(int(cfg.async_.max_staleness), lc.ewma_beta_rule, lc.ewma_beta)
        self.rule = lc.ewma_reset
        if lc.ewma_reset_threshold <= 0:
            second = "0 (reset off: loss.ewma_reset_threshold=0)"
        elif self.rule == "guarded":
            second = "a 2nd on each triggering step (the candidate theta, kept only if it keeps more tokens)"
        else:
            second = "a 2nd only on a reset"
        self.cost = Cost(extra_forwards=f"1 (theta_bar; {second})", extra_param_copies="1 (theta_bar, fp32)")

    def describe(self) -> str:
        return f"{super().describe()}; ewma_beta={self.beta:.4g}; ewma_reset={self.rule}"

    def init_state(self, params):
        return EwmaState(params=jax.tree.map(lambda x: x.astype(jnp.float32), params), count=jnp.float32(1.0),
                         streak=jnp.int32(0), resets=jnp.int32(0))

    def state_shardings(self, param_shardings, replicated):
        return EwmaState(params=param_shardings, count=replicated, streak=replicated, resets=replicated)

    def steady_config(self):
        """``loss.ewma_reset_threshold=0``: a step without a reset traces no reset branch (its
        second forward runs only on a reset step)."""
        if self.loss.ewma_reset_threshold <= 0:
            return self.cfg
        cfg = self.cfg.model_copy(deep=True)
        cfg.loss.ewma_reset_threshold = 0.0
        return cfg

    def reset(self, params, cstate):
        fresh = self.init_state(params)
        return fresh.replace(resets=cstate.resets)

    def _retained(self, prox: jax.Array, b: Any) -> jax.Array:
        """Train-infer retained ratio R of the whole batch for pi_prox = ``prox``."""
        U, m, r, T = prox.shape
        flat = lambda x: x.reshape(U * m, r, T)  # noqa: E731
        ti = jax.vmap(lambda p, bl, lm, tid: losses.train_infer_factor(p, bl, lm, self.loss, turn_ids=tid))(
            flat(prox), flat(b.behav_logp), flat(b.loss_mask), flat(b.turn_ids)
        )
        nv = jnp.sum(ti.valid.astype(jnp.float32))
        nk = jnp.sum((ti.kept & ti.valid).astype(jnp.float32))
        return jnp.where(nv > 0, nk / jnp.maximum(nv, 1.0), 1.0)

    def prox_logp(self, logprobs, params, cstate, batch, version):
        lc = self.loss
        tokens, amask = batch.tokens, batch.attention_mask
        ew_lp = logprobs(cstate.params, tokens, amask)
        R = self._retained(ew_lp, batch)
        trigger, streak = proximal.reset_predicate(R, lc.ewma_reset_threshold, lc.ewma_reset_patience,
                                                   cstate.streak, lc.ewma_reset_cooldown)
        R_cand = R
        if lc.ewma_reset_threshold <= 0:  # reset off: R < 0 never holds; trace no reset branch (2nd forward)
            reset, prox = trigger, ew_lp
        elif self.rule == "current":
            reset = proximal.reset_accept("current", trigger, R, R)
            prox = lax.cond(reset, lambda: logprobs(params, tokens, amask), lambda: ew_lp)
        else:  # guarded: score the candidate only on a triggering step, keep it only if it keeps more tokens
            def candidate():
                lp = logprobs(params, tokens, amask)
                return lp, self._retained(lp, batch)

            cand_lp, R_cand = lax.cond(trigger, candidate, lambda: (ew_lp, R))
            reset = proximal.reset_accept("guarded", trigger, R, R_cand)
            prox = jnp.where(reset, cand_lp, ew_lp)
        ew_params, count = proximal.ewma_reset(cstate.params, params, reset, cstate.count)
        new = EwmaState(params=ew_params, count=count, streak=streak, resets=cstate.resets + reset.astype(jnp.int32))
        return lax.stop_gradient(prox), new, {"ewma_reset": reset.astype(jnp.float32), "ewma_retained": R,
                                              "ewma_reset_rejected": (trigger & ~reset).astype(jnp.float32),
                                              "ewma_retained_candidate": R_cand}

    def after_update(self, params, cstate):
        lc = self.loss
        new_ew, new_count = proximal.ewma_update(cstate.params, params, self.beta, cstate.count,
                                                 lc.ewma_bias_correction)
        ok = tree_finite(new_ew) & jnp.isfinite(new_count)
        new = cstate.replace(params=tree_where(ok, new_ew, cstate.params),
                             count=jnp.where(ok, new_count, cstate.count))
        return new, {"nonfinite_ewma": (~ok).astype(jnp.float32), "ewma_beta": jnp.float32(self.beta),
                     "ewma_streak": new.streak.astype(jnp.float32), "ewma_resets": new.resets.astype(jnp.float32)}

    def checkpoint_items(self, cstate):
        return {"ewma": {"params": cstate.params, "count": cstate.count, "streak": cstate.streak,
                         "resets": cstate.resets}}

    def from_checkpoint_items(self, items, like):
        e = items["ewma"]
        return EwmaState(params=e["params"], count=e["count"], streak=e["streak"], resets=e["resets"])


@register("exact")
class Exact(Correction):
    """pi_prox = pi_v at each token's own behaviour version, from its ``old_logits.route``
    (:mod:`jax_rl.learner.correction.old_logits.routes`): the route declares the cost, where the old log-probs are
    computed and what it refuses; this class asks it."""

    needs_exact = True

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self._route = make_route(cfg)
        self.cost = Cost(extra_forwards=self._route.extra_forwards,
                         extra_param_copies=self._route.extra_param_copies)

    @property
    def route(self) -> Route:
        return self._route

    @property
    def learner_store(self) -> bool:
        return self._route.learner_store

    def describe(self) -> str:
        return f"{super().describe()}; old_logits.route={self._route.name}"

    def prox_logp(self, logprobs, params, cstate, batch, version):
        return batch.prox_logp, cstate, {}
