"""``runtime=ray``: rollout-worker actors, a learner actor and the buffer as an actor.

* ``runtime.ray_workers`` ``RolloutWorker`` actors, each with its own engine, generator and
  agent loop. Each runs whole GRPO groups (``run_group``) and returns them as
  :class:`rollout.types.Trajectory` objects (numpy arrays through Ray's object store).
* one ``LearnerActor`` holding the :class:`~jax_rl.learner.learner.Learner` (multi-host learners use
  ``runtime.coordinator`` / ``jax.distributed`` inside it).
* one ``BufferActor`` wrapping :class:`rollout.buffer.TrajectoryBuffer`.

The driver dispatches groups (after buffer admission), collects results with ``ray.wait``, and
after each learner step puts the new params into the object store **once** and hands the same
ObjectRef to every worker. If a worker dies, it is replaced and its in-flight groups are re-issued
(counted in ``reissued_groups``); results are de-duplicated by group id, so no group is trained
twice. Every ``checkpoint.every`` steps (and at the end, or on SIGTERM/Ctrl-C) the learner saves
its state with the buffer, the next group id and the groups still in flight; ``--resume`` restores
them and re-issues those groups. Ray runs with ``RAY_AUTH_MODE=disabled``, no dashboard, and its
temp dir under the run dir.

The pieces: :mod:`jax_rl.runtime.ray_cluster` (start / join Ray, the endpoint checks, the daemon
watch), :mod:`jax_rl.runtime.ray_actors` (the three actor classes), :mod:`jax_rl.runtime.ray_producer`
(the producer and the learner handle the loop drives); this module is the driver
(:func:`run_train_ray`). Ray is an optional dependency (the ``[ray]`` extra), imported inside the
functions that use it.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Optional

from jax_rl.checkpoint import resolve_checkpoint_dir
from jax_rl.config import Config
from jax_rl.metrics import MetricsWriter
from jax_rl.model_builder import build_model_config
from jax_rl.affinity import pin_process
from jax_rl.runtime.context import StopFlag, raise_if_disk_full, signal_exit_code, start_of_run_lines
from jax_rl.runtime.envs import build_env_factory, build_tokenizer
from jax_rl.runtime.loop import RunStart, finished_run_line, run_rl, sft_line
from jax_rl.runtime.ray_actors import actor_classes, jax_tree_to_host
from jax_rl.runtime.ray_cluster import (RayDaemonWatch, RayFailure, check_ray_endpoints, init_ray, ray_get,
                                        reclaim_signals)
from jax_rl.runtime.ray_producer import RayProducer, RemoteLearner
from jax_rl.runtime.run_dir import delete_earlier_run, lock_run_dir, resolve_run_dir, unlock_run_dir

log = logging.getLogger("jax_rl.runtime")

__all__ = ["run_train_ray", "init_ray", "check_ray_endpoints", "RayDaemonWatch", "RayProducer", "RemoteLearner",
           "RayFailure", "actor_classes", "jax_tree_to_host"]


def _check_before_run_dir(cfg: Config) -> None:
    """Everything that can refuse the run in one line before its run dir and Ray exist: the Ray endpoints, the
    env, tokenizer and model config (the actors build them again), and a cluster to join that does not answer;
    prints the start-of-run lines."""
    if cfg.rollout.threads != 1:
        log.warning("rollout.threads=%d is the embedded runtime's engine count; runtime=ray runs "
                    "runtime.ray_workers=%d rollout-worker actors (one engine each) and ignores it",
                    cfg.rollout.threads, cfg.runtime.ray_workers)
    check_ray_endpoints(cfg.runtime)  # an address that does not answer: one line, before anything exists
    # the actors build these again; building them here first refuses a bad env, tokenizer or
    # checkpoint (and a config where no prompt fits) in one line before the run dir and Ray exist
    env_factory = build_env_factory(cfg)
    tokenizer = build_tokenizer(cfg, env_factory)
    build_model_config(cfg, tokenizer)
    start_of_run_lines(cfg, tokenizer, env_factory)
    if cfg.runtime.ray_address is not None:  # joining a cluster: one that does not answer fails before the run dir
        init_ray(None, runtime=cfg.runtime)


def _take_run_dir(cfg: Config) -> tuple[Path, Path, bool]:
    """``(run dir, checkpoint dir, fresh)``: the run dir made and locked by the driver for the whole run, an
    earlier run's files deleted on ``run.overwrite``; ``fresh``: no run dir existed before."""
    fresh = not resolve_run_dir(cfg, create=False).exists()
    run_dir = resolve_run_dir(cfg)
    # the driver holds the run dir (it lives for the whole run; the actors never lock it), before the
    # earlier run's files go (the caller took it already when the dir existed: this is idempotent)
    lock_run_dir(run_dir, command="train", what="--resume" if cfg.resume else "--overwrite" if cfg.run.overwrite
                 else "a new run in it")
    delete_earlier_run(cfg, run_dir)  # run.overwrite (a fresh run only)
    _, ckpt_dir, _ = resolve_checkpoint_dir(cfg)
    return run_dir, ckpt_dir, fresh


