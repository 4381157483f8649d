"""Qwen3 / Qwen3-MoE hyper-parameters (:class:`Qwen3Config`, HF ``config.json`` conversion), the
model presets (:data:`PRESETS`, :func:`get_preset`) and the MoE layers' execution options
(:class:`MoEOptions`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Optional

__all__ = ["Qwen3Config", "MoEOptions", "PRESETS", "get_preset"]


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
        model_type = _hf_model_type(d)
        out = dict(_HF_DEFAULTS[model_type])
        theta = _hf_rope_theta(d)
        if theta is not None:
            out["rope_theta"] = theta
        _hf_expert_alias(d)
        dt = _hf_dtype(d)
        if dt is not None:
            out["dtype"] = dt
        _hf_require_implemented(d)
        out.update(_hf_fields(d, {f.name for f in dataclasses.fields(cls)} - {"dtype"}, model_type))
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



@dataclasses.dataclass(frozen=True)
class MoEOptions:
    """How the MoE layers run (``Qwen3ForCausalLM(moe=...)``, passed to every :class:`MoE` layer): options
    that change no parameter, only the dispatch, the drops and the router's precision. Frozen and hashable
    (a static attribute of the Flax module; part of the rollout engine's ``model_kwargs``). Built from the
    config by :func:`jax_rl.models.qwen3.model_kwargs` (``model.moe_*``) and, for the engine,
    :func:`jax_rl.model_builder.rollout_model_kwargs` (``rollout.moe_*``). A dense model ignores it;
    the values are checked when an MoE layer is built (ValueError naming the ``moe_*`` key).

    Attributes:
      dispatch: ``model.moe_dispatch``: ``"dense"`` (every expert on every token, one-hot combine) or
        ``"ragged"`` (sorted token copies and a grouped matmul; expert-parallel under a mesh whose
        ``expert`` axis is > 1, see :class:`jax_rl.models.qwen3.MoE`).
      capacity_factor: ``model.moe_capacity_factor``: the expert-parallel path's capacity factor
        (MaxText ``capacity_factor``); None (default) = dropless.
      matmul: ``model.moe_matmul``: the expert-parallel path's grouped matmul, ``ragged_dot``,
        ``megablox`` or ``auto`` (megablox on a TPU backend; MaxText ``megablox``).
      router_dtype: the router matmul's dtype (a dtype name or dtype): ``float32`` (default, the
        learner's) or the engine's ``rollout.moe_router_dtype``.
      capacity_all_paths: ``capacity_factor`` drops token copies on the dense and single-shard paths
        too (the engine's ``rollout.moe_capacity_factor``;
        :func:`jax_rl.models.qwen3.layers.capacity_keep`). Default False.
    """

    dispatch: str = "dense"
    capacity_factor: Optional[float] = None
    matmul: str = "ragged_dot"
    router_dtype: Any = "float32"
    capacity_all_paths: bool = False

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


# ------------------------------------------------------------------ Qwen3Config.from_hf's steps (each pops what it reads)


def _hf_model_type(d: dict[str, Any]) -> str:
    """``model_type`` (inferred from ``num_experts`` when absent), checked with ``architectures``."""
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
    return model_type


def _hf_rope_theta(d: dict[str, Any]) -> Optional[float]:
    """The RoPE base from a top-level ``rope_theta`` and / or ``rope_parameters`` / ``rope_scaling`` (default
    RoPE only; they must agree), or None."""
    theta = d.pop("rope_theta", None)
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
    return None if theta is None else float(theta)


def _hf_expert_alias(d: dict[str, Any]) -> None:
    """transformers 5 writes ``num_local_experts`` next to ``num_experts``: folded into it (they must agree)."""
    if "num_local_experts" in d:
        nle = d.pop("num_local_experts")
        if d.setdefault("num_experts", nle) != nle:
            raise ValueError(f"config.num_local_experts={nle} disagrees with "
                             f"config.num_experts={d['num_experts']}")


def _hf_dtype(d: dict[str, Any]) -> Optional[str]:
    """``dtype`` (or transformers 4's ``torch_dtype``) without a ``torch.`` prefix, or None."""
    dt = d.pop("dtype", None)
    tdt = d.pop("torch_dtype", None)
    dt = dt if dt is not None else tdt
    return None if dt is None else str(dt).replace("torch.", "")


def _hf_require_implemented(d: dict[str, Any]) -> None:
    """The values we do not implement (bias, sliding window, dropout, non-silu, non-full attention) rejected."""
    for key, allowed, default in (("hidden_act", ("silu",), "silu"), ("attention_bias", (False,), False),
                                  ("use_sliding_window", (False,), False), ("attention_dropout", (0, 0.0), 0.0),
                                  ("mlp_bias", (False,), False)):
        v = d.pop(key, default)
        if v not in allowed:
            raise ValueError(f"config.{key}={v!r} is not supported (supported: {allowed})")
    lt = d.pop("layer_types", None)
    if lt is not None and any(t != "full_attention" for t in lt):
        raise ValueError(f"config.layer_types={lt!r} is not supported (only 'full_attention')")


def _hf_fields(d: dict[str, Any], fields: set[str], model_type: str) -> dict[str, Any]:
    """The remaining keys that are :class:`Qwen3Config` fields (the MoE ones only for ``qwen3_moe``); any other
    key not in ``_IGNORED_HF_KEYS`` is an error."""
    if model_type == "qwen3":
        fields = fields - {"num_experts", "num_experts_per_tok", "moe_intermediate_size",
                           "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"}
    out, unknown = {}, []
    for key, v in d.items():
        if key in fields:
            out[key] = v
        elif key not in _IGNORED_HF_KEYS:
            unknown.append(key)
    if unknown:
        raise ValueError(f"config has unsupported keys {sorted(unknown)} for model_type "
                         f"{model_type!r}")
    return out
