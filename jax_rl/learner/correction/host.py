"""pi_prox's host-side inputs: what the host step puts in a learner batch before the jitted step
(:func:`plan_host_inputs`, one decision for every caller; :func:`host_inputs`, the step itself)."""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import jax

from jax_rl.learner.correction.base import Correction

__all__ = ["HostInputs", "plan_host_inputs", "host_inputs"]


@dataclasses.dataclass(frozen=True)
class HostInputs:
    """What the host step puts in the learner batch before the jitted step (:func:`plan_host_inputs`).

    Attributes:
        field: ``"prox_logp"`` (``exact``: the jitted step reads pi_prox from the batch),
            ``"old_logp"`` (an approximate mode measuring its error, ``old_logits.measure_error``)
            or None (pi_prox is computed in jit: the batch carries neither).
        score: the field is filled by the learner's snapshot store (the batch carries no
            ``old_logp``); False: from the batch's own ``old_logp``.
    """

    field: Optional[str]
    score: bool


def plan_host_inputs(strategy: Correction, *, given: bool, store: bool) -> HostInputs:
    """The one decision of pi_prox's host-side inputs, for every caller (the learner's train step,
    ``loss_and_grads`` and the abstract batch ``jax-rl compile`` lowers).

    Args:
        strategy: the correction strategy (``loss.correction``).
        given: the batch carries ``old_logp`` (exact old log-probs from a rollout-side route or
            the caller).
        store: the learner keeps a snapshot store that can score the batch.

    Raises:
        ValueError: ``exact`` without a store and without a given ``old_logp`` (never trained on
            missing exact old log-probs).
    """
    field = "prox_logp" if strategy.needs_exact else "old_logp" if strategy.learner_store else None
    if field is not None and not given and not store:
        raise ValueError(f"loss.correction={strategy.name} with old_logits.route={strategy.cfg.old_logits.route}: the "
                         "batch carries no old_logp (the route fills it before the learner) and the learner keeps no "
                         "snapshot store; refusing to train without exact old log-probs")
    return HostInputs(field=field, score=field is not None and not given)


def host_inputs(strategy: Correction, batch: dict,
                score: Optional[Callable[[], tuple[jax.Array, dict]]]) -> tuple[dict, dict]:
    """The host step before the jitted step: the batch with the fields :func:`plan_host_inputs`
    decides (a caller's ``prox_logp`` is never taken as is).

    Args:
        batch: arrays by field name (device arrays, or ``jax.ShapeDtypeStruct`` for an abstract
            batch); may hold a caller-supplied ``old_logp``.
        score: computes the exact old log-probs from the snapshot store: ``(old_logp, stats)``;
            None when the learner keeps no store.

    Returns:
        ``(batch, stats)``: under ``exact`` the batch carries ``prox_logp`` (the given
        ``old_logp`` or the store's); an approximate mode measuring its error carries
        ``old_logp``; otherwise neither. ``stats``: the store's (empty when nothing was scored).

    Raises:
        ValueError: as :func:`plan_host_inputs`.
    """
    plan = plan_host_inputs(strategy, given="old_logp" in batch, store=score is not None)
    out = {k: v for k, v in batch.items() if k not in ("prox_logp", "old_logp")}
    stats: dict = {}
    if plan.field is not None:
        out[plan.field], stats = score() if plan.score else (batch["old_logp"], {})
    return out, stats
