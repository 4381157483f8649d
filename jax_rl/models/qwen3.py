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
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jax_rl.models.expert_parallel import expert_parallel_moe, expert_parallel_size, resolve_moe_matmul
from jax_rl.sharding import constrain

Array = jax.Array

__all__ = [
    "Qwen3Config",
    "PRESETS",
    "get_preset",
    "RMSNorm",
    "Attention",
    "MLP",
    "MoE",
    "DecoderLayer",
    "Qwen3ForCausalLM",
    "KVCache",
    "token_logprobs",
    "sequence_logprobs",
    "count_params",
    "REMAT_POLICIES",
    "remat_policy_fn",
    "ATTENTION_KINDS",
    "resolve_attention",
    "stack_layer_params",
    "model_kwargs",
    "unstack_layer_params",
]

_NEG_INF = -1e30  # finite "minus infinity" for masked attention scores (no NaN on empty rows)


# --------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------

# HF class defaults, used for keys missing from a config.json (transformers Qwen3Config /
# Qwen3MoeConfig). Note Qwen3MoeConfig defaults norm_topk_prob=False although the released
# checkpoints set it to true.
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3": dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=10000.0, max_position_embeddings=32768, tie_word_embeddings=False,
    ),
    "qwen3_moe": dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=10000.0, max_position_embeddings=32768, tie_word_embeddings=False,
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=False,
        decoder_sparse_step=1, mlp_only_layers=(),
    ),
}

# Keys of config.json that carry no numerics we implement (or only training-time knobs that
# are off / irrelevant for us). Anything else unknown is an error.
_IGNORED_HF_KEYS = frozenset({
    "architectures", "transformers_version", "initializer_range", "use_cache", "pad_token_id",
    "output_router_logits", "router_aux_loss_coef", "max_window_layers", "sliding_window",
    "output_attentions", "output_hidden_states", "return_dict", "id2label", "label2id",
    "problem_type", "chunk_size_feed_forward", "is_encoder_decoder", "name_or_path",
    "_name_or_path", "tokenizer_class", "torchscript", "use_return_dict", "pruned_heads",
    "tie_encoder_decoder", "add_cross_attention", "cross_attention_hidden_size",
    "finetuning_task", "prefix", "sep_token_id", "decoder_start_token_id", "task_specific_params",
    "keys_to_ignore_at_inference", "base_model_tp_plan", "base_model_pp_plan",
    "router_jitter_noise",  # only used in training-mode HF forward with jitter; not in Qwen3
})


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
    """Qwen3 / Qwen3-MoE hyper-parameters, named as in HF ``config.json``.

    ``num_experts == 0`` means a dense model (HF ``model_type="qwen3"``). ``dtype`` is the
    storage dtype written to / read from config.json (HF ``torch_dtype`` / ``dtype``); it does
    not choose the compute dtype (that is ``Qwen3ForCausalLM(dtype=...)``).
    """

    vocab_size: int = 151936
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = True
    # MoE (Qwen3-MoE); num_experts == 0 -> dense
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # informational
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    dtype: str = "bfloat16"

    def __post_init__(self):
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Qwen3Config.{name} must be > 0, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"Qwen3Config.num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"Qwen3Config.head_dim must be even for RoPE, got {self.head_dim}")
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"Qwen3Config.num_experts_per_tok={self.num_experts_per_tok} must be in "
                    f"[1, num_experts={self.num_experts}]")
            if self.moe_intermediate_size <= 0:
                raise ValueError("Qwen3Config.moe_intermediate_size must be > 0 for MoE")
            if self.decoder_sparse_step <= 0:
                raise ValueError("Qwen3Config.decoder_sparse_step must be > 0")

    # ---- derived -----------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def model_type(self) -> str:
        return "qwen3_moe" if self.is_moe else "qwen3"

    def layer_is_moe(self, i: int) -> bool:
        """HF ``Qwen3MoeDecoderLayer`` rule: MoE iff not in mlp_only_layers, num_experts > 0
        and ``(i + 1) % decoder_sparse_step == 0``."""
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.layer_is_moe(i))

    def replace(self, **kw) -> "Qwen3Config":
        return dataclasses.replace(self, **kw)

    # ---- HF conversion -----------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "Qwen3Config":
        """Build from an HF ``config.json`` dict (transformers 4.x or 5.x form).

        Accepts a top-level ``rope_theta`` or transformers-5 ``rope_parameters``
        (``{"rope_type": "default", "rope_theta": ...}``), and ``dtype`` or ``torch_dtype``.
        Raises ``ValueError`` naming the field for any value we do not implement (rope
        scaling, sliding window, attention bias, non-silu activation, unknown keys, ...).
        """
        d = dict(hf)
        model_type = d.pop("model_type", None)
        archs = d.get("architectures")
        if model_type is None:
            model_type = "qwen3_moe" if "num_experts" in d else "qwen3"
        if model_type not in _HF_DEFAULTS:
            raise ValueError(f"config.model_type={model_type!r} is not supported "
                             "(expected 'qwen3' or 'qwen3_moe')")
        if archs is not None:
            ok = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}[model_type]
            bad = [a for a in archs if a != ok]
            if bad:
                raise ValueError(f"config.architectures={archs!r} is not supported (expected [{ok!r}])")
        out = dict(_HF_DEFAULTS[model_type])

        # --- rope
        theta_top = d.pop("rope_theta", None)
        theta = theta_top
        for key in ("rope_parameters", "rope_scaling"):
            rp = d.pop(key, None)
            if rp is None:
                continue
            if not isinstance(rp, dict):
                raise ValueError(f"config.{key}={rp!r} is not supported")
            rp = dict(rp)
            rtype = rp.pop("rope_type", rp.pop("type", "default"))
            if rtype not in (None, "default"):
                raise ValueError(f"config.{key}.rope_type={rtype!r} is not supported "
                                 "(only 'default' RoPE is implemented)")
            if "rope_theta" in rp:
                t = float(rp.pop("rope_theta"))
                if theta is not None and float(theta) != t:
                    raise ValueError(f"config.{key}.rope_theta={t} disagrees with "
                                     f"config.rope_theta={theta}")
                theta = t
            prf = rp.pop("partial_rotary_factor", 1.0)
            if prf != 1.0:
                raise ValueError(f"config.{key}.partial_rotary_factor={prf} is not supported")
            if rp:
                raise ValueError(f"config.{key} has unsupported entries {sorted(rp)}")
        if theta is not None:
            out["rope_theta"] = float(theta)

        # --- aliases (transformers 5 writes num_local_experts next to num_experts)
        if "num_local_experts" in d:
            nle = d.pop("num_local_experts")
            if d.setdefault("num_experts", nle) != nle:
                raise ValueError(f"config.num_local_experts={nle} disagrees with "
                                 f"config.num_experts={d['num_experts']}")

        # --- dtype
        dt = d.pop("dtype", None)
        tdt = d.pop("torch_dtype", None)
        dt = dt if dt is not None else tdt
        if dt is not None:
            out["dtype"] = str(dt).replace("torch.", "")

        # --- values we do not implement
        def _require(key, allowed, default):
            v = d.pop(key, default)
            if v not in allowed:
                raise ValueError(f"config.{key}={v!r} is not supported (supported: {allowed})")

        _require("hidden_act", ("silu",), "silu")
        _require("attention_bias", (False,), False)
        _require("use_sliding_window", (False,), False)
        _require("attention_dropout", (0, 0.0), 0.0)
        _require("mlp_bias", (False,), False)
        lt = d.pop("layer_types", None)
        if lt is not None and any(t != "full_attention" for t in lt):
            raise ValueError(f"config.layer_types={lt!r} is not supported (only 'full_attention')")

        fields = {f.name for f in dataclasses.fields(cls)} - {"dtype"}
        if model_type == "qwen3":
            fields -= {"num_experts", "num_experts_per_tok", "moe_intermediate_size",
                       "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"}
        unknown = []
        for key, v in d.items():
            if key in fields:
                out[key] = v
            elif key not in _IGNORED_HF_KEYS:
                unknown.append(key)
        if unknown:
            raise ValueError(f"config has unsupported keys {sorted(unknown)} for model_type "
                             f"{model_type!r}")
        if out.get("head_dim") is None:
            out["head_dim"] = out["hidden_size"] // out["num_attention_heads"]
        if model_type == "qwen3_moe" and not out.get("num_experts"):
            raise ValueError("config.num_experts must be > 0 for model_type 'qwen3_moe'")
        return cls(**out)

    def to_hf(self) -> dict[str, Any]:
        """The HF ``config.json`` dict (transformers-5 form, with a top-level ``rope_theta`` too)."""
        d: dict[str, Any] = dict(
            architectures=["Qwen3MoeForCausalLM" if self.is_moe else "Qwen3ForCausalLM"],
            model_type=self.model_type,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            hidden_act="silu",
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            tie_word_embeddings=self.tie_word_embeddings,
            attention_bias=False,
            attention_dropout=0.0,
            use_sliding_window=False,
            dtype=self.dtype,
        )
        if self.bos_token_id is not None:
            d["bos_token_id"] = self.bos_token_id
        if self.eos_token_id is not None:
            eos = self.eos_token_id
            d["eos_token_id"] = list(eos) if isinstance(eos, tuple) else eos
        if self.is_moe:
            d.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers),
            )
        return d


