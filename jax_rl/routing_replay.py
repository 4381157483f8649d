"""MoE routing replay (``moe.routing_replay``): one policy object that the learner, the train step,
the scorers and the rollout side ask, instead of each testing the mode's name.

``none``
    every forward routes by its own router.
``r2``
    the learner runs one no-grad routing forward at the step's starting params and forces those
    routes in the gradient forward only; the pi_prox forwards route by themselves.
``r3``
    the rollout engine's recorded expert ids (``Trajectory.routes`` / ``batch['routes']``) are
    forced in every learner forward: pi_prox, the exact route's old-logit forwards and the
    gradient forward (Ma et al. 2025, "Stabilizing MoE RL by aligning training and inference
    routers", R3; docs/design.md §2.7 Routing replay).

Under r2 and r3 the engine records routes, and the step logs ``routing_agreement`` when the batch
carries them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jax_rl.learner.batch import BatchError
from jax_rl.config import ConfigError
from jax_rl.models.qwen3 import route_dtype

__all__ = ["RoutingReplay", "MODES", "routing_agreement"]

MODES = ("none", "r2", "r3")


def routing_agreement(own: jax.Array, recorded: jax.Array, attention_mask: jax.Array, num_experts: int
                      ) -> tuple[jax.Array, jax.Array]:
    """``(agreement, n)``: the fraction of (token, MoE layer) pairs where ``own`` and ``recorded``
    ([..., T, n_moe_layers, k] expert ids) hold the same SET of k experts, over the pairs under
    ``attention_mask`` [..., T] whose recorded ids are all in [0, num_experts) (a -1 = no
    recorded route is not counted), and their number n (float32). 1.0 when n = 0."""
    rec = recorded.astype(jnp.int32)
    valid = attention_mask[..., None] & jnp.all((rec >= 0) & (rec < num_experts), axis=-1)
    same = jnp.all(jnp.sort(own.astype(jnp.int32), axis=-1) == jnp.sort(rec, axis=-1), axis=-1)
    n = jnp.sum(valid.astype(jnp.float32))
    agree = jnp.sum((same & valid).astype(jnp.float32))
    return jnp.where(n > 0, agree / jnp.maximum(n, 1.0), 1.0), n


@dataclasses.dataclass(frozen=True)
class RoutingReplay:
    """The routing-replay policy of a run.

    Args:
        mode: ``moe.routing_replay`` (``none``, ``r2``, ``r3``).
        num_experts: the MoE's expert count E; 0 for a dense model.

    Raises:
        ValueError: an unknown mode.
    """

    mode: str = "none"
    num_experts: int = 0

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"moe.routing_replay={self.mode!r}: unknown; known: {list(MODES)}")

    @classmethod
    def from_config(cls, cfg: Any, model_config: Any) -> "RoutingReplay":
        """The policy of ``cfg.moe.routing_replay`` for ``model_config`` (a ``Qwen3Config``).

        Raises:
            jax_rl.config.ConfigError: routing replay on a model without an MoE layer (one line
                naming the key and the model).
        """
        mode = cfg.moe.routing_replay
        moe = bool(model_config.is_moe)
        if mode != "none" and not moe:
            m = cfg.model
            model = f"model.checkpoint={m.checkpoint!r}" if m.checkpoint else f"model.preset={m.preset}"
            raise ConfigError(f"moe.routing_replay={mode} replays MoE expert routes; the model ({model}) has no "
                              "MoE layer: set moe.routing_replay=none")
        return cls(mode, int(model_config.num_experts) if moe else 0)

    @property
    def active(self) -> bool:
        """Any replay on an MoE model (the engine records routes; the step runs its routing forward)."""
        return self.mode != "none" and self.num_experts > 0

    @property
    def records(self) -> bool:
        """The rollout engine records each token's expert ids (r2 and r3)."""
        return self.active

    @property
    def forces_rollout_routes(self) -> bool:
        """Every learner forward (pi_prox, old logits, gradient) forces the batch's recorded routes (r3)."""
        return self.active and self.mode == "r3"

    def check_batch(self, b: dict) -> None:
        """Refuse a batch an r3 step cannot train (no ``routes``); drop ``routes`` when nothing reads them.

        Raises:
            jax_rl.learner.batch.BatchError: r3 and ``b`` carries no ``routes``.
        """
        if self.forces_rollout_routes and b.get("routes") is None:
            raise BatchError("moe.routing_replay=r3 needs batch['routes'] (the rollout engine's expert ids, "
                             "Trajectory.routes); the batch carries none")
        if not self.active:
            b.pop("routes", None)

    def step_routes(self, route_chunk: Optional[Any], params: Any, b: Any) -> tuple[Any, Any, dict]:
        """The routes inside the train step: ``(routes of the pi_prox forwards, the batch the gradient
        forward reads (its ``routes`` forced), metrics)``. Pure and traced under jit.

        Args:
            route_chunk: the chunked no-grad routing forward ``(params, tokens, attention_mask) ->
                routes int32 [U, m, r, T, n_moe_layers, k]`` (:func:`jax_rl.learner.train_step.make_route_fn`),
                None when inactive.
            params: the step's starting params.
            b: the :class:`jax_rl.learner.batch.LearnerBatch` [U, m, r, T] (``routes`` optional).

        ``none``: no forced routes anywhere. ``r3``: the rollout's ``b.routes`` everywhere. ``r2``:
        the routes of one no-grad routing forward at ``params`` in the gradient forward; the pi_prox
        forwards route by themselves. ``routing_agreement`` (and ``routing_pairs``, the (token,
        layer) pairs it counts) when the batch carries the rollout's routes
        (:func:`routing_agreement`).
        """
        if not self.active or route_chunk is None:
            return None, b.replace(routes=None), {}
        own = route_chunk(params, b.tokens, b.attention_mask)  # [U, m, r, T, n_moe_layers, k]
        metrics = {}
        if b.routes is not None:
            metrics["routing_agreement"], metrics["routing_pairs"] = routing_agreement(
                own, b.routes, b.attention_mask, self.num_experts)
        if self.forces_rollout_routes:
            return b.routes, b, metrics
        return None, b.replace(routes=own), metrics

    def route_spec(self, model_config: Any) -> Optional[tuple[tuple[int, int], Any]]:
        """``((n_moe_layers, k), dtype)`` of a batch's ``routes`` trailing dims when the engine records
        them, else None (:func:`jax_rl.learner.batch.abstract_batch`)."""
        if not self.records:
            return None
        return (len(model_config.moe_layers), int(model_config.num_experts_per_tok)), route_dtype(self.num_experts)
