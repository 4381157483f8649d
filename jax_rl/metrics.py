"""Run metrics writers: ``metrics.jsonl`` / ``eval.jsonl``, TensorBoard, optional W&B.

One :class:`MetricsWriter` per run, owned by the runtime. Each ``write(step, metrics)`` call
appends exactly one JSON object (one line) to ``<run_dir>/metrics.jsonl`` and mirrors the
scalars to TensorBoard (``<run_dir>/tb``, tensorboardX event files) and, when asked for and
installed, to Weights & Biases.

Values are coerced to plain JSON:

- Python / numpy / jax scalars (anything with ``__float__``) become ``float``; ``int`` and
  ``bool`` stay integers (``bool`` -> 0/1). ``step`` is always an ``int``.
- Non-finite floats (NaN, +-inf) are written as ``null`` and their keys are listed, sorted,
  in a ``nonfinite_keys`` field of the same line. Writing never raises on a bad value.
- Sequences / arrays become lists of floats (``null`` for non-finite, e.g. ``staleness_hist``);
  size-1 arrays become scalars. Nested dicts are flattened with ``/`` (``{"loss": {"kl": x}}``
  -> ``"loss/kl"``). Strings are kept as they are (JSON only, not mirrored to TensorBoard).
  Anything else is written as ``str(value)``.
- TensorBoard tags are the JSONL keys with ``@`` -> ``_at_`` and other characters outside
  ``[A-Za-z0-9_./-]`` -> ``_`` (``eval/pass@4`` -> ``eval/pass_at_4``); W&B gets the keys as is.

This module does not import jax; it uses ``float(x)`` on whatever it is given, so pass host
values (a device array costs a device->host transfer per key).

Only the primary process writes (``is_primary=False`` turns every method into a no-op), so a
multi-host learner can call it unconditionally with ``is_primary=jax.process_index() == 0``.
All methods are thread-safe (one lock per writer).
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import re
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Union

__all__ = [
    "MetricsWriter",
    "read_jsonl",
    "iter_jsonl",
    "sanitize",
    "write_json",
    "truncate_jsonl",
    "METRICS_FILE",
    "EVAL_FILE",
    "TB_DIR",
]

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
EVAL_FILE = "eval.jsonl"
TB_DIR = "tb"
NONFINITE_KEY = "nonfinite_keys"

PathLike = Union[str, os.PathLike]

_warned: set[str] = set()
_warn_lock = threading.Lock()


def _tb_tag(key: str) -> str:
    """TensorBoard tags allow ``[A-Za-z0-9_./-]``: ``eval/pass@4`` -> ``eval/pass_at_4``."""
    return re.sub(r"[^A-Za-z0-9_./-]", "_", key.replace("@", "_at_"))


def _warn_once(key: str, msg: str) -> None:
    with _warn_lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(msg, RuntimeWarning, stacklevel=3)
    log.warning(msg)


# ----------------------------------------------------------------------------- coercion


def _to_number(v: Any) -> Any:
    """Scalar -> int/float, or raise TypeError/ValueError if it isn't scalar-like."""
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, numbers.Integral):
        return int(v)
    if isinstance(v, float):
        return v
    # numpy / jax scalars and 0-d or size-1 arrays
    size = getattr(v, "size", None)
    if size is not None and size != 1:
        raise TypeError("not a scalar")
    if size == 1 and hasattr(v, "reshape"):
        v = v.reshape(())
    kind = getattr(getattr(v, "dtype", None), "kind", "")
    if kind == "b":
        return int(bool(v))
    if kind in ("i", "u"):
        return int(v)
    return float(v)  # type: ignore[arg-type]