def _tiny_dense() -> Qwen3Config:
    return Qwen3Config(
        vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
        rope_theta=1_000_000.0, max_position_embeddings=4096, tie_word_embeddings=True,
        dtype="float32",
    )


def _tiny_moe() -> Qwen3Config:
    return _tiny_dense().replace(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                 norm_topk_prob=True)


def _qwen3_0p6b() -> Qwen3Config:
    return Qwen3Config(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=1_000_000.0, max_position_embeddings=40960, tie_word_embeddings=True,
        bos_token_id=151643, eos_token_id=151645, dtype="bfloat16",
    )


def _qwen3_4b() -> Qwen3Config:
    return _qwen3_0p6b().replace(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                                 num_attention_heads=32, num_key_value_heads=8)


def _qwen3_30b_a3b() -> Qwen3Config:
    return Qwen3Config(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=1_000_000.0, max_position_embeddings=40960, tie_word_embeddings=False,
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=(), bos_token_id=151643, eos_token_id=151645,
        dtype="bfloat16",
    )


PRESETS: dict[str, Callable[[], Qwen3Config]] = {
    "tiny_dense": _tiny_dense,
    "tiny_moe": _tiny_moe,
    "qwen3_0p6b": _qwen3_0p6b,
    "qwen3_4b": _qwen3_4b,
    "qwen3_30b_a3b": _qwen3_30b_a3b,
}


