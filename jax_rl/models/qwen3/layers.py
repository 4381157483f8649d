"""Qwen3 building blocks: RMSNorm, RoPE, the dense projections, :class:`Attention`, :class:`MLP`, :class:`MoE` and :class:`DecoderLayer`, and
the remat policies over their ``checkpoint_name`` tags. The XLA attention cores (``attend``, ``attend_cached``,
``attend_cached_t``, with their custom VJPs) are :mod:`jax_rl.models.xla_attention`, re-exported here. Shapes and
parameter layout: the package docstring (:mod:`jax_rl.models.qwen3`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jax_rl.models import bitwise
from jax_rl.models.expert_parallel import (EPOptions, ep_capacity, expert_parallel_moe, expert_parallel_size,
                                           resolve_moe_matmul)
from jax_rl.models.qwen3.config import MoEOptions, Qwen3Config
from jax_rl.models.xla_attention import attend, attend_cached, attend_cached_t  # noqa: F401 (re-exported)
from jax_rl.sharding import constrain

Array = jax.Array

__all__ = [
    "RMSNorm",
    "rope_cos_sin",
    "apply_rope",
    "attend",
    "attend_cached",
    "attend_cached_t",
    "Attention",
    "MLP",
    "MoE",
    "capacity_keep",
    "DecoderLayer",
    "AttendFn",
    "LayerAttendFn",
    "REMAT_POLICIES",
    "remat_policy_fn",
]

# --------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------

_init_normal = jax.nn.initializers.normal(stddev=0.02)  # HF initializer_range=0.02


def _param(rngs: nnx.Rngs | None, shape: Sequence[int], names: tuple[str | None, ...],
           param_dtype, init=_init_normal) -> nnx.Param:
    """A Param with logical axis names in ``out_sharding`` metadata (not eagerly sharded)."""
    assert len(names) == len(shape), (names, shape)
    if init is None:
        value = jnp.ones(shape, param_dtype)
    else:
        value = init(rngs.params(), tuple(shape), param_dtype)
    return nnx.Param(value, out_sharding=tuple(names), eager_sharding=False)


def _constrain(x: Array, names: tuple[str | None, ...]) -> Array:
    """Sharding constraint on an activation by logical names, when a mesh is set."""
    return constrain(x, names)


class RMSNorm(nnx.Module):
    """RMSNorm with HF's cast order: normalise in fp32, cast back to the input dtype, then
    multiply by ``weight`` (HF ``Qwen3RMSNorm``). ``x [..., dim] -> [..., dim]``."""

    def __init__(self, dim: int, eps: float, *, param_dtype=jnp.float32,
                 names: tuple[str | None, ...] = ("norm",)):
        self.eps = eps
        self.weight = _param(None, (dim,), names, param_dtype, init=None)

    def __call__(self, x: Array) -> Array:
        dt = x.dtype
        xf = x.astype(jnp.float32)
        var = jnp.mean(jnp.square(xf), axis=-1, keepdims=True)
        y = (xf * jax.lax.rsqrt(var + self.eps)).astype(dt)
        return self.weight[...].astype(dt) * y


def rope_cos_sin(positions: Array, head_dim: int, theta: float) -> tuple[Array, Array]:
    """HF default RoPE tables. ``positions [B,T] int -> cos, sin [B,T,H] float32``."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B,T,H/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
    """Rotate-half RoPE. ``x [B,T,n,H]``, ``cos/sin [B,T,H]`` (cast to x.dtype as HF does)."""
    cos = cos[:, :, None, :].astype(x.dtype)
    sin = sin[:, :, None, :].astype(x.dtype)
    h = x.shape[-1] // 2
    rot = jnp.concatenate([-x[..., h:], x[..., :h]], axis=-1)
    return x * cos + rot * sin


def _wgrad(x: Array, dy: Array) -> Array:
    """``x^T @ dy`` for x [M,I], dy [M,O] -> [I,O]. XLA:CPU's fast GEMM wants row-major
    operands, so the smaller of the two is transposed explicitly (the barrier stops XLA from
    folding the transpose back into the dot and transposing - or fusing elementwise producers
    into a transpose of - the larger one)."""
    if x.shape[1] <= dy.shape[1]:
        return jnp.dot(jax.lax.optimization_barrier(x.T), dy)
    return jnp.dot(jax.lax.optimization_barrier(dy.T), x).T


