"""Weight-only quantisation of the rollout engine's matmul weights (``rollout.quantize``).

What production inference servers do to fit a model (vLLM / TensorRT-LLM "W8A16" weight-only
int8, fp8 e4m3 checkpoints, int4), as a rollout option, so the engine's numerics differ from the
fp32 learner's the way a real deployment's do (a train-infer gap where the mask bites).

Scheme: symmetric, per output channel (one scale per output element of the matmul: every axis
but the contracted input axes keeps its own scale, so a stacked ``[L, ...]`` layer axis and the
MoE expert axis get scales per layer / per expert), absmax calibration, no zero point::

    scale[c] = max_i |w[i, c]| / B          B = 127.5 (int8), 7.5 (int4), 448 (fp8 e4m3fn)
    q[i, c]  = convert(w[i, c] / scale[c])  round half to even, saturated to the type's range
                                             (int8 [-128, 127], int4 [-8, 7]); fp8: nearest e4m3
    w~[i, c] = q[i, c] * scale[c]

so ``|w - w~| <= scale / 2`` per channel for int8/int4 (the value at ``|w| = absmax`` maps to
``+-B`` and saturates by half a step), and ``|w - w~| <= 2^-4 |w| + 2^-10 scale`` for fp8 (3
mantissa bits; the e4m3fn subnormal spacing is 2^-9). The math is qwix 0.1.8's
(``qwix.quantize`` / ``qwix.dequantize``: google/qwix ``_src/core/qarray.py``, absmax
calibration, ``get_symmetric_bound`` = qmax + 0.5 for integer types); this module picks the
weights, the axes and the dtypes.

Which weights (the matmuls of every decoder layer): attention ``q_proj`` / ``k_proj`` /
``v_proj`` / ``o_proj``, the dense MLP's and every MoE expert's ``gate_proj`` / ``up_proj`` /
``down_proj``. Kept in the rollout dtype: the embedding (a row gather, not a matmul), the LM head
(the logits feed the sampled token's log-prob directly, and weight-only schemes such as vLLM's
AWQ / GPTQ / fp8 leave ``lm_head`` unquantised by default), the MoE router (tiny, and a routing
flip is a discrete change; vLLM's fp8 MoE keeps the gate in bf16 too), RMSNorm weights.

Storage: the engine keeps each quantised weight as a ``qwix.QArray`` (``qvalue`` int8 / int4 /
float8_e4m3fn of the weight's shape, ``scale`` float32 with 1 on the contracted axes) in its
params tree, so its resident copy of those weights is 1 byte per element (int8, fp8; int4: 4 bits
where the backend packs them, XLA:TPU does, XLA:CPU keeps a byte per element) instead of 2 (bf16).
:func:`dequantize_params` turns them back into compute-dtype arrays INSIDE each jitted engine
program (``Qwen3Engine._model``): a transient dequantised copy per program run, which XLA may
fuse into the consuming dot on GPU / TPU but need not. So the memory saving is real for the
resident weights; a bandwidth saving per decode step would need a fused int8 matmul kernel,
which this does not claim.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, get_args

import jax
import jax.numpy as jnp

__all__ = [
    "QUANTIZE_MODES",
    "QuantizeMode",
    "QTYPES",
    "QUANTIZED_WEIGHTS",
    "contracted_axes",
    "quantize_weight",
    "dequantize_weight",
    "quantize_params",
    "dequantize_params",
    "quantized_shardings",
    "is_qarray",
]

QuantizeMode = Literal["none", "int8", "fp8", "int4"]
QUANTIZE_MODES: tuple[str, ...] = get_args(QuantizeMode)
"""Values of ``rollout.quantize``."""

QTYPES: dict[str, Any] = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn, "int4": jnp.int4}
"""Storage dtype of ``qvalue`` per mode."""

# param name -> the contracted (input) axes, counted from the end, of the weight [..., in..., out...]:
# q/k/v [D, heads, Dh] contract D; o_proj [N, Dh, D] contracts (N, Dh); the MLP's and the MoE
# experts' gate/up [.., D, F] and down [.., F, D] contract the second-to-last axis. Leading axes
# (the stacked ``layers`` axis, the MoE ``expert`` axis) are never contracted: they get own scales.
QUANTIZED_WEIGHTS: dict[str, tuple[int, ...]] = {
    "q_proj": (-3,), "k_proj": (-3,), "v_proj": (-3,), "o_proj": (-3, -2),
    "gate_proj": (-2,), "up_proj": (-2,), "down_proj": (-2,),
}


def _check_mode(mode: str) -> None:
    if mode not in QUANTIZE_MODES:
        raise ValueError(f"rollout.quantize must be one of {QUANTIZE_MODES}, got {mode!r}")


def _qwix():
    import qwix  # imported on first use: only a quantised engine needs it

    return qwix


def is_qarray(x: Any) -> bool:
    """True for a ``qwix.QArray`` (a quantised weight of the engine's params tree)."""
    if type(x).__name__ != "QArray":
        return False
    return isinstance(x, _qwix().QArray)


def _param_name(path: tuple) -> Optional[str]:
    """The param's own name from a pytree path: the last string dict key / attribute other than the
    nnx ``Variable``'s ``value`` (``('layers', 0, 'attn', 'q_proj', .value)`` -> ``'q_proj'``)."""
    for entry in reversed(path):
        key = getattr(entry, "key", None)
        if key is None:
            key = getattr(entry, "name", None)
        if isinstance(key, str) and key != "value":
            return key
    return None


def contracted_axes(path: tuple, ndim: int) -> Optional[tuple[int, ...]]:
    """Non-negative contracted axes of the param at pytree ``path`` with ``ndim`` dims, or None when
    that param is not quantised (:data:`QUANTIZED_WEIGHTS`; the module docstring says why)."""
    rel = QUANTIZED_WEIGHTS.get(_param_name(path) or "")
    if rel is None or ndim < len(rel) + 1:
        return None
    return tuple(sorted(a % ndim for a in rel))


def quantize_weight(w: jax.Array, mode: str, contract: tuple[int, ...]) -> Any:
    """Symmetric per-output-channel weight quantisation (module docstring formula).

    Args:
        w: [..., in..., out...] float weight (fp32 master weights preferred: the scales are
            computed in ``w``'s dtype and stored as float32).
        mode: ``int8``, ``fp8`` (float8_e4m3fn) or ``int4``.
        contract: the contracted (input) axes of ``w``: they share a scale; every other axis is a
            channel with its own.

    Returns:
        ``qwix.QArray``: ``qvalue`` [w.shape] in :data:`QTYPES` ``[mode]``, ``scale`` float32 of
        ``w.shape`` with 1 on ``contract`` (an all-zero channel gets scale 1 and q = 0).

    Raises:
        ValueError: ``mode`` is not a quantising mode; ``contract`` names no axis of ``w``.

    Pure and jit-able (``mode`` and ``contract`` static).
    """
    if mode not in QTYPES:
        raise ValueError(f"quantize_weight: mode must be one of {tuple(QTYPES)}, got {mode!r}")
    contract = tuple(int(a) % w.ndim for a in contract)
    if not contract:
        raise ValueError(f"quantize_weight: contract must name at least one axis of a {w.ndim}-d weight")
    channels = tuple(a for a in range(w.ndim) if a not in contract)
    w = jnp.asarray(w)
    if w.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64):
        w = w.astype(jnp.float32)
    return _qwix().quantize(w, QTYPES[mode], channelwise_axes=channels, scale_dtype=jnp.float32)