def get_preset(name: str, **hf_overrides: Any) -> Qwen3Config:
    """A preset config with HF-named field overrides (e.g. ``hidden_size=32``)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
    cfg = PRESETS[name]()
    if not hf_overrides:
        return cfg
    bad = sorted(set(hf_overrides) - {f.name for f in dataclasses.fields(Qwen3Config)})
    if bad:
        raise ValueError(f"unknown Qwen3Config override(s) {bad}")
    return cfg.replace(**hf_overrides)


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


def _to_heads(x: Array, K: int) -> Array:
    """[B,T,N,H] -> [B,K,G*T,H] (kv-head major; the G query heads of a kv head stacked on T)."""
    B, T, N, H = x.shape
    return x.reshape(B, T, K, N // K, H).transpose(0, 2, 3, 1, 4).reshape(B, K, (N // K) * T, H)


def _from_heads(o: Array, T: int) -> Array:
    """[B,K,G*T,H] -> [B,T,N,H] (inverse of ``_to_heads``)."""
    B, K, M, H = o.shape
    G = M // T
    return o.reshape(B, K, G, T, H).transpose(0, 3, 1, 2, 4).reshape(B, T, K * G, H)


def _attn_probs(qh: Array, kh: Array, mask: Array, G: int) -> Array:
    """Softmax probabilities [B,K,G*T,S] float32 (HF eager: scale after the dot, fp32)."""
    B, K, M, H = qh.shape
    S = kh.shape[2]
    s = jnp.einsum("bkmh,bksh->bkms", qh, kh, preferred_element_type=jnp.float32) * (H ** -0.5)
    s = jnp.where(mask[:, None, None], s.reshape(B, K, G, M // G, S), _NEG_INF)
    return jax.nn.softmax(s, axis=-1).reshape(B, K, M, S)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attn_core(qh: Array, kh: Array, vh: Array, mask: Array, G: int) -> Array:
    """Grouped attention in head-major layout: qh [B,K,G*T,H], kh/vh [B,K,S,H], mask [B,T,S]
    -> [B,K,G*T,H] (vh.dtype). A hand-written backward (same maths as autodiff) whose dots all
    take their operands in row-major order, so XLA:CPU inserts no transposes of [T,S] arrays."""
    return jnp.einsum("bkms,bksh->bkmh", _attn_probs(qh, kh, mask, G).astype(vh.dtype), vh)


def _attn_core_fwd(qh, kh, vh, mask, G):
    p = _attn_probs(qh, kh, mask, G).astype(vh.dtype)
    return jnp.einsum("bkms,bksh->bkmh", p, vh), (qh, kh, vh, mask, p)


def _attn_core_bwd(G, res, do):
    qh, kh, vh, mask, p = res
    B, K, M, H = qh.shape
    S = kh.shape[2]
    do = do.astype(vh.dtype)
    dp = jnp.einsum("bkmh,bksh->bkms", do, vh, preferred_element_type=jnp.float32)
    dv = jnp.einsum("bkhm,bkms->bkhs", do.swapaxes(-1, -2), p).swapaxes(-1, -2)
    pf = p.astype(jnp.float32)
    ds = pf * (dp - jnp.sum(dp * pf, axis=-1, keepdims=True))  # softmax vjp
    ds = jnp.where(mask[:, None, None], ds.reshape(B, K, G, M // G, S), 0.0)  # where vjp
    ds = (ds.reshape(B, K, M, S) * (H ** -0.5)).astype(qh.dtype)
    dq = jnp.einsum("bkms,bksh->bkmh", ds, kh)
    dk = jnp.einsum("bkhm,bkms->bkhs", qh.swapaxes(-1, -2), ds).swapaxes(-1, -2)
    return dq, dk.astype(kh.dtype), dv.astype(vh.dtype), None


_attn_core.defvjp(_attn_core_fwd, _attn_core_bwd)


def attend(q: Array, k: Array, v: Array, mask: Array) -> Array:
    """GQA softmax attention (HF eager numerics: scores scaled after the dot, fp32 softmax).

    q [B,T,N,H], k/v [B,S,K,H], mask [B,T,S] bool (True = may attend) -> [B,T,N,H] (q.dtype).
    """
    B, T, N, H = q.shape
    K = k.shape[2]
    if T == 1:  # decode: no transpose of the cache
        qg = q.reshape(B, K, N // K, H)
        s = jnp.einsum("bkgh,bskh->bkgs", qg, k, preferred_element_type=jnp.float32)
        s = jnp.where(mask[:, :, None, :], s * (H ** -0.5), _NEG_INF)
        p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
        return jnp.einsum("bkgs,bskh->bkgh", p, v).reshape(B, 1, N, H).astype(q.dtype)
    kh = k.transpose(0, 2, 1, 3)
    vh = v.transpose(0, 2, 1, 3)
    o = _attn_core(_to_heads(q, K), kh, vh, mask, N // K)
    return _from_heads(o, T).astype(q.dtype)


def attend_cached(q: Array, kh: Array, vh: Array, mask: Array) -> Array:
    """One-token (decode) GQA attention over a head-major cache (the ``KVCache`` layout).

    q [B,1,N,H], kh/vh [B,K,S,H], mask [B,1,S] bool -> [B,1,N,H] (q.dtype). The same numerics
    as ``attend`` with T == 1; the cache's batch and head dims lead, so the dots read it in
    place (no transpose of the cache).
    """
    # the same einsums as ``attend`` on a [B,S,K,H] view: XLA folds the swapaxes into the
    # dots' dimension numbers (no copy of the cache on TPU), and XLA:CPU gives the same bits
    # as before the cache became head-major
    return attend(q, kh.swapaxes(1, 2), vh.swapaxes(1, 2), mask)


def attend_cached_t(q: Array, kt: Array, vh: Array, mask: Array) -> Array:
    """``attend_cached`` over a key-transposed cache (``KVCache.per_layer``'s layout).

    q [B,1,N,H], kt [B,K,H,S], vh [B,K,S,H], mask [B,1,S] bool -> [B,1,N,H] (q.dtype). The same
    einsums as ``attend`` on [B,S,K,H] views: XLA folds the transposes into the dots' dimension
    numbers, so the score dot reads the keys with the positions contiguous (the layout is what
    makes it fast on XLA:CPU), and the values equal ``attend``'s bit for bit.
    """
    return attend(q, kt.transpose(0, 3, 1, 2), vh.swapaxes(1, 2), mask)


_CAUSAL_BLOCK = 80  # query rows per block of the causal attention (see _attend_causal)


def _attend_causal(q: Array, k: Array, v: Array, mask: Array) -> Array:
    """``attend`` for a mask that is causal (``mask[b,t,s]`` False for ``s > t``) with S == T:
    the queries are split into blocks and block i only scores keys ``< end_i``, skipping the
    upper triangle (~40% of the work at 4 blocks). Same values as ``attend``."""
    B, T, N, H = q.shape
    nb = max(1, min(8, T // _CAUSAL_BLOCK))
    if nb == 1:
        return attend(q, k, v, mask)
    K = k.shape[2]
    kh = k.transpose(0, 2, 1, 3)
    vh = v.transpose(0, 2, 1, 3)
    bounds = [round(i * T / nb) for i in range(nb + 1)]
    outs = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        o = _attn_core(_to_heads(q[:, a:b], K), kh[:, :, :b], vh[:, :, :b], mask[:, a:b, :b],
                       N // K)
        outs.append(_from_heads(o, b - a))
    return jnp.concatenate(outs, axis=1).astype(q.dtype)


def _wgrad(x: Array, dy: Array) -> Array:
    """``x^T @ dy`` for x [M,I], dy [M,O] -> [I,O]. XLA:CPU's fast GEMM wants row-major
    operands, so the smaller of the two is transposed explicitly (the barrier stops XLA from
    folding the transpose back into the dot and transposing - or fusing elementwise producers
    into a transpose of - the larger one)."""
    if x.shape[1] <= dy.shape[1]:
        return jnp.dot(jax.lax.optimization_barrier(x.T), dy)
    return jnp.dot(jax.lax.optimization_barrier(dy.T), x).T


@jax.custom_vjp
def _dense(x: Array, w: Array) -> Array:
    """``x [..., I] @ w [I, O]`` (x.dtype); same values and gradients as the plain dot, with a
    backward laid out for XLA:CPU (see ``_wgrad``)."""
    return jnp.dot(x, w)


def _dense_fwd(x, w):
    return jnp.dot(x, w), (x, w)


def _dense_bwd(res, dy):
    x, w = res
    dy = dy.astype(x.dtype)
    dx = jnp.dot(dy, w.T)
    dw = _wgrad(x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1]))
    return dx, dw.astype(w.dtype)


_dense.defvjp(_dense_fwd, _dense_bwd)


def _proj(x: Array, w: Array, n_in: int = 1) -> Array:
    """Contract the last ``n_in`` dims of x with the first ``n_in`` of w (an einsum such as
    ``btd,dnh->btnh``) as one 2-D ``_dense``."""
    in_shape, out_shape = w.shape[:n_in], w.shape[n_in:]
    y = _dense(x.reshape(*x.shape[:x.ndim - n_in], math.prod(in_shape)),
               w.reshape(math.prod(in_shape), math.prod(out_shape)))
    return y.reshape(*x.shape[:x.ndim - n_in], *out_shape)


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
    dense path and the single-shard ragged path are always dropless. ``num_experts`` must
    divide by ``mesh.expert`` on the EP path (ValueError otherwise).

    ``matmul``: the EP path's grouped matmul, ``ragged_dot``, ``megablox`` (Pallas TPU kernels,
    whose weight gradient costs 1x instead of ragged_dot's G x on TPU) or ``auto`` (megablox on a
    TPU backend; resolved at construction into ``self.matmul``); see
    :func:`jax_rl.models.expert_parallel.grouped_matmul`. The single-shard ragged path always
    uses ``ragged_dot``.
    """

    def __init__(self, cfg: Qwen3Config, *, rngs: nnx.Rngs, dtype, param_dtype,
                 dispatch: str = "dense", capacity_factor: float | None = None, matmul: str = "ragged_dot"):
        if dispatch not in ("dense", "ragged"):
            raise ValueError(f"moe_dispatch must be 'dense' or 'ragged', got {dispatch!r}")
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(f"moe_capacity_factor must be > 0 or None (dropless), "
                             f"got {capacity_factor}")
        D, F, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
        self.dtype = dtype
        self.dispatch = dispatch
        self.capacity_factor = capacity_factor
        self.matmul = resolve_moe_matmul(matmul)
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.router = _param(rngs, (D, E), ("embed", "router"), param_dtype)
        self.gate_proj = _param(rngs, (E, D, F), ("expert", "embed", "mlp"), param_dtype)
        self.up_proj = _param(rngs, (E, D, F), ("expert", "embed", "mlp"), param_dtype)
        self.down_proj = _param(rngs, (E, F, D), ("expert", "mlp", "embed"), param_dtype)

    def route(self, x: Array, forced_expert_ids: Array | None = None) -> tuple[Array, Array]:
        """x [B,T,D] -> (weights [B,T,k] float32, expert ids [B,T,k] int32)."""
        logits = jnp.einsum("btd,de->bte", x.astype(jnp.float32),
                            self.router[...].astype(jnp.float32))
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
                 return_dropped: bool = False):
        """x [B,T,D] -> (y [B,T,D] compute dtype, expert ids [B,T,k] int32).

        ``forced_expert_ids`` [B,T,k] int: use these experts instead of the top-k (routing
        replay); their router probabilities are the combine weights (renormalised over the k
        forced ids when ``norm_topk_prob``). A token whose ids hold any value outside
        ``[0, E)`` (:data:`ROUTE_MISSING`) falls back to the router's own top-k.

        ``valid`` [B,T] bool (e.g. the attention mask): on the EP path a False token (padding)
        takes no capacity slot and gets y = 0; the other paths ignore it (they never drop).
        ``return_dropped``: also return, third, the int32 [] count of valid token copies the EP
        path dropped for capacity (``expert_parallel_moe``; 0 on the dropless paths)."""
        dt = self.dtype
        x = x.astype(dt)
        w, ids = self.route(x, forced_expert_ids)
        wg = self.gate_proj[...].astype(dt)
        wu = self.up_proj[...].astype(dt)
        wd = self.down_proj[...].astype(dt)
        dropped = jnp.int32(0)
        if self.dispatch == "dense":
            E = wg.shape[0]
            combine = jnp.einsum("btk,btke->bte", w.astype(dt), jax.nn.one_hot(ids, E, dtype=dt))
            g = jnp.einsum("btd,edf->btef", x, wg)
            u = jnp.einsum("btd,edf->btef", x, wu)
            a = jax.nn.silu(g) * u * combine[..., None]
            y = jnp.einsum("btef,efd->btd", a, wd)
        elif expert_parallel_size() > 1:
            y, dropped = expert_parallel_moe(x, w.astype(dt), ids, wg, wu, wd, valid=valid,
                                             capacity_factor=self.capacity_factor, matmul=self.matmul)
        else:
            y = self._ragged(x, w.astype(dt), ids, wg, wu, wd)
        return (y, ids, dropped) if return_dropped else (y, ids)

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


