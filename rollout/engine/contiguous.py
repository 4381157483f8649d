"""The contiguous K/V layout (``kv_layout="contiguous"``): ``max_cache_len`` positions reserved per slot,
the cache k/v ``[L, B, Hkv, S, Dh]`` (or L per-layer buffers; the decode-state table of
:mod:`rollout.engine.core`). Its host operations decide which rows of a generator step share a prefill
program (length buckets, a GRPO group's identical prompts run once, append-prefills on a slot's kept K/V
in their own window); copying a slot copies its row. Nothing to budget: every slot's positions are
reserved (:meth:`KVLayout.admission_budget` None).

Compiled shapes are bounded: row buckets are powers of two up to ``slots``, length buckets powers of
two from 16 up to ``max_cache_len`` (:func:`rollout.engine.slots.prefill_bucket`; docs/interfaces.md,
"The RL engine's prefill"). The device programs are :class:`rollout.engine.programs.StepPrograms`.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import jax.numpy as jnp
import numpy as np

from rollout.engine.layout import KVLayout
from rollout.engine.programs import PROGRAMS, StepConfig, StepPrograms
from rollout.engine.slots import PrefillResult, SlotPrefill, prefill_bucket

__all__ = ["ContiguousLayout"]


class ContiguousLayout(KVLayout):
    """``max_cache_len`` positions reserved per slot (module doc)."""

    name = "contiguous"
    table = PROGRAMS

    def step_programs(self, cfg: StepConfig, model: Callable[[Any], Any], dequantized: Callable[[Any], Any]
                      ) -> StepPrograms:
        return StepPrograms(cfg, model, dequantized)

    def prefill_slots(self, params: Any, decode_state: dict, rows: Sequence["SlotPrefill"]
                      ) -> tuple[dict, list["PrefillResult"]]:
        """Prefill many requests into their slots: the RL path's batched prefill + insert.

        Rows with ``start == 0`` (fresh) are grouped by length bucket P
        (:func:`prefill_bucket` of their cache positions) and each group runs ONE jitted program:
        a prefill over ``[n, P]`` rows with per-row lengths, then a bulk insert that copies each
        row's K/V into its slots. Fresh rows with the same tokens (the G samples of a GRPO group)
        are prefilled once and their K/V copied into every one of their slots, each slot armed
        with its own seed and temperature (a token's key depends on its seed and position only,
        so the samples equal G separate prefills). Rows with ``start > 0`` (append-prefill: the
        slot already holds the K/V of ``tokens[:start]``, e.g. an episode's earlier turns) are
        grouped by the bucket T of their new positions and the bucket W of their own end position
        ``len(tokens) - 1`` and run through :meth:`Qwen3ForCausalLM.extend` on a window of the
        slots' own rows, one program per group: only cache positions ``[0, W)`` are read, attended
        to and written back (the rest of the row is left as it is), so an append costs in
        proportion to the row's live length, not to ``max_cache_len``. W is the row's own (not the
        longest row's of the call), so a row's numerics do not depend on what shares its call.

        Compiled shapes: (row bucket n, length bucket) per program, n a power of two capped at
        ``slots`` and the length bucket a power of two >= 16 capped at ``max_cache_len``, so at most
        ``ceil(log2 slots) + 1`` times ``log2(max_cache_len / 16) + 1`` fresh programs; the
        append-prefill has one program per (T, W) pair with T <= W, both buckets of that set, so
        at most k (k + 1) / 2 for the k length buckets. The
        append-prefill always runs ``slots`` rows: its per-row
        values changed at fp32 rounding with the row count on XLA:CPU, and which requests share a
        call depends on thread timing, so a row's K/V and log-probs are its own only that way
        (bit-identical whatever shares the call; a resumed run reproduces the straight one). A
        capacity-dropping MoE engine (``counts_moe_drops``) keeps the row bucket there: its rows
        share the experts' capacity anyway. Padding rows and positions are inert (no slot written,
        no MoE capacity taken).

        Args:
          params: engine params (from :meth:`load_params`).
          decode_state: the decode state (donated).
          rows: :class:`SlotPrefill` rows; distinct slots; ``1 <= len(tokens) <= max_cache_len``
            and ``start < len(tokens)``.

        Returns:
          ``(new_state, results)``: one :class:`PrefillResult` per row, in order (its
          ``moe_dropped`` an int with ``counts_moe_drops``, else None).

        Raises:
          ValueError: a slot out of range or used twice, an empty or too long row, a bad start.
        """
        rows = list(rows)
        self._check_rows(rows)
        results: list[dict] = [dict(prefill_tokens=0, shared=False) for _ in rows]
        fresh, ext = self._bucket_rows(rows)
        state = decode_state
        for P, idx in sorted(fresh.items()):
            state = self._prefill_group(params, state, rows, idx, P, results)
        for (T, W), idx in sorted(ext.items()):
            state = self._extend_group(params, state, rows, idx, T, results, window=W)
        return state, [PrefillResult(int(r["prefill_tokens"]), bool(r["shared"]), r.get("routes"), r.get("moe_dropped"))
                       for r in results]

    def _bucket_rows(self, rows: list) -> tuple[dict[int, list[int]], dict[tuple[int, int], list[int]]]:
        """The programs :meth:`prefill_slots` runs: fresh rows (indices) by length bucket P, and
        append-prefill rows by (new-token bucket T, window W: the bucket of the row's own end position)."""
        fresh: dict[int, list[int]] = {}
        ext: dict[tuple[int, int], list[int]] = {}
        for i, r in enumerate(rows):
            m = len(r.tokens) - 1 - int(r.start)
            bucket = prefill_bucket(max(m, 1), self.max_cache_len)
            if int(r.start) == 0:
                fresh.setdefault(bucket, []).append(i)
            else:
                ext.setdefault((bucket, prefill_bucket(len(r.tokens) - 1, self.max_cache_len)), []).append(i)
        return fresh, ext

    def copy_slot(self, decode_state: dict, src: int, dst: int, *, token: int, seed: int,
                  temperature: Optional[float] = None) -> dict:
        """Slot ``dst`` takes slot ``src``'s K/V row and length (one device copy of a slot's row),
        armed with its own pending ``token``, ``seed`` and ``temperature`` (None: the engine's):
        the G samples of a group whose first sample was just prefilled into ``src``. Donates the
        state. Raises ValueError for a slot out of range or ``src == dst``."""
        src, dst = int(src), int(dst)
        if not (0 <= src < self._slots and 0 <= dst < self._slots) or src == dst:
            raise ValueError(f"copy_slot: slots {src} -> {dst} (range [0, {self._slots}), distinct)")
        t = self.temperature if temperature is None else float(temperature)
        with self._in_mesh():
            return self._jits["copy_slot"](decode_state, jnp.int32(src), jnp.int32(dst), jnp.int32(token),
                                       jnp.uint32(int(seed) & 0xFFFFFFFF), jnp.float32(t))

    def insert(self, decode_state: dict, prefix: dict, slot: int) -> dict:
        """:meth:`KVLayout.insert`: the prefix's K/V copied into row ``slot`` (one device program), armed.
        Raises ValueError for a slot out of range or a prefix too long."""
        slot, n = self._check_insert(prefix, slot)
        args = (prefix["k"], prefix["v"], jnp.int32(n), jnp.int32(prefix["token"]), jnp.uint32(prefix["seed"]),
                jnp.float32(prefix["temperature"]), decode_state, jnp.int32(slot))
        with self._in_mesh():
            return self._jits["insert"](*args)

    def _row_bucket(self, n: int) -> int:
        b = 1
        while b < n:
            b *= 2
        return min(b, self._slots)

    def _prefill_group(self, params: Any, state: dict, rows: list, idx: list[int], P: int,
                       results: list[dict]) -> dict:
        uniq: dict[tuple, int] = {}  # tokens -> its row among the program's rows
        owner: list[int] = []
        B = self._slots
        dest = np.full((B,), -1, np.int32)
        pending = np.zeros((B,), np.int32)
        seeds = np.zeros((B,), np.uint32)
        temps = np.ones((B,), np.float32)
        for i in idx:
            r = rows[i]
            key = tuple(int(t) for t in r.tokens)
            j = uniq.get(key)
            if j is None:
                j = uniq[key] = len(owner)
                owner.append(i)
                results[i]["prefill_tokens"] = len(key) - 1
            else:
                results[i]["shared"] = True
            slot = int(r.slot)
            dest[slot], pending[slot] = j, key[-1]
            seeds[slot] = int(r.seed) & 0xFFFFFFFF
            temps[slot] = self.temperature if r.temperature is None else float(r.temperature)
        n = len(owner)
        nb = self._row_bucket(n)
        buf = np.zeros((nb, P), np.int32)
        lens = np.zeros((nb,), np.int32)
        for j, i in enumerate(owner):
            t = rows[i].tokens
            lens[j] = len(t) - 1
            buf[j, : lens[j]] = np.asarray(t[:-1], np.int32)
        with self._in_mesh():
            state, (routes, drops) = self._jits["prefill_slots"](params, jnp.asarray(buf), jnp.asarray(lens), state,
                                                             jnp.asarray(dest), jnp.asarray(pending),
                                                             jnp.asarray(seeds), jnp.asarray(temps))
        if self.counts_moe_drops:
            drops = np.asarray(drops)
            for i in idx:
                results[i]["moe_dropped"] = 0 if results[i]["shared"] else int(drops[int(dest[int(rows[i].slot)])])
        if self.record_routes:
            routes = np.asarray(routes)
            for i in idx:
                j = int(dest[int(rows[i].slot)])
                results[i]["routes"] = routes[j, : int(lens[j])]
        return state

    def _extend_group(self, params: Any, state: dict, rows: list, idx: list[int], T: int,
                      results: list[dict], window: Optional[int] = None) -> dict:
        B = self._slots
        # B rows (padding rows write nowhere), not the row bucket of len(idx): on XLA:CPU an
        # append-prefill row's values changed at fp32 rounding with the call's row count, and which
        # requests share a call depends on when they reached the generator (thread timing), so a
        # request's K/V and log-probs depended on its neighbours (a resumed K=0 run differed from the
        # straight one). One program per T bucket; a row's numerics are its own (test_prefill.py,
        # test_a_rows_prefill_is_bit_identical_whatever_shares_its_call). Except with MoE capacity
        # drops (counts_moe_drops): there the rows of a call share the experts' capacity, which the
        # program's shape sets (module doc), so a row's result depends on its call whatever the
        # padding, and B padding rows would only raise the capacity: the row bucket stays.
        nb = self._row_bucket(len(idx)) if self.counts_moe_drops else B
        buf = np.zeros((nb, T), np.int32)
        starts = np.zeros((nb,), np.int32)
        lens = np.zeros((nb,), np.int32)
        slots = np.full((nb,), B, np.int32)  # padding rows write nowhere
        pending = np.zeros((nb,), np.int32)
        seeds = np.zeros((nb,), np.uint32)
        temps = np.ones((nb,), np.float32)
        for j, i in enumerate(idx):
            r = rows[i]
            st = int(r.start)
            new = np.asarray(r.tokens[st:-1], np.int32)
            starts[j], lens[j], slots[j], pending[j] = st, len(new), int(r.slot), int(r.tokens[-1])
            buf[j, : len(new)] = new
            seeds[j] = int(r.seed) & 0xFFFFFFFF
            temps[j] = self.temperature if r.temperature is None else float(r.temperature)
            results[i]["prefill_tokens"] = len(new)
        with self._in_mesh():
            state, (routes, drops) = self._jits["append_prefill"](params, state, jnp.asarray(buf), jnp.asarray(starts),
                                                            jnp.asarray(lens), jnp.asarray(slots), jnp.asarray(pending),
                                                            jnp.asarray(seeds), jnp.asarray(temps),
                                                            window=None if window == self.max_cache_len else window)
        if self.counts_moe_drops:
            drops = np.asarray(drops)
            for j, i in enumerate(idx):
                results[i]["moe_dropped"] = int(drops[j])
        if self.record_routes:
            routes = np.asarray(routes)
            for j, i in enumerate(idx):
                results[i]["routes"] = routes[j, : int(lens[j])]
        return state

