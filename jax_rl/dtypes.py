"""Dtype names and the one "cast the float leaves" rule, shared by the learner side (publish, compile) and the
rollout engine (a leaf: imports only jax, so ``rollout/`` and every ``jax_rl`` package can use it).

- :func:`resolve_dtype`: ``rollout.dtype`` names (``bfloat16`` / ``float32``, aliases ``bf16`` / ``fp32``) or a
  dtype -> the jnp scalar type.
- :func:`cast_floating`: a params tree with its floating leaves cast to a dtype and every other leaf (int,
  bool, quantized int8 weights) untouched: what a publish sends to the engines (``rollout.dtype``).
"""

from __future__ import annotations

from typing import Any, Optional, Union

import jax
import jax.numpy as jnp

__all__ = ["DTYPES", "resolve_dtype", "is_floating", "cast_floating"]

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "bf16": jnp.bfloat16, "fp32": jnp.float32}
"""The dtype names ``rollout.dtype`` accepts (and their short aliases)."""


def resolve_dtype(dtype: Union[str, Any]) -> Any:
    """``dtype`` as a jnp scalar type: a name of :data:`DTYPES`, or anything ``jnp.dtype`` reads.

    Raises:
        ValueError: a name not in :data:`DTYPES`.
    """
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unknown rollout dtype {dtype!r}; expected 'bfloat16' or 'float32'")
        return DTYPES[dtype]
    return jnp.dtype(dtype).type


def is_floating(x: Any) -> bool:
    """Whether array (or ``ShapeDtypeStruct``) ``x`` holds floats (any width)."""
    return bool(jnp.issubdtype(x.dtype, jnp.floating))


def cast_floating(tree: Any, dtype: Union[str, Any], shardings: Optional[Any] = None) -> Any:
    """``tree`` with each floating leaf cast to ``dtype`` (``x.astype``: jax or numpy arrays alike), every other
    leaf returned as is.

    Args:
        tree: a pytree of arrays (params).
        dtype: the target (:func:`resolve_dtype`).
        shardings: a tree like ``tree`` of shardings, inside ``jax.jit`` only: each cast leaf is constrained to
            its sharding (``jax.lax.with_sharding_constraint``), so the cast runs where the leaf lives before any
            reshard moves the (smaller) result.

    Raises:
        ValueError: an unknown dtype name.
    """
    dt = resolve_dtype(dtype)
    if shardings is None:
        return jax.tree.map(lambda x: x.astype(dt) if is_floating(x) else x, tree)
    return jax.tree.map(lambda x, sh: jax.lax.with_sharding_constraint(x.astype(dt), sh) if is_floating(x) else x,
                        tree, shardings)