AttendFn = Callable[[Array, Array, Array], Array]
LayerAttendFn = Callable[[Array, Array, Array, Any], tuple[Array, Any]]


class DecoderLayer(nnx.Module):
    """Pre-norm block: ``h = x + attn(norm_in(x))``; ``out = h + mlp(norm_post(h))``."""

    def __init__(self, cfg: Qwen3Config, layer_idx: int, *, rngs: nnx.Rngs, dtype, param_dtype,
                 moe_dispatch: str = "dense", moe_capacity_factor: float | None = None,
                 moe_matmul: str = "ragged_dot"):
        self.is_moe = cfg.layer_is_moe(layer_idx)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps,
                                                param_dtype=param_dtype)
        self.attn = Attention(cfg, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        if self.is_moe:
            self.mlp = MoE(cfg, rngs=rngs, dtype=dtype, param_dtype=param_dtype,
                           dispatch=moe_dispatch, capacity_factor=moe_capacity_factor, matmul=moe_matmul)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, rngs=rngs, dtype=dtype,
                           param_dtype=param_dtype)

    def __call__(self, x: Array, positions: Array, attend_fn: AttendFn,
                 forced_expert_ids: Array | None = None, valid: Array | None = None
                 ) -> tuple[Array, Array | None, Array | None]:
        """x [B,T,D] -> (x [B,T,D], expert ids [B,T,k] or None, MoE capacity drops int32 [] or
        None). ``attend_fn(q,k,v)`` does the attention core (full-sequence, prefill or cached
        decode); ``valid`` [B,T] bool: the tokens that take MoE capacity (:class:`MoE`)."""
        q, k, v = self.attn.qkv(self.input_layernorm(x), positions)
        h = x + self.attn.out(checkpoint_name(attend_fn(q, k, v), "context")).astype(x.dtype)
        y = self.post_attention_layernorm(h)
        if self.is_moe:
            y, ids, dropped = self.mlp(y, forced_expert_ids, valid=valid, return_dropped=True)
        else:
            y, ids, dropped = self.mlp(y), None, None
        out = h + y.astype(h.dtype)
        return _constrain(out, ("activation_batch", "activation_length", "activation_embed")), ids, dropped


