"""The K/V layout interface: how an engine keeps its slots' keys and values.

A layout is an object the engine holds (``Qwen3Engine.kv``), chosen once from the registry
(:data:`rollout.engine.layouts.KV_LAYOUTS`, by the spec's ``kv_layout``) and never compared by name
elsewhere (``tests/test_structure.py`` checks it). It owns:

* its **step programs** (:meth:`KVLayout.step_programs`: a :class:`rollout.engine.programs.StepPrograms`
  whose decode step differs only in the model call, and :attr:`KVLayout.table`, the jit table);
* its **host operations**, each over the decode state: admit / prefill (:meth:`prefill_slots`), JetStream's
  ``insert`` of a batch-1 prefix (:meth:`insert`), copy a group's slot (:meth:`copy_slot`), free (:meth:`free_slots`), what runs before a decode call
  (:meth:`before_decode`) and after any program (:meth:`after_call`), a fresh state (:meth:`reset`);
* its **admission budget** and stats, which the generator asks before admitting and decoding
  (:mod:`rollout.kv_pressure`): :meth:`admission_budget` (None: the layout reserves every slot's
  positions, nothing to budget), :meth:`request_pages`, :meth:`decode_shortfall`, :meth:`release`,
  :meth:`preempt_slots`, :meth:`stats`, :attr:`shards` / :meth:`shard_of`.

Layouts: :class:`rollout.engine.contiguous.ContiguousLayout` (``max_cache_len`` positions reserved per
slot) and :class:`rollout.engine.paged.PagedLayout` (one pool of pages).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ClassVar, Optional, Sequence

import jax
import numpy as np

from rollout.engine.programs import ProgramDef, StepConfig, StepPrograms, decode_state_shardings
from rollout.engine.slots import PrefillResult, SlotPrefill
from rollout.engine.spec import EngineSpec

__all__ = ["KVLayout", "LayoutFacts"]


class LayoutFacts:
    """What a layout knows of its engine beyond the spec: whether programs record MoE routes and dropped
    copies (from the model), and the engine's mesh (None: one device, no ambient mesh)."""

    def __init__(self, *, record_routes: bool, counts_moe_drops: bool, mesh: Optional[jax.sharding.Mesh],
                 model_config: Any) -> None:
        self.record_routes = bool(record_routes)
        self.counts_moe_drops = bool(counts_moe_drops)
        self.mesh = mesh
        self.model_config = model_config


