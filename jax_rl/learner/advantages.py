"""Group advantages (GRPO, RLOO) and their broadcast over tokens. Pure and jit-able.

``algo.advantage`` names an estimator in :data:`REGISTRY` (``@register("name")``, as the correction
modes are registered in :mod:`jax_rl.learner.correction`); :func:`compute_advantages` asks it. Adding an
estimator: one registered function ``(rewards [N], group_ids [N], algo) -> [N]`` and its name in
``AlgoConfig.advantage`` (``tests/test_structure.py`` checks the two agree).

Group ids may be arbitrary ints (not necessarily 0..G-1, not sorted): they are mapped to
dense ids with ``jnp.unique(..., size=N)`` and reduced with segment ops (num_segments = N).
Formula sources: GRPO (DeepSeekMath, arXiv 2402.03300; verl ``compute_grpo_outcome_advantage``),
RLOO (Ahmadian et al. 2024, arXiv 2402.14740).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import jax
import jax.numpy as jnp

from jax_rl.registry import registrar

if TYPE_CHECKING:  # annotations only
    from jax_rl.config import AlgoConfig

__all__ = ["REGISTRY", "register", "check_group_size", "compute_advantages", "grpo_advantages", "rloo_advantages",
           "broadcast_advantages"]

Estimator = Callable[[jax.Array, jax.Array, "AlgoConfig"], jax.Array]
REGISTRY: dict[str, Estimator] = {}
"""``algo.advantage`` name -> estimator ``(rewards [N], group_ids [N], algo) -> fp32 [N]``."""


register = registrar(REGISTRY)
"""Function decorator: ``@register(name)`` makes ``algo.advantage=name`` use this estimator."""


GROUP_BASELINE = {
    "grpo": "each reward minus its group's mean",
    "rloo": "each reward minus the mean of the other samples of its group",
}
"""Estimators whose baseline is the group (what they compute): one sample a group gives an advantage of 0."""


def check_group_size(algo: "AlgoConfig") -> None:
    """Refuse a group the estimator cannot learn from: ``algo.group_size=1`` with a group baseline
    (:data:`GROUP_BASELINE`) makes every advantage 0, so every step would have loss 0 and grad norm 0.

    Raises:
        ValueError: one line naming ``algo.group_size`` and ``algo.advantage``.
    """
    what = GROUP_BASELINE.get(algo.advantage)
    if what is not None and int(algo.group_size) < 2:
        raise ValueError(f"algo.group_size={algo.group_size} with algo.advantage={algo.advantage}: the advantage is "
                         f"{what}, 0 with one sample a group, so RL would learn nothing; set algo.group_size >= 2")


def compute_advantages(algo: "AlgoConfig", rewards, group_ids) -> jax.Array:
    """Per-trajectory advantages by the estimator ``algo.advantage`` names.

    Args:
        algo: the ``algo`` config section (``advantage``, ``advantage_std_normalize``).
        rewards: float [N]; group_ids: int [N], arbitrary values.

    Returns:
        fp32 [N].

    Raises:
        ValueError: an ``algo.advantage`` no estimator is registered under; shapes not both [N].
    """
    try:
        fn = REGISTRY[algo.advantage]
    except KeyError:
        raise ValueError(f"unknown algo.advantage {algo.advantage!r}; known: {sorted(REGISTRY)}") from None
    return fn(rewards, group_ids, algo)


def _groups(rewards, group_ids):
    r = jnp.asarray(rewards, jnp.float32)
    gid = jnp.asarray(group_ids)
    if r.ndim != 1 or gid.shape != r.shape:
        raise ValueError(f"rewards {r.shape} and group_ids {gid.shape} must both be [N]")
    n = r.shape[0]
    _, dense = jnp.unique(gid, size=n, return_inverse=True, fill_value=0)
    dense = dense.reshape(-1)
    cnt = jax.ops.segment_sum(jnp.ones_like(r), dense, num_segments=n)
    tot = jax.ops.segment_sum(r, dense, num_segments=n)
    return r, dense, cnt, tot, n


def grpo_advantages(rewards, group_ids, normalize_std: bool = True, eps: float = 1e-6) -> jax.Array:
    """GRPO: A_i = (r_i - mean_g) / (std_g + eps), or r_i - mean_g without std normalisation.

    std_g is the unbiased (ddof = 1) group standard deviation, as torch.std in verl/TRL.
    A group whose rewards are all equal (including a group of one) gives exactly 0 (never
    NaN/inf, independent of rounding in the mean).

    Args:
        rewards: float [N].
        group_ids: int [N], arbitrary values.
        normalize_std: divide by std_g + eps (``algo.advantage_std_normalize``).
        eps: added to std_g.

    Returns:
        fp32 [N].

    Raises:
        ValueError: shapes are not both [N].
    """
    r, dense, cnt, tot, n = _groups(rewards, group_ids)
    mean = (tot / jnp.maximum(cnt, 1.0))[dense]
    centred = r - mean
    ss = jax.ops.segment_sum(centred * centred, dense, num_segments=n)
    c = cnt[dense]
    std = jnp.sqrt(ss[dense] / jnp.maximum(c - 1.0, 1.0))
    rmax = jax.ops.segment_max(r, dense, num_segments=n)[dense]
    rmin = jax.ops.segment_min(r, dense, num_segments=n)[dense]
    const = rmax == rmin
    adv = centred / (std + eps) if normalize_std else centred
    return jnp.where(const, 0.0, adv).astype(jnp.float32)


def rloo_advantages(rewards, group_ids) -> jax.Array:
    """RLOO: A_i = r_i - mean_{j != i, same group} r_j = (n r_i - S) / (n - 1).

    A group of one, or with all rewards equal, gives exactly 0.

    Args:
        rewards: float [N]; group_ids: int [N], arbitrary values.

    Returns:
        fp32 [N].
    """
    r, dense, cnt, tot, n = _groups(rewards, group_ids)
    c = cnt[dense]
    S = tot[dense]
    adv = (c * r - S) / jnp.maximum(c - 1.0, 1.0)
    rmax = jax.ops.segment_max(r, dense, num_segments=n)[dense]
    rmin = jax.ops.segment_min(r, dense, num_segments=n)[dense]
    return jnp.where((c <= 1.0) | (rmax == rmin), 0.0, adv).astype(jnp.float32)


@register("grpo")
def _grpo(rewards, group_ids, algo: "AlgoConfig") -> jax.Array:
    return grpo_advantages(rewards, group_ids, normalize_std=algo.advantage_std_normalize)


@register("rloo")
def _rloo(rewards, group_ids, algo: "AlgoConfig") -> jax.Array:
    return rloo_advantages(rewards, group_ids)


def broadcast_advantages(adv, loss_mask) -> jax.Array:
    """Per-trajectory advantages [N] -> per-token [N, T]: adv[b] on loss_mask tokens, 0 elsewhere.

    Raises:
        ValueError: adv is not [N] or loss_mask is not [N, T].
    """
    a = jnp.asarray(adv, jnp.float32)
    mask = jnp.asarray(loss_mask, bool)
    if a.ndim != 1 or mask.ndim != 2 or mask.shape[0] != a.shape[0]:
        raise ValueError(f"adv must be [N] and loss_mask [N, T], got {a.shape} and {mask.shape}")
    return jnp.where(mask, a[:, None], 0.0)
