"""The RL path's prefill rows and their results (:class:`SlotPrefill`, :class:`PrefillResult`), and the
length buckets of prefill programs (:func:`prefill_bucket`): what every K/V layout's
``prefill_slots`` takes and returns (:mod:`rollout.engine.layout`)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional, Sequence

import numpy as np

__all__ = ["SlotPrefill", "PrefillResult", "prefill_bucket", "MIN_BUCKET"]

MIN_BUCKET = 16
"""The smallest length bucket (cache positions) of a prefill program."""


def prefill_bucket(n: int, max_cache_len: int) -> int:
    """Power-of-two bucket (>= 16, <= max_cache_len) holding ``n`` cache positions."""
    b = MIN_BUCKET
    while b < n:
        b *= 2
    return min(b, max_cache_len)


@dataclasses.dataclass(frozen=True)
class SlotPrefill:
    """One row of :meth:`Qwen3Engine.prefill_slots`.

    Attributes:
      tokens: the request's whole context (int ids, ``1 <= len <= max_cache_len``); its last token
        stays pending (fed by the first decode step), the others end up in the slot's cache.
      slot: the decode slot it fills.
      seed: sampling seed (the token at absolute position p uses ``fold_in(PRNGKey(seed), p)``).
      temperature: per-request temperature (None: the engine's; <= 0: greedy).
      start: cache positions ``[0, start)`` of ``slot`` already hold ``tokens[:start]``'s K/V
        (an episode's earlier turns): only ``tokens[start:-1]`` are run (append-prefill). 0: fresh.
    """

    tokens: Sequence[int]
    slot: int
    seed: int = 0
    temperature: Optional[float] = None
    start: int = 0


class PrefillResult(NamedTuple):
    """What :meth:`Qwen3Engine.prefill_slots` reports for one :class:`SlotPrefill` row.

    Attributes:
      prefill_tokens: cache positions this row's program computed (0 for a row that shared another
        row's prefill: a GRPO group's later samples).
      shared: the row's K/V were copied from another row's prefill.
      routes: None, or int32 [len(tokens) - 1 - start, n_moe_layers, k] (``record_routes``): the
        routes of the positions ``start .. len(tokens) - 2`` the row ran.
      moe_dropped: None, or int (``counts_moe_drops``): the MoE token copies this row's program
        dropped for capacity, summed over its positions and the MoE layers (0 for a shared row).
    """

    prefill_tokens: int
    shared: bool
    routes: Optional[np.ndarray] = None
    moe_dropped: Optional[int] = None
