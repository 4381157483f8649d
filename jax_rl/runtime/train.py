"""``jax-rl train`` / ``sft`` / ``eval``: the main job.

``run_train(cfg)``:

1. resolve ``run.dir``, write ``config.yaml``;
2. build tokenizer, model config, mesh and :class:`~jax_rl.learner.learner.Learner` (from
   ``model.checkpoint`` or from scratch with ``run.seed``);
3. SFT warm start for ``sft.steps`` on reference-solver demonstrations, then a held-out eval
   (``sft_success``);
4. asynchronous RL for ``run.steps`` learner steps, publishing one version per step, with periodic
   eval and checkpoints: the one loop :func:`jax_rl.runtime.loop.run_rl`, fed by the embedded
   producer (rollout threads, :mod:`jax_rl.runtime.embedded`) or by Ray dispatch
   (:mod:`jax_rl.runtime.ray_runtime`);
5. final eval, ``summary.json``, plots, a one-screen summary (also in :func:`~jax_rl.runtime.loop.run_rl`).

The pieces of the run (config, dirs, tokenizer, learner, SFT, eval, checkpoints) are held by
:class:`jax_rl.runtime.context.RunContext`.

Ctrl-C / SIGTERM finish the current step, save a checkpoint and stop rollouts cleanly; the
process then exits with 128 + the signal number (130 / 143), as schedulers expect.

``resume=true`` continues from the newest restorable checkpoint in ``run.dir`` (a partial or
corrupt newer step is reported in one line and skipped), or from ``resume_step``, with the
buffer, at exactly the RL step that checkpoint recorded. Nothing in the run dir changes until
the restore and every compatibility check have passed; then ``config.yaml`` is rewritten,
``metrics.jsonl`` / ``eval.jsonl`` rows after the restored step are dropped, TensorBoard purges
them (``purge_step``), and checkpoints newer than the restored step are deleted.
"""

from __future__ import annotations

import json
import logging
import sys
import tempfile

from jax_rl.checkpoint import resolve_checkpoint_dir
from jax_rl.config import Config, ConfigError, load_config
from jax_rl.learner.advantages import check_group_size
from jax_rl.model_builder import adopt_checkpoint_layer_layout
from jax_rl.runtime.context import (TIMING_KEYS, RunContext, StopFlag, drop_newer_checkpoints, raise_if_disk_full,
                                    resume_rl_step, signal_exit_code)
from jax_rl.runtime.embedded import EmbeddedProducer
from jax_rl.runtime.loop import RunStart, finished_run_line, run_rl, sft_line
from jax_rl.runtime.run_dir import lock_run_dir, multiprocess_start, resolve_run_dir, unlock_run_dir
from rollout.types import json_safe

log = logging.getLogger("jax_rl.runtime")

__all__ = ["run_train", "run_sft", "run_eval", "TIMING_KEYS"]


def run_train(cfg: Config) -> int:
    """The whole job (SFT, RL, eval, outputs).

    Returns:
        the process exit code: 0 when done; 1 when the rollout failed systematically (checkpoint,
        metrics and summary written, ``rollout_failed`` in the summary); 128 + signal number (130
        Ctrl-C, 143 SIGTERM) when stopped by a signal, after the checkpoint at the last finished
        step is committed.

    Raises:
        ConfigError; FileNotFoundError / CheckpointMismatchError / CheckpointCorruptError (a
        refused resume: nothing in the run dir has changed); CheckpointDiskFullError (one line
        naming the run dir and the bytes needed; the last good checkpoint is intact).
    """
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        check_group_size(cfg.algo)  # (the CLI refused it already: here for a run_train called directly)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    with _holding_run_dir(cfg, "train"):
        return _run_train(cfg)


class _holding_run_dir:
    """``with``: this process holds the run dir's lock (:func:`~jax_rl.runtime.run_dir.lock_run_dir`) from
    here to the end of the command, before anything reads or deletes the earlier run in it. A dir that does
    not exist yet (a fresh run) and a multi-process run are locked by :meth:`RunContext.hold` just before
    they are written. Raises RunDirHeldError (one line, exit 2) when another process holds it."""

    def __init__(self, cfg: Config, command: str):
        self.cfg, self.command = cfg, command

    def __enter__(self):
        self.dir = resolve_run_dir(self.cfg, create=False)
        if self.dir.is_dir() and not multiprocess_start(self.cfg.runtime):
            lock_run_dir(self.dir, command=self.command, what=RunContext.lock_what(self.cfg))
        return self

    def __exit__(self, *exc):
        unlock_run_dir(self.dir)
        return False