# --------------------------------------------------------------------------------------
# KV cache
# --------------------------------------------------------------------------------------


@flax.struct.dataclass
class KVCache:
    """Per-slot KV cache (a pytree).

    k, v: [L,B,K,S,H] (cache dtype; head-major, as JetStream/MaxText decode caches, so the
    decode attention reads each layer's [B,K,S,H] in place); lengths: [B] int32 = number of
    valid positions per slot (the next token of slot b goes to position ``lengths[b]``).

    Per-layer form (``per_layer()``; what the rollout engine keeps for unrolled layers, i.e. on
    the CPU): k is a tuple of L key-transposed arrays [B,K,H,S] and v a tuple of L arrays
    [B,K,S,H]. Same values; ``decode_step`` then writes and reads each layer's own buffer,
    where the stacked form makes XLA:CPU copy the layer's [B,K,S,H] out of the [L,...] buffer
    before the attention dots (two cache-layer copies per layer per token). Keys are stored
    transposed so the decode score dot ``q [G,H] @ k [H,S]`` has the positions as its
    contiguous output dim: XLA:CPU ran it 2.8x faster than over [B,K,S,H] (32 slots x 145
    positions, 4 kv heads of 32: 0.43 vs 1.2 ms, ``bench/rollout_decode.py``). Scanned layers
    need the stacked form.
    """

    k: Any
    v: Any
    lengths: Array

    @property
    def is_per_layer(self) -> bool:
        return isinstance(self.k, (tuple, list))

    @property
    def max_len(self) -> int:
        return self.v[0].shape[2] if self.is_per_layer else self.k.shape[3]

    def per_layer(self) -> "KVCache":
        """This cache with k as a tuple of per-layer key-transposed [B,K,H,S] arrays and v as a
        tuple of per-layer [B,K,S,H] arrays."""
        if self.is_per_layer:
            return self
        L = self.k.shape[0]
        return KVCache(k=tuple(self.k[i].swapaxes(2, 3) for i in range(L)),
                       v=tuple(self.v[i] for i in range(L)),
                       lengths=self.lengths)

    def stacked(self) -> "KVCache":
        """This cache with k/v as [L,B,K,S,H] arrays."""
        if not self.is_per_layer:
            return self
        return KVCache(k=jnp.stack([k.swapaxes(2, 3) for k in self.k]), v=jnp.stack(self.v),
                       lengths=self.lengths)

    def insert(self, other: "KVCache", slot: int | Array, row: int = 0) -> "KVCache":
        """Copy row ``row`` of another (stacked) cache (e.g. a batch-1 prefill) into slot ``slot``."""
        s = other.k.shape[3]
        if self.is_per_layer:
            k = tuple(c.at[slot, :, :, :s].set(other.k[i, row].swapaxes(1, 2).astype(c.dtype))
                      for i, c in enumerate(self.k))
            v = tuple(c.at[slot, :, :s].set(other.v[i, row].astype(c.dtype)) for i, c in enumerate(self.v))
        else:
            k = self.k.at[:, slot, :, :s].set(other.k[:, row].astype(self.k.dtype))
            v = self.v.at[:, slot, :, :s].set(other.v[:, row].astype(self.v.dtype))
        return KVCache(k=k, v=v, lengths=self.lengths.at[slot].set(other.lengths[row]))


