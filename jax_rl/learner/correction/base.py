"""The correction strategy's interface (:class:`Correction`, the ``ppo`` row), its declared :class:`Cost`, the
``loss.correction`` registry (:data:`REGISTRY`, :func:`register`) and the config checks a run is built after
(:func:`check_config`, :func:`make_correction`). The modes are :mod:`jax_rl.learner.correction.modes`; the
package's docstring is the table of them."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax

from jax_rl.config import Config, ConfigError
from jax_rl.learner.correction.old_logits.routes import ROUTES, Route
from jax_rl.registry import registrar

__all__ = ["LogprobFn", "Cost", "Correction", "REGISTRY", "register", "check_config", "make_correction"]

# (params, tokens [U,m,r,T], attention_mask [U,m,r,T]) -> log-probs [U,m,r,T] (training numerics)
LogprobFn = Callable[[Any, jax.Array, jax.Array], jax.Array]


@dataclasses.dataclass(frozen=True)
class Cost:
    """Declared extra cost of a mode per learner step, on top of the gradient forward/backward."""

    extra_forwards: str = "0"
    extra_param_copies: str = "0"

    def __str__(self) -> str:
        return f"extra forwards: {self.extra_forwards}; extra param copies: {self.extra_param_copies}"


class Correction:
    """Base strategy: pi_prox = mu, no state, no host step (the ``ppo`` row).

    Args:
        cfg: the run config (``loss``, ``optim``, ``async.max_staleness`` are read).
    """

    name = "ppo"
    cost = Cost()
    approximate = False  # an approximation of the exact old logits (measure_error applies)
    needs_exact = False  # the jitted step reads ``batch.prox_logp`` from the host step

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.loss = cfg.loss

    @classmethod
    def check(cls, cfg: Config) -> None:
        """What this mode allows with it, asked by :func:`check_config` (one line naming the keys).

        Raises:
            ValueError: ``old_logits.measure_error`` under a mode that approximates nothing; an
                ``old_logits.route`` this mode cannot use or whose own checks fail
                (:meth:`jax_rl.learner.correction.old_logits.routes.Route.check`).
        """
        if cfg.old_logits.measure_error and not cls.approximate:
            approx = " / ".join(n for n, c in REGISTRY.items() if c.approximate)
            raise ValueError(
                f"old_logits.measure_error=true measures the {approx} approximation of the exact old logits; "
                f"it has nothing to measure under loss.correction={cfg.loss.correction!r}: set "
                "old_logits.measure_error=false")
        ROUTES[cfg.old_logits.route].check(cfg, exact=cls.needs_exact)

    @property
    def route(self) -> Optional[Route]:
        """The exact-old-logit route this mode uses (``exact``), else None."""
        return None

    @property
    def learner_store(self) -> bool:
        """The learner keeps the snapshot store: the exact route asks for it
        (:attr:`jax_rl.learner.correction.old_logits.routes.Route.learner_store`), or an approximate mode measures
        its error against the exact old logits (``old_logits.measure_error``)."""
        return self.approximate and bool(self.cfg.old_logits.measure_error)

    @property
    def scores_before_buffer(self) -> bool:
        """Every trajectory enters the buffer with ``old_logp`` filled on the rollout side (the
        buffer refuses an unscored one): the route says so."""
        return self.route is not None and self.route.scores_before_buffer

    def describe(self) -> str:
        """One line for the start of a run: the mode and its declared cost."""
        return f"loss.correction={self.name}: {self.cost}"

    # --- state ---------------------------------------------------------------------
    def init_state(self, params: Any) -> Any:
        """The strategy's part of ``TrainState.correction`` (a pytree or None), in jit."""
        return None

    def state_shardings(self, param_shardings: Any, replicated: Any) -> Any:
        return None

    def reset(self, params: Any, cstate: Any) -> Any:
        """The state after SFT (or any change of params outside RL): re-anchored on ``params``."""
        return cstate

    def steady_config(self) -> Config:
        """The config whose train step is the step as it runs when no rare branch fires (what
        ``jax-rl compile`` costs: XLA counts a ``lax.cond`` by its costliest branch). Default:
        this config."""
        return self.cfg

    # --- in-jit ----------------------------------------------------------------------
    def prox_logp(self, logprobs: LogprobFn, params: Any, cstate: Any, batch: Any, version
                  ) -> tuple[Optional[jax.Array], Any, dict]:
        """``(prox_logp [U,m,r,T] or None, new state, metrics)`` at the start of the step.

        None means: derive it per microbatch from the gradient forward (:meth:`micro_prox`).
        """
        return batch.behav_logp, cstate, {}

    def micro_prox(self, logp: jax.Array, x: Any, version) -> jax.Array:
        raise NotImplementedError(f"{self.name} computes prox_logp before the updates")

    def after_update(self, params: Any, cstate: Any) -> tuple[Any, dict]:
        """In-jit hook after the optimizer updates: ``(new state, metrics)``."""
        return cstate, {}

    # --- checkpoints -----------------------------------------------------------------
    def checkpoint_items(self, cstate: Any) -> dict[str, Any]:
        """Checkpoint items (name -> pytree of arrays) holding the strategy's state."""
        return {}

    def from_checkpoint_items(self, items: dict[str, Any], like: Any) -> Any:
        return like


REGISTRY: dict[str, type[Correction]] = {}


register = registrar(REGISTRY)
"""Class decorator: ``@register(name)`` makes ``loss.correction=name`` use this strategy."""


register("ppo")(Correction)


def check_config(cfg: Config) -> Config:
    """What the registries allow with ``cfg``: the correction mode's and its ``old_logits.route``'s own
    refusals (:meth:`Correction.check`). The config's schema validates every key and the rules between
    sections; this adds the registries' knowledge, which the config, a leaf of the import graph, does not
    import. Called where a run is built: the CLI's loader and :func:`make_correction`.

    Returns:
        ``cfg``, unchanged.

    Raises:
        ConfigError: one line naming the keys (an unknown ``loss.correction`` included).
    """
    try:
        strategy = REGISTRY[cfg.loss.correction]
    except KeyError:
        raise ConfigError(f"unknown loss.correction {cfg.loss.correction!r}; known: {sorted(REGISTRY)}") from None
    try:
        strategy.check(cfg)
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(f"invalid config: {e}") from None
    return cfg


def make_correction(cfg: Config) -> Correction:
    """The strategy of ``cfg.loss.correction``, after :func:`check_config`.

    Raises:
        ConfigError: what :func:`check_config` refuses.
    """
    return REGISTRY[check_config(cfg).loss.correction](cfg)
