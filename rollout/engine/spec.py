"""The engine spec: one frozen, typed description of a :class:`rollout.engine.Qwen3Engine`.

An :class:`EngineSpec` is built once (from the config by :func:`jax_rl.runtime.engines.engine_spec`; by hand
in tests and benches) and passed whole to the engine, the AOT compile path
(:func:`jax_rl.tpu.compile_rollout`) and the benches. ``rollout/`` imports no config: the spec is the
engine's own vocabulary. A new engine knob is one field here (and one line in the builder).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Union

from rollout.quantize import QUANTIZE_MODES

__all__ = ["EngineSpec", "check_chunk_size"]


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """What an engine is (its shapes, dtype, sampling, K/V layout); where it runs (a mesh) and its
    tokenizer are given next to it.

    Attributes:
      slots: concurrent decode slots B (``max_concurrent_decodes``; ``rollout.slots``).
      max_cache_len: K/V positions per slot S; a sequence (prompt + generated) holds at most S tokens.
      max_prefill_length: advertised to JetStream's Driver (rounded up to a power of two >= 16). The RL
        path's prefill accepts up to S - 1 cached tokens (+1 pending), bucketed to powers of two.
      dtype: compute + param + K/V dtype, ``"bfloat16"`` or ``"float32"`` (logits and sampling: float32).
      temperature, top_p, top_k: default sampling; a request's temperature may override it. top_p / top_k
        are engine-wide (static in the programs).
      model_kwargs: extra kwargs to ``Qwen3ForCausalLM`` (``scan_layers``, ``attention``, ``moe``: a
        :class:`jax_rl.models.qwen3.MoEOptions`, ...).
      kv_per_layer: the decode cache as L per-layer buffers, layers unrolled (None: on off a TPU;
        :class:`rollout.engine.Qwen3Engine`).
      record_routes: return the expert ids every MoE layer chose (a dense model: ignored).
      quantize: ``rollout.quantize`` (``"none"``, ``"int8"``, ``"fp8"``, ``"int4"``).
      kv_layout: the K/V layout's name in :data:`rollout.engine.layouts.KV_LAYOUTS` (``rollout.kv_layout``; default
        paged, as the config's).
      kv_page_size, kv_pages: a paged layout's page size (positions) and pool size (None: slots x
        ceil(max_cache_len / kv_page_size)); unread by the contiguous layout.
      sampler: ``rollout.sampler`` (``"auto"``, ``"xla"``, ``"kernel"``).
      prefill_chunk_size: ``rollout.prefill_chunk_size`` (the paged layout's chunked prefill).

    Raises (at construction, one line naming the field):
      ValueError: ``slots < 1``, ``max_cache_len < 2``, ``top_p`` outside (0, 1], an unknown ``sampler`` or
        ``quantize``, a ``prefill_chunk_size`` not a power of two >= 16. (An unknown ``kv_layout``: where the
        engine looks it up, :func:`rollout.engine.layouts.kv_layout_class`.)
    """

    slots: int = 16
    max_cache_len: int = 512
    max_prefill_length: int = 256
    dtype: Union[str, Any] = "bfloat16"
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    model_kwargs: Optional[Mapping[str, Any]] = None
    kv_per_layer: Optional[bool] = None
    record_routes: bool = False
    quantize: str = "none"
    kv_layout: str = "paged"
    kv_page_size: int = 16
    kv_pages: Optional[int] = None
    sampler: str = "auto"
    prefill_chunk_size: int = 2048

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise ValueError(f"slots must be >= 1, got {self.slots}")
        if self.max_cache_len < 2:
            raise ValueError(f"max_cache_len must be >= 2, got {self.max_cache_len}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.sampler not in ("auto", "xla", "kernel"):
            raise ValueError(f"sampler must be 'auto', 'xla' or 'kernel' (rollout.sampler), got {self.sampler!r}")
        if self.quantize not in QUANTIZE_MODES:
            raise ValueError(f"rollout.quantize must be one of {QUANTIZE_MODES}, got {self.quantize!r}")
        check_chunk_size(self.prefill_chunk_size)

    def replace(self, **changes: Any) -> "EngineSpec":
        """A copy with ``changes`` (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)

    @property
    def model_kw(self) -> dict:
        """:attr:`model_kwargs` as a fresh dict."""
        return dict(self.model_kwargs or {})


def check_chunk_size(chunk: int) -> int:
    """``chunk`` as an int; ValueError (naming ``rollout.prefill_chunk_size``) unless a power of two >= 16."""
    c = int(chunk)
    if c < 16 or c & (c - 1):
        raise ValueError(f"rollout.prefill_chunk_size={chunk}: must be a power of two >= 16 (the prefill "
                         f"programs' position buckets are powers of two)")
    return c
