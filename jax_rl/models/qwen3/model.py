"""The Qwen3 / Qwen3-MoE causal LM (:class:`Qwen3ForCausalLM`: full forward, prefill, cached
decode), the ``scan_layers`` stacking helpers, the attention / scan-unroll choices, the routing
replay route helpers, :func:`count_params` and :func:`model_kwargs`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_rl.models.qwen3.cache import KVCache
from jax_rl.models.qwen3.config import Qwen3Config
from jax_rl.models.qwen3.layers import (
    REMAT_POLICIES,
    AttendFn,
    DecoderLayer,
    LayerAttendFn,
    RMSNorm,
    _attend_causal,
    _constrain,
    _param,
    attend,
    attend_cached,
    attend_cached_t,
    remat_policy_fn,
)

Array = jax.Array

__all__ = [
    "Qwen3ForCausalLM",
    "ATTENTION_KINDS",
    "resolve_attention",
    "resolve_scan_unroll",
    "stack_layer_params",
    "unstack_layer_params",
    "ROUTE_MISSING",
    "route_dtype",
    "stack_routes",
    "unstack_routes",
    "count_params",
    "model_kwargs",
]


# --------------------------------------------------------------------------------------
# Layer stacking (scan_layers), attention choice
# --------------------------------------------------------------------------------------

ATTENTION_KINDS: tuple[str, ...] = ("auto", "xla", "splash", "cudnn")


def resolve_scan_unroll(unroll: int | bool | str, num_layers: int) -> int:
    """``model.scan_unroll`` -> the ``unroll`` of the scanned decoder stack's ``jax.lax.scan``
    (layers per loop iteration, 1..``num_layers``): ``"auto"`` = ``num_layers`` (the whole stack
    written out, no loop) on the CPU backend and 1 elsewhere; ``"full"`` / ``True`` =
    ``num_layers``; ``False`` = 1; an int n >= 1 is clipped to ``num_layers``.

    On XLA:CPU a one-layer loop body costs the ``ppo`` learner 8-13% per step against the
    written-out stack (``bench/learner_step.py``: per-iteration slices of the stacked params and
    gradient updates into them, no fusion across layers); with the extra no-grad forward of
    ``decoupled`` / ``ppo_ewma`` the two measured within noise. On a TPU the loop is what keeps compile time
    independent of depth (MaxText ``scan_layers``), so ``auto`` keeps it there.
    Unrolling changes no op, only XLA's fusion: values agree to fp32 rounding.

    Raises:
        ValueError: another string, or an int < 1.
    """
    if isinstance(unroll, str):
        if unroll == "auto":
            return num_layers if jax.default_backend() == "cpu" else 1
        if unroll == "full":
            return num_layers
        raise ValueError(f"scan_unroll must be 'auto', 'full' or an int >= 1, got {unroll!r}")
    if isinstance(unroll, bool):
        return num_layers if unroll else 1
    if int(unroll) < 1:
        raise ValueError(f"scan_unroll must be 'auto', 'full' or an int >= 1, got {unroll!r}")
    return min(int(unroll), max(num_layers, 1))


def resolve_attention(kind: str) -> str:
    """``auto`` -> ``splash`` on a TPU backend, else ``xla``; ``xla``/``splash``/``cudnn``
    unchanged (``cudnn`` is opt-in until measured on a GPU). Raises ValueError for other names."""
    if kind not in ATTENTION_KINDS:
        raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {kind!r}")
    if kind == "auto":
        return "splash" if jax.default_backend() == "tpu" else "xla"
    return kind


def _stack_layers(layers: Sequence[nnx.Module]) -> nnx.Module:
    """Stack L same-structure modules into the first one: every Param becomes [L, ...] with
    logical names ``("layers", *names)`` (MaxText's stacked ``layers`` axis)."""
    states = [nnx.state(m) for m in layers]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *states)
    first = layers[0]
    nnx.update(first, stacked)
    for _, var in nnx.iter_graph(first):
        if isinstance(var, nnx.Variable):
            names = var.get_metadata().get("out_sharding")
            if names is not None:
                var.set_metadata("out_sharding", ("layers", *names))
    return first


