"""The typed outputs of the Qwen3 model's calls (Gemma's ``Output`` is the model):
:class:`ModelOutput` (``forward``, ``hidden_states``, ``prefill``, ``extend``, ``decode_step``),
:class:`MoeDrops` (the MoE layers' capacity drops of one call) and :class:`TrunkOutput` (the decoder
stack's, inside the model); the routing-replay route helpers (expert ids stacked into the routes
arrays trajectories and batches carry, and back).

Each is a ``flax.struct.dataclass`` (a pytree: it passes through ``jax.jit``, ``lax.scan`` and
``lax.map``). A field a call was not asked for is None, so no flag changes what a call returns,
only which fields are filled.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jax_rl.models.qwen3.cache import KVCache

Array = jax.Array

__all__ = ["ModelOutput", "MoeDrops", "TrunkOutput", "count_moe_drops", "ROUTE_MISSING", "route_dtype",
           "stack_routes", "unstack_routes"]


@flax.struct.dataclass
class MoeDrops:
    """The token copies the MoE layers dropped for capacity in one model call (GShard capacity:
    the expert-parallel dispatch's ``model.moe_capacity_factor``, or the engine's
    ``rollout.moe_capacity_factor`` on every path; :func:`jax_rl.models.qwen3.layers.capacity_keep`).

    Attributes:
        dropped: float32 [], valid token copies dropped, summed over the tokens and the MoE layers
            (0 for a dropless or dense model).
        copies: float32 [], valid token copies routed: valid tokens x ``num_experts_per_tok`` x MoE
            layers (0 for a dense model). float32 because the count passes 2**31 for a big batch.
        per_row: int32 [B], each row's (decode slot's) valid copies dropped, summed over its tokens
            and the MoE layers (the rollout engine's per-slot count); filled by ``prefill``,
            ``extend`` and ``decode_step`` (which count per token), None from ``hidden_states`` /
            ``forward`` (which count per call).
    """

    dropped: Array
    copies: Array
    per_row: Optional[Array] = None


@flax.struct.dataclass
class ModelOutput:
    """What a :class:`~jax_rl.models.qwen3.Qwen3ForCausalLM` call returns; fields a call does
    not fill are None.

    Attributes:
        logits: float32 [B,T,V] (``forward``, ``prefill``, ``extend``) or [B,V] (``decode_step``).
        hidden: [B,T,D] compute dtype, the final-normed hidden state (``hidden_states``).
        cache: the KV cache after the call (``prefill``, ``extend``: :class:`StackedKVCache`;
            ``decode_step``: the type it was given).
        expert_ids: per MoE layer, in layer order, the experts each position was routed to, int32
            [B,T,k] ([B,k] from ``decode_step``); an empty tuple for a dense model. Always from
            ``forward`` / ``hidden_states``; from ``prefill`` / ``extend`` / ``decode_step`` with
            ``return_expert_ids``.
        hidden_states: with ``output_hidden_states``, the L+1 arrays [B,T,D] ``[embeddings, after
            layer 0, ..., after layer L-2, final norm(after layer L-1)]`` (HF convention).
        moe_drops: :class:`MoeDrops`, with ``return_moe_drops``.
    """

    logits: Optional[Array] = None
    hidden: Optional[Array] = None
    cache: Optional[KVCache] = None
    expert_ids: Optional[tuple[Array, ...]] = None
    hidden_states: Optional[tuple[Array, ...]] = None
    moe_drops: Optional[MoeDrops] = None


@flax.struct.dataclass
class TrunkOutput:
    """The decoder stack's result (``Qwen3ForCausalLM._trunk``).

    Attributes:
        h: [B,T,D] compute dtype, the final-normed hidden state.
        expert_ids: tuple of int32 [B,T,k], one per MoE layer (empty for a dense model).
        hidden_states: tuple of L+1 [B,T,D] (``output_hidden_states``) or None.
        ys: the attention cores' per-layer outputs stacked [L, ...] (e.g. the new K/V), or None.
        carry: the final layer carry (e.g. the decode KV buffers), or None.
        dropped: the MoE layers' capacity drops, int32 [n_moe] per layer, or [n_moe,B,T] per layer
            and token (``row_drops``); None without an MoE layer.
    """

    h: Array
    expert_ids: tuple[Array, ...]
    hidden_states: Optional[tuple[Array, ...]] = None
    ys: Any = None
    carry: Any = None
    dropped: Optional[Array] = None


def count_moe_drops(dropped: Optional[Array], valid: Optional[Array], batch_shape: tuple[int, int],
                    copies_per_token: int, per_row: bool = False) -> MoeDrops:
    """:class:`MoeDrops` of one call from the trunk's per-layer drops.

    Args:
        dropped: int32 [n_moe] (per MoE layer) or [n_moe,B,T] (per layer and token, ``per_row``),
            or None (no MoE layer: every count 0).
        valid: [B,T] bool, the tokens that took MoE capacity (padding does not), or None (all).
        batch_shape: (B, T).
        copies_per_token: ``num_experts_per_tok`` (each valid token routes that many copies per
            MoE layer).
        per_row: ``dropped`` is per token; also fill ``MoeDrops.per_row``.
    """
    B, T = batch_shape
    if dropped is None:
        return MoeDrops(dropped=jnp.float32(0), copies=jnp.float32(0),
                        per_row=jnp.zeros((B,), jnp.int32) if per_row else None)
    n_valid = (jnp.float32(B * T) if valid is None
               else jnp.sum(jnp.asarray(valid, bool), dtype=jnp.float32))
    copies = n_valid * jnp.float32(dropped.shape[0] * copies_per_token)
    return MoeDrops(dropped=jnp.sum(dropped.astype(jnp.float32)), copies=copies,
                    per_row=jnp.sum(dropped, axis=(0, 2), dtype=jnp.int32) if per_row else None)


ROUTE_MISSING = -1
"""Expert id meaning "no recorded route" in a routes array (any value outside [0, E) does):
the MoE block routes such a token by its own router (:meth:`MoE.route`)."""


def route_dtype(num_experts: int) -> np.dtype:
    """Compact storage dtype of recorded expert ids (routing replay, ``moe.routing_replay``):
    int8 for up to 127 experts, int16 up to 32767, else int32; :data:`ROUTE_MISSING` fits all."""
    for dt in (np.int8, np.int16):
        if num_experts <= np.iinfo(dt).max:
            return np.dtype(dt)
    return np.dtype(np.int32)


def stack_routes(expert_ids: Sequence[Array]) -> Array:
    """Per-MoE-layer expert ids (list of [..., T, k]) -> one [..., T, n_moe_layers, k] array
    (the layout of ``Trajectory.routes`` / ``LearnerBatch.routes``)."""
    return jnp.stack([jnp.asarray(i) for i in expert_ids], axis=-2)


def unstack_routes(routes: Array | None) -> list[Array] | None:
    """[..., T, n_moe_layers, k] -> the per-MoE-layer list ``forced_expert_ids`` takes."""
    if routes is None:
        return None
    routes = jnp.asarray(routes)
    return [routes[..., i, :] for i in range(routes.shape[-2])]
