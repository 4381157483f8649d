"""Orbax checkpointing for the learner: one ``CheckpointManager`` with separate items.

Items of one checkpoint (a step directory ``<dir>/<step>/``):

- ``state``: the learner's :class:`~jax_rl.train_step.TrainState` minus the correction's
  state, as a nested dict of jax arrays ``{params, opt_state, version, step, rng}``;
- the correction strategy's items (:meth:`jax_rl.correction.Correction.checkpoint_items`;
  ``ewma``: ``{params, count, streak, resets}`` for the EWMA strategy);
- ``snapshots``: the snapshot store of :mod:`jax_rl.old_logits`, ``{"v<n>": params}``
  (only when the store holds something);
- ``metadata``: JSON. ``rl_step`` (the RL loop step the state is at; the runtime resumes
  from exactly this step), ``version`` (published versions), ``opt_step`` (optimizer updates;
  ``ppo_epochs x minibatches`` per RL step; also written as ``step``),
  ``config_hash`` (:func:`jax_rl.config.config_hash`), ``model_arch`` (the model's HF config
  dict), ``correction``, ``snapshot_versions`` and ``runtime`` (whatever JSON-able dict the
  runtime hands in: buffer state, rollout counters).

The runtime names step directories by the RL step (``checkpoints/<rl_step>``); a learner used
on its own names them by version.

Faults. A save writes into ``<step>.orbax-checkpoint-tmp*`` and renames it when committed, so
a killed or failed save never leaves a step a restore would pick (the tmp dir is removed on
the next start or at once after a failure). :meth:`Checkpointer.check_step` validates a step
(items present, metadata JSON parses); :meth:`jax_rl.learner_checkpoints.LearnerCheckpoints.restore` adds the array
restore and falls back past bad steps (:class:`CheckpointCorruptError`). A save that would not
fit on the disk (raw array bytes vs ``shutil.disk_usage``), or that fails with ENOSPC /
``RESOURCE_EXHAUSTED`` in Orbax's background thread, raises one
:class:`CheckpointDiskFullError` line; the older steps stay intact. The tracebacks the failed
writes would print are dropped: no-space records of the ``absl`` and ``asyncio`` loggers, and
tensorstore's ``Event loop is closed`` unraisable exceptions (``_ClosedLoopHook``).

Saves are asynchronous when ``checkpoint.async_save`` (Orbax writes in a background thread;
:meth:`Checkpointer.save` returns after the device->host copy). Restores take abstract
targets (``jax.ShapeDtypeStruct`` with a ``sharding``), so a checkpoint written on one mesh
restores onto any other mesh: Orbax reads each shard the new layout needs.

Multi-process: every process calls :meth:`save` / :meth:`restore` with its (global) arrays;
Orbax coordinates the write, and the JSON item is written by the primary process only.

No pickle anywhere: arrays go through tensorstore, metadata through JSON.
"""

from __future__ import annotations

import errno
import json
import logging
import shutil
from pathlib import Path
from typing import Any, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp

__all__ = ["Checkpointer", "CheckpointMismatchError", "CheckpointCorruptError", "CheckpointDiskFullError",
           "ITEM_NAMES", "abstract_like", "tree_nbytes", "is_no_space", "disk_full_error", "to_nested",
           "from_nested", "train_state_items", "restore_train_state", "saved_layer_layout"]

log = logging.getLogger(__name__)

ITEM_NAMES = ("state", "ewma", "snapshots", "metadata")


class CheckpointMismatchError(ValueError):
    """The checkpoint was written by a run whose model or correction mode differs from this one."""


class CheckpointCorruptError(ValueError):
    """A checkpoint step is partial or unreadable (missing item, bad metadata JSON, failed restore).

    The message is one line naming the step directory and what is wrong with it.
    """


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


def tree_nbytes(*trees: Any) -> int:
    """Total bytes of the array leaves of ``trees`` (global shapes; None trees count 0)."""
    n = 0
    for t in trees:
        if t is None:
            continue
        for x in jax.tree.leaves(t):
            size, dt = getattr(x, "size", None), getattr(x, "dtype", None)
            if size is not None and dt is not None:
                n += int(size) * int(getattr(dt, "itemsize", 0) or 4)
    return n


def one_line(e: BaseException, limit: int = 300) -> str:
    """``"<ExceptionType>: <message>"`` on one line, whitespace collapsed, at most ``limit`` characters."""
    msg = " ".join(str(e).split()) or type(e).__name__
    msg = msg if len(msg) <= limit else msg[: limit - 3] + "..."
    return f"{type(e).__name__}: {msg}"


