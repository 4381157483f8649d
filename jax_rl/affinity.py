"""CPU pinning of a role's process (``runtime.learner_cpus`` / ``runtime.rollout_cpus``).

On Linux a CPU affinity mask belongs to a thread, and a new thread inherits its creator's. So
:func:`pin_process` sets the mask of every thread the process has (``/proc/self/task``) and a
thread started afterwards (the rollout's agent threads, XLA's thread pool) inherits it. Pin before
JAX's CPU client starts: XLA sizes its intra-op thread pool from the CPUs the process may use
(``os.sched_getaffinity``), so a process pinned to one core runs its XLA work on that core only
(measured: a pinned 1500 x 1500 matmul loop's CPU seconds / wall seconds is 1.0 and every thread's
mask is the pinned set; ``tests/runtime/test_affinity.py`` checks the masks).

Used by ``runtime=ray`` (:mod:`jax_rl.runtime.ray_runtime`): the learner actor and the driver on
``learner_cpus``, every rollout-worker actor on ``rollout_cpus``. Ray's own daemons (gcs_server,
raylet) and the buffer actor stay unpinned. Linux only (``os.sched_setaffinity``).
"""

from __future__ import annotations

import os
from typing import Iterable, Optional

__all__ = ["allowed_cpus", "check_cpus", "pin_process", "thread_affinities"]


_BEFORE_PIN: Optional[set[int]] = None  # the mask this process had before its first pin_process


def allowed_cpus() -> set[int]:
    """The CPU ids this process may run on (``os.sched_getaffinity(0)``; every CPU where the OS has
    no affinity API). In a process that :func:`pin_process` pinned, the mask it had before: the
    config (which names both roles' CPUs) is validated again inside each pinned role process."""
    if _BEFORE_PIN is not None:
        return set(_BEFORE_PIN)
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def check_cpus(cpus: Optional[list[int]]) -> Optional[list[int]]:
    """Validate a CPU id list (config validation): None passes; else a non-empty list of distinct
    ids, each one this process may run on.

    Raises:
        ValueError: one line naming the offending ids and the allowed ones.
    """
    if cpus is None:
        return None
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError("CPU pinning needs os.sched_setaffinity (Linux); use null")
    if not cpus or len(set(cpus)) != len(cpus) or any(isinstance(c, bool) or c < 0 for c in cpus):
        raise ValueError("must be a non-empty list of distinct CPU ids >= 0 (null = no pinning)")
    allowed = allowed_cpus()
    bad = sorted(set(cpus) - allowed)
    if bad:
        raise ValueError(f"CPU id(s) {bad} are not among the CPUs this process may run on "
                         f"(os.sched_getaffinity: {sorted(allowed)})")
    return list(cpus)


def _tids() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no procfs: the calling thread only
        return [0]


def pin_process(cpus: Optional[Iterable[int]]) -> Optional[set[int]]:
    """Pin every thread of this process to ``cpus`` (None = leave the process alone).

    Threads that exit while it runs are skipped; the pass is repeated until no new thread appears,
    so one started concurrently by an unpinned thread is caught. Returns the calling thread's new
    mask (None when not pinned)."""
    global _BEFORE_PIN
    if cpus is None:
        return None
    want = set(int(c) for c in cpus)
    if _BEFORE_PIN is None:
        _BEFORE_PIN = allowed_cpus()
    done: set[int] = set()
    for _ in range(10):
        todo = [t for t in _tids() if t not in done]
        if not todo:
            break
        for tid in todo:
            try:
                os.sched_setaffinity(tid, want)
            except (ProcessLookupError, FileNotFoundError):  # the thread exited meanwhile
                pass
            done.add(tid)
    os.sched_setaffinity(0, want)
    return set(os.sched_getaffinity(0))


def thread_affinities() -> list[list[int]]:
    """The distinct CPU masks of this process's threads (sorted lists): ``[[1]]`` for a process
    pinned to CPU 1 whose every thread kept that mask."""
    masks = set()
    for tid in _tids():
        try:
            masks.add(tuple(sorted(os.sched_getaffinity(tid))))
        except (ProcessLookupError, FileNotFoundError, OSError):
            pass
    return [list(m) for m in sorted(masks)]