def _run_train(cfg: Config) -> int:
    resolve_run_dir(cfg, create=False, check_fresh=True)
    if cfg.runtime.kind == "ray":
        from jax_rl.runtime.ray_runtime import run_train_ray  # lazy: Ray (the embedded runtime runs without it)

        return run_train_ray(cfg)
    # start-of-run lines (a config where no prompt fits ends here); the run dir is created by
    # materialize() once every check (resume included) has passed
    stop = StopFlag()
    stop.install()  # before the tokenizer training and the model build: a signal there stops before anything is written
    try:
        ctx = RunContext(cfg, create_dir=False, preflight=True)
    except BaseException:
        stop.restore()
        raise
    start_step = 0
    failed = True
    try:
        if stop.event.is_set():
            failed = False
            return _stopped_before_start(stop)
        if cfg.resume:
            start_step = ctx.resume()  # every check; raises before anything is written
            done = finished_run_line(cfg, resolve_run_dir(cfg, create=False), start_step)
            if done:  # nothing to train, evaluate or write: that line alone
                print(done, flush=True)
                failed = False
                return 0
            print(ctx.resume_line, flush=True)
        ctx.hold("train")
        ctx.materialize()
        if cfg.resume:
            drop_newer_checkpoints(ctx.learner, ctx.ckpt_dir, ctx.resumed_step)
        ctx.open_writer(resume_step=start_step if cfg.resume else None)
        if not ctx.meta.get("sft_done"):
            ev = ctx.sft_and_eval(stop=stop.event)
            if ev is None or stop.event.is_set():  # a signal in SFT or its eval: checkpoint and stop there
                failed = False
                return ctx.stopped_in_sft(stop)
            print(sft_line(cfg, ev))
        producer = EmbeddedProducer(ctx, ctx.meta)
        rc = run_rl(cfg, ctx, producer, ctx.writer, stop,
                    RunStart(start_step=start_step, pad_id=ctx.tokenizer.pad_id,
                             sft_success=ctx.meta.get("sft_success"), run_dir=ctx.run_dir, ckpt_dir=ctx.ckpt_dir,
                             t0=ctx.t0))
        failed = False
        return rc
    except Exception as e:
        raise_if_disk_full(e, ctx.run_dir, ctx.ckpt_dir, ctx.learner)
        raise
    finally:
        ctx.close()
        try:
            ctx.learner.close()  # waits for a save in flight
        except Exception as e:
            if not failed:
                raise_if_disk_full(e, ctx.run_dir, ctx.ckpt_dir, ctx.learner)
                raise
            log.debug("while stopping a failed run: %r", e)  # the first error is the one reported
        stop.restore()


def _stopped_before_start(stop: StopFlag) -> int:
    print(f"stopped by signal {stop.signum} while starting (tokenizer, model): nothing was written", flush=True)
    return signal_exit_code(stop)


def run_sft(cfg: Config) -> int:
    """``jax-rl sft``: SFT only, then a held-out eval and a checkpoint."""
    logging.basicConfig(level=logging.WARNING)
    if cfg.sft.steps <= 0:
        raise ConfigError("sft.steps must be > 0 for `jax-rl sft`")
    if cfg.resume:  # SFT from scratch into the run dir asked to be continued would overwrite its checkpoint
        raise ConfigError("resume=true: `jax-rl sft` does not resume (it starts SFT from scratch); `jax-rl train "
                          "--resume` continues a train run, --overwrite starts this SFT over in the same run.dir")
    with _holding_run_dir(cfg, "sft"):
        return _run_sft(cfg)


def _run_sft(cfg: Config) -> int:
    resolve_run_dir(cfg, create=False, check_fresh=True, resumable=False)
    if cfg.runtime.kind != "embedded":  # no rollout: nothing for Ray to run
        log.warning("runtime=%s: `jax-rl sft` runs SFT and its eval in this process; runtime.* applies to "
                    "`jax-rl train`", cfg.runtime.kind)
    stop = StopFlag()
    stop.install()
    try:
        return _sft_stoppable(cfg, stop)
    finally:
        stop.restore()


