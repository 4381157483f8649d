"""``jax-rl train`` / ``sft`` / ``eval``: the main job.

``run_train(cfg)``:

1. resolve ``run.dir``, write ``config.yaml``;
2. build tokenizer, model config, mesh and :class:`~jax_rl.learner.Learner` (from
   ``model.checkpoint`` or from scratch with ``run.seed``);
3. SFT warm start for ``sft.steps`` on reference-solver demonstrations, then a held-out eval
   (``sft_success``);
4. asynchronous RL for ``run.steps`` learner steps (embedded threads or Ray actors), publishing
   one version per step, with periodic eval and checkpoints;
5. final eval, ``summary.json``, plots, a one-screen summary.

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
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np

from jax_rl.config import Config, ConfigError, dump_config
from jax_rl.runtime import components as C

log = logging.getLogger("jax_rl.runtime")

__all__ = ["run_train", "run_sft", "run_eval", "Trainer"]

# metrics that depend on wall-clock time (excluded when comparing runs for reproducibility)
TIMING_KEYS = ("wall_s", "step_time_s", "tokens_per_s", "rollout_tokens_per_s", "wait_s", "old_logits_s", "publish_s")


class _StopFlag:
    """Set by SIGINT/SIGTERM; the learner loop finishes its step, checkpoints and exits."""

    def __init__(self):
        self.event = threading.Event()
        self.signum: Optional[int] = None
        self._old: dict = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for s in (signal.SIGINT, signal.SIGTERM):
            self._old[s] = signal.getsignal(s)
            signal.signal(s, self._handler)

    def _handler(self, signum, frame) -> None:
        if self.event.is_set():  # second Ctrl-C: give up immediately
            raise KeyboardInterrupt
        self.signum = signum
        self.event.set()
        log.warning("signal %d: finishing the current step, then checkpoint and stop", signum)

    def restore(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)


class Trainer:
    """Holds the pieces of one run; used by ``run_train``, ``run_sft`` and ``run_eval``."""

    def __init__(self, cfg: Config, *, create_dir: bool = True, preflight: bool = False):
        self.cfg = cfg
        self.t0 = time.perf_counter()
        self.run_dir = C.resolve_run_dir(cfg, create=False)
        self.ckpt_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else self.run_dir / "checkpoints"
        self.env_factory = C.build_env_factory(cfg)
        self.tokenizer = C.build_tokenizer(cfg, self.env_factory)
        self.model_config = C.build_model_config(cfg, self.tokenizer)
        from jax_rl.learner import Learner, initialize_distributed

        initialize_distributed(cfg.runtime)  # before anything asks jax about devices
        C.check_mesh(cfg)
        self.kv_cache_bytes = C.check_kv_cache(cfg, self.model_config)
        self.warnings = C.rollout_preflight(cfg, self.tokenizer, self.env_factory) if preflight else []

        mesh, init_params = None, None
        if cfg.model.checkpoint:
            init_params, mesh = _load_hf_params(cfg, self.model_config)
        self.learner = Learner(cfg, mesh=mesh, model_config=self.model_config, init_params=init_params)
        if create_dir:  # only once the config has proved buildable: a bad one leaves no run dir
            self.run_dir.mkdir(parents=True, exist_ok=True)
            if cfg.model.tokenizer == "bpe" and _is_primary():
                self.tokenizer.save(self.run_dir / "tokenizer.json")
        self.meta: dict[str, Any] = {}
        self.rollout_failed: Optional[str] = None  # set by the RL loop when the rollout fails systematically
        self.resume_line = ""
        self.resumed_step: Optional[int] = None
        self._eval_gen = None
        self.writer = None

    # ---------------------------------------------------------------- outputs
    def open_writer(self, resume_step: Optional[int] = None):
        """Open the run's :class:`~jax_rl.metrics.MetricsWriter`; ``resume_step`` drops the rows
        (JSONL and TensorBoard) of steps after it, left by the run being resumed."""
        from jax_rl.metrics import MetricsWriter

        self.writer = MetricsWriter(self.run_dir, tensorboard=self.cfg.logging.tensorboard,
                                    wandb=self.cfg.logging.wandb, is_primary=_is_primary(),
                                    resume_step=resume_step)
        return self.writer

    def materialize(self) -> None:
        """Create the run dir and write ``config.yaml`` (and a ``bpe`` run's tokenizer). Called
        only once every check (config, restore, compatibility) has passed."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if _is_primary():
            if self.cfg.model.tokenizer == "bpe" and not (self.run_dir / "tokenizer.json").is_file():
                self.tokenizer.save(self.run_dir / "tokenizer.json")
            dump_config(self.cfg, self.run_dir / "config.yaml")

    def resume(self) -> int:
        """Restore the checkpoint to resume from (validated, with fallback; see
        :meth:`jax_rl.learner.Learner.restore`), set ``self.meta`` to its runtime metadata and
        return its RL step. Writes nothing.

        Raises:
            FileNotFoundError / CheckpointMismatchError / CheckpointCorruptError (one line).
        """
        if not self.ckpt_dir.is_dir():  # (Orbax would create it: a refused resume must write nothing)
            raise FileNotFoundError(f"no checkpoint found in {self.ckpt_dir} (nothing to resume)")
        meta = self.learner.restore(self.ckpt_dir, step=self.cfg.resume_step)
        self.meta = dict(meta.get("runtime") or {})  # what _save handed in as extra_metadata
        rl_step = resume_rl_step(meta)
        self.meta["rl_steps"] = rl_step
        self.resumed_step = int(meta["checkpoint_step"])  # the step dir restored
        self.resume_line = (f"resumed from {self.ckpt_dir / str(meta['checkpoint_step'])} at RL step {rl_step} "
                            f"(version {self.learner.version}, optimizer step {self.learner.step})")
        return rl_step

    # ---------------------------------------------------------------- SFT
    def sft(self, steps: Optional[int] = None, progress: bool = True) -> dict:
        """Cross-entropy on reference-solver demos (assistant tokens only). Returns last metrics."""
        cfg = self.cfg
        steps = cfg.sft.steps if steps is None else steps
        if steps <= 0:
            return {}
        t = time.perf_counter()
        demos = C.sft_examples(cfg, self.tokenizer, self.env_factory, cfg.sft.num_demos)
        rng = np.random.default_rng(cfg.run.seed)
        last: dict = {}
        from jax_rl.console import TrainProgress

        with TrainProgress(steps, enabled=progress and cfg.logging.progress, description="SFT") as bar:
            for s in range(steps):
                idx = rng.choice(len(demos), size=cfg.sft.batch_size, replace=len(demos) < cfg.sft.batch_size)
                batch = C.pad_examples([demos[i] for i in idx], pad_id=self.tokenizer.pad_id)
                last = self.learner.sft_step(batch)
                bar.update(s + 1, {"sft_loss": last.get("sft_loss", last.get("loss", float("nan")))})
                if s % 10 == 0 or s == steps - 1:
                    self._sft_log(s + 1, last)
        self.learner.reset_proximal()  # SFT ended: the correction's state re-anchors on the SFT params
        last["sft_wall_s"] = time.perf_counter() - t
        return last

    def _sft_log(self, step: int, metrics: dict) -> None:
        from jax_rl.metrics import sanitize

        with open(self.run_dir / "sft.jsonl", "a") as f:
            f.write(json.dumps({"step": step, **sanitize(metrics)[0]}) + "\n")

    # ---------------------------------------------------------------- eval
    def evaluate(self, step: int, label: str = "eval") -> dict:
        """Held-out avg@k / pass@k on seeds ``eval.seed_offset + i`` with the current params."""
        from jax_rl.evaluation import eval_seeds, summarize_eval
        from rollout.agent import AgentLoop

        cfg = self.cfg
        t = time.perf_counter()
        params = self.learner.get_params()
        if self._eval_gen is None:
            self._eval_gen = C.build_generator(cfg, self.model_config, params, self.learner.version,
                                               temperature=cfg.eval.temperature)
        else:
            self._eval_gen.update_params(params, self.learner.version)
        seeds = eval_seeds(cfg.eval.num_tasks, cfg.eval.seed_offset)
        agent = AgentLoop(self._eval_gen, self.tokenizer, self.env_factory, cfg.rollout,
                          max_workers=max(cfg.rollout.slots, cfg.eval.k))
        try:
            groups = agent.run_groups(seeds, group_size=cfg.eval.k, first_group_id=10**9)
        finally:
            agent.close()
        results = [
            {"env": g[0].env if g else cfg.env.name, "task_seed": int(s), "rewards": [float(x.reward) for x in g]}
            for s, g in zip(seeds, groups)
        ]
        summary = summarize_eval(results, cfg.eval.k)
        summary["success"] = float(np.mean([r for res in results for r in res["rewards"]])) if results else 0.0
        summary["eval_s"] = time.perf_counter() - t
        summary["label"] = label
        summary["version"] = self.learner.version
        if self.writer is not None:
            self.writer.write_eval(step, summary)
        return summary

    def close(self) -> None:
        if self._eval_gen is not None:
            self._eval_gen.stop()
            self._eval_gen = None
        if self.writer is not None:
            self.writer.close()


def _load_hf_params(cfg: Config, model_config):
    """Params of ``model.checkpoint`` read tensor by tensor into their sharded layout."""
    import jax.numpy as jnp
    from flax import nnx

    from jax_rl.models.hf_io import CheckpointError, load_pretrained
    from jax_rl.model_builder import resolve_mesh

    mesh = resolve_mesh(cfg)
    try:
        model, _ = load_pretrained(cfg.model.checkpoint, dtype=jnp.float32, mesh=mesh, config=model_config)
    except CheckpointError as e:  # e.g. a tensor's bytes do not match its header
        raise ConfigError(f"model.checkpoint={cfg.model.checkpoint!r}: {e}") from None
    return nnx.state(model, nnx.Param), mesh


def _is_primary() -> bool:
    import jax

    return jax.process_index() == 0


def _rl_loop(tr: Trainer, start_step: int, stop: _StopFlag) -> dict:
    """The embedded asynchronous RL loop. Returns the last metrics row."""
    from jax_rl.console import TrainProgress
    from rollout.agent import AgentLoop
    from rollout.buffer import TrajectoryBuffer
    from jax_rl.runtime.embedded import RolloutManager

    cfg = tr.cfg
    K = cfg.async_.max_staleness
    n_groups = cfg.optim.batch_size // cfg.rollout.group_size
    buffer = TrajectoryBuffer(cfg.rollout.group_size, K, groups_per_step=n_groups, max_seq_len=cfg.optim.max_seq_len)
    if tr.meta.get("buffer"):
        buffer.import_state(tr.meta["buffer"])
    params = tr.learner.get_params()
    gens = [C.build_generator(cfg, tr.model_config, params, tr.learner.version) for _ in range(cfg.rollout.threads)]
    agents = [AgentLoop(g, tr.tokenizer, tr.env_factory, cfg.rollout) for g in gens]
    published = {"version": tr.learner.version}
    prod = tr.meta.get("producer", {})
    mgr = RolloutManager(cfg, gens, agents, buffer, lambda: published["version"],
                         next_group=prod.get("next_group", 0), reissue=prod.get("reissue"),
                         episode_errors=prod.get("episode_errors", 0))
    mgr.start()
    last: dict = {}
    ckpt_every = cfg.checkpoint.every
    eval_every = cfg.eval.every
    try:
        with TrainProgress(cfg.run.steps, enabled=cfg.logging.progress) as bar:
            for step in range(start_step, cfg.run.steps):
                if stop.event.is_set():
                    break
                t_wait = time.perf_counter()
                groups = None
                while groups is None and not stop.event.is_set():
                    groups = buffer.get_batch(n_groups, tr.learner.version, timeout=1.0)
                    if mgr.fatal and groups is None:  # one bad episode is dropped; a failing rollout stops
                        tr.rollout_failed = mgr.fatal
                        break
                if groups is None:
                    break
                wait_s = time.perf_counter() - t_wait
                groups, trajs, batch = C.learner_batch(cfg, groups, tr.tokenizer.pad_id)
                v_train = tr.learner.version
                metrics = tr.learner.train_step(batch)
                t_pub = time.perf_counter()
                new_params = tr.learner.get_params()
                for g in gens:
                    g.update_params(new_params, tr.learner.version)
                published["version"] = tr.learner.version
                buffer.notify()
                row = C.step_row(cfg, step + 1, tr.learner.version, metrics, batch, groups, trajs, v_train)
                bstats = buffer.stats()
                row.update({
                    "episode_errors": mgr.episode_errors,
                    "dropped_overlong": bstats["dropped_overlong"],
                    "rollout_tokens_per_s": mgr.rollout_tokens_per_s(),
                    "wait_s": wait_s,
                    "publish_s": time.perf_counter() - t_pub,
                    **{f"buffer/{k}": v for k, v in bstats.items()},
                    "wall_s": time.perf_counter() - tr.t0,
                })
                tr.writer.write(step + 1, row)
                last = row
                bar.update(step + 1, row)
                if eval_every and (step + 1) % eval_every == 0 and step + 1 < cfg.run.steps:
                    ev = tr.evaluate(step + 1)
                    print(f"eval @ step {step + 1}: held-out success {ev['success']:.3f}", flush=True)
                if ckpt_every and (step + 1) % ckpt_every == 0:
                    _save(tr, buffer, mgr, rl_step=step + 1)
    finally:
        mgr.stop(timeout=5.0)
        tr.meta["buffer_stats"] = buffer.stats()
        tr.meta["buffer"] = buffer.export_state()
        tr.meta["producer"] = mgr.state()
        tr.meta["rollout_tokens_per_s"] = mgr.rollout_tokens_per_s()
        tr.meta["episode_errors"] = mgr.episode_errors
    return last


def _save(tr: Trainer, buffer=None, mgr=None, *, rl_step: int) -> None:
    """Checkpoint at ``rl_step`` (the step dir's name and the metadata's ``rl_step``), after
    flushing TensorBoard so every row up to ``rl_step`` is on disk before the checkpoint is."""
    if buffer is not None:
        tr.meta["buffer"] = buffer.export_state()
        tr.meta["buffer_stats"] = buffer.stats()
    if mgr is not None:
        tr.meta["producer"] = mgr.state()
    tr.meta["rl_steps"] = int(rl_step)
    if tr.writer is not None:
        tr.writer.flush()
    tr.learner.save(tr.ckpt_dir, extra_metadata=_json_safe(tr.meta), rl_step=int(rl_step))


def resume_rl_step(meta: dict) -> int:
    """The RL step a checkpoint's metadata records (``rl_step``). Checkpoints written before it
    was recorded: their version (one published version per RL step), with a warning."""
    if "rl_step" in meta:
        return int(meta["rl_step"])
    log.warning("checkpoint has no rl_step (written by an older jax-rl); resuming at RL step = version %s",
                meta.get("version"))
    return int(meta["version"])


def drop_newer_checkpoints(learner, ckpt_dir: Path, restored_step: int) -> None:
    """Once a resume has passed every check: delete the checkpoints newer than the restored one
    (a corrupt step, or the future of an explicit ``resume_step``), each named on one line, so a
    later ``--resume`` can never pick a step from the abandoned timeline."""
    for s in learner.delete_checkpoints_after(restored_step, ckpt_dir):
        print(f"removed checkpoint {Path(ckpt_dir) / str(s)} (newer than the restored step {restored_step})",
              flush=True)


def _json_safe(d: Any) -> Any:
    return json.loads(json.dumps(d, default=lambda o: o.item() if hasattr(o, "item") else str(o)))


def run_train(cfg: Config) -> int:
    """The whole job (SFT, RL, eval, outputs).

    Returns:
        the process exit code: 0 when done; 128 + signal number (130 Ctrl-C, 143 SIGTERM) when
        stopped by a signal, after the checkpoint at the last finished step is committed.

    Raises:
        ConfigError; FileNotFoundError / CheckpointMismatchError / CheckpointCorruptError (a
        refused resume: nothing in the run dir has changed); CheckpointDiskFullError (one line
        naming the run dir and the bytes needed; the last good checkpoint is intact).
    """
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    C.resolve_run_dir(cfg, create=False, check_fresh=True)
    if cfg.runtime.kind == "ray":
        from jax_rl.runtime.ray_runtime import run_train_ray

        # the actors build these again; building them here first refuses a bad env, tokenizer or
        # checkpoint in one line before the run dir and Ray exist
        env_factory = C.build_env_factory(cfg)
        C.build_model_config(cfg, C.build_tokenizer(cfg, env_factory))

        return run_train_ray(cfg)
    # start-of-run warnings (a config where no prompt fits ends here); the run dir is created by
    # materialize() once every check (resume included) has passed
    tr = Trainer(cfg, create_dir=False, preflight=True)
    stop = _StopFlag()
    stop.install()
    start_step = 0
    failed = True
    try:
        if cfg.resume:
            start_step = tr.resume()  # every check; raises before anything is written
            print(tr.resume_line, flush=True)
        tr.materialize()
        if cfg.resume:
            drop_newer_checkpoints(tr.learner, tr.ckpt_dir, tr.resumed_step)
        tr.open_writer(resume_step=start_step if cfg.resume else None)
        if not tr.meta.get("sft_done"):
            if cfg.sft.steps > 0:
                sft_metrics = tr.sft()
                tr.meta["sft_metrics"] = sft_metrics
            tr.meta["sft_done"] = True  # tr.sft() ended with learner.reset_proximal()
            ev = tr.evaluate(0, label="after_sft")
            tr.meta["sft_success"] = ev["success"]
            tr.meta["sft_eval"] = ev
            print(f"held-out success after SFT: {ev['success']:.3f} ({cfg.eval.num_tasks} tasks x {cfg.eval.k})")
        last = _rl_loop(tr, start_step, stop)
        rl_steps = int(last.get("step", start_step))
        _save(tr, rl_step=rl_steps)
        tr.learner.wait_for_checkpoints()  # committed before we report or exit
        interrupted = stop.event.is_set()
        rollout_failed = tr.rollout_failed
        final = tr.evaluate(rl_steps, label="final") if not (interrupted or rollout_failed) else {}
        summary = {
            "sft_success": tr.meta.get("sft_success"),
            "final_success": final.get("success"),
            f"final_pass_at_{cfg.eval.k}": final.get(f"pass@{cfg.eval.k}"),
            "final_pass_at_k": final.get(f"pass@{cfg.eval.k}"),
            f"final_avg_at_{cfg.eval.k}": final.get(f"avg@{cfg.eval.k}"),
            "wall_s": time.perf_counter() - tr.t0,
            "rl_steps": rl_steps,
            "version": tr.learner.version,
            "opt_step": tr.learner.step,
            "correction": cfg.loss.correction,
            "max_staleness": cfg.async_.max_staleness,
            "interrupted": interrupted,
            "tokens_per_s_mean": _mean_metric(tr.run_dir, "tokens_per_s"),
            "rollout_tokens_per_s": tr.meta.get("rollout_tokens_per_s"),
            "episode_errors": tr.meta.get("episode_errors", 0),
            "dropped_overlong": (tr.meta.get("buffer_stats") or {}).get("dropped_overlong", 0),
            **{f"buffer_{k}": v for k, v in (tr.meta.get("buffer_stats") or {}).items()},
        }
        if rollout_failed:
            summary["rollout_failed"] = rollout_failed
        write_outputs(tr.run_dir, tr.ckpt_dir, summary)
        if rollout_failed:  # checkpoint, metrics and summary are written: fix the env/config, then --resume
            print(f"jax-rl: {rollout_failed}", file=sys.stderr)
            failed = False
            return 1
        failed = False
        return signal_exit_code(stop)
    except Exception as e:
        _raise_if_disk_full(e, tr.run_dir, tr.ckpt_dir, tr.learner)
        raise
    finally:
        tr.close()
        try:
            tr.learner.close()  # waits for a save in flight
        except Exception as e:
            if not failed:
                _raise_if_disk_full(e, tr.run_dir, tr.ckpt_dir, tr.learner)
                raise
            log.debug("while stopping a failed run: %r", e)  # the first error is the one reported
        stop.restore()


def signal_exit_code(stop: _StopFlag) -> int:
    """0, or 128 + the signal that stopped the run (130 for Ctrl-C, 143 for SIGTERM)."""
    if stop.event.is_set():
        return 128 + int(stop.signum or signal.SIGINT)
    return 0


def _raise_if_disk_full(e: BaseException, run_dir: Path, ckpt_dir: Path, learner=None) -> None:
    """A full disk, wherever it struck (a checkpoint, metrics.jsonl, TensorBoard, summary), ends
    the run with one line naming the run dir, the bytes a checkpoint needs and the last good
    checkpoint (raised as ``CheckpointDiskFullError``). Anything else: returns."""
    from jax_rl.checkpoint import CheckpointDiskFullError, disk_full_error, is_no_space, tree_nbytes

    if isinstance(e, CheckpointDiskFullError):
        raise CheckpointDiskFullError(f"run dir {run_dir}: {e}") from None
    if not is_no_space(e):
        return
    need = 0
    if learner is not None:
        st = learner.state
        need = tree_nbytes(st.params, st.opt_state, st.correction)
    what = f"{type(e).__name__} {getattr(e, 'filename', None) or ''}".strip()
    raise disk_full_error(ckpt_dir, need, f"writing failed ({what})", run_dir=run_dir) from None


def write_outputs(run_dir: Path, ckpt_dir: Path, summary: dict) -> None:
    """End of a train run (either runtime): ``summary.json``, the plots, the console summary."""
    (run_dir / "summary.json").write_text(json.dumps(_json_safe(summary), indent=2))
    try:
        from jax_rl.plots import plot_runs

        plot_runs([run_dir])
    except Exception as e:  # plotting must never lose a finished run
        log.warning("plotting failed: %r", e)
    from jax_rl.console import print_summary

    print_summary(summary, {"run dir": run_dir, "metrics": run_dir / "metrics.jsonl",
                            "eval": run_dir / "eval.jsonl", "checkpoints": ckpt_dir,
                            "plots": run_dir / "plots", "summary": run_dir / "summary.json"})


def _mean_metric(run_dir: Path, key: str) -> Optional[float]:
    from jax_rl.metrics import read_jsonl

    vals = [r[key] for r in read_jsonl(run_dir / "metrics.jsonl") if isinstance(r.get(key), (int, float))]
    return float(np.mean(vals)) if vals else None


def run_sft(cfg: Config) -> int:
    """``jax-rl sft``: SFT only, then a held-out eval and a checkpoint."""
    logging.basicConfig(level=logging.WARNING)
    if cfg.sft.steps <= 0:
        raise ConfigError("sft.steps must be > 0 for `jax-rl sft`")
    C.resolve_run_dir(cfg, create=False, check_fresh=True)
    tr = Trainer(cfg, create_dir=False)
    tr.materialize()
    tr.open_writer()
    try:
        m = tr.sft()
        ev = tr.evaluate(0, label="after_sft")
        tr.meta.update(sft_done=True, sft_success=ev["success"], sft_metrics=m)
        _save(tr, rl_step=0)
        tr.learner.wait_for_checkpoints()
        out = {"sft_success": ev["success"], "sft_loss": m.get("sft_loss"), "checkpoints": str(tr.ckpt_dir)}
        (tr.run_dir / "summary.json").write_text(json.dumps(_json_safe(out), indent=2))
        print(json.dumps(_json_safe(out), indent=2))
        return 0
    finally:
        tr.close()
        tr.learner.close()


# Sections a checkpoint's train state depends on: ``jax-rl eval`` takes them from the run's own
# config.yaml, so any CONFIG (e.g. the default tiny_cpu.yaml) can evaluate any run.
_STATE_SECTIONS = ("model", "loss", "old_logits", "async_")


def run_eval(cfg: Config, checkpoint_dir: str) -> int:
    """``jax-rl eval CHECKPOINT_DIR CONFIG``: restore and print held-out avg@k / pass@k.

    ``CHECKPOINT_DIR`` is a run dir, its ``checkpoints/`` dir, or one step's dir
    (``checkpoints/300``). When the run dir has a ``config.yaml``, the model, correction mode,
    old-logit and staleness settings come from it (the eval and env settings from ``CONFIG``), and a
    ``bpe`` run uses its saved ``tokenizer.json``.

    Raises:
        ConfigError: no such checkpoint dir.
    """
    from jax_rl.config import load_config

    logging.basicConfig(level=logging.WARNING)
    p = Path(checkpoint_dir)
    step = None
    if p.name.isdigit() and p.parent.name == "checkpoints":
        p, step = p.parent, int(p.name)
    ckpt = p / "checkpoints" if (p / "checkpoints").is_dir() else p
    if not ckpt.is_dir():
        raise ConfigError(f"no checkpoint dir at {checkpoint_dir!r} (give a run dir, its checkpoints/ or a step dir)")
    saved = ckpt.parent / "config.yaml"
    if saved.is_file():
        run_cfg = load_config(saved)
        for sec in _STATE_SECTIONS:
            if getattr(cfg, sec) != getattr(run_cfg, sec):
                log.warning("eval: using %s from %s (the checkpoint's), not from the given config", sec.rstrip("_"), saved)
                setattr(cfg, sec, getattr(run_cfg, sec))
        if cfg.model.tokenizer == "bpe" and (ckpt.parent / "tokenizer.json").is_file():
            cfg.model.tokenizer = str(ckpt.parent / "tokenizer.json")
    cfg.run.dir = str(ckpt.parent)
    cfg.resume_step = None
    cfg.resume = False
    tr = Trainer(cfg, create_dir=False)
    try:
        meta = tr.learner.restore(ckpt, step=step)
        print(f"evaluating {ckpt / str(meta['checkpoint_step'])} (RL step {resume_rl_step(meta)}, "
              f"version {tr.learner.version})", file=sys.stderr, flush=True)
        ev = tr.evaluate(resume_rl_step(meta), label="standalone")
        print(json.dumps(_json_safe(ev), indent=2))
        return 0
    finally:
        tr.close()
        tr.learner.close()