def abstract_like(tree: Any, shardings: Any = None) -> Any:
    """``jax.ShapeDtypeStruct`` tree for ``tree`` (arrays), with ``shardings`` (same tree) if given.

    Used as an Orbax restore target: the restored arrays get these shapes, dtypes and
    shardings (resharding from whatever layout was saved).
    """
    if shardings is None:
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _layers_layout_of_paths(paths) -> Optional[str]:
    """``"stacked"`` / ``"unrolled (one subtree per layer)"`` from the key paths of a params
    tree (the key after ``layers`` is a layer index in the unrolled layout), None if no
    ``layers`` key."""
    for path in paths:
        path = [str(k) for k in path]
        if "layers" in path[:-1]:
            nxt = path[path.index("layers") + 1]
            return "unrolled (one subtree per layer)" if nxt.isdigit() else "stacked"
    return None


def _layers_layout_of_tree(tree: Any) -> Optional[str]:
    paths = [[getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in p]
             for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    return _layers_layout_of_paths(paths)


def saved_layer_layout(directory: str | Path, step: Optional[int] = None) -> Optional[str]:
    """How a checkpoint's ``state`` item stores the decoder layers, read from its tree metadata
    (no array is read): ``"stacked"`` (``params/layers/<name>`` [L, ...], ``model.scan_layers``),
    ``"unrolled (one subtree per layer)"`` (``params/layers/<i>/<name>``) or None (no ``layers``
    subtree, no such step, or unreadable metadata). ``step=None``: the newest step dir under
    ``directory`` whose metadata reads."""
    directory = Path(directory)
    if step is None:
        try:
            steps = sorted((int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit()),
                           reverse=True)
        except OSError:
            return None
    else:
        steps = [int(step)]
    for s in steps:
        try:
            meta = json.loads((directory / str(s) / "state" / "_METADATA").read_text())
            paths = [[k["key"] for k in v["key_metadata"]] for v in meta["tree_metadata"].values()]
        except Exception:  # noqa: BLE001 - an unreadable step is reported by the restore itself
            continue
        return _layers_layout_of_paths(paths)
    return None


def _host_local_to_numpy(tree: Any) -> Any:
    """``tree`` with every fully addressable ``jax.Array`` as a numpy array (None stays None)."""
    if tree is None:
        return None
    return jax.tree.map(lambda x: np.asarray(x) if isinstance(x, jax.Array) and x.is_fully_addressable else x, tree)


class Checkpointer:
    """Thin wrapper over ``orbax.checkpoint.CheckpointManager`` with the learner's items.

    Args:
        directory: checkpoint root (created if missing). Must be visible to every process in
            multi-process runs (a shared filesystem or GCS).
        every: save interval in learner steps for :meth:`should_save` (0 = never periodic).
        max_to_keep: newest checkpoints kept; older ones are deleted after a save commits.
        async_save: write in a background thread (Orbax async checkpointing).
        active_processes: multi-process with the learner on some processes only (disaggregated): the
            processes that hold its arrays and call this Checkpointer (Orbax's
            ``MultiprocessingOptions.active_processes``, the first one primary); None = every process.
    """

    def __init__(self, directory: str | Path, *, every: int = 0, max_to_keep: int = 2, async_save: bool = True,
                 active_processes: Optional[set] = None):
        self.directory = Path(directory).absolute()
        self.every = int(every)
        mp = ocp.options.MultiprocessingOptions() if active_processes is None else \
            ocp.options.MultiprocessingOptions(primary_host=min(active_processes),
                                               active_processes=set(active_processes))
        opts = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            enable_async_checkpointing=async_save,
            create=active_processes is None,  # (Orbax does not create it for a subset of processes: done here)
            cleanup_tmp_directories=True,  # a save killed mid-write leaves a tmp dir, never a step
            multiprocessing_options=mp,
        )
        if active_processes is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
        self._mgr = ocp.CheckpointManager(self.directory, options=opts, item_names=ITEM_NAMES)
        self._need = 0  # bytes of the last save attempted (for the disk-full message)
        self._disk_full_reported = False
        # absl: Orbax's own error logs; asyncio: "Task exception was never retrieved" for the
        # failed writes of a save that hit a full disk, logged when the tasks are collected
        for name in ("absl", "asyncio"):
            logging.getLogger(name).addFilter(_NOSPACE_FILTER)  # idempotent
        _install_closed_loop_hook()

    # ---------------------------------------------------------------------------------
    def should_save(self, step: int) -> bool:
        """True when ``every > 0`` and ``step`` is a positive multiple of it."""
        return self.every > 0 and step > 0 and step % self.every == 0

    def save(
        self,
        step: int,
        *,
        state: dict,
        metadata: dict,
        ewma: Optional[dict] = None,
        snapshots: Optional[dict] = None,
    ) -> bool:
        """Save one checkpoint at ``step`` (async). Returns True if a save was started.

        Args:
            step: the learner step (directory name). Saving the same step twice is a no-op.
            state: nested dict of jax arrays (the train state without EWMA).
            metadata: JSON-serialisable dict.
            ewma: nested dict of jax arrays or None (item omitted).
            snapshots: ``{"v<n>": params}`` or None/empty (item omitted).
        """
        if step in self._mgr.all_steps():
            log.info("checkpoint for step %d already exists; skipping", step)
            return False
        # a full disk is refused before Orbax starts writing (the estimate is the raw array
        # bytes: an upper bound for float params, which barely compress)
        need = tree_nbytes(state, ewma, snapshots) + len(json.dumps(metadata, default=str)) + (64 << 10)
        self._need = need
        free = shutil.disk_usage(self.directory).free
        if free < need:
            raise self._disk_full(step, need, free)
        if jax.process_count() > 1:  # the learner on one process of several: Orbax refuses a process-local
            # jax.Array in a multi-process run, so its fully addressable arrays are saved as host arrays (the
            # same tensorstore layout; restored onto the learner's shardings as usual)
            state, ewma, snapshots = (_host_local_to_numpy(t) for t in (state, ewma, snapshots))
        items = {"state": ocp.args.StandardSave(state), "metadata": ocp.args.JsonSave(metadata)}
        if ewma is not None:
            items["ewma"] = ocp.args.StandardSave(ewma)
        if snapshots:
            items["snapshots"] = ocp.args.StandardSave(snapshots)
        try:
            return bool(self._mgr.save(step, args=ocp.args.Composite(**items), force=True))
        except Exception as e:  # also surfaces the failure of the previous async save
            if _is_no_space(e):
                raise self._disk_full(step, need) from None
            raise

    def latest_step(self) -> Optional[int]:
        """Newest saved step (committed or in flight from this process), or None."""
        return self._mgr.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._mgr.all_steps())

    def restore_metadata(self, step: Optional[int] = None) -> dict:
        """The JSON metadata item of ``step`` (default: latest).

        Raises:
            FileNotFoundError: no checkpoint in the directory.
        """
        step = self.resolve(step)
        return dict(self._mgr.restore(step, args=ocp.args.Composite(metadata=ocp.args.JsonRestore())).metadata)

    def restore(
        self,
        step: Optional[int] = None,
        *,
        state: Any,
        ewma: Any = None,
        snapshots: Any = None,
    ) -> dict:
        """Restore items of ``step`` (default latest) into abstract targets.

        Args:
            state / ewma / snapshots: trees of ``jax.ShapeDtypeStruct`` with shardings (see
                :func:`abstract_like`); None skips the item.

        Returns:
            ``{"state": ..., "ewma": ... or None, "snapshots": ... or None, "metadata": dict}``.

        Raises:
            FileNotFoundError: no checkpoint.
            CheckpointMismatchError: the decoder layers are stacked on one side and unrolled on
                the other (``model.scan_layers``), one line.
            ValueError: the saved tree does not match the target (Orbax's message).
        """
        step = self.resolve(step)
        self.check_layer_layout(step, state)
        items = {"state": ocp.args.StandardRestore(state), "metadata": ocp.args.JsonRestore()}
        if ewma is not None:
            items["ewma"] = ocp.args.StandardRestore(ewma)
        if snapshots:
            items["snapshots"] = ocp.args.StandardRestore(snapshots)
        out = self._mgr.restore(step, args=ocp.args.Composite(**items))
        return {
            "state": out.state,
            "ewma": out.ewma if ewma is not None else None,
            "snapshots": out.snapshots if snapshots else None,
            "metadata": dict(out.metadata),
        }

    def check_layer_layout(self, step: int, state: Any) -> None:
        """One-line ``CheckpointMismatchError`` when the saved state stores the decoder layers in
        the other layout than ``state`` (the restore target): unrolled ``params/layers/<i>/...``
        vs stacked ``params/layers/<name>`` [L, ...] (``model.scan_layers``). No-op when either
        side has no ``layers`` subtree or the saved tree metadata cannot be read."""
        want = _layers_layout_of_tree(state)
        have = saved_layer_layout(self.directory, step)
        if want is None or have is None or want == have:
            return
        raise CheckpointMismatchError(
            f"checkpoint {self.directory / str(step)} stores the decoder layers {have} but this run "
            f"builds them {want}: set model.scan_layers={'true' if have == 'stacked' else 'false'} "
            "to resume it")

    def wait(self) -> None:
        """Block until in-flight async saves are committed.

        Raises:
            CheckpointDiskFullError: the save in flight ran out of disk space (its partial
                files are removed; the older steps are intact).
        """
        try:
            self._mgr.wait_until_finished()
        except Exception as e:
            if _is_no_space(e):
                raise self._disk_full(None, self._need) from None
            raise

    def close(self) -> None:
        """Wait for pending saves and release Orbax's threads.

        Raises:
            CheckpointDiskFullError: as :meth:`wait`, unless that failure was already raised.
        """
        reported = self._disk_full_reported
        try:
            self.wait()
        except CheckpointDiskFullError:
            if not reported:
                raise
        finally:
            try:
                self._mgr.close()
            except Exception as e:  # a failed background save is re-raised here by Orbax
                if not _is_no_space(e):
                    raise

    # ---------------------------------------------------------------------------------
    def check_step(self, step: int, items: tuple[str, ...] = ("state", "metadata")) -> dict:
        """Cheap validation of one step: its item directories exist and its metadata parses.

        Args:
            step: a step in :meth:`all_steps`.
            items: item names that must be present (``state`` and ``metadata`` always are;
                the learner adds ``ewma`` / ``snapshots`` when its mode needs them).

        Returns:
            the metadata dict.

        Raises:
            CheckpointCorruptError: one line naming the step dir and the problem.
        """
        d = self.directory / str(step)
        if not d.is_dir():
            raise CheckpointCorruptError(f"checkpoint {d} does not exist")
        missing = [i for i in dict.fromkeys(("state", "metadata", *items)) if not (d / i).is_dir()]
        if missing:
            raise CheckpointCorruptError(f"checkpoint {d} is missing item(s) {', '.join(missing)}")
        try:
            meta = self.restore_metadata(step)
        except Exception as e:
            raise CheckpointCorruptError(f"checkpoint {d} has unreadable metadata ({one_line(e)})") from None
        for k in ("version",):
            if k not in meta:
                raise CheckpointCorruptError(f"checkpoint {d} metadata has no {k!r} key")
        return meta

    def delete_after(self, step: int) -> list[int]:
        """Delete every step newer than ``step`` (a resume from ``step`` supersedes them).

        Returns the deleted steps.
        """
        self._mgr.wait_until_finished()
        self._mgr.reload()
        gone = [s for s in self._mgr.all_steps() if s > step]
        for s in gone:
            self._mgr.delete(s)
        return sorted(gone)

    def _disk_full(self, step: Optional[int], need: int, free: Optional[int] = None) -> CheckpointDiskFullError:
        self._disk_full_reported = True
        try:
            self._mgr.wait_until_finished()  # an earlier save still in flight may yet commit
        except Exception:
            pass
        _cancel_unstarted_writes()
        self._cleanup_tmp()
        what = f"cannot write checkpoint step {step}" if step is not None else "cannot write a checkpoint"
        return disk_full_error(self.directory, need, what, free=free)

    def _cleanup_tmp(self) -> None:
        """Remove Orbax's uncommitted ``<step>.orbax-checkpoint-tmp*`` dirs (primary process)."""
        if jax.process_index() != 0:
            return
        for p in self.directory.glob("*.orbax-checkpoint-tmp*"):
            shutil.rmtree(p, ignore_errors=True)

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------------------------
    def delete(self, step: int) -> None:
        """Delete checkpoint ``step`` (after the writes in flight finish)."""
        self._mgr.wait_until_finished()
        self._mgr.delete(int(step))

    def resolve(self, step: Optional[int]) -> int:
        """The step a restore reads: ``step``, or the newest when None.

        Raises:
            FileNotFoundError: no checkpoint in the directory, or no such ``step`` (naming the
                steps there).
        """
        self._mgr.wait_until_finished()
        self._mgr.reload()
        if step is None:
            step = self._mgr.latest_step()
        if step is None:
            raise FileNotFoundError(f"no checkpoint found in {self.directory}")
        if step not in self._mgr.all_steps():
            raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory}; have {self.all_steps()}")
        return int(step)


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


