"""The Qwen3 / Qwen3-MoE causal LM (:class:`Qwen3ForCausalLM`: full forward, prefill, cached
decode), the ``scan_layers`` stacking helpers, the attention / scan-unroll choices, the routing
replay route helpers, :func:`count_params` and :func:`model_kwargs`."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jax_rl.models import bitwise
from jax_rl.models.attention import cudnn_attend, splash_attend
from jax_rl.models.bitwise import chunked_attend, from_rows, replicated, rows_trunk, to_rows
from jax_rl.models.kv_storage import storage_dtype
from jax_rl.models.qwen3.cache import KVCache, StackedKVCache
from jax_rl.models.qwen3.config import MoEOptions, Qwen3Config
from jax_rl.models.qwen3.layers import (
    REMAT_POLICIES,
    AttendFn,
    DecoderLayer,
    LayerAttendFn,
    RMSNorm,
    _constrain,
    _param,
    attend,
    attend_cached,
    attend_cached_t,
    remat_policy_fn,
)
from jax_rl.models.qwen3.outputs import ModelOutput, TrunkOutput, count_moe_drops
from jax_rl.models.xla_attention import attend_causal

Array = jax.Array

__all__ = [
    "Qwen3ForCausalLM",
    "ATTENTION_KINDS",
    "resolve_attention",
    "resolve_scan_unroll",
    "stack_layer_params",
    "unstack_layer_params",
    "count_params",
    "model_kwargs",
]


# --------------------------------------------------------------------------------------
# Layer stacking (scan_layers), attention choice
# --------------------------------------------------------------------------------------

ATTENTION_KINDS: tuple[str, ...] = ("auto", "xla", "splash", "cudnn", "bitwise")


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
    """``auto`` -> ``splash`` on a TPU backend, else ``xla``; ``xla``/``splash``/``cudnn``/``bitwise``
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
    dtype. Logits are always float32. ``moe``: the MoE layers' execution options
    (:class:`jax_rl.models.qwen3.MoEOptions`: dispatch ``dense`` / ``ragged``, the expert-parallel
    capacity factor and grouped matmul, the router dtype, drops on every path; config ``model.moe_*``
    and the engine's ``rollout.moe_*``; default: dense dispatch, dropless, fp32 router).

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
    (``splash`` when ``jax.default_backend() == "tpu"``, else ``xla``; resolved here, at construction, into
    ``self.attention``); ``bitwise``: the bitwise mode, every path (``model.bitwise``, :mod:`jax_rl.models.bitwise`).
    """

    def __init__(self, config: Qwen3Config, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 param_dtype=jnp.float32, moe: MoEOptions = MoEOptions(), remat: bool = False,
                 scan_layers: bool = False, remat_policy: str | None = None,
                 attention: str = "xla", scan_unroll: int | bool | str = 1):
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
        self.bitwise = self.attention == "bitwise"  # the bitwise mode (jax_rl.models.bitwise), chosen once here
        kinds = {cfg.layer_is_moe(i) for i in range(cfg.num_hidden_layers)}
        self.scan_layers = bool(scan_layers) and len(kinds) == 1
        self.scan_unroll = resolve_scan_unroll(scan_unroll, cfg.num_hidden_layers)
        self.embed_tokens = _param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"),
                                   param_dtype)
        layers = [
            DecoderLayer(cfg, i, rngs=rngs, dtype=self.dtype, param_dtype=param_dtype, moe=moe)
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
        if self.bitwise:  # on the row tile (jax_rl.models.bitwise)
            return from_rows(self._lm_logits(to_rows(h, 2)), h.shape[:2])
        return self._lm_logits(h)

    def _lm_logits(self, h: Array) -> Array:
        h = h.astype(self.dtype)
        w = (self.embed_tokens if self.lm_head is None else self.lm_head)[...]
        w = replicated(w) if self.bitwise else w  # the mode: the dot whole on every device of a mesh
        if self.bitwise:  # the mode: in fixed chunks of D on XLA:CPU (jax_rl.models.bitwise.K_CHUNK)
            with bitwise.chunked_contractions():
                if bitwise.k_chunks(h.shape[-1]) > 1:
                    return bitwise.chunked_contract(h, w.astype(self.dtype), w_k_last=self.lm_head is None,
                                                    out_dtype=jnp.float32)
        return jnp.einsum("btd,vd->btv" if self.lm_head is None else "btd,dv->btv", h, w.astype(self.dtype),
                          preferred_element_type=jnp.float32)

    def _trunk(self, x: Array, positions: Array, attend: LayerAttendFn, layer_xs: Any = None,
               forced_expert_ids=None, output_hidden_states: bool = False, remat: bool = False,
               carry: Any = None, valid: Array | None = None, row_drops: bool = False) -> TrunkOutput:
        """Runs the decoder stack on x [B,T,D] -> :class:`TrunkOutput`.

        ``attend(q, k, v, xs_i) -> (o, ys_i)`` does the attention core of one layer; ``xs_i`` is
        layer i's slice of ``layer_xs`` (a pytree of [L, ...] arrays, e.g. the KV cache, or
        None) and the ``ys_i`` (same structure for every layer, or None) come back stacked
        [L, ...] as ``ys``.

        With ``carry`` (a pytree threaded through the layers in order, e.g. the whole KV cache
        updated in place) the signature is ``attend(q, k, v, xs_i, carry) -> (o, ys_i, carry)``
        and the final carry comes back as ``carry``. Under ``scan_layers`` it is the scan carry, so
        XLA updates its buffers in place instead of restacking per-layer outputs.

        ``valid`` [B,T] bool: the tokens that take MoE capacity (padding does not; :class:`MoE`).
        ``dropped`` holds the MoE layers' capacity drops per layer, int32 [n_moe], or with
        ``row_drops`` per layer and token, [n_moe,B,T] (:func:`count_moe_drops` sums them).
        """
        body = functools.partial(rows_trunk, self._trunk_body) if self.bitwise else self._trunk_body  # the row tile
        return body(x, positions, attend, layer_xs, forced_expert_ids, output_hidden_states, remat=remat,
                    carry=carry, valid=valid, row_drops=row_drops)

    def _trunk_body(self, x, positions, attend, layer_xs, forced_expert_ids, output_hidden_states, *,
                    remat: bool, carry: Any, valid: Array | None, row_drops: bool) -> TrunkOutput:
        per_token = row_drops
        policy = remat_policy_fn(self.remat_policy) if remat else None
        with_carry = carry is not None

        def run(graphdef, state, x, positions, xs_i, forced, c):
            layer = nnx.merge(graphdef, replicated(state) if self.bitwise else state)  # the mode: weights whole
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
            return self._trunk_scanned(run, x, positions, layer_xs, forced_expert_ids,
                                       output_hidden_states, carry)
        expert_ids: list[Array] = []
        drops: list[Array] = []
        hidden = [x] if output_hidden_states else None
        ys_list = []
        moe_idx = 0
        for i, layer in enumerate(self.layers):
            forced = None
            if layer.is_moe:
                forced = None if forced_expert_ids is None else forced_expert_ids[moe_idx]
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
        return TrunkOutput(h=h, expert_ids=tuple(expert_ids), hidden_states=None if hidden is None else tuple(hidden),
                           ys=ys, carry=carry if with_carry else None, dropped=jnp.stack(drops) if drops else None)

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
        hidden = None
        if output_hidden_states:  # HF convention: [embeddings, ..., final-normed]
            hidden = (x0, *(hs[i] for i in range(L - 1)), h)
        return TrunkOutput(h=h, expert_ids=tuple(ids[i] for i in range(L)) if is_moe else (),
                           hidden_states=hidden, ys=ys, carry=layer_carry, dropped=dropped)  # dropped: None if dense

    def _moe_drops(self, t: TrunkOutput, valid: Array | None, bt: tuple[int, int], per_row: bool = False):
        """The call's :class:`MoeDrops` from the trunk's per-layer drops (:func:`count_moe_drops`)."""
        return count_moe_drops(t.dropped, valid, bt, self.config.num_experts_per_tok, per_row)

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
                      output_hidden_states: bool = False, return_moe_drops: bool = False) -> ModelOutput:
        """The decoder stack without the LM head (arguments as :meth:`forward`) ->
        :class:`ModelOutput` with ``hidden`` [B,T,D] (compute dtype, final-normed),
        ``expert_ids``, ``hidden_states`` (with ``output_hidden_states``) and ``moe_drops``
        (:class:`MoeDrops` ``dropped`` / ``copies`` over the valid tokens, with
        ``return_moe_drops``). Padding (``attention_mask`` False) takes no MoE capacity slot."""
        input_ids = jnp.asarray(input_ids)
        B, T = input_ids.shape
        if positions is None:
            positions = self._default_positions(B, T)
        mask = self._full_mask(B, T, attention_mask)
        core = self._causal_core(attention_mask, B, T, mask)
        t = self._trunk(self.embed(input_ids), positions, lambda q, k, v, _xs: (core(q, k, v), None), None,
                        forced_expert_ids, output_hidden_states, remat=self.remat, valid=attention_mask)
        return ModelOutput(hidden=t.h, expert_ids=t.expert_ids, hidden_states=t.hidden_states,
                           moe_drops=self._moe_drops(t, attention_mask, (B, T)) if return_moe_drops else None)

    def _causal_core(self, valid: Array | None, B: int, T: int, mask: Array) -> AttendFn:
        """The full-sequence causal attention core for ``self.attention``: splash (Pallas TPU
        kernel, segment ids from ``valid`` [B,T]), cudnn (key lengths from ``valid``: right
        padding) or the XLA path (``mask`` [B,T,T]); in the bitwise mode the chunked core."""
        if self.bitwise:
            return lambda q, k, v: chunked_attend(q, k, v, self._default_positions(B, T))
        if self.attention == "splash":
            seg = (jnp.ones((B, T), jnp.int32) if valid is None
                   else jnp.asarray(valid, bool).astype(jnp.int32))
            return lambda q, k, v: splash_attend(q, k, v, seg)
        if self.attention == "cudnn":
            return lambda q, k, v: cudnn_attend(q, k, v, valid)
        return lambda q, k, v: attend_causal(q, k, v, mask)

    # ---- public forward paths ----------------------------------------------------------------
    def forward(self, input_ids: Array, positions: Array | None = None,
                attention_mask: Array | None = None, *, forced_expert_ids=None,
                output_hidden_states: bool = False, return_moe_drops: bool = False) -> ModelOutput:
        """Full-sequence forward.

        input_ids [B,T] int32; positions [B,T] (default arange(T)); attention_mask [B,T] bool
        (False = padding key). ``forced_expert_ids``: per MoE layer (in layer order) [B,T,k]
        ids to use instead of the router's top-k (a list, or an array [n_moe_layers,B,T,k]).
        Returns :class:`ModelOutput`: ``logits`` [B,T,V] f32, ``expert_ids`` (int32 [B,T,k] per
        MoE layer), ``hidden_states`` with ``output_hidden_states`` (L+1 arrays [B,T,D]; HF
        convention), ``moe_drops`` with ``return_moe_drops``.
        """
        out = self.hidden_states(input_ids, positions, attention_mask, forced_expert_ids=forced_expert_ids,
                                 output_hidden_states=output_hidden_states, return_moe_drops=return_moe_drops)
        return out.replace(logits=self.lm_logits(out.hidden), hidden=None)

    def __call__(self, input_ids: Array, positions: Array | None = None,
                 attention_mask: Array | None = None) -> Array:
        """input_ids [B,T] int32 -> logits [B,T,V] float32."""
        return self.forward(input_ids, positions, attention_mask).logits

    def init_cache(self, batch_size: int, max_len: int, dtype=None, *, backend_storage: bool = False) -> StackedKVCache:
        """Empty cache: k/v zeros [L,B,K,S,H] of values in ``dtype`` (default: compute dtype).

        ``backend_storage``: stored as the backend being traced for keeps K/V
        (``kv_storage.storage_dtype``: a 16-bit float cache on XLA:CPU as its uint16 bits, the cache's
        ``dtype`` set; :mod:`jax_rl.models.qwen3.cache`); what the rollout engine's decode state holds.
        False: k/v in ``dtype`` itself (a cache whose arrays the caller reads as values)."""
        c = self.config
        shape = (c.num_hidden_layers, batch_size, c.num_key_value_heads, max_len, c.head_dim)
        dt = self.dtype if dtype is None else jnp.dtype(dtype)
        store = storage_dtype(dt) if backend_storage else dt
        return StackedKVCache(k=jnp.zeros(shape, store), v=jnp.zeros(shape, store),
                              lengths=jnp.zeros((batch_size,), jnp.int32), dtype=None if store == dt else dt)

    def prefill(self, input_ids: Array, lengths: Array, cache: StackedKVCache, *,
                return_expert_ids: bool = False, return_moe_drops: bool = False) -> ModelOutput:
        """Prompt pass writing K/V for positions 0..T-1 of every row.

        input_ids [B,T] right-padded, lengths [B] int32 (valid tokens per row), a stacked cache
        with S >= T. Returns :class:`ModelOutput`: ``logits`` [B,T,V] f32, ``cache`` with
        ``lengths`` set (rows' previous contents replaced); the next-token logit of row b is
        ``logits[b, lengths[b]-1]``. With ``return_expert_ids``: ``expert_ids`` (int32 [B,T,k] per
        MoE layer, the routes the router chose for every position); with ``return_moe_drops``:
        ``moe_drops`` over the valid tokens, ``per_row`` included (:class:`MoeDrops`).
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

        t = self._trunk(self.embed(input_ids), positions, layer_attend, valid=valid, row_drops=return_moe_drops)
        k, v = t.ys
        k = cache.store(k).swapaxes(2, 3)  # [L,B,T,K,H] -> [L,B,K,T,H]
        v = cache.store(v).swapaxes(2, 3)
        cache = cache.replace(k=jax.lax.dynamic_update_slice(cache.k, k, (0, 0, 0, 0, 0)),
                              v=jax.lax.dynamic_update_slice(cache.v, v, (0, 0, 0, 0, 0)), lengths=lengths)
        return ModelOutput(logits=self.lm_logits(t.h), cache=cache,
                           expert_ids=t.expert_ids if return_expert_ids else None,
                           moe_drops=self._moe_drops(t, valid, (B, T), True) if return_moe_drops else None)

    def extend(self, input_ids: Array, starts: Array, lengths: Array, cache: StackedKVCache, *,
               return_expert_ids: bool = False, return_moe_drops: bool = False) -> ModelOutput:
        """Append-prefill: run new tokens on top of rows that already hold K/V.

        input_ids [B,T] int32 right-padded, ``lengths`` [B] int32 valid new tokens per row,
        ``starts`` [B] int32: row b's cache holds the K/V of positions ``< starts[b]`` (the
        conversation so far); token t of row b is placed at position ``starts[b] + t`` and attends
        to every position ``<= starts[b] + t`` (the cached ones and the new ones before it).
        ``cache``: a :class:`StackedKVCache` [L,B,K,S,H] (``S >= starts + lengths``; its ``lengths``
        is ignored).

        Returns :class:`ModelOutput`: ``logits`` [B,T,V] f32, ``cache`` whose k/v hold the new
        tokens' K/V at positions ``[starts, starts + lengths)`` and the old values elsewhere,
        ``lengths = starts + lengths``; ``expert_ids`` / ``moe_drops`` as in :meth:`prefill`. With
        ``starts == 0`` this is :meth:`prefill` over keys of length S instead of T (the same values
        up to fp32 summation order). The attention is the XLA ``attend`` (never splash): the keys
        are the whole row, masked past each query's position. Padded tokens (``t >= lengths``) take
        no MoE capacity and write nothing.

        Raises:
            ValueError: ``cache`` is not a :class:`StackedKVCache`.
        """
        if not isinstance(cache, StackedKVCache):
            raise ValueError(f"extend takes a StackedKVCache (cache.stacked()), got {type(cache).__name__}")
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
            return jnp.where(take, cache.store(g), old)  # as stored (the bits, on a cache of bits)

        def layer_attend(q, k, v, xs):
            ck, cv = merge(k, xs[0]), merge(v, xs[1])
            kv = (cache.load(c).swapaxes(1, 2).astype(q.dtype) for c in (ck, cv))
            if self.bitwise:
                return chunked_attend(q, *kv, positions), (ck, cv)
            return attend(q, *kv, mask), (ck, cv)

        t = self._trunk(self.embed(input_ids), positions, layer_attend, (cache.k, cache.v), valid=valid,
                        row_drops=return_moe_drops)
        k, v = t.ys
        return ModelOutput(logits=self.lm_logits(t.h), cache=cache.replace(k=k, v=v, lengths=starts + lengths),
                           expert_ids=t.expert_ids if return_expert_ids else None,
                           moe_drops=self._moe_drops(t, valid, (B, T), True) if return_moe_drops else None)

    def decode_step(self, tokens: Array, cache: KVCache, *, forced_expert_ids=None,
                    return_expert_ids: bool = False, valid: Array | None = None,
                    return_moe_drops: bool = False) -> ModelOutput:
        """One decode token per slot.

        tokens [B] int32 is placed at position ``cache.lengths[b]`` and attends to cache
        positions ``<= lengths[b]``; then lengths += 1. Returns :class:`ModelOutput`: ``logits``
        [B,V] f32, ``cache`` (the type it was given); ``expert_ids`` (int32 [B,k] per MoE layer)
        with ``return_expert_ids``; ``moe_drops`` (``per_row``: each slot's token copies dropped
        for capacity) with ``return_moe_drops``. Inactive slots are the caller's business (mask
        them; their lengths still advance). ``valid`` [B] bool: the slots whose token takes MoE
        capacity (None: all; only a dropping MoE path reads it).

        The cache is written at one position per slot and layer: the whole [L,B,K,S,H] k/v
        buffers are threaded through the layers (the scan carry under ``scan_layers``) and
        each layer scatters its [B,K,H] new entries at ``(layer, b, :, lengths[b])`` (a write
        at ``lengths[b] >= S`` is dropped), then reads its layer back for attention. Under
        ``jit`` with the cache donated XLA does this in place: a step touches the params and
        the cache once, not a rewritten copy of the cache (``bench/decode_compile.py``).
        A :class:`LayerKVCache` (unrolled layers only) is threaded as L separate buffers, each
        written at one position and read by the attention in place; the cache comes back in the
        same form.
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
        idx = (jnp.arange(B, dtype=jnp.int32)[:, None], jnp.arange(K, dtype=jnp.int32)[None, :], pos[:, None])
        core = attend_cached_t if cache.is_per_layer else attend_cached

        def layer_attend(q, k, v, i, kv):  # kv: the cache's (k, v) buffers, the layer carry
            kv, ki, vi = cache.write_decode(kv, i, k[:, 0], v[:, 0], idx)
            if self.bitwise:  # ki [B,K,S,H] or (per layer) [B,K,H,S]
                return chunked_attend(q, ki.transpose(0, 3, 1, 2) if cache.is_per_layer else ki.swapaxes(1, 2),
                                      vi.swapaxes(1, 2), positions), None, kv
            return core(q, ki.astype(q.dtype), vi.astype(q.dtype), mask), None, kv

        forced = None
        if forced_expert_ids is not None:
            forced = [jnp.asarray(f)[:, None] for f in forced_expert_ids]
        layer_idx = jnp.arange(L, dtype=jnp.int32) if self.scan_layers else tuple(range(L))
        valid = None if valid is None else jnp.asarray(valid, bool)[:, None]
        t = self._trunk(self.embed(tokens[:, None]), positions, layer_attend, layer_idx, forced,
                        carry=(cache.k, cache.v), valid=valid, row_drops=return_moe_drops)
        k, v = t.carry
        return ModelOutput(logits=self.lm_logits(t.h)[:, 0], cache=cache.replace(k=k, v=v, lengths=pos + 1),
                           expert_ids=tuple(i[:, 0] for i in t.expert_ids) if return_expert_ids else None,
                           moe_drops=self._moe_drops(t, valid, (B, 1), True) if return_moe_drops else None)


# --------------------------------------------------------------------------------------
# Parameter count, constructor arguments
# --------------------------------------------------------------------------------------

def count_params(config: Qwen3Config) -> int:
    """Number of parameters, from ``nnx.eval_shape`` (nothing is allocated)."""
    abs_model = nnx.eval_shape(lambda: Qwen3ForCausalLM(config, rngs=nnx.Rngs(0)))
    state = nnx.state(abs_model, nnx.Param)
    return int(sum(math.prod(x.shape) for x in jax.tree.leaves(state)))


def model_kwargs(model_cfg: Any) -> dict[str, Any]:
    """``Qwen3ForCausalLM`` keyword arguments from the ``model`` config section
    (``jax_rl.config.ModelConfig``): ``moe`` (:class:`MoEOptions` of ``moe_dispatch``,
    ``moe_capacity_factor``, ``moe_matmul``), ``remat_policy`` (``remat`` folded in), ``scan_layers``,
    ``scan_unroll``, ``attention``. The learner and the rollout engine must build their models with the
    same ``scan_layers`` (the params tree layout differs)."""
    policy = getattr(model_cfg, "remat_policy", None)
    if policy is None:
        policy = "full" if getattr(model_cfg, "remat", False) else "none"
    return dict(moe=MoEOptions(dispatch=getattr(model_cfg, "moe_dispatch", "dense"),
                               capacity_factor=getattr(model_cfg, "moe_capacity_factor", None),
                               matmul=getattr(model_cfg, "moe_matmul", "ragged_dot")),
                remat_policy=policy,
                scan_layers=bool(getattr(model_cfg, "scan_layers", False)),
                scan_unroll=getattr(model_cfg, "scan_unroll", 1),
                attention="bitwise" if getattr(model_cfg, "bitwise", False) else getattr(model_cfg, "attention", "xla"))