class KVLayout:
    """The K/V layout of one engine (module doc). Subclasses set :attr:`name` (their registry key),
    :attr:`table` and :attr:`pooled`, and override the host operations they change.

    Args:
      spec: the engine's :class:`EngineSpec`.
      facts: :class:`LayoutFacts`.
    """

    name: ClassVar[str] = ""
    table: ClassVar[dict[str, ProgramDef]] = {}
    """The jit table of :meth:`step_programs` (:func:`rollout.engine.programs.build_programs`)."""
    pooled: ClassVar[bool] = False
    """The layout's K/V is one pool sized by ``rollout.kv_pages`` / ``kv_pool_gib`` (not slots x
    ``max_cache_len``): what the runtime's memory check sizes (:mod:`jax_rl.runtime.resources`)."""
    one_device_kernel: ClassVar[bool] = False
    """The layout's attention is a kernel chosen by the target backend
    (:func:`jax_rl.models.backend_target.target_backend`) that runs unpartitioned on a one-device engine:
    an AOT compile for a TPU traces it for the TPU, on one chip (:func:`jax_rl.tpu.compile_rollout`)."""
    keeps_prefix_pages: ClassVar[bool] = False
    """The layout shares prefix K/V by reference itself (the generator's copying prefix cache is then off)."""

    def __init__(self, spec: EngineSpec, facts: LayoutFacts) -> None:
        self.spec = spec
        self._slots = int(spec.slots)
        self.max_cache_len = int(spec.max_cache_len)
        self.temperature = float(spec.temperature)
        self.prefill_chunk_size = int(spec.prefill_chunk_size)
        self.record_routes = facts.record_routes
        self.counts_moe_drops = facts.counts_moe_drops
        self._mesh = facts.mesh
        self._jits: dict[str, Any] = {}

    # ---- programs ----------------------------------------------------------------------------
    def step_programs(self, cfg: StepConfig, model: Callable[[Any], Any], dequantized: Callable[[Any], Any]
                      ) -> StepPrograms:
        """The layout's device functions over the engine's model."""
        raise NotImplementedError

    @staticmethod
    def state_shardings(abstract_state: dict, mesh: jax.sharding.Mesh) -> dict:
        """The decode state's shardings on ``mesh`` (a sharded engine)."""
        return decode_state_shardings(abstract_state, mesh)

    def bind(self, jits: dict[str, Any]) -> None:
        """The engine's jitted programs (of :attr:`table`), which the host operations call."""
        self._jits = jits

    def _in_mesh(self) -> Any:
        return jax.set_mesh(self._mesh) if self._mesh is not None else contextlib.nullcontext()

    # ---- host operations ---------------------------------------------------------------------
    def reset(self) -> None:
        """The host side of a fresh decode state (``Qwen3Engine.init_decode_state``)."""

    def prefill_slots(self, params: Any, decode_state: dict, rows: Sequence[SlotPrefill]
                      ) -> tuple[dict, list[PrefillResult]]:
        """``Qwen3Engine.prefill_slots``."""
        raise NotImplementedError

    def _check_rows(self, rows: list) -> None:
        """Raise ValueError for a :meth:`prefill_slots` row with a slot out of range or used twice, an
        empty or too long row, or a bad start."""
        used: set[int] = set()
        for r in rows:
            n_tok, slot = len(r.tokens), int(r.slot)
            if not 0 <= slot < self._slots or slot in used:
                raise ValueError(f"prefill_slots: slot {slot} out of range [0, {self._slots}) or used twice")
            used.add(slot)
            if not 1 <= n_tok <= self.max_cache_len:
                raise ValueError(f"prefill_slots: the row for slot {slot} has {n_tok} tokens; a row needs 1..max_cache_len="
                                 f"{self.max_cache_len}")
            if not 0 <= int(r.start) < n_tok:
                raise ValueError(f"prefill_slots: start={r.start} outside [0, {n_tok}) tokens")

    def copy_slot(self, decode_state: dict, src: int, dst: int, *, token: int, seed: int,
                  temperature: Optional[float] = None) -> dict:
        """``Qwen3Engine.copy_slot``."""
        raise NotImplementedError

    def insert(self, decode_state: dict, prefix: dict, slot: int) -> dict:
        """JetStream's ``insert`` (:meth:`rollout.engine.jetstream.JetStreamAdapter.insert`): ``prefix`` (from
        ``prefill``: k/v [L,1,K,P,H], ``length``, ``token``, ``seed``, ``temperature``) into slot ``slot``,
        armed. Donates the state."""
        raise NotImplementedError

    def _check_insert(self, prefix: dict, slot: int) -> tuple[int, int]:
        """``(slot, length)`` of an :meth:`insert`; ValueError for a slot out of range or a prefix length
        outside ``[0, max_cache_len)``."""
        slot, n = int(slot), int(prefix["length"])
        if not 0 <= slot < self._slots:
            raise ValueError(f"slot {slot} out of range [0, {self._slots})")
        if not 0 <= n < self.max_cache_len:
            raise ValueError(f"insert: a prefix of {n} cached positions into slot {slot}; a prefix holds "
                             f"0..max_cache_len - 1 = {self.max_cache_len - 1}")
        return slot, n

    def free_slots(self, decode_state: dict, slots: Sequence[int]) -> dict:
        """``Qwen3Engine.free_slots``: deactivate ``slots`` (their K/V stay). Donates the state. Raises
        ValueError for a slot out of range."""
        mask = self._mask(slots)
        with self._in_mesh():
            return self._jits["free_slots"](decode_state, jax.numpy.asarray(mask))

    def _mask(self, slots: Sequence[int]) -> np.ndarray:
        """[B] bool of ``slots``; ValueError for a slot out of range."""
        mask = np.zeros((self._slots,), bool)
        for s_ in slots:
            if not 0 <= int(s_) < self._slots:
                raise ValueError(f"slot {s_} out of range [0, {self._slots})")
            mask[int(s_)] = True
        return mask

    def before_decode(self, decode_state: dict, n: int) -> tuple[dict, dict[str, Any]]:
        """What runs before a decode call of ``n`` steps: ``(state, static kwargs of the decode programs)``."""
        return decode_state, {}

    def after_call(self, decode_state: dict) -> dict:
        """What the host notes of a decode program's output state (the state, unchanged)."""
        return decode_state

    def append_prefill_shape(self, positions: int) -> tuple[int, int]:
        """``(rows, T)`` of the largest append-prefill program rows of ``positions`` new positions run."""
        return self._slots, int(positions)

    # ---- admission budget and stats (rollout.kv_pressure) ------------------------------------
    def admission_budget(self, n_decode: int, shard: Optional[int] = None) -> Optional[int]:
        """K/V units admissions may take now (None: every slot's positions are reserved, no budget)."""
        return None

    def request_pages(self, tokens: Sequence[int], slot: int, start: int, n_decode: int,
                      shared: bool = False) -> int:
        """What admitting one row takes from :meth:`admission_budget`."""
        return 0

    def decode_shortfall(self, n: int, shard: Optional[int] = None) -> int:
        """K/V units the active slots lack for ``n`` more positions (0: the decode call fits)."""
        return 0

    def release(self, slots: Sequence[int]) -> None:
        """Give back what inactive ``slots`` hold for no session (host bookkeeping)."""

    def preempt_slots(self, decode_state: dict, slots: Sequence[int]) -> dict:
        """Preempt active ``slots`` (their K/V given up, the slots deactivated)."""
        return self.free_slots(decode_state, slots)

    def stats(self) -> dict[str, int]:
        """The layout's counters (``kv_pages_in_use``, ...); {} where it keeps none."""
        return {}

    @property
    def shards(self) -> int:
        """D, the shards of slots the K/V is split into for admission (1: any slot any K/V)."""
        return 1

    def shard_of(self, slot: int) -> int:
        """The admission shard of ``slot``."""
        return 0