# model fields that say what size a model is, shown first when a checkpoint's model differs
_SIZE_FIELDS = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "vocab_size")


def describe_model(arch: dict, name: Optional[str] = None) -> str:
    """``model.preset=tiny_dense (dense, hidden 64, 2 layers, 2 heads / 1 kv, vocab 640)`` from an
    HF config dict (``Qwen3Config.to_hf()``) and the config's model name, when known."""
    kind = f"MoE {arch.get('num_experts')} experts" if arch.get("num_experts") else "dense"
    size = (f"{kind}, hidden {arch.get('hidden_size')}, {arch.get('num_hidden_layers')} layers, "
            f"{arch.get('num_attention_heads')} heads / {arch.get('num_key_value_heads')} kv, "
            f"vocab {arch.get('vocab_size')}")
    return f"{name} ({size})" if name else f"a model ({size})"


def _saved_model_name(saved: dict, directory: Any) -> Optional[str]:
    """The saved run's ``model.preset=...`` / ``model.checkpoint=...``: from the metadata (newer
    checkpoints) or the run's config.yaml next to the checkpoints dir (YAML, no code run)."""
    if saved.get("model_name"):
        return str(saved["model_name"])
    try:
        import yaml

        m = (yaml.safe_load((Path(directory).parent / "config.yaml").read_text(encoding="utf-8")) or {}).get("model")
        if isinstance(m, dict):
            return model_name(m.get("preset"), m.get("checkpoint"))
    except Exception:  # noqa: BLE001 - no readable config.yaml: the sizes alone are shown
        pass
    return None


