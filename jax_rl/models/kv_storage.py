"""How K/V buffers are stored on the backend a program is traced for
(:mod:`jax_rl.models.backend_target`).

K/V storage (:func:`storage_dtype`): on XLA:CPU a 16-bit float K/V buffer (bf16, f16) is stored as its
uint16 bits. XLA:CPU runs every bf16 scatter and dynamic-update-slice in f32, so a one-token write into a
bf16 buffer converted the whole buffer to f32 and back at every decode step (``docs/performance.md``,
"Why the CPU paged path was slower, and the fix": 51% of the paged decode call, 68% of the contiguous
one). On the bits a write is an integer scatter that touches only its entries (in place under a donated
jit); a read bitcasts back what it reads (:func:`from_storage`: the values bit for bit the same). Bitcast
only what is read (a layer, the gathered pages), fused into its consumer: a whole-buffer
``bitcast-convert`` is materialised by XLA:CPU (half the win, measured on the paged pool). Other
backends store the float dtype itself. Both K/V layouts follow this rule: the paged pool
(:mod:`jax_rl.models.paged_attention`) and the contiguous cache (:mod:`jax_rl.models.qwen3.cache`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_rl.models.backend_target import current_target_backend

Array = jax.Array

__all__ = ["storage_dtype", "to_storage", "from_storage"]

def storage_dtype(dtype) -> jnp.dtype:
    """The dtype a K/V buffer of values of ``dtype`` is stored in on the backend being traced for
    (:func:`current_target_backend`): uint16 (the values' bits) for a 16-bit float on XLA:CPU (module
    doc), else ``dtype``."""
    dt = jnp.dtype(dtype)
    if current_target_backend() == "cpu" and dt.itemsize == 2 and jnp.issubdtype(dt, jnp.floating):
        return jnp.dtype(jnp.uint16)
    return dt


def to_storage(x: Array, store_dtype, dtype=None) -> Array:
    """Values ``x`` as a buffer of ``store_dtype`` holds them: cast to ``dtype`` (the values' dtype; None:
    ``store_dtype``), then bitcast to ``store_dtype`` where that differs (uint16 bits)."""
    store_dtype = jnp.dtype(store_dtype)
    x = x.astype(store_dtype if dtype is None else dtype)
    return x if x.dtype == store_dtype else jax.lax.bitcast_convert_type(x, store_dtype)


def from_storage(x: Array, dtype) -> Array:
    """Values read from a buffer: bitcast from the uint16 bits to ``dtype`` (None, or ``x``'s own dtype:
    ``x`` as it is)."""
    if dtype is None or x.dtype == jnp.dtype(dtype):
        return x
    return jax.lax.bitcast_convert_type(x, dtype)
