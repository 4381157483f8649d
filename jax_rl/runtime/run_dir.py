"""A run's directory: where it is (``run.dir`` or ``runs/<name>-<UTC time>``), what counts as an earlier
run in it, clearing one (``run.overwrite``), and its one writer (``<run.dir>/.lock``: an OS file lock that
``train`` and ``sft`` hold for their whole life; readers never take it)."""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import socket
from pathlib import Path
from typing import Optional

from jax_rl.config import Config, ConfigError

log = logging.getLogger("jax_rl.runtime")

__all__ = ["RUN_FILES", "RUN_DIRS", "LOCK_FILE", "RunDirHeldError", "resolve_run_dir", "delete_earlier_run",
           "lock_run_dir", "unlock_run_dir", "lock_holder", "probe_run_dir", "multiprocess_start", "hold_run_dir_all"]


def resolve_run_dir(cfg: Config, *, create: bool = True, check_fresh: bool = False, resumable: bool = True) -> Path:
    """``run.dir`` or ``runs/<name>-<UTC timestamp>``; with ``resume`` and no ``run.dir``, the
    newest existing ``runs/<name>-*`` dir.

    Raises:
        ConfigError: ``resume=true`` and no earlier run dir exists; ``check_fresh`` (a new train or
            SFT run) and ``run.dir`` already holds a run, finished or not (any of :data:`RUN_FILES`
            or a checkpoint), without ``resume`` or ``run.overwrite`` (then
            :func:`delete_earlier_run` clears it once the new run has passed its checks); the line
            offers ``--resume`` only when ``resumable`` (``jax-rl sft`` does not resume).
    """
    name = cfg.run.name or "run"
    if cfg.run.dir:
        d = Path(cfg.run.dir)
    elif cfg.resume:
        cands = sorted(Path("runs").glob(f"{name}-*"), key=lambda p: p.stat().st_mtime)
        if not cands:
            raise ConfigError(f"resume=true but no earlier run dir runs/{name}-* exists; set run.dir")
        d = cands[-1]
    else:
        ts = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
        d = Path("runs") / f"{name}-{ts}"
    if cfg.resume and not d.exists():
        raise ConfigError(f"resume=true but run.dir={str(d)!r} does not exist")
    if check_fresh and not cfg.resume and d.is_dir():
        found = [n for n in RUN_FILES if (d / n).exists()] + (["checkpoints/"] if any((d / "checkpoints").glob("*"))
                                                              else [])
        if found and not cfg.run.overwrite:
            resume = "pass --resume (resume=true) to continue it, " if resumable else ""
            raise ConfigError(f"run.dir={str(d)!r} already holds a run, finished or not ({', '.join(found)}); "
                              f"{resume}--overwrite (run.overwrite=true) to delete it and start over, or choose "
                              "another run.dir")
    if create:
        d.mkdir(parents=True, exist_ok=True)
    cfg.run.dir = str(d)
    return d


# What a run writes into its dir (besides checkpoints/): a fresh run refuses a dir holding any of
# them, and ``run.overwrite`` deletes exactly these (nothing else the dir may hold).
RUN_FILES = ("config.yaml", "metrics.jsonl", "eval.jsonl", "sft.jsonl", "summary.json", "tokenizer.json")


RUN_DIRS = ("checkpoints", "tb", "plots", "ray", "ray_tmp")


def delete_earlier_run(cfg: Config, run_dir: Path, *, primary: bool = True) -> None:
    """With ``run.overwrite`` (a fresh run, once every check has passed, before it writes anything):
    delete the earlier run's :data:`RUN_FILES` and :data:`RUN_DIRS` from ``run_dir``, nothing else.
    Then ``run.overwrite`` is reset, so the new run's config.yaml does not carry it. Only the
    ``primary`` process deletes (the others only reset the key)."""
    import shutil

    if not cfg.run.overwrite:
        return
    cfg.run.overwrite = False
    d = Path(run_dir)
    if cfg.resume or not primary or not d.is_dir():
        return
    for n in RUN_FILES:
        (d / n).unlink(missing_ok=True)
    for n in RUN_DIRS:
        if (d / n).is_dir():
            shutil.rmtree(d / n)
    log.warning("run.overwrite: deleted the earlier run in %s", d)


# ---------------------------------------------------------------- one writer per run dir
LOCK_FILE = ".lock"  # in the run dir; never in RUN_FILES, so ``run.overwrite`` leaves it (and its lock) alone

_HELD: dict[str, int] = {}  # this process's held run dirs (resolved path -> the locked file's descriptor)


class RunDirHeldError(RuntimeError):
    """Another live process holds the run dir's lock (the CLI: one line naming its PID and host, exit 2)."""


def lock_holder(run_dir: Path) -> dict:
    """What ``<run_dir>/.lock`` says of its holder (``pid``, ``host``, ``command``, ``since``); {} when there
    is no lock file or it is empty. Reads only (a reader, e.g. ``jax-rl eval``, never takes the lock)."""
    try:
        text = (Path(run_dir) / LOCK_FILE).read_text(encoding="utf-8")
        out = json.loads(text) if text.strip() else {}
    except (OSError, ValueError):
        return {}
    return out if isinstance(out, dict) else {}