def model_name(preset: Any, checkpoint: Any) -> Optional[str]:
    """``model.checkpoint=PATH`` when set, else ``model.preset=NAME`` (None when neither)."""
    if checkpoint:
        return f"model.checkpoint={checkpoint}"
    return f"model.preset={preset}" if preset else None


def check_compatible(saved: dict, *, model_arch: dict, correction: str, directory: Any = "",
                     model: Optional[str] = None) -> None:
    """Refuse a restore whose saved run had another model architecture or correction mode.

    Args:
        saved: the checkpoint's metadata dict.
        model_arch: this run's model HF config dict.
        correction: this run's ``loss.correction``.
        model: this run's :func:`model_name` (shown in the message).

    Raises:
        CheckpointMismatchError: naming the saved model and this config's (name and size), then the
            differing fields (size fields first); or the two correction modes.
    """
    where = f" in {directory}" if directory else ""
    s_arch = saved.get("model_arch") or {}
    if s_arch and s_arch != model_arch:
        diff = sorted((k for k in set(s_arch) | set(model_arch) if s_arch.get(k) != model_arch.get(k)),
                      key=lambda k: (_SIZE_FIELDS.index(k) if k in _SIZE_FIELDS else len(_SIZE_FIELDS), k))
        shown = ", ".join(f"{k}: saved={s_arch.get(k)!r} now={model_arch.get(k)!r}" for k in diff[:6])
        raise CheckpointMismatchError(
            f"checkpoint{where} was written for {describe_model(s_arch, _saved_model_name(saved, directory))} "
            f"but this config asks for {describe_model(model_arch, model)} ({shown}); resume with the model "
            "the run was started with, or start a fresh run dir"
        )
    s_corr = saved.get("correction")
    if s_corr is not None and s_corr != correction:
        raise CheckpointMismatchError(
            f"checkpoint{where} was written with loss.correction={s_corr!r} but this run has "
            f"loss.correction={correction!r}; the train state (EWMA, snapshot store) differs between modes"
        )