def _contract(x: Array, w: Array, n_in: int) -> Array:
    """The last ``n_in`` dims of x against the first ``n_in`` of w, w in its stored shape (the bitwise mode on
    XLA:CPU: in fixed chunks of the contraction, :func:`jax_rl.models.bitwise.chunked_contract`)."""
    if bitwise.k_chunks(math.prod(x.shape[x.ndim - n_in:])) > 1:
        return bitwise.chunked_contract(x, w, n_in)
    dims = ((tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in))), ((), ()))
    return jax.lax.dot_general(x, w, dims)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _proj(x: Array, w: Array, n_in: int = 1) -> Array:
    """Contract the last ``n_in`` dims of x with the first ``n_in`` of w (an einsum such as
    ``btd,dnh->btnh``), in x.dtype.

    The forward contracts w in its stored shape: flattening ``[D, K, H]`` to ``[D, K*H]`` is
    not a bitcast under the TPU's (8, 128) tiling, so a reshaped weight is copied into a new
    layout every decode step (462 MiB per step at Qwen3-0.6B x 32 slots, by the TPU compiler;
    docs/history.md). The backward works on 2-D views laid out for XLA:CPU (``_wgrad``)."""
    return _contract(x, w, n_in)


def _proj_fwd(x, w, n_in):
    return _contract(x, w, n_in), (x, w)


def _proj_bwd(n_in, res, dy):
    x, w = res
    w2 = w.reshape(math.prod(w.shape[:n_in]), math.prod(w.shape[n_in:]))
    dy2 = dy.astype(x.dtype).reshape(-1, w2.shape[1])
    dx = jnp.dot(dy2, w2.T).reshape(x.shape)
    dw = _wgrad(x.reshape(-1, w2.shape[0]), dy2)
    return dx, dw.reshape(w.shape).astype(w.dtype)


_proj.defvjp(_proj_fwd, _proj_bwd)