# --------------------------------------------------------------------------------------
# Layer stacking (scan_layers), remat policies, attention choice
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

ATTENTION_KINDS: tuple[str, ...] = ("auto", "xla", "splash")


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
    """``auto`` -> ``splash`` on a TPU backend, else ``xla``; ``xla``/``splash`` unchanged.
    Raises ValueError for other names."""
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
    TPU splash attention for full forwards and prefill; decode stays ``xla``) or ``auto``
    (``splash`` when ``jax.default_backend() == "tpu"``, else ``xla``; resolved here, at
    construction, into ``self.attention``).
    """

    def __init__(self, config: Qwen3Config, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 param_dtype=jnp.float32, moe_dispatch: str = "dense", remat: bool = False,
                 scan_layers: bool = False, remat_policy: str | None = None,
                 attention: str = "xla", moe_capacity_factor: float | None = None,
                 moe_matmul: str = "ragged_dot", scan_unroll: int | bool | str = 1):
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
                         moe_matmul=moe_matmul)
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
               carry: Any = None, valid: Array | None = None, moe_drops: list | None = None):
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
        """
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

            x, ids, dropped = layer(x, positions, fn, forced, valid)
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
        kernel, segment ids from ``valid`` [B,T]) or the XLA path (``mask`` [B,T,T])."""
        if self.attention == "splash":
            seg = (jnp.ones((B, T), jnp.int32) if valid is None
                   else jnp.asarray(valid, bool).astype(jnp.int32))
            from jax_rl.models.attention import splash_attend

            return lambda q, k, v: splash_attend(q, k, v, seg)
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
                return_expert_ids: bool = False):
        """Prompt pass writing K/V for positions 0..T-1 of every row.

        input_ids [B,T] right-padded, lengths [B] int32 (valid tokens per row), cache with
        S >= T. Returns (logits [B,T,V] f32, cache with ``lengths`` set). The next-token logit
        of row b is ``logits[b, lengths[b]-1]``. Rows' previous cache contents are replaced.
        With ``return_expert_ids`` the per-MoE-layer expert ids (list of [B,T,k] int32, the
        routes the router chose for every position) come third.
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

        h, ids, _, (k, v) = self._trunk(self.embed(input_ids), positions, layer_attend, valid=valid)
        k = k.astype(cache.k.dtype).swapaxes(2, 3)  # [L,B,T,K,H] -> [L,B,K,T,H]
        v = v.astype(cache.v.dtype).swapaxes(2, 3)
        cache = KVCache(k=jax.lax.dynamic_update_slice(cache.k, k, (0, 0, 0, 0, 0)),
                        v=jax.lax.dynamic_update_slice(cache.v, v, (0, 0, 0, 0, 0)),
                        lengths=lengths)
        if return_expert_ids:
            return self.lm_logits(h), cache, ids
        return self.lm_logits(h), cache

    def decode_step(self, tokens: Array, cache: KVCache, *, forced_expert_ids=None,
                    return_expert_ids: bool = False):
        """One decode token per slot.

        tokens [B] int32 is placed at position ``cache.lengths[b]`` and attends to cache
        positions ``<= lengths[b]``; then lengths += 1. Returns (logits [B,V] f32, cache)
        (plus expert ids list of [B,k] when ``return_expert_ids``). Inactive slots are the
        caller's business (mask them; their lengths still advance).

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
                                           if cache.is_per_layer else (cache.k, cache.v))
        cache = KVCache(k=k, v=v, lengths=pos + 1)
        logits = self.lm_logits(h)[:, 0]
        if return_expert_ids:
            return logits, cache, [i[:, 0] for i in ids]
        return logits, cache


# --------------------------------------------------------------------------------------
# Log-probs
# --------------------------------------------------------------------------------------

_CHUNK_ELEMS = 1 << 22  # ~16 MB of fp32 logits per chunk
_UNROLL_CHUNKS: bool | int = 1  # scan unroll of the LM-head chunk loop (1: a loop)


def _chunk_len(B: int, T: int, V: int, chunk_elems: int, chunk_tokens: int | None = None) -> int:
    """Largest divisor of T with B*C*V <= chunk_elems, or, with ``chunk_tokens``, the largest
    divisor of T not above it (at least 1)."""
    target = max(1, chunk_elems // max(1, B * V)) if chunk_tokens is None else max(1, int(chunk_tokens))
    if target >= T:
        return T
    for c in range(target, 0, -1):
        if T % c == 0:
            return c
    return 1


def _map_over_t(fn: Callable[..., Array], arrays: Sequence[Array], B: int, T: int, V: int,
                chunk_elems: int, chunk_tokens: int | None = None) -> Array:
    """Apply ``fn(*chunks) -> [B,C,...]`` over T-chunks of ``arrays`` (each [B,T,...]) with a
    rematerialised lax.map, so neither the forward nor the backward keeps a [B,T,V]."""
    C = _chunk_len(B, T, V, chunk_elems, chunk_tokens)
    if C == T:
        return fn(*arrays)
    n = T // C

    @jax.checkpoint
    def body(i):
        return fn(*[jax.lax.dynamic_slice_in_dim(a, i * C, C, axis=1) for a in arrays])

    # lax.map as a scan; _UNROLL_CHUNKS writes the loop out (tests of jax_rl.compile's cost
    # analysis, which counts a loop body once)
    out = jax.lax.scan(lambda c, i: (c, body(i)), None, jnp.arange(n), unroll=_UNROLL_CHUNKS)[1]  # [n,B,C,...]
    return jnp.moveaxis(out, 0, 1).reshape(B, T, *out.shape[3:])


def _scaled_lse_picked(logits: Array, targets: Array, temperature) -> tuple[Array, Array, Array]:
    """fp32 ``logits / temperature`` [..., V], its logsumexp and the targets' scaled logits [...]."""
    lg = logits.astype(jnp.float32) / temperature
    lse = jax.nn.logsumexp(lg, axis=-1)
    picked = jnp.take_along_axis(lg, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return lg, lse, picked


def _logp_from_logits(logits: Array, targets: Array, temperature) -> Array:
    _, lse, picked = _scaled_lse_picked(logits, targets, temperature)
    return picked - lse


def _logp_entropy_from_logits(logits: Array, targets: Array, temperature) -> Array:
    """[..., 2]: log-prob of ``targets`` and the entropy ``H = lse - sum softmax * logits`` (nats)
    of ``softmax(logits / temperature)``."""
    lg, lse, picked = _scaled_lse_picked(logits, targets, temperature)
    ent = lse - jnp.sum(jax.nn.softmax(lg, axis=-1) * lg, axis=-1)
    return jnp.stack([picked - lse, ent], axis=-1)


def _trunc_logp_from_logits(logits: Array, targets: Array, temperature, top_k: int, top_p: float,
                            return_entropy: bool = False) -> Array:
    """log pi_trunc of ``targets`` under ``softmax(logits / temperature)`` truncated by top-k then
    top-p (:func:`jax_rl.sampling.kept_set`, the rollout sampler's own rule) and renormalised
    over the kept set: ``log_softmax[tok] - log(kept mass)`` if ``tok`` is kept, ``-inf`` if not.
    The kept set is stop-gradient, the kept mass carries gradient; a ``-inf`` entry has an exact
    zero gradient. With ``return_entropy`` [..., 2]: also the entropy (nats) of the truncated,
    renormalised distribution."""
    from jax_rl.sampling import kept_set, log_kept_mass

    lp = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)  # as the sampler
    kept = kept_set(lp, top_k, top_p)
    lkm = log_kept_mass(lp, kept)
    tg = targets[..., None].astype(jnp.int32)
    picked = jnp.take_along_axis(lp, tg, axis=-1)[..., 0]
    inside = jnp.take_along_axis(kept, tg, axis=-1)[..., 0]
    logp = jnp.where(inside, picked - lkm, -jnp.inf)
    if not return_entropy:
        return logp
    lq = jnp.where(kept, lp - lkm[..., None], 0.0)  # log q on the kept set, 0 elsewhere (no -inf)
    ent = -jnp.sum(jnp.where(kept, jnp.exp(lq) * lq, 0.0), axis=-1)
    return jnp.stack([logp, ent], axis=-1)


