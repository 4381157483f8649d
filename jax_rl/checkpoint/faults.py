"""Checkpoint faults (part of :mod:`jax_rl.checkpoint`): the error types, the disk-full detection and its
one-line error, and the hooks that drop the tracebacks a failed Orbax write would print (the ``absl`` /
``asyncio`` no-space log records, tensorstore's ``Event loop is closed`` unraisable exceptions)."""

from __future__ import annotations

import errno
import logging
import shutil
from pathlib import Path
from typing import Any, Optional



log = logging.getLogger("jax_rl.checkpoint")


class CheckpointMismatchError(ValueError):
    """The checkpoint was written by a run whose model or correction mode differs from this one."""


class CheckpointCorruptError(ValueError):
    """A checkpoint step is partial or unreadable (missing item, bad metadata JSON, failed restore).

    The message is one line naming the step directory and what is wrong with it.
    """


class CheckpointCommitError(RuntimeError):
    """A checkpoint save did not commit (Orbax's write of ``<step>.orbax-checkpoint-tmp`` failed). One line
    naming the step and its dir; the steps committed before it are intact (the CLI: exit 1)."""


class CheckpointDiskFullError(OSError):
    """A checkpoint could not be written for lack of disk space.

    The message is one line naming the checkpoint dir, the bytes needed and free, and the last
    good step (left intact: a failed save never leaves a step directory behind).
    """

    def __init__(self, msg: str):
        super().__init__(errno.ENOSPC, msg)
        self.msg = msg

    def __str__(self) -> str:
        return self.msg


# Orbax's background-thread failures are logged by absl with full tracebacks before they
# surface as an exception; for a full disk we report one line ourselves instead.
_NOSPACE_MARKERS = ("No space left on device", "RESOURCE_EXHAUSTED", "Disk quota exceeded")


def _is_no_space(e: BaseException) -> bool:
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(m in str(e) for m in _NOSPACE_MARKERS):
            return True
        e = e.__cause__ or e.__context__
    return False


class _NoSpaceLogFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None and _is_no_space(record.exc_info[1]):
            return False
        return not any(m in str(record.getMessage()) for m in _NOSPACE_MARKERS)


_NOSPACE_FILTER = _NoSpaceLogFilter()


def _is_closed_loop_callback(exc: BaseException, tb: Any) -> bool:
    """``RuntimeError('Event loop is closed')`` raised by ``asyncio``'s ``_check_closed``: what a
    tensorstore write that completes after Orbax's save loop has already ended (its first write
    failed, e.g. ENOSPC, and ``asyncio.run`` closed the loop) raises when it posts its result."""
    if not isinstance(exc, RuntimeError) or str(exc) != "Event loop is closed":
        return False
    last = None
    while tb is not None:
        last, tb = tb, tb.tb_next
    return last is not None and last.tb_frame.f_code.co_name == "_check_closed"


class _ClosedLoopHook:
    """``sys.unraisablehook`` wrapper (installed once by :class:`Checkpointer`): drops the
    ``Event loop is closed`` tracebacks that tensorstore's completion callbacks report (as
    unraisable exceptions, from the thread that completes the write) for the writes still in
    flight when a failed Orbax save closed its loop: one per array chunk, hundreds on a full
    disk. The failure itself surfaces once, from Orbax, as :class:`CheckpointDiskFullError` or
    its own error. Any other unraisable exception goes to the previous hook; ``dropped`` counts
    the ones dropped.
    """

    def __init__(self, previous):
        self.previous = previous
        self.dropped = 0

    def __call__(self, args):
        if args.exc_value is not None and _is_closed_loop_callback(args.exc_value, args.exc_traceback):
            self.dropped += 1
            return
        self.previous(args)


def _install_closed_loop_hook() -> None:
    import sys

    if not isinstance(sys.unraisablehook, _ClosedLoopHook):
        sys.unraisablehook = _ClosedLoopHook(sys.unraisablehook)


def _cancel_unstarted_writes() -> int:
    """Close Orbax's / tensorstore's write coroutines that were created but never started.

    When the first write of an async save fails (ENOSPC), Orbax's event loop ends while the
    per-fragment writes it had just created (``serialization.async_serialize_from_host``'s
    ``write_fragment`` coroutines) were never scheduled; the failed save's exception keeps them
    alive, and Python reports each as ``coroutine ... was never awaited`` when it is finally
    collected, at interpreter shutdown, after the run's one-line error. Once the save is over
    (``wait_until_finished`` returned or raised) nothing can run them any more: they are closed
    here, which is what cancelling a never-started coroutine is. Returns how many."""
    import gc
    import inspect

    gc.collect()
    n = 0
    for o in gc.get_objects():
        if inspect.iscoroutine(o) and inspect.getcoroutinestate(o) == inspect.CORO_CREATED:
            f = o.cr_code.co_filename
            if "orbax" in f or "tensorstore" in f:
                o.close()
                n += 1
    if n:
        log.debug("closed %d never-started checkpoint write coroutine(s)", n)
    return n


def one_line(e: BaseException, limit: int = 300) -> str:
    """``"<ExceptionType>: <message>"`` on one line, whitespace collapsed, at most ``limit`` characters."""
    msg = " ".join(str(e).split()) or type(e).__name__
    msg = msg if len(msg) <= limit else msg[: limit - 3] + "..."
    return f"{type(e).__name__}: {msg}"


def is_no_space(e: BaseException) -> bool:
    """True when ``e`` (or its cause / context chain) is ENOSPC / EDQUOT / tensorstore's
    ``RESOURCE_EXHAUSTED``."""
    return _is_no_space(e)


def disk_full_error(ckpt_dir: str | Path, need: int, what: str, *, free: Optional[int] = None,
                    run_dir: Any = None) -> CheckpointDiskFullError:
    """The one-line disk-full error: what failed, the bytes a checkpoint needs and those free
    in ``ckpt_dir``, and the newest committed step there (uncommitted tmp dirs are not steps)."""
    d = Path(ckpt_dir)
    if free is None:
        probe = d if d.exists() else d.parent
        try:
            free = shutil.disk_usage(probe).free
        except OSError:
            free = -1
    steps = sorted(int(p.name) for p in d.iterdir() if p.name.isdigit() and p.is_dir()) if d.is_dir() else []
    last = f"last good checkpoint: {d / str(steps[-1])}" if steps else "no checkpoint written yet"
    where = f"run dir {run_dir}: " if run_dir is not None else ""
    return CheckpointDiskFullError(
        f"{where}disk full: {what}; a checkpoint needs ~{need} bytes, {free} free in {d}; {last}")