class Attention(nnx.Module):
    """Qwen3 attention: q/k/v projections, per-head q_norm/k_norm over head_dim (before RoPE),
    rotate-half RoPE, GQA, o_proj. No biases."""

    def __init__(self, cfg: Qwen3Config, *, rngs: nnx.Rngs, dtype, param_dtype):
        D, N, K, H = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.dtype = dtype
        self.theta = cfg.rope_theta
        self.q_proj = _param(rngs, (D, N, H), ("embed", "q_heads", "head_dim"), param_dtype)
        self.k_proj = _param(rngs, (D, K, H), ("embed", "kv_heads", "head_dim"), param_dtype)
        self.v_proj = _param(rngs, (D, K, H), ("embed", "kv_heads", "head_dim"), param_dtype)
        self.o_proj = _param(rngs, (N, H, D), ("q_heads", "head_dim", "embed"), param_dtype)
        self.q_norm = RMSNorm(H, cfg.rms_norm_eps, param_dtype=param_dtype, names=("head_dim",))
        self.k_norm = RMSNorm(H, cfg.rms_norm_eps, param_dtype=param_dtype, names=("head_dim",))

    def qkv(self, x: Array, positions: Array) -> tuple[Array, Array, Array]:
        """x [B,T,D], positions [B,T] -> q [B,T,N,H], k/v [B,T,K,H] (normed + rotated)."""
        dt = self.dtype
        x = x.astype(dt)
        q = _proj(x, self.q_proj[...].astype(dt))
        k = _proj(x, self.k_proj[...].astype(dt))
        v = _proj(x, self.v_proj[...].astype(dt))
        q, k, v = (checkpoint_name(q, "query_proj"), checkpoint_name(k, "key_proj"),
                   checkpoint_name(v, "value_proj"))
        q = self.q_norm(q)
        k = self.k_norm(k)
        cos, sin = rope_cos_sin(positions, q.shape[-1], self.theta)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def out(self, o: Array) -> Array:
        """o [B,T,N,H] -> [B,T,D]."""
        return checkpoint_name(
            _proj(o.astype(self.dtype), self.o_proj[...].astype(self.dtype), n_in=2), "out_proj")


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``. x [B,T,D] -> [B,T,D]."""

    def __init__(self, D: int, F: int, *, rngs: nnx.Rngs, dtype, param_dtype):
        self.dtype = dtype
        self.gate_proj = _param(rngs, (D, F), ("embed", "mlp"), param_dtype)
        self.up_proj = _param(rngs, (D, F), ("embed", "mlp"), param_dtype)
        self.down_proj = _param(rngs, (F, D), ("mlp", "embed"), param_dtype)

    def __call__(self, x: Array) -> Array:
        dt = self.dtype
        x = x.astype(dt)
        g = checkpoint_name(_proj(x, self.gate_proj[...].astype(dt)), "mlpwi_0")
        u = checkpoint_name(_proj(x, self.up_proj[...].astype(dt)), "mlpwi_1")
        return checkpoint_name(_proj(jax.nn.silu(g) * u, self.down_proj[...].astype(dt)), "mlpwo")


class MoE(nnx.Module):
    """Qwen3-MoE sparse block (no shared expert).

    Router (HF ``Qwen3MoeTopKRouter``): ``logits = x @ router`` in fp32, softmax over all E
    experts, top-k, renormalise the k weights when ``norm_topk_prob``. Output
    ``sum_k w_k * expert_{id_k}(x)``. ``dispatch="dense"`` computes every expert on every
    token with one-hot combine weights (small/CPU); ``dispatch="ragged"`` sorts token copies by
    expert and uses ``jax.lax.ragged_dot`` (grouped matmul). Both give the same result.

    Expert parallelism is automatic: with ``dispatch="ragged"`` under a ``jax.set_mesh`` mesh
    whose ``expert`` axis is > 1, the token copies are sent to the expert shards that hold
    their experts and back (``jax_rl.models.expert_parallel.expert_parallel_moe``: a
    ``shard_map`` with ``all_to_all`` of fixed-capacity buffers, local experts by
    ``ragged_dot``; MaxText ``moe.py`` EP / GShard capacity). ``capacity_factor`` applies
    there only: ``None`` (default) is dropless, a number > 0 sizes the exchange buffers to
    that multiple of the uniform load and drops (zero contribution) the copies over it. The
    dense path and the single-shard ragged path are dropless unless ``capacity_all_paths``
    (the rollout engine's ``rollout.moe_capacity_factor``): then they drop too, by
    :func:`capacity_keep` (per expert, per forward call). ``num_experts`` must
    divide by ``mesh.expert`` on the EP path (ValueError otherwise).

    ``matmul``: the EP path's grouped matmul, ``ragged_dot``, ``megablox`` (Pallas TPU kernels,
    whose weight gradient costs 1x instead of ragged_dot's G x on TPU) or ``auto`` (megablox on a
    TPU backend; resolved at construction into ``self.matmul``); see
    :func:`jax_rl.models.expert_parallel.grouped_matmul`. The single-shard ragged path always
    uses ``ragged_dot``.

    ``router_dtype``: the dtype of the router matmul's inputs and logits (``float32`` default:
    the learner's; ``bfloat16`` = the engine's ``rollout.moe_router_dtype``, as a server computing
    the gate linear in the model dtype, e.g. vLLM's ``FusedMoE`` gate, whose top-k softmax then
    runs in fp32 on the bf16 logits: here too, softmax and top-k are fp32 on the rounded logits).
    """

    def __init__(self, cfg: Qwen3Config, *, rngs: nnx.Rngs, dtype, param_dtype,
                 dispatch: str = "dense", capacity_factor: float | None = None, matmul: str = "ragged_dot",
                 router_dtype: Any = jnp.float32, capacity_all_paths: bool = False):
        if dispatch not in ("dense", "ragged"):
            raise ValueError(f"moe_dispatch must be 'dense' or 'ragged', got {dispatch!r}")
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(f"moe_capacity_factor must be > 0 or None (dropless), "
                             f"got {capacity_factor}")
        D, F, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
        self.dtype = dtype
        self.dispatch = dispatch
        self.capacity_factor = capacity_factor
        self.capacity_all_paths = bool(capacity_all_paths)
        self.router_dtype = jnp.dtype(router_dtype)
        self.matmul = resolve_moe_matmul(matmul)
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.router = _param(rngs, (D, E), ("embed", "router"), param_dtype)
        self.gate_proj = _param(rngs, (E, D, F), ("expert", "embed", "mlp"), param_dtype)
        self.up_proj = _param(rngs, (E, D, F), ("expert", "embed", "mlp"), param_dtype)
        self.down_proj = _param(rngs, (E, F, D), ("expert", "mlp", "embed"), param_dtype)

    def route(self, x: Array, forced_expert_ids: Array | None = None) -> tuple[Array, Array]:
        """x [B,T,D] -> (weights [B,T,k] float32, expert ids [B,T,k] int32)."""
        rd = self.router_dtype  # float32 (the default): the learner's routing
        logits = jnp.einsum("btd,de->bte", x.astype(rd), self.router[...].astype(rd)).astype(jnp.float32)
        probs = jax.nn.softmax(logits, axis=-1)
        if forced_expert_ids is None:
            w, ids = jax.lax.top_k(probs, self.top_k)
        else:
            ids = jnp.asarray(forced_expert_ids).astype(jnp.int32)
            if ids.shape != probs.shape[:-1] + (self.top_k,):
                raise ValueError(f"forced_expert_ids shape {ids.shape} != "
                                 f"{probs.shape[:-1] + (self.top_k,)}")
            # a token whose forced ids hold a value outside [0, E) (ROUTE_MISSING: no recorded
            # route, e.g. padding or a trajectory's last token) is routed by the router's top-k
            E = probs.shape[-1]
            missing = jnp.any((ids < 0) | (ids >= E), axis=-1, keepdims=True)
            ids = jnp.where(missing, jax.lax.top_k(probs, self.top_k)[1], ids)
            # routing replay: the gates are the router's softmax over all E experts taken at the
            # forced ids (renormalised below as Qwen3 does), so the router still gets gradient
            w = jnp.take_along_axis(probs, ids, axis=-1)
        if self.norm_topk_prob:
            w = w / jnp.sum(w, axis=-1, keepdims=True)
        return w, ids.astype(jnp.int32)

    def __call__(self, x: Array, forced_expert_ids: Array | None = None, valid: Array | None = None,
                 dropped_per_token: bool = False) -> tuple[Array, Array, Array]:
        """x [B,T,D] -> (y [B,T,D] compute dtype, expert ids [B,T,k] int32, dropped), always three
        (no flag changes the arity; an unused ``dropped`` costs nothing under jit).

        ``forced_expert_ids`` [B,T,k] int: use these experts instead of the top-k (routing
        replay); their router probabilities are the combine weights (renormalised over the k
        forced ids when ``norm_topk_prob``). A token whose ids hold any value outside
        ``[0, E)`` (:data:`ROUTE_MISSING`) falls back to the router's own top-k.

        ``valid`` [B,T] bool (e.g. the attention mask): on the EP path a False token (padding)
        takes no capacity slot and gets y = 0; the other paths ignore it unless they drop
        (``capacity_all_paths``: a False token takes no slot there either).
        ``dropped``: the int32 [] count of valid token copies dropped
        for capacity (``expert_parallel_moe``, or :func:`capacity_keep`; 0 on a dropless path);
        with ``dropped_per_token`` that count per token instead, int32 [B, T] (summed over the k
        copies; the rollout engine attributes its drops to its slots)."""
        dt = self.dtype
        x = x.astype(dt)
        w, ids = self.route(x, forced_expert_ids)
        wg = self.gate_proj[...].astype(dt)
        wu = self.up_proj[...].astype(dt)
        wd = self.down_proj[...].astype(dt)
        dropped = jnp.zeros(ids.shape[:2], jnp.int32) if dropped_per_token else jnp.int32(0)
        local = self.dispatch == "dense" or expert_parallel_size() <= 1
        if local and self.capacity_all_paths and self.capacity_factor is not None:
            keep, dropped = capacity_keep(ids, valid, wg.shape[0], self.capacity_factor)
            if dropped_per_token:
                ok = jnp.ones(ids.shape[:2], bool) if valid is None else jnp.asarray(valid, bool)
                dropped = jnp.sum(ok[..., None] & ~keep, axis=-1, dtype=jnp.int32)
            w = jnp.where(keep, w, 0.0)  # a dropped copy contributes nothing; the residual passes
        if self.dispatch == "dense":
            E = wg.shape[0]
            combine = jnp.einsum("btk,btke->bte", w.astype(dt), jax.nn.one_hot(ids, E, dtype=dt))
            g = jnp.einsum("btd,edf->btef", x, wg)
            u = jnp.einsum("btd,edf->btef", x, wu)
            a = jax.nn.silu(g) * u * combine[..., None]
            y = jnp.einsum("btef,efd->btd", a, wd)
        elif expert_parallel_size() > 1:
            opts = EPOptions(capacity_factor=self.capacity_factor, matmul=self.matmul, per_token=dropped_per_token)
            y, dropped, tok = expert_parallel_moe(x, w.astype(dt), ids, wg, wu, wd, valid=valid, options=opts)
            dropped = tok if dropped_per_token else dropped
        else:
            y = self._ragged(x, w.astype(dt), ids, wg, wu, wd)
        return y, ids, dropped

    @staticmethod
    def _ragged(x, w, ids, wg, wu, wd):
        B, T, D = x.shape
        k = ids.shape[-1]
        E = wg.shape[0]
        xf = x.reshape(B * T, D)
        flat_ids = ids.reshape(-1)  # [B*T*k]
        order = jnp.argsort(flat_ids, stable=True)
        token_idx = order // k
        xs = xf[token_idx]  # [B*T*k, D] sorted by expert
        group_sizes = jnp.bincount(flat_ids, length=E).astype(jnp.int32)
        g = jax.lax.ragged_dot(xs, wg, group_sizes)
        u = jax.lax.ragged_dot(xs, wu, group_sizes)
        ys = jax.lax.ragged_dot(jax.nn.silu(g) * u, wd, group_sizes)  # [B*T*k, D]
        ys = ys * w.reshape(-1)[order][:, None]
        y = jnp.zeros_like(xf).at[token_idx].add(ys)
        return y.reshape(B, T, D)


def capacity_keep(ids: Array, valid: Array | None, num_experts: int,
                  capacity_factor: float) -> tuple[Array, Array]:
    """GShard capacity on one device: which token copies an expert takes in one forward call.

    Each expert takes at most ``C = ceil(capacity_factor * B*T*k / E)`` copies (the uniform load
    times the factor, at least 1: :func:`jax_rl.models.expert_parallel.ep_capacity` with the E
    experts in place of the EP shards), filled first-choice first (all top-1 copies in token
    order, then all top-2 copies, ...: GShard's priority, Lepikhin et al. 2020 arXiv:2006.16668
    section 2.2, as the EP path fills its slots); a copy that finds its expert full is dropped.
    Invalid tokens (``valid`` False: padding, an inactive decode slot) take no slot.

    Args:
        ids: [B, T, k] int expert ids.
        valid: [B, T] bool, or None (every token valid).
        num_experts: E.
        capacity_factor: > 0.

    Returns:
        ``(keep [B, T, k] bool, dropped int32 [])``: ``keep`` False for dropped and invalid copies;
        ``dropped`` counts the valid copies dropped.

    Raises:
        ValueError: ``capacity_factor <= 0``.
    """
    B, T, k = ids.shape
    cap = ep_capacity(B * T * k, num_experts, capacity_factor)
    ok = jnp.ones((B, T), bool) if valid is None else jnp.asarray(valid, bool)
    order = jnp.transpose(ids.astype(jnp.int32), (2, 0, 1)).reshape(-1)  # [k*B*T], choice-major
    ok_c = jnp.broadcast_to(ok[None], (k, B, T)).reshape(-1)
    hot = jax.nn.one_hot(order, num_experts, dtype=jnp.int32) * ok_c[:, None].astype(jnp.int32)
    rank = jnp.sum((jnp.cumsum(hot, axis=0) - hot) * hot, axis=-1)  # earlier copies to the same expert
    keep_c = ok_c & (rank < cap)
    dropped = jnp.sum(ok_c & ~keep_c, dtype=jnp.int32)
    return jnp.transpose(keep_c.reshape(k, B, T), (1, 2, 0)), dropped


AttendFn = Callable[[Array, Array, Array], Array]
LayerAttendFn = Callable[[Array, Array, Array, Any], tuple[Array, Any]]


class DecoderLayer(nnx.Module):
    """Pre-norm block: ``h = x + attn(norm_in(x))``; ``out = h + mlp(norm_post(h))``; ``moe``: an MoE
    layer's execution options (:class:`jax_rl.models.qwen3.MoEOptions`)."""

    def __init__(self, cfg: Qwen3Config, layer_idx: int, *, rngs: nnx.Rngs, dtype, param_dtype,
                 moe: MoEOptions = MoEOptions()):
        self.is_moe = cfg.layer_is_moe(layer_idx)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps,
                                                param_dtype=param_dtype)
        self.attn = Attention(cfg, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        if self.is_moe:
            self.mlp = MoE(cfg, rngs=rngs, dtype=dtype, param_dtype=param_dtype,
                           dispatch=moe.dispatch, capacity_factor=moe.capacity_factor, matmul=moe.matmul,
                           router_dtype=moe.router_dtype, capacity_all_paths=moe.capacity_all_paths)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, rngs=rngs, dtype=dtype,
                           param_dtype=param_dtype)

    def __call__(self, x: Array, positions: Array, attend_fn: AttendFn,
                 forced_expert_ids: Array | None = None, valid: Array | None = None,
                 drops_per_token: bool = False) -> tuple[Array, Array | None, Array | None]:
        """x [B,T,D] -> (x [B,T,D], expert ids [B,T,k] or None, MoE capacity drops int32 [] or
        None; [B,T] per token with ``drops_per_token``). ``attend_fn(q,k,v)`` does the attention
        core (full-sequence, prefill or cached decode); ``valid`` [B,T] bool: the tokens that take
        MoE capacity (:class:`MoE`)."""
        q, k, v = self.attn.qkv(self.input_layernorm(x), positions)
        h = x + self.attn.out(checkpoint_name(attend_fn(q, k, v), "context")).astype(x.dtype)
        y = self.post_attention_layernorm(h)
        if self.is_moe:
            y, ids, dropped = self.mlp(y, forced_expert_ids, valid=valid,
                                       dropped_per_token=drops_per_token)
        else:
            y, ids, dropped = self.mlp(y), None, None
        out = h + y.astype(h.dtype)
        return _constrain(out, ("activation_batch", "activation_length", "activation_embed")), ids, dropped