def _coerce(value: Any) -> tuple[Any, bool]:
    """Return (json_value, is_nonfinite). Never raises."""
    if value is None:
        return None, False
    if isinstance(value, str):
        return value, False
    try:
        x = _to_number(value)
        if isinstance(x, float) and not math.isfinite(x):
            return None, True
        return x, False
    except Exception:
        pass
    # sequences / arrays -> list of numbers
    try:
        if hasattr(value, "tolist") and not isinstance(value, (list, tuple)):
            value = value.tolist()
        if isinstance(value, (list, tuple)):
            out, bad = [], False
            for item in value:
                c, b = _coerce(item)
                out.append(c)
                bad = bad or b
            return out, bad
    except Exception:
        pass
    try:
        return str(value), False
    except Exception:  # pragma: no cover - pathological __str__
        return "<unprintable>", False


def _flatten(d: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            yield from _flatten(v, key + "/")
        else:
            yield key, v


def sanitize(metrics: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Flatten and coerce a metrics dict to JSON-safe values.

    Returns ``(flat_dict, nonfinite_keys)``: non-finite floats are ``None`` in ``flat_dict`` and
    their keys are listed (sorted) in ``nonfinite_keys``. Never raises on values.
    """
    out: dict[str, Any] = {}
    bad: list[str] = []
    for k, v in _flatten(metrics):
        c, b = _coerce(v)
        out[str(k)] = c
        if b:
            bad.append(str(k))
    return out, sorted(bad)


def write_json(path: PathLike, obj: Mapping[str, Any], *, indent: int = 2) -> Path:
    """Write ``obj`` (sanitised: non-finite -> null, numpy -> Python) atomically to ``path``.

    Used for ``summary.json``. Nested dicts are kept nested. Returns the path.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    def clean(o: Any) -> Any:
        if isinstance(o, Mapping):
            return {str(k): clean(v) for k, v in o.items()}
        return _coerce(o)[0]

    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(clean(obj), indent=indent, allow_nan=False) + "\n")
    os.replace(tmp, path)
    return path


# ----------------------------------------------------------------------------- reading


def iter_jsonl(path: PathLike) -> Iterator[dict[str, Any]]:
    """Yield the JSON objects of a JSONL file, one per non-blank line.

    A missing file yields nothing. Lines that are not valid JSON objects (e.g. a last line
    truncated by a crash) are skipped with a log warning. ``NaN``/``Infinity`` literals written by
    other tools are accepted (Python's json parses them to float).
    """
    p = Path(path)
    if not p.is_file():
        return
    with p.open("r", encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                log.warning("%s:%d: skipping malformed JSON line", p, lineno)
                continue
            if isinstance(obj, dict):
                yield obj


def read_jsonl(path: PathLike) -> list[dict[str, Any]]:
    """All JSON objects of a JSONL file as a list (``[]`` if the file is missing or empty)."""
    return list(iter_jsonl(path))


def relabel_final(path: PathLike) -> int:
    """A resumed run's ``eval.jsonl``: the earlier run's ``final`` rows become ``eval`` rows (its end
    was not the run's end), so the file keeps one ``final`` row, the resumed run's. Rewritten
    atomically and only when a row changes; returns the rows relabelled."""
    p = Path(path)
    if not p.is_file():
        return 0
    lines, n = [], 0
    for line in p.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            lines.append(line)
            continue
        if isinstance(obj, dict) and obj.get("label") == "final":
            obj["label"], n = "eval", n + 1
            line = json.dumps(obj, allow_nan=False)
        lines.append(line)
    if n:
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text("".join(ln + "\n" for ln in lines), encoding="utf-8")
        os.replace(tmp, p)
    return n


def truncate_jsonl(path: PathLike, max_step: int) -> int:
    """Keep only the rows of a JSONL file whose ``step`` is ``<= max_step`` (and that parse).

    The file is rewritten atomically (a temp file in the same dir, then ``os.replace``) and only
    when something is dropped; a missing file is left missing. Returns the rows dropped.
    """
    p = Path(path)
    if not p.is_file():
        return 0
    keep, dropped = [], 0
    with p.open("r", encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                ok = isinstance(obj, dict) and int(obj.get("step", 0)) <= max_step
            except (json.JSONDecodeError, TypeError, ValueError):
                ok = False
            if ok:
                keep.append(line if line.endswith("\n") else line + "\n")
            else:
                dropped += 1
    if dropped:
        tmp = p.with_name(p.name + ".tmp")
        with tmp.open("w", encoding="utf-8") as f:
            f.writelines(keep)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
        log.info("%s: dropped %d row(s) after step %d (resumed run)", p, dropped, max_step)
    return dropped


# ----------------------------------------------------------------------------- writer


class MetricsWriter:
    """Append-only metrics sink for one run.

    Args:
        run_dir: the run directory; created if missing. Files: ``metrics.jsonl``,
            ``eval.jsonl``, ``tb/`` (TensorBoard events), ``wandb/`` (W&B local files).
        tensorboard: mirror numeric scalars to TensorBoard via tensorboardX. If tensorboardX
            can't be imported or its writer fails, a warning is issued once and JSONL goes on.
        wandb: also log to Weights & Biases (``wandb.init(dir=run_dir, ...)``). If ``wandb`` is
            not installed, warns once and continues without it.
        is_primary: only the primary process (``jax.process_index() == 0``) writes; on the
            others every method is a no-op and no file is created.
        wandb_project / wandb_name / wandb_config: passed to ``wandb.init`` (project defaults to
            ``"jax-rl"``, name to the run dir's basename).

        resume_step: a resumed run's restored step N. Rows of ``metrics.jsonl`` / ``eval.jsonl``
            with ``step > N`` (written by the interrupted run after its checkpoint, or a
            malformed last line) are dropped first, each file rewritten atomically; TensorBoard
            gets ``purge_step=N+1``, so it discards the earlier sessions' events at steps > N.
            Each step then appears once.

    Files are opened in append mode, so a resumed run continues the same ``metrics.jsonl``.
    Each line is flushed as it is written, so ``jax-rl plot`` works on a running run.
    """

    def __init__(
        self,
        run_dir: PathLike,
        *,
        tensorboard: bool = True,
        wandb: bool = False,
        is_primary: bool = True,
        wandb_project: Optional[str] = None,
        wandb_name: Optional[str] = None,
        wandb_config: Optional[Mapping[str, Any]] = None,
        resume_step: Optional[int] = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.is_primary = bool(is_primary)
        self.metrics_path = self.run_dir / METRICS_FILE
        self.eval_path = self.run_dir / EVAL_FILE
        self.tb_dir = self.run_dir / TB_DIR
        self._lock = threading.RLock()
        self._closed = False
        self._files: dict[str, Any] = {}
        self._tb = None
        self._wandb = None
        if not self.is_primary:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if resume_step is not None:
            for path in (self.metrics_path, self.eval_path):
                truncate_jsonl(path, int(resume_step))
            relabel_final(self.eval_path)
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter

                purge = None if resume_step is None else int(resume_step) + 1
                # tensorboardX names the event file by the second; a writer opened within the
                # same second as an earlier one would truncate that file: wait for the next second
                while any(self.tb_dir.glob(f"events.out.tfevents.{str(time.time())[:10]}.*")):
                    time.sleep(0.05)
                self._tb = SummaryWriter(logdir=str(self.tb_dir), flush_secs=10, purge_step=purge)
            except Exception as e:  # ImportError or a writer failure
                _warn_once("tensorboard", f"TensorBoard logging disabled: {type(e).__name__}: {e}")
                self._tb = None
        if wandb:
            try:
                import wandb as _wandb  # type: ignore[import-not-found]
            except ImportError:
                _warn_once(
                    "wandb",
                    "logging.wandb=true but wandb is not installed (pip install wandb); "
                    "continuing without W&B",
                )
            else:
                try:
                    self._wandb = _wandb.init(
                        project=wandb_project or "jax-rl",
                        name=wandb_name or self.run_dir.name,
                        dir=str(self.run_dir),
                        config=dict(wandb_config) if wandb_config else None,
                        resume="allow",
                    )
                except Exception as e:
                    _warn_once("wandb-init", f"wandb.init failed ({type(e).__name__}: {e}); continuing without W&B")
                    self._wandb = None

    # -- internals -------------------------------------------------------------------

    def _file(self, path: Path):
        f = self._files.get(str(path))
        if f is None:
            f = path.open("a", encoding="utf-8")
            self._files[str(path)] = f
        return f

    def _record(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        flat, bad = sanitize(metrics)
        flat.pop("step", None)
        flat.pop(NONFINITE_KEY, None)
        row: dict[str, Any] = {"step": int(step)}
        row.update(flat)
        if bad:
            row[NONFINITE_KEY] = bad
        return row

    def _append(self, path: Path, row: dict[str, Any]) -> None:
        f = self._file(path)
        f.write(json.dumps(row, allow_nan=False) + "\n")
        f.flush()

    def _mirror(self, step: int, row: dict[str, Any], prefix: str) -> None:
        scalars = {
            f"{prefix}{k}": v
            for k, v in row.items()
            if k not in ("step", NONFINITE_KEY)
            and isinstance(v, (int, float))
            and not isinstance(v, bool)
        }
        if self._tb is not None:
            try:
                for k, v in scalars.items():
                    self._tb.add_scalar(_tb_tag(k), v, global_step=step)
            except Exception as e:
                _warn_once("tb-write", f"TensorBoard write failed, disabling it: {type(e).__name__}: {e}")
                self._tb = None
        if self._wandb is not None:
            try:
                self._wandb.log(scalars, step=step)
            except Exception as e:
                _warn_once("wandb-log", f"wandb.log failed, disabling W&B: {type(e).__name__}: {e}")
                self._wandb = None

    # -- public API ------------------------------------------------------------------

    def write(self, step: int, metrics: Mapping[str, Any]) -> Optional[dict[str, Any]]:
        """Append one line ``{"step": step, **metrics}`` to ``metrics.jsonl`` and mirror scalars.

        Args:
            step: learner step (int; the x axis everywhere).
            metrics: flat or nested dict of scalars / arrays / strings (see module doc).
        Returns:
            The row as written (``None`` on non-primary processes or after :meth:`close`).
        """
        return self._write_row(self.metrics_path, step, metrics, prefix="")

    def write_eval(self, step: int, metrics: Mapping[str, Any]) -> Optional[dict[str, Any]]:
        """Append one line to ``eval.jsonl``; scalars go to TensorBoard / W&B under ``eval/``."""
        return self._write_row(self.eval_path, step, metrics, prefix="eval/")

    def _write_row(self, path: Path, step: int, metrics: Mapping[str, Any], prefix: str) -> Optional[dict[str, Any]]:
        """Append one sanitised row to ``path`` and mirror it to TensorBoard / W&B under ``prefix``."""
        if not self.is_primary:
            return None
        with self._lock:
            if self._closed:
                _warn_once("closed", "MetricsWriter.write after close(); ignored")
                return None
            row = self._record(step, metrics)
            self._append(path, row)
            self._mirror(int(step), row, prefix=prefix)
            return row

    def write_summary(self, summary: Mapping[str, Any], name: str = "summary.json") -> Optional[Path]:
        """Write ``<run_dir>/summary.json`` atomically (sanitised); returns its path."""
        if not self.is_primary:
            return None
        with self._lock:
            return write_json(self.run_dir / name, {**summary, "written_at": time.time()})

    def flush(self) -> None:
        """Flush the TensorBoard writer (JSONL lines are flushed on every write)."""
        if not self.is_primary:
            return
        with self._lock:
            if self._tb is not None:
                try:
                    self._tb.flush()
                except Exception:  # pragma: no cover
                    pass

    def close(self) -> None:
        """Close files, the TensorBoard writer and the W&B run. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for f in self._files.values():
                try:
                    f.close()
                except Exception:  # pragma: no cover
                    pass
            self._files.clear()
            if self._tb is not None:
                try:
                    self._tb.close()
                except Exception:  # pragma: no cover
                    pass
                self._tb = None
            if self._wandb is not None:
                try:
                    self._wandb.finish()
                except Exception:  # pragma: no cover
                    pass
                self._wandb = None

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
