"""A run's directory: where it is (``run.dir`` or ``runs/<name>-<UTC time>``), what counts as an earlier
run in it, and clearing one (``run.overwrite``)."""

from __future__ import annotations

import datetime as _dt
import logging
from pathlib import Path

from jax_rl.config import Config, ConfigError

log = logging.getLogger("jax_rl.runtime")

__all__ = ["RUN_FILES", "RUN_DIRS", "resolve_run_dir", "delete_earlier_run"]


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
