"""The :class:`Checkpointer` (part of :mod:`jax_rl.checkpoint`): one Orbax ``CheckpointManager`` with
separate items, its saves, restores and step checks, and :func:`restore_train_state` (the package docstring has
the items and the faults)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp

from jax_rl.checkpoint.faults import (_NOSPACE_FILTER, CheckpointCommitError, CheckpointCorruptError,
                                      CheckpointDiskFullError, CheckpointMismatchError, _cancel_unstarted_writes, _install_closed_loop_hook,
                                      _is_no_space, disk_full_error, one_line)
from jax_rl.checkpoint.trees import (RETIRED_STATE_LEAVES, _core, _host_local_to_numpy, _layers_layout_of_tree,
                                     abstract_like, from_nested, saved_layer_layout, saved_state_keys, to_nested,
                                     tree_nbytes)

log = logging.getLogger("jax_rl.checkpoint")


ITEM_NAMES = ("state", "ewma", "snapshots", "metadata")


class _ReadOnlyNote(logging.Filter):
    """Drops Orbax's warning that a read-only manager's directory is read only (what the reader asked for)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Given directory is read only")


_READ_ONLY_NOTE = _ReadOnlyNote()


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
        read_only: a reader of a dir another process may be writing (``jax-rl eval`` / ``export`` of a live
            run): Orbax's ``read_only`` manager, which creates, cleans and deletes nothing (a live writer's
            ``<step>.orbax-checkpoint-tmp`` save in flight is left alone; only committed steps are listed).
            :meth:`save` / :meth:`delete` / :meth:`delete_after` raise ``PermissionError``. A writer
            (``read_only=False``, the run-dir lock's holder) removes the uncommitted dirs a killed save left.
    """

    def __init__(self, directory: str | Path, *, every: int = 0, max_to_keep: int = 2, async_save: bool = True,
                 active_processes: Optional[set] = None, read_only: bool = False):
        self.directory = Path(directory).absolute()
        self.every = int(every)
        self.read_only = bool(read_only)
        mp = ocp.options.MultiprocessingOptions() if active_processes is None else \
            ocp.options.MultiprocessingOptions(primary_host=min(active_processes),
                                               active_processes=set(active_processes))
        if self.read_only:
            logging.getLogger("absl").addFilter(_READ_ONLY_NOTE)  # Orbax's "Given directory is read only" (idempotent)
            opts = ocp.CheckpointManagerOptions(read_only=True, create=False, max_to_keep=None, save_interval_steps=0,
                                                enable_async_checkpointing=False, cleanup_tmp_directories=False,
                                                multiprocessing_options=mp)
        else:
            opts = ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep,
                enable_async_checkpointing=async_save,
                create=active_processes is None,  # (Orbax does not create it for a subset of processes: done here)
                cleanup_tmp_directories=True,  # a save killed mid-write leaves a tmp dir, never a step
                multiprocessing_options=mp,
            )
        if active_processes is not None and not self.read_only:
            self.directory.mkdir(parents=True, exist_ok=True)
        self._in_flight: Optional[int] = None  # the step of the save started last (for a failed commit's line)
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
        self._writable("save")
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
            started = bool(self._mgr.save(step, args=ocp.args.Composite(**items), force=True))
        except Exception as e:  # also surfaces the failure of the previous async save
            if _is_no_space(e):
                raise self._disk_full(step, need) from None
            raise self._commit_failed(self._in_flight if self._in_flight is not None else step, e) from None
        self._in_flight = step
        return started

    def latest_step(self) -> Optional[int]:
        """Newest saved step (committed or in flight from this process), or None."""
        return self._mgr.latest_step()

    def all_steps(self, reload: bool = False) -> list[int]:
        """The committed steps, ascending (``reload``: listed again from the dir, e.g. one a live writer
        changes)."""
        if reload:
            self._mgr.reload()
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
        # leaves earlier versions saved and the TrainState no longer has: read beside the rest, dropped
        retired = {k: v for k, v in RETIRED_STATE_LEAVES.items()
                   if k not in state and k in saved_state_keys(self.directory, step)}
        if retired:
            rep = jax.tree.leaves(state["version"])[0].sharding
            state = {**state, **{k: jax.ShapeDtypeStruct(shape, dt, sharding=rep) for k, (shape, dt) in retired.items()}}
        items = {"state": ocp.args.StandardRestore(state), "metadata": ocp.args.JsonRestore()}
        if ewma is not None:
            items["ewma"] = ocp.args.StandardRestore(ewma)
        if snapshots:
            items["snapshots"] = ocp.args.StandardRestore(snapshots)
        out = self._mgr.restore(step, args=ocp.args.Composite(**items))
        return {
            "state": {k: v for k, v in out.state.items() if k not in retired},
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
            raise self._commit_failed(self._in_flight, e) from None
        self._in_flight = None

    def _commit_failed(self, step: Optional[int], e: BaseException) -> CheckpointCommitError:
        """The one-line error of a save that did not commit (Orbax's background write failed: e.g. its
        ``<step>.orbax-checkpoint-tmp`` dir was removed under it)."""
        self._in_flight = None
        where = self.directory / str(step) if step is not None else self.directory
        return CheckpointCommitError(f"checkpoint step {step if step is not None else '?'} did not commit in "
                                     f"{where} ({one_line(e)}); the steps committed before it are intact")

    def _writable(self, what: str) -> None:
        if self.read_only:
            raise PermissionError(f"checkpoint dir {self.directory} is open read-only: cannot {what}")

    def close(self) -> None:
        """Wait for pending saves and release Orbax's threads.

        Raises:
            CheckpointDiskFullError: as :meth:`wait`, unless that failure was already raised.
            CheckpointCommitError: as :meth:`wait`.
        """
        reported = self._disk_full_reported
        failed = False
        try:
            self.wait()
        except CheckpointDiskFullError:
            if not reported:
                raise
        except CheckpointCommitError:
            failed = True
            raise
        finally:
            try:
                self._mgr.close()
            except Exception as e:  # a failed background save is re-raised here by Orbax
                if not (_is_no_space(e) or failed):  # (the failure wait() raised, not a second line)
                    raise self._commit_failed(self._in_flight, e) from None

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
        self._writable("delete steps")
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
        """Remove Orbax's uncommitted ``<step>.orbax-checkpoint-tmp*`` dirs (primary process; a writer only)."""
        if jax.process_index() != 0 or self.read_only:
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
        self._writable("delete a step")
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