def _start_ray(cfg: Config, run_dir: Path, fresh: bool, stop: StopFlag) -> None:
    """Start (or join) Ray with its temp dir under ``run_dir``. Raises :class:`RayFailure` when it does not
    start, after restoring the signal handlers and, for a ``fresh`` run, removing the run dir and Ray's temp
    dir (nothing of the run is left behind)."""
    try:
        init_ray(run_dir, runtime=cfg.runtime)
    except RayFailure:
        stop.restore()
        if fresh:  # nothing of the run exists yet: leave no run dir (nor Ray's temp dir) behind
            link = run_dir / "ray_tmp"
            if link.is_symlink():
                shutil.rmtree(link.resolve(), ignore_errors=True)
            unlock_run_dir(run_dir)
            shutil.rmtree(run_dir, ignore_errors=True)
        raise


def _drive(cfg: Config, actor, worker_classes: tuple, stop: StopFlag, run_dir: Path, ckpt_dir: Path, t0: float,
           opened: list) -> int:
    """The run through the learner ``actor``: restore on ``--resume`` (a finished run ends here), SFT and its
    eval, then :func:`run_rl` with a :class:`RayProducer` of ``worker_classes`` (RolloutWorker, BufferActor).
    The metrics writer it opens goes into ``opened`` (the caller closes it). Returns the exit code."""
    import ray

    hf = ray_get(actor.model_config_hf.remote())
    print(ray_get(actor.describe.remote()), flush=True)  # what the correction mode costs, as embedded
    pad_id = ray.get(actor.pad_id.remote())
    meta: dict = {}
    if cfg.resume:
        meta = ray_get(actor.restore.remote())  # one-line errors; nothing written yet
    start_step = int(meta.get("rl_steps", 0))
    done = finished_run_line(cfg, run_dir, start_step) if cfg.resume else None
    if done:  # nothing to train, evaluate or write: that line alone
        print(done, flush=True)
        return 0
    if cfg.resume:
        print(meta.pop("resume_line"), flush=True)
    ray_get(actor.materialize.remote(meta.pop("resumed_step", None)))
    writer = MetricsWriter(run_dir, tensorboard=cfg.logging.tensorboard, wandb=cfg.logging.wandb,
                           resume_step=start_step if cfg.resume else None)
    opened.append(writer)
    if meta.get("sft_done"):
        sft_eval = dict(meta.get("sft_eval") or {"success": meta.get("sft_success")})
    else:
        sft_eval = _sft_in_parts(cfg, actor, stop, int(meta.get("sft_steps_done", 0)))
        if sft_eval is None:  # a signal in SFT: its checkpoint (RL step 0, SFT's progress), then stop
            return _stopped_in_sft(cfg, actor, stop, ckpt_dir)
        print(sft_line(cfg, sft_eval), flush=True)
    producer = RayProducer(cfg, actor, hf, meta, actor_classes=worker_classes)
    producer.stop_event = stop.event  # a SIGTERM while the workers compile does not wait for them
    return run_rl(cfg, RemoteLearner(actor), producer, writer, stop,
                  RunStart(start_step=start_step, pad_id=pad_id, sft_success=sft_eval.get("success"),
                           run_dir=run_dir, ckpt_dir=ckpt_dir, t0=t0))


SFT_PART = 25  # SFT steps per learner-actor call: the driver checks its signals between two