def stack_layer_params(params: dict, num_layers: int) -> dict:
    """A nested params dict of the unrolled layout (``params["layers"][i][...]``, e.g. a pure
    dict from ``nnx.to_pure_dict``) -> the ``scan_layers`` layout (``params["layers"][...]`` of
    [L, ...]). Raises ValueError when ``layers`` is not the unrolled layout with L entries."""
    layers = params.get("layers")
    if not isinstance(layers, dict) or sorted(layers) != list(range(num_layers)):
        raise ValueError(f"params['layers'] is not an unrolled stack of {num_layers} layers")
    out = dict(params)
    out["layers"] = jax.tree.map(lambda *xs: jnp.stack(xs), *[layers[i] for i in range(num_layers)])
    return out


def unstack_layer_params(params: dict, num_layers: int) -> dict:
    """Inverse of ``stack_layer_params``: [L, ...] leaves -> ``params["layers"][i]``."""
    out = dict(params)
    out["layers"] = {i: jax.tree.map(lambda a, i=i: a[i], params["layers"])
                     for i in range(num_layers)}
    return out


# --------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------


class Qwen3ForCausalLM(nnx.Module):
    """Qwen3 / Qwen3-MoE causal LM (HF ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM``).

    ``dtype`` is the compute dtype (params are cast on use), ``param_dtype`` the storage
    dtype. Logits are always float32. ``moe_dispatch``: ``"dense"`` or ``"ragged"``
    (expert-parallel under a mesh with ``expert`` > 1, see :class:`MoE`);
    ``moe_capacity_factor``: that EP path's capacity factor, None = dropless; ``moe_matmul``:
    its grouped matmul (``ragged_dot``, ``megablox`` or ``auto``, see :class:`MoE`).
    ``moe_router_dtype``: the router matmul's dtype (``float32`` default; the rollout engine's
    ``rollout.moe_router_dtype``); ``moe_capacity_all_paths``: ``moe_capacity_factor`` drops token
    copies on the dense and single-shard paths too (the engine's ``rollout.moe_capacity_factor``;
    :func:`jax_rl.models.qwen3.layers.capacity_keep`).

    ``scan_layers``: store the decoder layers' params stacked on a leading ``layers`` axis
    (``self.layers`` is then one ``DecoderLayer`` whose params are ``[L, ...]``, logical names
    ``("layers", ...)``) and run the stack under ``jax.lax.scan`` (MaxText ``scan_layers``):
    one layer is compiled instead of L. Needs every layer of the same kind (all dense or all
    MoE); a mixed stack (``decoder_sparse_step > 1`` / ``mlp_only_layers``) stays unrolled and
    ``self.scan_layers`` is False. Same logits as the unrolled layout (bit-identical on CPU
    fp32 in our tests).

    ``remat_policy``: rematerialisation of each decoder layer in the backward pass, MaxText
    names (``REMAT_POLICIES``): ``none`` (keep all activations), ``full`` (keep only the layer
    input), ``minimal`` (keep matmul outputs without batch dims), ``save_dot_except_mlp``,
    ``save_dot_with_context_except_mlp``, ``save_dot_except_mlpwi``, ``save_qkv_proj``,
    ``save_out_proj``. ``remat=True`` (older flag) means ``full`` when no policy is given.

    ``attention``: ``xla`` (einsum softmax attention, HF eager numerics), ``splash`` (Pallas
    TPU splash attention for full forwards and prefill; decode stays ``xla``), ``cudnn``
    (``jax.nn.dot_product_attention``'s cuDNN flash attention on a GPU, right padding only,
    full forwards and prefill: :func:`jax_rl.models.attention.cudnn_attend`) or ``auto``
    (``splash`` when ``jax.default_backend() == "tpu"``, else ``xla``; resolved here, at
    construction, into ``self.attention``).
    """

    def __init__(self, config: Qwen3Config, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 param_dtype=jnp.float32, moe_dispatch: str = "dense", remat: bool = False,
                 scan_layers: bool = False, remat_policy: str | None = None,
                 attention: str = "xla", moe_capacity_factor: float | None = None,
                 moe_matmul: str = "ragged_dot", scan_unroll: int | bool | str = 1,
                 moe_router_dtype: Any = "float32", moe_capacity_all_paths: bool = False):
        cfg = config
        self.config = cfg
        self.dtype = jnp.dtype(dtype)
        self.param_dtype = jnp.dtype(param_dtype)
        if remat_policy is None:
            remat_policy = "full" if remat else "none"
        if remat_policy not in REMAT_POLICIES:
            raise ValueError(f"remat_policy must be one of {sorted(REMAT_POLICIES)}, "
                             f"got {remat_policy!r}")
        self.remat_policy = remat_policy
        self.remat = remat_policy != "none"
        self.attention = resolve_attention(attention)
        kinds = {cfg.layer_is_moe(i) for i in range(cfg.num_hidden_layers)}
        self.scan_layers = bool(scan_layers) and len(kinds) == 1
        self.scan_unroll = resolve_scan_unroll(scan_unroll, cfg.num_hidden_layers)
        self.embed_tokens = _param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"),
                                   param_dtype)
        layers = [
            DecoderLayer(cfg, i, rngs=rngs, dtype=self.dtype, param_dtype=param_dtype,
                         moe_dispatch=moe_dispatch, moe_capacity_factor=moe_capacity_factor,
                         moe_matmul=moe_matmul, moe_router_dtype=jnp.dtype(moe_router_dtype),
                         moe_capacity_all_paths=moe_capacity_all_paths)
            for i in range(cfg.num_hidden_layers)
        ]
        if self.scan_layers:
            self.layers = _stack_layers(layers)
        else:
            self.layers = nnx.List(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = _param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"),
                                  param_dtype)
        else:
            self.lm_head = None

    # ---- pieces --------------------------------------------------------------------------
    def embed(self, input_ids: Array) -> Array:
        """input_ids [B,T] int -> [B,T,D] (compute dtype)."""
        x = jnp.take(self.embed_tokens[...], input_ids, axis=0).astype(self.dtype)
        return _constrain(x, ("activation_batch", "activation_length", "activation_embed"))

    def lm_logits(self, h: Array) -> Array:
        """Final-normed hidden h [B,T,D] -> logits [B,T,V] float32 (tied: ``h @ embed.T``)."""
        h = h.astype(self.dtype)
        if self.lm_head is None:
            return jnp.einsum("btd,vd->btv", h, self.embed_tokens[...].astype(self.dtype),
                              preferred_element_type=jnp.float32)
        return jnp.einsum("btd,dv->btv", h, self.lm_head[...].astype(self.dtype),
                          preferred_element_type=jnp.float32)

    def _forced_for(self, forced_expert_ids, moe_idx: int):
        if forced_expert_ids is None:
            return None
        return forced_expert_ids[moe_idx]

    def _trunk(self, x: Array, positions: Array, attend: LayerAttendFn, layer_xs: Any = None,
               forced_expert_ids=None, output_hidden_states: bool = False, remat: bool = False,
               carry: Any = None, valid: Array | None = None, moe_drops: list | None = None,
               moe_row_drops: list | None = None):
        """Runs the decoder stack.

        ``attend(q, k, v, xs_i) -> (o, ys_i)`` does the attention core of one layer; ``xs_i`` is
        layer i's slice of ``layer_xs`` (a pytree of [L, ...] arrays, e.g. the KV cache, or
        None) and the ``ys_i`` (same structure for every layer, or None) come back stacked
        [L, ...]. Returns (final-normed h, expert ids list, hidden list | None, stacked ys).

        With ``carry`` (a pytree threaded through the layers in order, e.g. the whole KV cache
        updated in place) the signature is ``attend(q, k, v, xs_i, carry) -> (o, ys_i, carry)``
        and the final carry is returned fifth. Under ``scan_layers`` it is the scan carry, so
        XLA updates its buffers in place instead of restacking per-layer outputs.

        ``valid`` [B,T] bool: the tokens that take MoE capacity (padding does not; :class:`MoE`).
        ``moe_drops``: a list the trunk appends ``(dropped, copies)`` to, float32 [] each: the
        token copies the MoE layers' expert-parallel dispatch dropped for capacity and the valid
        copies routed (valid tokens x k x MoE layers), summed over the layers.
        ``moe_row_drops``: a list the trunk appends one int32 [B] to: each row's valid token copies
        dropped for capacity, summed over its tokens and the MoE layers (zeros for a dropless or
        dense model; the rollout engine's per-slot count).
        """
        per_token = moe_row_drops is not None
        policy = remat_policy_fn(self.remat_policy) if remat else None
        with_carry = carry is not None

        def run(graphdef, state, x, positions, xs_i, forced, c):
            layer = nnx.merge(graphdef, state)
            box = {}

            def fn(q, k, v):
                if with_carry:
                    o, box["ys"], box["c"] = attend(q, k, v, xs_i, c)
                else:
                    (o, box["ys"]), box["c"] = attend(q, k, v, xs_i), None
                return o

            x, ids, dropped = layer(x, positions, fn, forced, valid, drops_per_token=per_token)
            return x, ids, dropped, box["ys"], box["c"]

        if remat:
            # CSE across the remat boundary is blocked by the loop itself only when the scan
            # keeps one layer per iteration.
            run = jax.checkpoint(run, policy=policy,
                                 prevent_cse=not self.scan_layers or self.scan_unroll != 1,
                                 static_argnums=(0,))
        if self.scan_layers:
            out = self._trunk_scanned(run, x, positions, layer_xs, forced_expert_ids,
                                      output_hidden_states, carry)
            self._count_drops(moe_drops, out[-1], valid, x.shape[:2])
            self._row_drops(moe_row_drops, out[-1], x.shape[0])
            return out[:5] if with_carry else out[:4]
        expert_ids: list[Array] = []
        drops: list[Array] = []
        hidden = [x] if output_hidden_states else None
        ys_list = []
        moe_idx = 0
        for i, layer in enumerate(self.layers):
            forced = None
            if layer.is_moe:
                forced = self._forced_for(forced_expert_ids, moe_idx)
                moe_idx += 1
            if layer_xs is None or isinstance(layer_xs, tuple) and len(layer_xs) == len(self.layers) \
                    and all(isinstance(a, int) for a in layer_xs):
                xs_i = None if layer_xs is None else layer_xs[i]  # static per-layer values
            else:
                xs_i = jax.tree.map(lambda a, i=i: a[i], layer_xs)
            graphdef, state = nnx.split(layer)
            x, ids, dropped, ys, carry = run(graphdef, state, x, positions, xs_i, forced, carry)
            ys_list.append(ys)
            if ids is not None:
                expert_ids.append(ids)
                drops.append(dropped)
            if hidden is not None:
                hidden.append(x)
        h = self.norm(x)
        if hidden is not None:
            hidden[-1] = h  # HF convention: the last entry is the final-normed hidden state
        ys = None if ys_list[0] is None else jax.tree.map(lambda *a: jnp.stack(a), *ys_list)
        self._count_drops(moe_drops, jnp.stack(drops) if drops else None, valid, x.shape[:2])
        self._row_drops(moe_row_drops, jnp.stack(drops) if drops else None, x.shape[0])
        if with_carry:
            return h, expert_ids, hidden, ys, carry
        return h, expert_ids, hidden, ys

    def _trunk_scanned(self, run, x, positions, layer_xs, forced_expert_ids,
                       output_hidden_states, layer_carry=None):
        """``_trunk`` for stacked params: ``jax.lax.scan`` over (params, xs_i, forced_i)."""
        L = self.config.num_hidden_layers
        is_moe = self.layers.is_moe
        forced = None
        if is_moe and forced_expert_ids is not None:
            forced = jnp.stack([jnp.asarray(f) for f in forced_expert_ids]) \
                if isinstance(forced_expert_ids, (list, tuple)) else jnp.asarray(forced_expert_ids)
        graphdef, state = nnx.split(self.layers)

        def body(carry, per_layer):
            x_i, c = carry
            st, xs_i, forced_i = per_layer
            y, ids, dropped, ys, c = run(graphdef, st, x_i, positions, xs_i, forced_i, c)
            return (y, c), (ids, dropped, ys, y if output_hidden_states else None)

        x0 = x
        (x, layer_carry), (ids, dropped, ys, hs) = jax.lax.scan(
            body, (x, layer_carry), (state, layer_xs, forced), length=L, unroll=self.scan_unroll)
        h = self.norm(x)
        expert_ids = [ids[i] for i in range(L)] if is_moe else []
        hidden = None
        if output_hidden_states:  # HF convention: [embeddings, ..., final-normed]
            hidden = [x0] + [hs[i] for i in range(L - 1)] + [h]
        return h, expert_ids, hidden, ys, layer_carry, dropped  # dropped: None for dense layers

    def _count_drops(self, moe_drops: list | None, dropped: Array | None, valid: Array | None,
                     bt: tuple[int, int]) -> None:
        """Append ``(dropped, copies)`` (float32 [] each: summed over layers they can pass int32
        for a big batch) to ``moe_drops`` (see :meth:`_trunk`); ``dropped``: the per-MoE-layer
        drop counts int32 [n_moe] (None: no MoE layer)."""
        if moe_drops is None:
            return
        if dropped is None:
            moe_drops.append((jnp.float32(0), jnp.float32(0)))
            return
        n_valid = (jnp.float32(bt[0] * bt[1]) if valid is None
                   else jnp.sum(jnp.asarray(valid, bool), dtype=jnp.float32))
        copies = n_valid * jnp.float32(dropped.shape[0] * self.config.num_experts_per_tok)
        moe_drops.append((jnp.sum(dropped.astype(jnp.float32)), copies))

    @staticmethod
    def _row_drops(moe_row_drops: list | None, dropped: Array | None, batch: int) -> None:
        """Append each row's dropped copies int32 [B] (``dropped``: [n_moe, B, T] per layer and
        token, or None: no MoE layer) to ``moe_row_drops`` (see :meth:`_trunk`)."""
        if moe_row_drops is None:
            return
        moe_row_drops.append(jnp.zeros((batch,), jnp.int32) if dropped is None
                             else jnp.sum(dropped, axis=(0, 2), dtype=jnp.int32))

    @staticmethod
    def _full_mask(B: int, T: int, attention_mask: Array | None) -> Array:
        """Causal mask [B,T,T], keys restricted to attention_mask when given."""
        causal = jnp.tril(jnp.ones((T, T), bool))[None]
        if attention_mask is None:
            return jnp.broadcast_to(causal, (B, T, T))
        return causal & jnp.asarray(attention_mask, bool)[:, None, :]

    @staticmethod
    def _default_positions(B: int, T: int) -> Array:
        # HF default with no position_ids: arange(T) for every row (right padding is fine;
        # left-padded callers must pass positions).
        return jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (B, T))

    def hidden_states(self, input_ids: Array, positions: Array | None = None,
                      attention_mask: Array | None = None, *, forced_expert_ids=None,
                      output_hidden_states: bool = False, moe_drops: list | None = None):
        """Final-normed hidden [B,T,D] (compute dtype), expert ids, per-layer hidden list.

        Padding (``attention_mask`` False) takes no MoE capacity slot. ``moe_drops``: a list
        this appends ``(dropped, copies)`` to (the MoE layers' capacity drops; :meth:`_trunk`)."""
        input_ids = jnp.asarray(input_ids)
        B, T = input_ids.shape
        if positions is None:
            positions = self._default_positions(B, T)
        mask = self._full_mask(B, T, attention_mask)
        core = self._causal_core(attention_mask, B, T, mask)
        h, ids, hidden, _ = self._trunk(
            self.embed(input_ids), positions, lambda q, k, v, _xs: (core(q, k, v), None), None,
            forced_expert_ids, output_hidden_states, remat=self.remat, valid=attention_mask,
            moe_drops=moe_drops)
        return h, ids, hidden

    def _causal_core(self, valid: Array | None, B: int, T: int, mask: Array) -> AttendFn:
        """The full-sequence causal attention core for ``self.attention``: splash (Pallas TPU
        kernel, segment ids from ``valid`` [B,T]), cudnn (key lengths from ``valid``: right
        padding) or the XLA path (``mask`` [B,T,T])."""
        if self.attention == "splash":
            seg = (jnp.ones((B, T), jnp.int32) if valid is None
                   else jnp.asarray(valid, bool).astype(jnp.int32))
            from jax_rl.models.attention import splash_attend

            return lambda q, k, v: splash_attend(q, k, v, seg)
        if self.attention == "cudnn":
            from jax_rl.models.attention import cudnn_attend

            return lambda q, k, v: cudnn_attend(q, k, v, valid)
        return lambda q, k, v: _attend_causal(q, k, v, mask)

    # ---- public forward paths ----------------------------------------------------------------
    def forward(self, input_ids: Array, positions: Array | None = None,
                attention_mask: Array | None = None, *, forced_expert_ids=None,
                output_hidden_states: bool = False) -> dict[str, Any]:
        """Full-sequence forward.

        input_ids [B,T] int32; positions [B,T] (default arange(T)); attention_mask [B,T] bool
        (False = padding key). ``forced_expert_ids``: per MoE layer (in layer order) [B,T,k]
        ids to use instead of the router's top-k (a list, or an array [n_moe_layers,B,T,k]).
        Returns ``dict(logits [B,T,V] f32, expert_ids list of [B,T,k] int32 per MoE layer,
        hidden_states)``; hidden_states (when requested) is the list
        ``[embeddings, after layer 0, ..., after layer L-2, final norm(after layer L-1)]``
        (L+1 arrays [B,T,D]; HF ``output_hidden_states`` convention).
        """
        h, ids, hs = self.hidden_states(input_ids, positions, attention_mask,
                                        forced_expert_ids=forced_expert_ids,
                                        output_hidden_states=output_hidden_states)
        return dict(logits=self.lm_logits(h), expert_ids=ids, hidden_states=hs)

    def __call__(self, input_ids: Array, positions: Array | None = None,
                 attention_mask: Array | None = None) -> Array:
        """input_ids [B,T] int32 -> logits [B,T,V] float32."""
        return self.forward(input_ids, positions, attention_mask)["logits"]

    def init_cache(self, batch_size: int, max_len: int, dtype=None) -> KVCache:
        """Empty cache: k/v zeros [L,B,K,S,H] in ``dtype`` (default: compute dtype)."""
        c = self.config
        shape = (c.num_hidden_layers, batch_size, c.num_key_value_heads, max_len, c.head_dim)
        dt = self.dtype if dtype is None else jnp.dtype(dtype)
        return KVCache(k=jnp.zeros(shape, dt), v=jnp.zeros(shape, dt),
                       lengths=jnp.zeros((batch_size,), jnp.int32))

    def prefill(self, input_ids: Array, lengths: Array, cache: KVCache, *,
                return_expert_ids: bool = False, moe_row_drops: list | None = None):
        """Prompt pass writing K/V for positions 0..T-1 of every row.

        input_ids [B,T] right-padded, lengths [B] int32 (valid tokens per row), cache with
        S >= T. Returns (logits [B,T,V] f32, cache with ``lengths`` set). The next-token logit
        of row b is ``logits[b, lengths[b]-1]``. Rows' previous cache contents are replaced.
        With ``return_expert_ids`` the per-MoE-layer expert ids (list of [B,T,k] int32, the
        routes the router chose for every position) come third. ``moe_row_drops``: a list this
        appends each row's MoE token copies dropped for capacity to, int32 [B] (:meth:`_trunk`).
        """
        input_ids = jnp.asarray(input_ids)
        B, T = input_ids.shape
        lengths = jnp.asarray(lengths, jnp.int32)
        positions = self._default_positions(B, T)
        valid = jnp.arange(T)[None, :] < lengths[:, None]
        mask = self._full_mask(B, T, valid)
        core = self._causal_core(valid, B, T, mask)

        def layer_attend(q, k, v, _xs):
            return core(q, k, v), (k, v)

        h, ids, _, (k, v) = self._trunk(self.embed(input_ids), positions, layer_attend, valid=valid,
                                        moe_row_drops=moe_row_drops)
        k = k.astype(cache.k.dtype).swapaxes(2, 3)  # [L,B,T,K,H] -> [L,B,K,T,H]
        v = v.astype(cache.v.dtype).swapaxes(2, 3)
        cache = KVCache(k=jax.lax.dynamic_update_slice(cache.k, k, (0, 0, 0, 0, 0)),
                        v=jax.lax.dynamic_update_slice(cache.v, v, (0, 0, 0, 0, 0)),
                        lengths=lengths)
        if return_expert_ids:
            return self.lm_logits(h), cache, ids
        return self.lm_logits(h), cache

    def extend(self, input_ids: Array, starts: Array, lengths: Array, cache: KVCache, *,
               return_expert_ids: bool = False, moe_row_drops: list | None = None):
        """Append-prefill: run new tokens on top of rows that already hold K/V.

        input_ids [B,T] int32 right-padded, ``lengths`` [B] int32 valid new tokens per row,
        ``starts`` [B] int32: row b's cache holds the K/V of positions ``< starts[b]`` (the
        conversation so far); token t of row b is placed at position ``starts[b] + t`` and attends
        to every position ``<= starts[b] + t`` (the cached ones and the new ones before it).
        ``cache``: stacked [L,B,K,S,H] (``S >= starts + lengths``; ``lengths`` is ignored).

        Returns (logits [B,T,V] f32, cache whose k/v hold the new tokens' K/V at positions
        ``[starts, starts + lengths)`` and the old values elsewhere, ``lengths = starts + lengths``)
        (+ per-MoE-layer expert ids, list of [B,T,k] int32, with ``return_expert_ids``). With
        ``starts == 0`` this is :meth:`prefill` over keys of length S instead of T (the same values
        up to fp32 summation order). The attention is the XLA ``attend`` (never splash): the keys
        are the whole row, masked past each query's position. Padded tokens (``t >= lengths``) take
        no MoE capacity and write nothing. ``moe_row_drops``: as in :meth:`prefill`.
        """
        if cache.is_per_layer:
            raise ValueError("extend takes a stacked KV cache (cache.stacked())")
        input_ids = jnp.asarray(input_ids)
        B, T = input_ids.shape
        S = cache.max_len
        starts = jnp.asarray(starts, jnp.int32)
        lengths = jnp.asarray(lengths, jnp.int32)
        positions = starts[:, None] + jnp.arange(T, dtype=jnp.int32)[None]  # [B,T]
        valid = jnp.arange(T)[None, :] < lengths[:, None]
        spos = jnp.arange(S, dtype=jnp.int32)
        rel = spos[None, :] - starts[:, None]  # [B,S]: index of cache position s among the new tokens
        take = ((rel >= 0) & (rel < lengths[:, None]))[:, None, :, None]  # [B,1,S,1]
        idx = jnp.clip(rel, 0, T - 1)[:, None, :, None]
        mask = spos[None, None, :] <= positions[:, :, None]  # [B,T,S]

        def merge(new, old):  # new [B,T,K,H] -> old [B,K,S,H] with positions [start, start+len) replaced
            g = jnp.take_along_axis(new.swapaxes(1, 2), idx, axis=2)
            return jnp.where(take, g.astype(old.dtype), old)

        def layer_attend(q, k, v, xs):
            ck, cv = merge(k, xs[0]), merge(v, xs[1])
            o = attend(q, ck.swapaxes(1, 2).astype(q.dtype), cv.swapaxes(1, 2).astype(q.dtype), mask)
            return o, (ck, cv)

        h, ids, _, (k, v) = self._trunk(self.embed(input_ids), positions, layer_attend, (cache.k, cache.v),
                                        valid=valid, moe_row_drops=moe_row_drops)
        cache = KVCache(k=k, v=v, lengths=starts + lengths)
        if return_expert_ids:
            return self.lm_logits(h), cache, ids
        return self.lm_logits(h), cache

    def decode_step(self, tokens: Array, cache: KVCache, *, forced_expert_ids=None,
                    return_expert_ids: bool = False, valid: Array | None = None,
                    moe_row_drops: list | None = None):
        """One decode token per slot.

        tokens [B] int32 is placed at position ``cache.lengths[b]`` and attends to cache
        positions ``<= lengths[b]``; then lengths += 1. Returns (logits [B,V] f32, cache)
        (plus expert ids list of [B,k] when ``return_expert_ids``). Inactive slots are the
        caller's business (mask them; their lengths still advance). ``valid`` [B] bool: the slots
        whose token takes MoE capacity (None: all; only a dropping MoE path reads it).
        ``moe_row_drops``: a list this appends each slot's MoE token copies dropped for capacity
        to, int32 [B] (:meth:`_trunk`).

        The cache is written at one position per slot and layer: the whole [L,B,K,S,H] k/v
        buffers are threaded through the layers (the scan carry under ``scan_layers``) and
        each layer scatters its [B,K,H] new entries at ``(layer, b, :, lengths[b])`` (a write
        at ``lengths[b] >= S`` is dropped), then reads its layer back for attention. Under
        ``jit`` with the cache donated XLA does this in place: a step touches the params and
        the cache once, not a rewritten copy of the cache (``bench/decode_compile.py``).
        A per-layer cache (``KVCache.per_layer()``; unrolled layers only) is threaded as L
        separate buffers, each written at one position and read by the attention in place; the
        cache comes back in the same form.
        """
        if cache.is_per_layer and self.scan_layers:
            raise ValueError("a per-layer KV cache needs unrolled layers; pass cache.stacked() "
                             "to a scan_layers model")
        tokens = jnp.asarray(tokens)
        S = cache.max_len
        pos = cache.lengths.astype(jnp.int32)
        positions = pos[:, None]
        mask = (jnp.arange(S)[None, :] <= pos[:, None])[:, None, :]  # [B,1,S]
        L = self.config.num_hidden_layers

        B, K = tokens.shape[0], self.config.num_key_value_heads
        b_idx = jnp.arange(B, dtype=jnp.int32)[:, None]
        k_idx = jnp.arange(K, dtype=jnp.int32)[None, :]

        def write(c, new, i):
            # c [L,B,K,S,H], new [B,K,H]: c[i, b, k, pos[b]] = new[b, k] (one scatter)
            return c.at[i, b_idx, k_idx, pos[:, None]].set(new.astype(c.dtype), mode="drop")

        def write_layer(c, new):
            # c [B,K,S,H] (one layer's own buffer): c[b, k, pos[b]] = new[b, k]
            return c.at[b_idx, k_idx, pos[:, None]].set(new.astype(c.dtype), mode="drop")

        def write_layer_t(c, new):
            # c [B,K,H,S] (one layer's key-transposed buffer): c[b, k, :, pos[b]] = new[b, k]
            return c.at[b_idx, k_idx, :, pos[:, None]].set(new.astype(c.dtype), mode="drop")

        def layer_attend_per_layer(q, k, v, i, kv):
            i = int(i)
            ck, cv = list(kv[0]), list(kv[1])
            ck[i], cv[i] = write_layer_t(ck[i], k[:, 0]), write_layer(cv[i], v[:, 0])
            o = attend_cached_t(q, ck[i].astype(q.dtype), cv[i].astype(q.dtype), mask)
            return o, None, (tuple(ck), tuple(cv))

        def layer_attend(q, k, v, i, kv):
            ck, cv = write(kv[0], k[:, 0], i), write(kv[1], v[:, 0], i)
            if isinstance(i, jax.Array):  # scanned: traced layer index
                ki = jax.lax.dynamic_index_in_dim(ck, i, 0, keepdims=False)
                vi = jax.lax.dynamic_index_in_dim(cv, i, 0, keepdims=False)
            else:  # unrolled: a static layer index
                ki, vi = ck[int(i)], cv[int(i)]
            return attend_cached(q, ki.astype(q.dtype), vi.astype(q.dtype), mask), None, (ck, cv)

        forced = None
        if forced_expert_ids is not None:
            forced = [jnp.asarray(f)[:, None] for f in forced_expert_ids]
        layer_idx = jnp.arange(L, dtype=jnp.int32) if self.scan_layers else tuple(range(L))
        attend_fn = layer_attend_per_layer if cache.is_per_layer else layer_attend
        h, ids, _, _, (k, v) = self._trunk(self.embed(tokens[:, None]), positions, attend_fn,
                                           layer_idx, forced, carry=(tuple(cache.k), tuple(cache.v))
                                           if cache.is_per_layer else (cache.k, cache.v),
                                           valid=None if valid is None else jnp.asarray(valid, bool)[:, None],
                                           moe_row_drops=moe_row_drops)
        cache = KVCache(k=k, v=v, lengths=pos + 1)
        logits = self.lm_logits(h)[:, 0]
        if return_expert_ids:
            return logits, cache, [i[:, 0] for i in ids]
        return logits, cache