def _sft_stoppable(cfg: Config, stop: StopFlag) -> int:
    ctx = RunContext(cfg, create_dir=False)
    if stop.event.is_set():
        ctx.learner.close()
        return _stopped_before_start(stop)
    ctx.hold("sft")
    ctx.materialize()
    ctx.open_writer()
    try:
        ev = ctx.sft_and_eval(stop=stop.event)
        if ev is None or stop.event.is_set():
            return ctx.stopped_in_sft(stop, command="sft")
        ctx.save(0, wait=True)
        out = json_safe({"sft_success": ev["success"], "sft_loss": ctx.meta["sft_metrics"].get("sft_loss"),
                         "checkpoints": str(ctx.ckpt_dir)}, default=str)
        (ctx.run_dir / "summary.json").write_text(json.dumps(out, indent=2))
        print(json.dumps(out, indent=2))
        return 0
    finally:
        ctx.close()
        ctx.learner.close()


# Sections a checkpoint's train state depends on: ``jax-rl eval`` takes them from the run's own
# config.yaml, so any CONFIG (e.g. the default tiny_cpu.yaml) can evaluate any run.
_STATE_SECTIONS = ("model", "loss", "old_logits", "async_")


def run_eval(cfg: Config, checkpoint_dir: str) -> int:
    """``jax-rl eval CHECKPOINT_DIR CONFIG``: restore and print held-out avg@k / pass@k.

    ``CHECKPOINT_DIR`` is a run dir, its ``checkpoints/`` dir, or one step's dir
    (``checkpoints/300``). When the run dir has a ``config.yaml``, the model, correction mode,
    old-logit and staleness settings come from it (the eval and env settings from ``CONFIG``), and a
    ``bpe`` run uses its saved ``tokenizer.json``. The decoder layers are built in the layout the
    checkpoint was saved in (``model.scan_layers`` adopted from it, with a warning, when they differ).

    Raises:
        FileNotFoundError: no checkpoint at ``checkpoint_dir`` (the CLI: one line naming it, exit 2).
    """
    logging.basicConfig(level=logging.WARNING)
    _, ckpt, step = resolve_checkpoint_dir(checkpoint_dir)  # FileNotFoundError: one line naming it, exit 2
    saved = ckpt.parent / "config.yaml"
    if saved.is_file():
        run_cfg = load_config(saved)
        for sec in _STATE_SECTIONS:
            if getattr(cfg, sec) != getattr(run_cfg, sec):
                log.warning("eval: using %s from %s (the checkpoint's), not from the given config", sec.rstrip("_"), saved)
                setattr(cfg, sec, getattr(run_cfg, sec))
        if cfg.model.tokenizer == "bpe" and (ckpt.parent / "tokenizer.json").is_file():
            cfg.model.tokenizer = str(ckpt.parent / "tokenizer.json")
    note = adopt_checkpoint_layer_layout(cfg, ckpt, step)  # either layout evaluates the same
    if note:
        log.warning("eval: %s", note)
    cfg.run.dir = str(ckpt.parent)
    cfg.resume_step = None
    cfg.resume = False
    # a reader writes nothing in the run dir (maybe a live run's): a disk snapshot store goes to a scratch dir
    scratch = tempfile.TemporaryDirectory(prefix="jxrl-eval-")
    cfg.old_logits.dir = scratch.name
    try:
        _eval_restored(cfg, ckpt, step)
    finally:
        scratch.cleanup()
    return 0


def _eval_restored(cfg: Config, ckpt, step) -> None:
    ctx = RunContext(cfg, create_dir=False)
    try:
        meta = ctx.learner.checkpoints.restore(ckpt, step=step, read_only=True)
        print(f"evaluating {ckpt / str(meta['checkpoint_step'])} (RL step {resume_rl_step(meta)}, "
              f"version {ctx.learner.version})", file=sys.stderr, flush=True)
        ev = ctx.evaluate(resume_rl_step(meta), label="standalone")
        print(json.dumps(json_safe(ev, default=str), indent=2))
    finally:
        ctx.close()
        ctx.learner.close()