def _sft_in_parts(cfg: Config, actor, stop: StopFlag, done: int) -> Optional[dict]:
    """SFT in the learner actor, ``SFT_PART`` steps a call from step ``done``, then its eval; None when a signal
    came first (after the part in flight: at most ``SFT_PART`` steps later)."""
    finished = cfg.sft.steps <= 0
    while not finished and not stop.event.is_set():
        done, finished = ray_get(actor.sft_part.remote(done + SFT_PART))
    if stop.event.is_set():
        return None
    return ray_get(actor.eval_after_sft.remote())


def _stopped_in_sft(cfg: Config, actor, stop: StopFlag, ckpt_dir: Path) -> int:
    meta = ray_get(actor.save_meta.remote(0))
    done = int(meta.get("sft_steps_done", 0))
    what = "after SFT" if meta.get("sft_done") else f"during SFT at step {done} of {cfg.sft.steps}"
    print(f"stopped by signal {stop.signum} {what}: checkpoint {Path(ckpt_dir) / '0'} committed; --resume "
          "continues from it", flush=True)
    return signal_exit_code(stop)


def _actor_failure(e: Exception, actor, ckpt_dir: Path) -> RayFailure:
    """The one-line error of an actor that died or never started: which one (the learner, a rollout worker, or
    a Ray actor of the run when Ray does not say) and the last checkpoint."""
    steps = sorted(int(p.name) for p in Path(ckpt_dir).glob("[0-9]*") if p.is_dir() and p.name.isdigit()) \
        if Path(ckpt_dir).is_dir() else []
    last = str(Path(ckpt_dir) / str(steps[-1])) if steps else "none"
    aid = getattr(e, "actor_id", None)
    try:
        learner = None if aid is None else aid == actor._actor_id.hex()
    except Exception:  # noqa: BLE001 - a Ray without these internals: say it may be either
        learner = None
    who = {True: "the learner actor", False: "a rollout-worker actor"}.get(learner, "a Ray actor of the run")
    return RayFailure(f"runtime=ray: {who} died or could not start ({type(e).__name__}: "
                      f"{' '.join(str(e).split())[:300]}); last checkpoint: {last}")


def _shut_down(opened: list, watch: RayDaemonWatch, actor, stop: StopFlag) -> None:
    """The run's end, whatever happened: the metrics writer closed, a dead Ray daemon's line and summary, the
    learner actor closed (30 s at most), the watch stopped, Ray shut down, the signal handlers restored."""
    import ray

    for writer in opened:
        writer.close()
    d = watch.dead()
    if d is not None:  # the loop noticed first (an actor call failed): the same line and summary
        watch.fail(*d)
    try:
        ray.get(actor.close.remote(), timeout=30)
    except Exception:
        pass
    watch.stop()
    ray.shutdown()
    stop.restore()


def run_train_ray(cfg: Config) -> int:
    """RL with Ray actors: SFT, eval and training run in the learner actor; the driver runs the one
    RL loop (:func:`jax_rl.runtime.loop.run_rl`) with a :class:`RayProducer` (rollout workers, the
    buffer actor, one object-store copy of each version's params)."""
    import ray  # optional dependency (the [ray] extra): imported when runtime=ray runs

    t0 = time.perf_counter()
    _check_before_run_dir(cfg)
    run_dir, ckpt_dir, fresh = _take_run_dir(cfg)
    # config.yaml is written by the learner actor once the restore and its checks have passed
    stop = StopFlag()
    stop.install()
    _start_ray(cfg, run_dir, fresh, stop)
    reclaim_signals(stop)  # SIGTERM: finish the step, checkpoint, summary.json, exit 143 (as embedded)
    # the driver beside its learner (after Ray's daemons started, which stay unpinned)
    pin_process(cfg.runtime.learner_cpus)
    RolloutWorker, BufferActor, LearnerActor = actor_classes()
    watch = RayDaemonWatch(cfg, run_dir, ckpt_dir, t0).start()  # a dead raylet / GCS: one line + summary.json
    opened: list = []  # the metrics writer, once open
    actor = LearnerActor.remote(cfg.to_dict())
    try:
        return _drive(cfg, actor, (RolloutWorker, BufferActor), stop, run_dir, ckpt_dir, t0, opened)
    except Exception as e:
        raise_if_disk_full(e, run_dir, ckpt_dir)
        if isinstance(e, (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError)) \
                and watch.dead() is None:  # an actor died or never started (not a daemon): one line, exit 1
            raise _actor_failure(e, actor, ckpt_dir) from None
        raise
    finally:
        _shut_down(opened, watch, actor, stop)
