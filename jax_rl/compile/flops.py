"""Model FLOPs (part of :mod:`jax_rl.compile`): the active matmul params of a ``Qwen3Config`` and
the forward FLOPs per token that ``model_flops_per_chip`` / ``flops_ratio`` / ``mfu_bound`` are
measured against."""

from __future__ import annotations


def _matmul_params(mc) -> tuple[int, int]:
    """(active matmul params per token, total) of a ``Qwen3Config``: attention and MLP/expert
    projections of every layer plus the LM head (the embedding lookup is not a matmul)."""
    D, L = mc.hidden_size, mc.num_hidden_layers
    H, K, dh = mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim
    attn = D * H * dh + 2 * D * K * dh + H * dh * D
    n_exp = int(getattr(mc, "num_experts", 0) or 0)
    active = total = 0
    for i in range(L):
        if mc.layer_is_moe(i):
            f = mc.moe_intermediate_size
            k = mc.num_experts_per_tok
            active += attn + k * 3 * D * f + D * n_exp
            total += attn + n_exp * 3 * D * f + D * n_exp
        else:
            f = mc.intermediate_size
            active += attn + 3 * D * f
            total += attn + 3 * D * f
    head = D * mc.vocab_size
    return active + head, total + head


def model_flops_per_token(mc, T: int) -> float:
    """Forward FLOPs per token of a [., T] sequence: ``2 * N_active`` (matmuls, LM head included)
    plus causal attention ``2 * L * H * head_dim * T`` (QK^T and AV over T/2 keys on average)."""
    active, _ = _matmul_params(mc)
    return 2.0 * active + 2.0 * mc.num_hidden_layers * mc.num_attention_heads * mc.head_dim * T
