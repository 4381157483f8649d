"""Pytree helpers of the learner's jitted steps (RL, SFT and the programs ``jax-rl compile`` lowers): the
skip-a-non-finite-update rule reads every leaf once and keeps the old tree where the new one is not finite."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["tree_finite", "tree_where"]


def tree_finite(tree: Any) -> jax.Array:
    """Scalar bool: every element of every leaf is finite (one cheap reduction per leaf, in jit)."""
    ok = jnp.bool_(True)
    for x in jax.tree.leaves(tree):
        ok = ok & jnp.all(jnp.isfinite(x))
    return ok


def tree_where(pred: jax.Array, a: Any, b: Any) -> Any:
    """``a`` where the scalar ``pred`` holds, else ``b``, leaf by leaf (same tree structure, in jit)."""
    return jax.tree.map(lambda x, y: jnp.where(pred, x, y), a, b)

