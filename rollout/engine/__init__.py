"""The rollout engine (:class:`Qwen3Engine`), a package whose files name its parts:

* :mod:`rollout.engine.core`: :class:`Qwen3Engine` (construction, decode, the program table's owner)
  and the decode state's layout;
* :mod:`rollout.engine.programs`: the jitted step programs (prefill, insert, append-prefill, decode,
  the n-step scan), built from one table (:data:`~rollout.engine.programs.PROGRAMS`);
* :mod:`rollout.engine.slots`: slot-state management (``prefill_slots``, ``copy_slot``,
  ``free_slots``, the length buckets and windows);
* :mod:`rollout.engine.sampler`: :func:`sample_tokens`, :class:`StepOutput`, JetStream's row packing;
* :mod:`rollout.engine.weights`: ``load_params`` (the weight sync's cast / layout / quantisation);
* :mod:`rollout.engine.paged`: the paged K/V layout (``kv_layout="paged"``): what it does and its host
  side over :class:`rollout.pages.PagePool`; :mod:`rollout.engine.paged_programs`, its step programs;
* :mod:`rollout.engine.jetstream`: the JetStream ``Engine`` API and tokenizer (``jax-rl serve``).

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