__all__.append("check_compatible")


def resolve_checkpoint_dir(where: Any, *, error: type = FileNotFoundError) -> tuple[Path, Path, Optional[int]]:
    """``(run_dir, checkpoints_dir, step or None = latest)``: the one place a checkpoint dir is
    resolved (the run context, ``jax-rl eval``, ``jax-rl export``, the learner's default).

    Args:
        where: a run config (``checkpoint.dir``, else ``run.dir/checkpoints``; the step is
            ``resume_step``), or a path given by the user: a run dir, its ``checkpoints/`` dir, or
            one step's dir ``checkpoints/N``.
        error: the exception class raised (a CLI passes its one-line error type).

    Raises:
        error: a config with neither ``checkpoint.dir`` nor ``run.dir``; a path with no
            checkpoint dir, a checkpoint dir with no step dir, or a step dir that does not exist.
    """
    if hasattr(where, "checkpoint") and hasattr(where, "run"):  # a Config (duck-typed: no import of config)
        ck, rd = where.checkpoint.dir, where.run.dir
        if not (ck or rd):
            raise error("no checkpoint dir: pass ckpt_dir or set checkpoint.dir / run.dir")
        ckpt = Path(ck) if ck else Path(rd) / "checkpoints"
        return (Path(rd) if rd else ckpt.parent), ckpt, where.resume_step
    p = Path(where)
    step = None
    if p.name.isdigit() and p.parent.name == "checkpoints":
        p, step = p.parent, int(p.name)
    ckpt = p / "checkpoints" if (p / "checkpoints").is_dir() else p
    if not ckpt.is_dir():
        what = "does not exist" if not p.exists() else "is not a directory" if not p.is_dir() else "has no checkpoints"
        raise error(f"no checkpoints at {str(where)!r}: it {what} (give a run dir, its checkpoints/ or a step "
                    "dir checkpoints/N)")
    if step is not None and not (ckpt / str(step)).is_dir():
        raise error(f"no checkpoint step dir {ckpt / str(step)}")
    if step is None and not any(c.name.isdigit() and c.is_dir() for c in ckpt.iterdir()):
        # refused before a checkpoint manager is opened there (Orbax scans a dir it manages for its
        # temporary paths in a background thread: not something to do to an arbitrary directory)
        raise error(f"no checkpoints at {str(where)!r}: {ckpt} holds no step dir (checkpoints/N); give a run "
                    "dir that has saved a checkpoint, its checkpoints/ or a step dir checkpoints/N")
    return ckpt.parent, ckpt, step


