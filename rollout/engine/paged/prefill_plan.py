"""Chunked prefill: how the paged engine cuts one ``prefill_slots`` call into programs.

A row of the call computes the cache positions ``[start, end)`` of its slot (``start``: its prefix
hit or the positions it already holds; ``end``: its context length). :func:`prefill_programs` cuts
them into chunks of at most ``chunk`` positions (``rollout.prefill_chunk_size``; MaxText's
``prefill_chunk_size``, vLLM's chunked prefill, SGLang's ``chunked_prefill_size``), run in order, each
an append-prefill onto the pages the row's earlier chunks wrote. Two costs go with it:

- a fresh 5.7k-token prompt used to run as ONE program of ``[slots, 8192]`` (the power-of-two bucket)
  attending over all 8,192 x 8,192 positions; in chunks of C a chunk ending at position e attends over
  a bucket of e's pages, so the attention work is about half (causal blocks past the chunk skipped)
  and the padding past the prompt at most one chunk's bucket;
- a program runs ``rows_per_program(T)`` rows, ``chunk // T`` for a new-token bucket T (at least 1, at
  most ``slots`` and :data:`MAX_ROWS`), not always ``slots``: two distinct 5.7k prompts in an 8-slot call
  run 8 rows (6 padding) of 8,192 as one program, but 2 rows of ``chunk`` per round in chunks. A padding
  row costs a real row's compute, so short rows are capped at :data:`MAX_ROWS` a program.

What a row computes depends only on the row itself: its chunks' boundaries on its own start, end and
``chunk``; a program's row count on the chunk's bucket T; its page bucket on the chunk's end. So which
requests share a call still does not change any row's K/V or ``behav_logp`` (XLA:CPU rounds a row's
values differently with the program's row count, which is why the count is a function of T alone).

Pure host code (no JAX): :mod:`rollout.engine.paged` runs the programs.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Hashable, Optional, Sequence

from rollout.engine.slots import prefill_bucket

__all__ = ["Chunk", "ChunkProgram", "prefill_programs", "rows_per_program", "check_chunk_size", "MAX_ROWS"]

MAX_ROWS = 16
"""The most rows a prefill program runs (for short rows ``chunk // T`` would reach ``slots``): fewer padding
rows for a call of few rows (GRPO groups share a prefill), more programs for a call of many distinct short
prompts. The trade measured with ``bench/paged_cpu.py`` is in docs/performance.md (the paged engine's host loop)."""


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One row's positions ``[start, start + length)`` computed by one program.

    Attributes:
      row: the row's index in the call.
      start: first cache position computed (int).
      length: positions computed (0: a row with nothing to compute, run only to arm its slot).
      last: the row's last chunk (its slot armed for decode after it).
    """

    row: int
    start: int
    length: int
    last: bool

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclasses.dataclass(frozen=True)
class ChunkProgram:
    """One append-prefill program: ``rows`` rows of ``T`` new positions (``T`` a power of two >= 16),
    attending over ``pages`` (the engine's page key of the chunks' end: its XLA page bucket, None on the
    TPU kernel path); ``chunks`` in row order (``len(chunks) <= rows``)."""

    T: int
    pages: Optional[Hashable]
    rows: int
    chunks: tuple[Chunk, ...]


def check_chunk_size(chunk: int) -> int:
    """``chunk`` as an int; ValueError (naming ``rollout.prefill_chunk_size``) unless a power of two >= 16."""
    c = int(chunk)
    if c < 16 or c & (c - 1):
        raise ValueError(f"rollout.prefill_chunk_size={chunk}: must be a power of two >= 16 (the prefill "
                         f"programs' position buckets are powers of two)")
    return c


def rows_per_program(T: int, chunk: int, slots: int) -> int:
    """Rows of a program of new-token bucket ``T``: ``chunk // T`` clipped to ``[1, min(slots, MAX_ROWS)]``
    (about ``chunk`` positions a program, and few padding rows)."""
    return max(1, min(int(slots), MAX_ROWS, int(chunk) // int(T)))


def row_chunks(row: int, start: int, end: int, chunk: int) -> list[Chunk]:
    """Row ``row``'s positions ``[start, end)`` in chunks of at most ``chunk`` (one empty chunk when
    ``start == end``). Raises ValueError when ``end < start``."""
    if end < start:
        raise ValueError(f"prefill row {row}: end {end} < start {start}")
    cuts = list(range(start, end, chunk)) or [start]
    return [Chunk(row, s, min(chunk, end - s), s + chunk >= end) for s in cuts]


def prefill_programs(rows: Sequence[tuple[int, int, int, int]], *, chunk: int, slots: int, max_len: int,
                     page_key: Callable[[int], Optional[Hashable]] = lambda end: None,
                     rows_at_slots: bool = False) -> list[ChunkProgram]:
    """The programs that compute ``rows``, in the order they must run.

    Args:
      rows: ``(row index, start, end, wave)`` per computed row: positions ``[start, end)``; a row of wave
        w reads pages a row of an earlier wave of the same call writes, so every program of wave w runs
        after all of wave w - 1's.
      chunk: most new positions a row computes per program (a power of two >= 16: :func:`check_chunk_size`).
      slots: the engine's slots (the most rows a program runs).
      max_len: ``max_cache_len`` (caps the position bucket).
      page_key: a chunk's end position -> the program's page key (the engine's page bucket).
      rows_at_slots: every program runs ``slots`` rows (a pool split over shards of slots: a row sits at
        its slot's index, in its shard); the chunks still cut the positions.

    Returns:
      :class:`ChunkProgram` s: per wave, round k runs every row's k-th chunk (a row's chunks in order),
      grouped by (T, page key), at most ``rows_per_program(T)`` rows each, sorted by (T, page key).

    Raises:
      ValueError: ``chunk`` not a power of two >= 16 (:func:`check_chunk_size`), or a row with ``end < start``.
    """
    chunk = check_chunk_size(chunk)
    out: list[ChunkProgram] = []
    for wave in sorted({w for *_, w in rows}):
        per_row = [row_chunks(i, s, e, chunk) for i, s, e, w in rows if w == wave]
        for k in range(max(len(c) for c in per_row)):
            groups: dict[tuple[int, Optional[Hashable]], list[Chunk]] = {}
            for cs in per_row:
                if k < len(cs):
                    c = cs[k]
                    groups.setdefault((prefill_bucket(max(c.length, 1), max_len), page_key(c.end)), []).append(c)
            for (T, pages), members in sorted(groups.items(), key=lambda kv: (kv[0][0], _order(kv[0][1]))):
                n = int(slots) if rows_at_slots else rows_per_program(T, chunk, slots)
                out += [ChunkProgram(T, pages, n, tuple(members[j:j + n])) for j in range(0, len(members), n)]
    return out


def _order(key: Optional[Hashable]) -> tuple:
    return (0, 0) if key is None else (1, key)
