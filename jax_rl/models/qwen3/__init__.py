"""Qwen3 dense and MoE decoder in Flax NNX, matching Hugging Face ``transformers`` exactly.

Reference: ``transformers/models/qwen3/modeling_qwen3.py`` and ``qwen3_moe/modeling_qwen3_moe.py``.
Notation in shapes and einsum strings:

    B batch, T query length, S key/cache length, D hidden_size, V vocab_size,
    N num_attention_heads, K num_key_value_heads, G = N // K, H head_dim,
    F intermediate_size (dense MLP) or moe_intermediate_size (per expert),
    E num_experts, k num_experts_per_tok, L num_hidden_layers.

Parameter layout (HF name -> ours; HF Linear weights are [out, in], ours [in, out]):

    model.embed_tokens.weight [V,D]            -> embed_tokens.embedding [V,D]   (vocab, embed)
    self_attn.q_proj.weight [N*H,D]            -> attn.q_proj [D,N,H]            (embed, q_heads, head_dim)
    self_attn.k_proj/v_proj.weight [K*H,D]     -> attn.k_proj/v_proj [D,K,H]     (embed, kv_heads, head_dim)
    self_attn.o_proj.weight [D,N*H]            -> attn.o_proj [N,H,D]            (q_heads, head_dim, embed)
    self_attn.q_norm/k_norm.weight [H]         -> attn.q_norm/k_norm.weight [H]  (head_dim,)
    input_/post_attention_layernorm.weight [D] -> *.weight [D]                   (norm,)
    mlp.gate_proj/up_proj.weight [F,D]         -> mlp.gate_proj/up_proj [D,F]    (embed, mlp)
    mlp.down_proj.weight [D,F]                 -> mlp.down_proj [F,D]            (mlp, embed)
    mlp.gate.weight [E,D] (router)             -> mlp.router [D,E]               (embed, router)
    mlp.experts.{j}.gate_proj/up_proj [F,D]    -> mlp.gate_proj/up_proj [E,D,F]  (expert, embed, mlp)
    mlp.experts.{j}.down_proj [D,F]            -> mlp.down_proj [E,F,D]          (expert, mlp, embed)
    model.norm.weight [D]                      -> norm.weight [D]                (norm,)
    lm_head.weight [V,D] (untied only)         -> lm_head [D,V]                  (embed, vocab)

Every parameter carries its logical axis names in the ``out_sharding`` metadata (created with
``eager_sharding=False``); ``jax_rl.sharding`` maps them to mesh axes.

With ``scan_layers=True`` (config ``model.scan_layers``) the per-layer params above are stacked
on a leading axis: ``layers.attn.q_proj [L,D,N,H]`` with names ``("layers", "embed", ...)``
instead of ``layers.{i}.attn.q_proj [D,N,H]`` (MaxText ``scan_layers``); ``hf_io`` maps both
layouts to HF's ``model.layers.{i}.*``.

Files:

    config.py   Qwen3Config (HF config.json conversion), PRESETS, get_preset, MoEOptions (the MoE
                layers' execution options, Qwen3ForCausalLM(moe=...))
    layers.py   RMSNorm, RoPE, the dense projections, Attention, MLP, MoE, DecoderLayer,
                REMAT_POLICIES / remat_policy_fn (the XLA attention cores attend / attend_cached,
                with their custom VJPs, are jax_rl.models.xla_attention, re-exported)
    cache.py    the KV cache, one type per layout: StackedKVCache, LayerKVCache (base KVCache)
    outputs.py  the typed call outputs (ModelOutput, MoeDrops, TrunkOutput), the routing-replay
                route helpers (ROUTE_MISSING, route_dtype, stack_routes, unstack_routes)
    model.py    Qwen3ForCausalLM, scan_layers stacking (stack_layer_params, ...), resolve_attention,
                resolve_scan_unroll, count_params, model_kwargs
    paged.py    decode and append-prefill over a paged K/V pool (PagedKVCache; not re-exported here)

The RL log-prob heads (``sequence_logprobs``, ``token_logprobs``) live in :mod:`jax_rl.learner.logprobs`.
Every public name above is importable from this package (``from jax_rl.models.qwen3 import X``).
"""

from jax_rl.models.qwen3.cache import KVCache, LayerKVCache, StackedKVCache
from jax_rl.models.qwen3.config import PRESETS, MoEOptions, Qwen3Config, get_preset
from jax_rl.models.qwen3.layers import (
    MLP,
    REMAT_POLICIES,
    Attention,
    DecoderLayer,
    MoE,
    RMSNorm,
    apply_rope,
    attend,
    attend_cached,
    attend_cached_t,
    remat_policy_fn,
    rope_cos_sin,
)
from jax_rl.models.qwen3.model import (
    ATTENTION_KINDS,
    Qwen3ForCausalLM,
    count_params,
    model_kwargs,
    resolve_attention,
    resolve_scan_unroll,
    stack_layer_params,
    unstack_layer_params,
)
from jax_rl.models.qwen3.outputs import (
    ROUTE_MISSING,
    ModelOutput,
    MoeDrops,
    TrunkOutput,
    count_moe_drops,
    route_dtype,
    stack_routes,
    unstack_routes,
)

__all__ = [
    "Qwen3Config",
    "MoEOptions",
    "PRESETS",
    "get_preset",
    "RMSNorm",
    "Attention",
    "MLP",
    "MoE",
    "DecoderLayer",
    "Qwen3ForCausalLM",
    "KVCache",
    "StackedKVCache",
    "LayerKVCache",
    "ModelOutput",
    "MoeDrops",
    "TrunkOutput",
    "count_moe_drops",
    "count_params",
    "REMAT_POLICIES",
    "remat_policy_fn",
    "ATTENTION_KINDS",
    "resolve_attention",
    "stack_layer_params",
    "model_kwargs",
    "unstack_layer_params",
    "rope_cos_sin",
    "apply_rope",
    "attend",
    "attend_cached",
    "attend_cached_t",
    "resolve_scan_unroll",
    "ROUTE_MISSING",
    "route_dtype",
    "stack_routes",
    "unstack_routes",
]