# --------------------------------------------------------------------------------------
# Routes (routing replay), parameter count, constructor arguments
# --------------------------------------------------------------------------------------

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


def count_params(config: Qwen3Config) -> int:
    """Number of parameters, from ``nnx.eval_shape`` (nothing is allocated)."""
    abs_model = nnx.eval_shape(lambda: Qwen3ForCausalLM(config, rngs=nnx.Rngs(0)))
    state = nnx.state(abs_model, nnx.Param)
    return int(sum(math.prod(x.shape) for x in jax.tree.leaves(state)))


def model_kwargs(model_cfg: Any) -> dict[str, Any]:
    """``Qwen3ForCausalLM`` keyword arguments from the ``model`` config section
    (``jax_rl.config.ModelConfig``): ``moe_dispatch``, ``moe_capacity_factor``, ``moe_matmul``,
    ``remat_policy`` (``remat`` folded in), ``scan_layers``, ``attention``. The learner and the
    rollout engine must build their models with the same ``scan_layers`` (the params tree
    layout differs)."""
    policy = getattr(model_cfg, "remat_policy", None)
    if policy is None:
        policy = "full" if getattr(model_cfg, "remat", False) else "none"
    return dict(moe_dispatch=getattr(model_cfg, "moe_dispatch", "dense"),
                moe_capacity_factor=getattr(model_cfg, "moe_capacity_factor", None),
                moe_matmul=getattr(model_cfg, "moe_matmul", "ragged_dot"),
                remat_policy=policy,
                scan_layers=bool(getattr(model_cfg, "scan_layers", False)),
                scan_unroll=getattr(model_cfg, "scan_unroll", 1),
                attention=getattr(model_cfg, "attention", "xla"))