# --------------------------------------------------------------------------------------
# Remat policies
# --------------------------------------------------------------------------------------

_SAVE_NAMES = {  # MaxText ``remat_policy`` -> checkpoint_name tags whose values are kept
    "minimal": ("query_proj", "key_proj", "value_proj", "context", "out_proj", "mlpwi_0",
                "mlpwi_1", "mlpwo"),
    "save_dot_with_context_except_mlp": ("query_proj", "key_proj", "value_proj", "context",
                                         "out_proj"),
    "save_dot_except_mlpwi": ("query_proj", "key_proj", "value_proj", "out_proj", "mlpwo"),
    "save_dot_except_mlp": ("query_proj", "key_proj", "value_proj", "out_proj"),
    "save_qkv_proj": ("query_proj", "key_proj", "value_proj"),
    "save_out_proj": ("out_proj",),
}
REMAT_POLICIES: tuple[str, ...] = ("none", "full", *_SAVE_NAMES)
"""Names accepted by ``remat_policy`` (MaxText ``remat_policy`` names, plus ``none``)."""


def remat_policy_fn(name: str):
    """The ``jax.checkpoint`` policy for a MaxText remat-policy name (None for ``full``: save
    nothing but the layer inputs). The tags are ``checkpoint_name``s in this module: matmul
    outputs ``query_proj``/``key_proj``/``value_proj``/``out_proj``/``mlpwi_0``/``mlpwi_1``/
    ``mlpwo`` and the attention output ``context``. ``minimal`` keeps every one of them
    (MaxText keeps all dots without batch dims; ours are tagged because they run through a
    custom VJP). Raises ValueError for an unknown name or ``none``."""
    if name == "full":
        return None
    if name not in _SAVE_NAMES:
        raise ValueError(f"remat_policy {name!r} has no checkpoint policy; one of "
                         f"{REMAT_POLICIES[1:]}")
    return jax.checkpoint_policies.save_only_these_names(*_SAVE_NAMES[name])