def dequantize_weight(q: Any, dtype: Any = jnp.float32) -> jax.Array:
    """``q.qvalue * q.scale`` (in float32) cast to ``dtype``: the weight the engine's matmul uses."""
    return _qwix().dequantize(q).astype(dtype)


def quantize_params(params: Any, mode: str, dtype: Any) -> Any:
    """The engine's params tree: every weight of :data:`QUANTIZED_WEIGHTS` as a ``qwix.QArray``
    (:func:`quantize_weight`, from the values as given: pass the fp32 master weights), every other
    float leaf cast to ``dtype``, integer leaves as they are. ``mode="none"`` only casts.

    Args:
        params: an ``nnx.State`` (or a pytree of the same paths) of the model's params.
        mode: :data:`QUANTIZE_MODES`.
        dtype: the rollout compute dtype (``rollout.dtype``).

    Raises:
        ValueError: an unknown ``mode``.

    Pure and jit-able.
    """
    _check_mode(mode)

    def one(path, x):
        x = jnp.asarray(x)
        if not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        axes = contracted_axes(path, x.ndim) if mode != "none" else None
        return x.astype(dtype) if axes is None else quantize_weight(x, mode, axes)

    return jax.tree_util.tree_map_with_path(one, params)


def dequantize_params(params: Any, dtype: Any) -> Any:
    """Every ``qwix.QArray`` leaf of ``params`` dequantised to ``dtype``; the rest as they are. The
    result has the model's params tree (what ``nnx.merge`` takes). Pure and jit-able."""
    return jax.tree.map(lambda x: dequantize_weight(x, dtype) if is_qarray(x) else x, params, is_leaf=is_qarray)


def quantized_shardings(abstract_quantized: Any, shardings: Any) -> Any:
    """Shardings for a quantised params tree: ``qvalue`` as its weight, ``scale`` as its weight
    with the contracted (size-1) axes replicated.

    Args:
        abstract_quantized: ``jax.eval_shape`` of :func:`quantize_params` (``QArray`` leaves).
        shardings: the model's param shardings (``NamedSharding`` leaves, a tree like the params).

    Returns:
        A tree like ``abstract_quantized`` of ``NamedSharding``.
    """
    from jax.sharding import NamedSharding, PartitionSpec

    qwix = _qwix()

    def one(q, s):
        if not is_qarray(q):
            return s
        spec = tuple(s.spec) + (None,) * (q.qvalue.ndim - len(s.spec))
        scale_spec = PartitionSpec(*(None if n == 1 else p for n, p in zip(q.scale.shape, spec)))
        return qwix.QArray(qvalue=s, scale=NamedSharding(s.mesh, scale_spec), zero_point=None, qtype=q.qtype)

    return jax.tree.map(one, abstract_quantized, shardings, is_leaf=is_qarray)