def _held_line(run_dir: Path, holder: dict, what: str) -> str:
    who = (f"PID {holder.get('pid', '?')} on host {holder.get('host', '?')}"
           f"{', since ' + str(holder['since']) if holder.get('since') else ''}") if holder else \
        "a process that has not written its PID yet"
    return (f"run.dir={str(run_dir)!r} is held by a live `jax-rl {holder.get('command', 'train')}` ({who}): "
            f"{what} refused, nothing was changed; wait for that run to end (or stop it) and try again")


def lock_run_dir(run_dir: Path, *, command: str = "train", what: str = "this run") -> None:
    """Take ``<run_dir>/.lock`` for this process (``fcntl.flock``, exclusive, non-blocking) and write the
    holder's PID, host, command and start time into it. The kernel drops the lock when the process ends,
    however it ends (``kill -9`` included), so a lock is never stale. Idempotent in one process; ``run_dir``
    must exist. Release with :func:`unlock_run_dir`.

    Raises:
        RunDirHeldError: another process holds it (one line naming its PID and host; nothing touched).
    """
    import fcntl

    d = Path(run_dir)
    key = str(d.resolve())
    if key in _HELD:
        return
    while True:
        fd = os.open(d / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)  # no O_TRUNC: the holder's record stays
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunDirHeldError(_held_line(d, lock_holder(d), what)) from None
        except BaseException:
            os.close(fd)
            raise
        try:  # the file locked is still the one at the path (a releasing holder unlinks it): else take the new one
            if os.fstat(fd).st_ino == os.stat(d / LOCK_FILE).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    rec = {"pid": os.getpid(), "host": socket.gethostname(), "command": command,
           "since": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(rec) + "\n").encode(), 0)
    _HELD[key] = fd


def unlock_run_dir(run_dir: Optional[Path]) -> None:
    """Release this process's lock on ``run_dir`` and remove the lock file (while still holding it: a process
    that opened the old file sees its inode gone and retries, :func:`lock_run_dir`); a no-op when not held."""
    if run_dir is None:
        return
    fd = _HELD.pop(str(Path(run_dir).resolve()), None)
    if fd is not None:
        try:  # a run dir left after a clean end holds no lock file (a kill -9 leaves one: its lock is gone anyway)
            (Path(run_dir) / LOCK_FILE).unlink(missing_ok=True)
        except OSError:
            pass
        os.close(fd)  # closing the only descriptor drops the flock


def probe_run_dir(run_dir: Path) -> Optional[dict]:
    """None when no process holds ``run_dir``'s lock (or there is no run dir), else the holder's record
    (:func:`lock_holder`). Takes and drops the lock at once when it is free; never writes the record."""
    import fcntl

    d = Path(run_dir)
    if str(d.resolve()) in _HELD:
        return lock_holder(d)
    if not (d / LOCK_FILE).is_file():
        return None
    try:
        fd = os.open(d / LOCK_FILE, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return None
    except BlockingIOError:
        return lock_holder(d)
    finally:
        os.close(fd)  # (drops the probe's lock, if it got it)


def multiprocess_start(runtime) -> bool:
    """True when this process will join a multi-process (``jax.distributed``) run: ``runtime.coordinator``
    set, or a TPU pod's ``TPU_WORKER_HOSTNAMES`` naming several hosts. Then the lock is taken once the
    processes can talk (:func:`hold_run_dir_all`), so process 0's refusal reaches every process."""
    hosts = [h for h in os.environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]
    return bool(getattr(runtime, "coordinator", None)) or len(hosts) > 1


def hold_run_dir_all(run_dir: Path, *, command: str, what: str, process_index: int, gather) -> None:
    """Every process of a run calls this at the same point (after ``jax.distributed`` started, before
    anything is written): process 0 takes the lock (:func:`lock_run_dir`), the others check it (a probe: a
    holder other than process 0 is a foreign writer). ``gather`` is an all-gather of a JSON-safe object
    (``jax_rl.collectives.allgather_json``), so a refusal on any process is raised on all of them (exit 2
    everywhere, no process left waiting for its peers).

    Raises:
        RunDirHeldError: naming the foreign holder.
    """
    d = Path(run_dir)
    d.mkdir(parents=True, exist_ok=True)
    err, mine = None, None
    if process_index == 0:
        try:
            lock_run_dir(d, command=command, what=what)
            mine = lock_holder(d)
        except RunDirHeldError as e:
            err = str(e)
    first = gather({"err": err, "holder": mine})  # 1: process 0's lock, taken before any process probes
    if first[0].get("err"):
        raise RunDirHeldError(first[0]["err"])
    mine = first[0].get("holder") or {}
    seen = probe_run_dir(d) if process_index != 0 else None  # 2: the others check who holds it
    foreign = None
    if seen and (seen.get("pid"), seen.get("host")) != (mine.get("pid"), mine.get("host")):
        foreign = _held_line(d, seen, what)
    errs = [r for r in gather(foreign) if r]
    if errs:
        unlock_run_dir(d)
        raise RunDirHeldError(errs[0])