def _per_token_fn(temperature, top_k: int, top_p: float, return_entropy: bool) -> Callable[[Array, Array], Array]:
    """``(logits [...,V], targets [...]) -> [...]`` (or [..., 2] with the entropy): the plain
    tempered log-softmax when no truncation is on (the untruncated code path, unchanged), else
    :func:`_trunc_logp_from_logits`."""
    from jax_rl.sampling import check_truncation, truncates

    check_truncation(top_k, top_p)
    if truncates(top_k, top_p):
        return lambda lg, tg: _trunc_logp_from_logits(lg, tg, temperature, int(top_k), float(top_p), return_entropy)
    per_token = _logp_entropy_from_logits if return_entropy else _logp_from_logits
    return lambda lg, tg: per_token(lg, tg, temperature)


def token_logprobs(logits: Array, targets: Array, temperature: float | Array = 1.0, *,
                   chunk_elems: int = _CHUNK_ELEMS, top_k: int = 0, top_p: float = 1.0) -> Array:
    """``log softmax(logits / temperature)[targets]``.

    logits [B,T,V] (any float dtype), targets [B,T] int -> [B,T] float32. Chunked over T
    (rematerialised ``lax.map``) when B*T*V exceeds ``chunk_elems``, so no second [B,T,V]
    (log-softmax) array is kept alive in the forward or the backward. ``top_k`` / ``top_p``
    (static): the log-prob under the sampler's truncated distribution, as in
    :func:`sequence_logprobs`.
    """
    B, T, V = logits.shape
    return _map_over_t(_per_token_fn(temperature, top_k, top_p, False), (logits, targets), B, T, V, chunk_elems)


