"""The rollout engine (:class:`Qwen3Engine`), a package whose files name its parts. Every module:

* :mod:`rollout.engine.core`: :class:`Qwen3Engine` (construction from an :class:`EngineSpec`, decode, the
  program table's owner) and the decode state's layout;
* :mod:`rollout.engine.spec`: :class:`EngineSpec`, the frozen description of an engine (built once from the
  config by :func:`jax_rl.runtime.engines.engine_spec`, passed whole to the engine, the compile path, the benches);
* :mod:`rollout.engine.layout`: :class:`~rollout.engine.layout.KVLayout`, the K/V layout interface (host
  operations, admission budget, stats, step programs) the engine holds as ``Qwen3Engine.kv``;
* :mod:`rollout.engine.layouts`: :data:`~rollout.engine.layouts.KV_LAYOUTS`, the registry the layout is
  chosen from, once (by ``rollout.kv_layout``);
* :mod:`rollout.engine.contiguous`: :class:`~rollout.engine.contiguous.ContiguousLayout` (``max_cache_len``
  positions reserved per slot): which rows share a prefill program, slot copies;
* :mod:`rollout.engine.paged` (a folder): the paged layout: ``layout`` (:class:`PagedLayout`), ``programs``,
  ``prefill_plan``, ``pool`` (the host page allocator), ``shards`` (one pool per shard of slots);
* :mod:`rollout.engine.programs`: the step programs (prefill, insert, append-prefill, THE decode step with
  the model call as its one hook, the n-step scan) and the contiguous jit table
  (:data:`~rollout.engine.programs.PROGRAMS`);
* :mod:`rollout.engine.slots`: the RL path's prefill rows and results (``SlotPrefill``, ``PrefillResult``)
  and the length buckets;
* :mod:`rollout.engine.sampler`: :func:`sample_tokens`, :class:`StepOutput`, JetStream's row packing;
  :mod:`rollout.engine.sampler_kernel`, the Pallas TPU sampler;
* :mod:`rollout.engine.weights`: ``load_params`` (the weight sync's cast / layout / quantisation);
* :mod:`rollout.engine.jetstream`: the JetStream ``Engine`` API and tokenizer (``jax-rl serve``).

Where to look: the decode step is :meth:`rollout.engine.programs.StepPrograms.decode` (its model call:
``model_step``, the paged one :meth:`rollout.engine.paged.programs.PagedStepPrograms.model_step`); a new
engine knob is a field of :class:`EngineSpec` (and a line of :func:`jax_rl.runtime.engines.engine_spec`).

Every name used across the repo is re-exported here: ``from rollout.engine import X`` keeps working.
"""

from rollout.engine.core import Qwen3Engine
from rollout.engine.jetstream import NO_BOS, JetStreamTokenizer
from rollout.engine.programs import PrefillRows, PrefixKV
from rollout.engine.sampler import StepOutput, inverse_cdf_index, pack_result, sample_tokens, unpack_result
from rollout.engine.slots import PrefillResult, SlotPrefill, prefill_bucket
from rollout.engine.spec import EngineSpec
from rollout.engine.weights import resolve_dtype


__all__ = [
    "Qwen3Engine",
    "EngineSpec",
    "JetStreamTokenizer",
    "sample_tokens",
    "inverse_cdf_index",
    "unpack_result",
    "pack_result",
    "StepOutput",
    "prefill_bucket",
    "SlotPrefill",
    "PrefillResult",
    "PrefixKV",
    "PrefillRows",
    "NO_BOS",
    "resolve_dtype",
]