__all__.append("resolve_checkpoint_dir")


# --------------------------------------------------------------------------------------
# Train-state tree I/O
# --------------------------------------------------------------------------------------

STATE_KEYS = ("params", "opt_state", "version", "step", "rng")


def _key_name(k: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def to_nested(tree: Any) -> dict:
    """Tree -> nested dict with string keys (Orbax-friendly, readable on disk)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    out: dict = {}
    for path, leaf in flat:
        node = out
        keys = [_key_name(k) for k in path] or ["value"]
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = leaf
    return out


def from_nested(nested: dict, like: Any) -> Any:
    """Inverse of :func:`to_nested` onto the structure of ``like``."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(like)
    leaves = []
    for path, _ in flat:
        node = nested
        for k in [_key_name(k) for k in path] or ["value"]:
            node = node[k]
        leaves.append(node)
    return jax.tree.unflatten(treedef, leaves)


def _core(state: Any) -> dict:
    return {k: getattr(state, k) for k in STATE_KEYS}


def train_state_items(state: Any, strategy: Any, snapshots: Optional[dict] = None) -> dict[str, Any]:
    """Checkpoint items of a TrainState: ``state`` (:data:`STATE_KEYS`), the correction
    strategy's items and ``snapshots`` (``{"v<n>": params}``, when given and not empty)."""
    items = {"state": to_nested(_core(state))}
    items.update({k: to_nested(v) for k, v in strategy.checkpoint_items(state.correction).items()})
    if snapshots:
        items["snapshots"] = {k: to_nested(v) for k, v in snapshots.items()}
    return items


def restore_train_state(ck: Checkpointer, step: int, state: Any, shardings: Any, strategy: Any,
                        snapshot_versions: list[int]) -> tuple[Any, Optional[dict]]:
    """Restore ``step`` onto the structure and shardings of ``state`` (any mesh).

    Returns:
        ``(TrainState, snapshots)``; snapshots is ``{"v<n>": params}`` or None.
    """
    target = {"state": to_nested(abstract_like(_core(state), _core(shardings)))}
    mine = strategy.checkpoint_items(state.correction)
    mine_sh = strategy.checkpoint_items(shardings.correction)
    for name, tree in mine.items():
        target[name] = to_nested(abstract_like(tree, mine_sh[name]))
    if snapshot_versions:
        one = to_nested(abstract_like(state.params, shardings.params))
        target["snapshots"] = {f"v{v}": one for v in snapshot_versions}
    out = ck.restore(step, **target)
    new = state.replace(**from_nested(out["state"], _core(state)))
    if mine:
        got = {name: from_nested(out[name], tree) for name, tree in mine.items()}
        new = new.replace(correction=strategy.from_checkpoint_items(got, state.correction))
    snaps = None
    if snapshot_versions:
        snaps = {k: from_nested(v, state.params) for k, v in out["snapshots"].items()}
    return new, snaps