def sequence_logprobs(model_or_graphdef, *args, temperature: float | Array = 1.0,
                      positions: Array | None = None, forced_expert_ids=None,
                      return_expert_ids: bool = False, return_entropy: bool = False,
                      chunk_elems: int = _CHUNK_ELEMS, chunk_tokens: int | None = None,
                      top_k: int = 0, top_p: float = 1.0, return_moe_drops: bool = False):
    """Per-token log-probs of a sequence under the model (pure, jit-friendly).

    Call as ``sequence_logprobs(model, tokens, attention_mask=None, temperature=1.0)`` or
    ``sequence_logprobs(graphdef, state, tokens, attention_mask=None, temperature=1.0)``.
    tokens [B,T] int32, attention_mask [B,T] bool (right padding). Returns [B,T] float32 with
    ``out[:, 0] = 0`` and ``out[:, t] = log p(tokens[t] | tokens[:t])`` (temperature applied),
    zero where attention_mask is False - the alignment of ``behav_logp``. The LM head and
    log-softmax run chunked over T, so the full [B,T,V] logits are never materialised.
    With ``return_entropy`` returns ``(logp, entropy)``: entropy [B,T] float32 in nats of the
    temperature-scaled next-token distribution that predicts ``tokens[t]`` (same alignment and
    zeros as logp; verl's ``entropy_from_logits``). With ``return_expert_ids`` the per-MoE-layer
    expert ids come next, and with ``return_moe_drops`` last the pair ``(dropped, copies)``
    (float32 [] each): the token copies the MoE layers' expert-parallel dispatch dropped for
    capacity (``model.moe_capacity_factor``; 0 when dropless or without EP) and the copies
    routed, over the valid tokens (attention_mask) and every MoE layer (0, 0 for a dense model).
    Padding takes no MoE capacity.

    The LM head runs over T-chunks of C positions (a rematerialised ``lax.map``): C is the
    largest divisor of T with B*C*V <= ``chunk_elems`` (default 4M logits, ~16 MB of fp32), or
    the largest divisor of T not above ``chunk_tokens`` when given (``model.logits_chunk_tokens``:
    on a TPU, a few hundred tokens keep the head's matmuls MXU-sized). All T positions go
    through the head (the last one predicts a pad target and is dropped), so a power-of-two T
    chunks evenly.

    Truncated sampling (``top_k > 0`` or ``top_p < 1``, static: ``rollout.top_k`` /
    ``rollout.top_p``): ``out[:, t]`` is log pi_trunc, the log-prob under the distribution the
    rollout sampler draws from: temperature, then top-k, then top-p (HF warper order, the
    sampler's own :func:`jax_rl.sampling.kept_set`), renormalised over the kept set, i.e.
    ``log_softmax(logits/T)[tok] - log(kept mass)``; ``-inf`` where ``tokens[t]`` is outside
    the kept set (prompt tokens can be; a generated token only when the two sides' numerics put
    it across the boundary). The kept set is stop-gradient, the kept mass carries gradient, a
    ``-inf`` entry has a zero gradient. The entropy is that of the truncated distribution. The
    cost is inside the chunked head: one ``lax.top_k`` over V per position for top-k, a sort
    over V per position for top-p alone (O(V log V), recomputed in the backward by the chunk's
    remat). The engine's per-token kept mass is not needed here: the learner recomputes the
    kept set from its own logits, and any difference from the engine's is exactly what
    ``train_infer_ratio`` (pi_prox / mu) measures. Off (the defaults): the untruncated code
    path, bit for bit.
    """
    if isinstance(model_or_graphdef, nnx.GraphDef):
        state, *rest = args
        model = nnx.merge(model_or_graphdef, state)
    else:
        model, rest = model_or_graphdef, list(args)
    if not rest:
        raise TypeError("sequence_logprobs needs tokens")
    tokens = jnp.asarray(rest[0])
    attention_mask = rest[1] if len(rest) > 1 else None
    if len(rest) > 2:
        temperature = rest[2]
    if len(rest) > 3:
        raise TypeError("too many positional arguments to sequence_logprobs")
    B, T = tokens.shape
    drops: list = []
    h, ids, _ = model.hidden_states(tokens, positions, attention_mask,
                                    forced_expert_ids=forced_expert_ids, moe_drops=drops)
    V = model.config.vocab_size

    per_token = _per_token_fn(temperature, top_k, top_p, return_entropy)

    def fn(hc, tc):
        return per_token(model.lm_logits(hc), tc)

    k = (2,) if return_entropy else ()
    if T > 1:
        # position t predicts tokens[t + 1]; the last position's target is a pad (dropped)
        targets = jnp.concatenate([tokens[:, 1:], jnp.zeros((B, 1), tokens.dtype)], axis=1)
        lp = _map_over_t(fn, (h, targets), B, T, V, chunk_elems, chunk_tokens)
        out = jnp.concatenate([jnp.zeros((B, 1, *k), jnp.float32), lp[:, :-1]], axis=1)
    else:
        out = jnp.zeros((B, T, *k), jnp.float32)
    if attention_mask is not None:
        am = jnp.asarray(attention_mask, bool)
        out = jnp.where(am[..., None] if k else am, out, 0.0)
    res = (out[..., 0], out[..., 1]) if return_entropy else (out,)
    if return_expert_ids:
        res = (*res, ids)
    if return_moe_drops:
        res = (*res, drops[0])
    return res if len(res) > 1 else res[0]


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
