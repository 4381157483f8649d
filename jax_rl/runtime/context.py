"""The run context: what one ``jax-rl train`` / ``sft`` / ``eval`` holds, and its helpers.

Both runtimes (the embedded one in :mod:`jax_rl.runtime.train` and the Ray one in
:mod:`jax_rl.runtime.ray_runtime`) import this module by its public names; it imports neither.

* :class:`RunContext`: config, run dir, checkpoint dir, tokenizer, model config, env factory and the
  :class:`~jax_rl.learner.learner.Learner`; SFT, held-out eval, checkpoint save / resume, the metrics writer.
  It is also the learner handle the RL loop (:mod:`jax_rl.runtime.loop`) drives in the embedded
  runtime.
* :func:`start_of_run_lines`: the one place that prints the start-of-run lines (preflight warnings).
* :class:`StopFlag`, :func:`signal_exit_code`: Ctrl-C / SIGTERM finish the step, then exit 130 / 143.
* :func:`raise_if_disk_full`: a full disk anywhere ends the run in one line.
* :func:`resume_rl_step`, :func:`drop_newer_checkpoints`.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from pathlib import Path
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jax_rl.checkpoint import CheckpointDiskFullError, disk_full_error, is_no_space, resolve_checkpoint_dir, tree_nbytes
from jax_rl.config import Config, ConfigError, dump_config
from jax_rl.console import TrainProgress
from jax_rl.evaluation import eval_seeds, summarize_eval
from jax_rl.learner.learner import Learner, initialize_distributed
from jax_rl.metrics import MetricsWriter, sanitize
from jax_rl.model_builder import build_model_config, learner_model_kwargs, resolve_mesh
from jax_rl.models.hf_io import CheckpointError, load_pretrained
from jax_rl.publish import Publisher
from jax_rl.runtime import engines
from jax_rl.runtime.envs import (build_env_factory, build_tokenizer, pad_examples, rollout_preflight, sft_examples,
                                   start_tau2_user_model)
from jax_rl.runtime.resources import check_kv_cache, check_mesh
from jax_rl.runtime.run_dir import delete_earlier_run, hold_run_dir_all, lock_run_dir, resolve_run_dir
from jax_rl.collectives import allgather_json
from rollout.agent import AgentLoop
from rollout.types import json_safe

log = logging.getLogger("jax_rl.runtime")

__all__ = ["RunContext", "StopFlag", "TIMING_KEYS", "start_of_run_lines", "signal_exit_code", "raise_if_disk_full",
           "resume_rl_step", "drop_newer_checkpoints", "is_primary"]

# metrics that depend on wall-clock time or thread timing (excluded when comparing runs for reproducibility).
# The engines' prefill work counters (the first three) are reproducible since admission is deterministic
# (rollout/admission.py; the K=0 resume test compares them); they stay here because the recorded-number
# fixtures (tests/runtime/fixtures) predate them.
TIMING_KEYS = ("prefill_tokens", "prefix_cache_hits", "episode_prefill_tokens_mean", "wall_s", "cpu_s", "step_time_s", "tokens_per_s", "rollout_tokens_per_s", "wait_s", "old_logits_s",
               "publish_s", "old_logits_scorer_s_total", "weight_sync_s", "weight_sync_cast_s", "weight_sync_s_total",
               "weight_sync_cast_s_total", "rollout_idle_frac", "old_logits_stall_s", "old_logits_publish_wait_s",
               "old_logits_stall_s_total", "old_logits_publish_wait_s_total")


def start_of_run_lines(cfg: Config, tokenizer, env_factory) -> list[str]:
    """The lines a train run prints before it starts (both runtimes call this, and only this):
    the rollout preflight warnings (:func:`~jax_rl.runtime.envs.rollout_preflight`, logged
    once each). Returns them.

    Raises:
        ConfigError: no sampled prompt fits ``rollout.max_cache_len``.
    """
    return rollout_preflight(cfg, tokenizer, env_factory)


class StopFlag:
    """Set by SIGINT/SIGTERM; the RL loop finishes its step, checkpoints and exits."""

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


def signal_exit_code(stop: StopFlag) -> int:
    """0, or 128 + the signal that stopped the run (130 for Ctrl-C, 143 for SIGTERM)."""
    if stop.event.is_set():
        return 128 + int(stop.signum or signal.SIGINT)
    return 0


class RunContext:
    """The pieces of one run; used by ``run_train``, ``run_sft``, ``run_eval``, the dry run and the
    Ray learner actor.

    Args:
        cfg: the run config.
        create_dir: create the run dir once the config has proved buildable (a bad config leaves no
            run dir). Train and SFT pass False and call :meth:`materialize` after every check.
        preflight: run :func:`start_of_run_lines` (warnings; ConfigError when no prompt fits).
    """

    def __init__(self, cfg: Config, *, create_dir: bool = True, preflight: bool = False):
        self.cfg = cfg
        self.t0 = time.perf_counter()
        self.run_dir = resolve_run_dir(cfg, create=False)
        _, self.ckpt_dir, _ = resolve_checkpoint_dir(cfg)
        self.env_factory = build_env_factory(cfg)
        self.tokenizer = build_tokenizer(cfg, self.env_factory)
        self.model_config = build_model_config(cfg, self.tokenizer)

        initialize_distributed(cfg.runtime)  # before anything asks jax about devices
        _check_processes(cfg)
        check_mesh(cfg)
        self.kv_cache_bytes = check_kv_cache(cfg, self.model_config)
        self.warnings = start_of_run_lines(cfg, self.tokenizer, self.env_factory) if preflight else []

        mesh, init_params = None, None
        if cfg.model.checkpoint:
            init_params, mesh = _load_hf_params(cfg, self.model_config)
        self.learner = Learner(cfg, mesh=mesh, model_config=self.model_config, init_params=init_params)
        # the learner's params -> the engines (both runtimes), from its params getter, mesh and the engines' dtype
        self.publisher = Publisher(self.learner.held.params, self.learner.mesh, cfg.rollout.dtype)
        # env.tau2.user=model: the user simulator's frozen model, served beside the policy (else None)
        self._user_gen = start_tau2_user_model(cfg, self.env_factory, self.tokenizer, self.model_config,
                                                 self.publisher, load_params=_load_hf_params)
        if preflight and is_primary():  # a train run: say what the correction mode costs, once
            print(self.learner.describe(), flush=True)
        if create_dir:  # only once the config has proved buildable: a bad one leaves no run dir
            self.run_dir.mkdir(parents=True, exist_ok=True)
            if cfg.model.tokenizer == "bpe" and is_primary():
                self.tokenizer.save(self.run_dir / "tokenizer.json")
        self.meta: dict[str, Any] = {}
        self.resume_line = ""
        self.resumed_step: Optional[int] = None
        self._eval_gen = None
        self.writer = None

    # ---------------------------------------------------------------- learner handle (the RL loop's)
    @property
    def version(self) -> int:
        return int(self.learner.version)

    @property
    def opt_step(self) -> int:
        return int(self.learner.step)

    def train_step(self, batch: dict, *, process_local: bool = False) -> dict:
        """One learner step; ``process_local``: ``batch`` holds this process's rows only (multi-process)."""
        return self.learner.train_step(batch, process_local=process_local)

    def save(self, rl_step: int, meta: Optional[dict] = None, *, wait: bool = False) -> None:
        """Checkpoint at ``rl_step`` (the step dir's name and the metadata's ``rl_step``) with the
        run metadata (``self.meta`` updated with ``meta``: buffer, producer state, counters), after
        flushing the metrics writer so every row up to ``rl_step`` is on disk before the checkpoint
        is. ``wait``: return once the checkpoint is committed."""
        self.meta.update(meta or {})
        self.meta["rl_steps"] = int(rl_step)
        if self.writer is not None:
            self.writer.flush()
        self.learner.checkpoints.save(self.ckpt_dir, extra_metadata=json_safe(self.meta, default=str),
                                      rl_step=int(rl_step))
        if wait:
            self.learner.checkpoints.wait()

    # ---------------------------------------------------------------- outputs
    def open_writer(self, resume_step: Optional[int] = None, *, tensorboard: Optional[bool] = None,
                    wandb: Optional[bool] = None):
        """Open the run's :class:`~jax_rl.metrics.MetricsWriter`; ``resume_step`` drops the rows
        (JSONL and TensorBoard) of steps after it, left by the run being resumed."""
        lg = self.cfg.logging
        self.writer = MetricsWriter(self.run_dir, tensorboard=lg.tensorboard if tensorboard is None else tensorboard,
                                    wandb=lg.wandb if wandb is None else wandb, is_primary=is_primary(),
                                    resume_step=resume_step)
        return self.writer

    @staticmethod
    def lock_what(cfg: Config) -> str:
        """What a refused lock refuses, for its line: ``--resume``, ``--overwrite`` or a new run."""
        return "--resume" if cfg.resume else "--overwrite" if cfg.run.overwrite else "a new run in it"

    def hold(self, command: str) -> None:
        """Take the run dir's lock before :meth:`materialize` writes (or deletes) anything: this process, or
        in a multi-process run process 0 with the others checking it
        (:func:`~jax_rl.runtime.run_dir.hold_run_dir_all`). Idempotent.

        Raises:
            RunDirHeldError: another live process holds it (nothing was changed)."""
        if jax.process_count() > 1:
            hold_run_dir_all(self.run_dir, command=command, what=self.lock_what(self.cfg),
                             process_index=jax.process_index(), gather=lambda o: allgather_json(o, what="run-dir lock"))
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        lock_run_dir(self.run_dir, command=command, what=self.lock_what(self.cfg))

    def materialize(self) -> None:
        """Create the run dir and write ``config.yaml`` (and a ``bpe`` run's tokenizer). Called
        only once every check (config, restore, compatibility) has passed; with ``run.overwrite``
        the earlier run in the dir is deleted first (:func:`~jax_rl.runtime.run_dir.delete_earlier_run`)."""
        delete_earlier_run(self.cfg, self.run_dir, primary=is_primary())
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if is_primary():
            if self.cfg.model.tokenizer == "bpe" and not (self.run_dir / "tokenizer.json").is_file():
                self.tokenizer.save(self.run_dir / "tokenizer.json")
            dump_config(self.cfg, self.run_dir / "config.yaml")

    def resume(self) -> int:
        """Restore the checkpoint to resume from (validated, with fallback; see
        :meth:`jax_rl.learner.checkpoints.LearnerCheckpoints.restore`), set ``self.meta`` to its runtime metadata and
        return its RL step. Writes nothing.

        Raises:
            FileNotFoundError / CheckpointMismatchError / CheckpointCorruptError (one line).
        """
        if not self.ckpt_dir.is_dir():  # (Orbax would create it: a refused resume must write nothing)
            raise FileNotFoundError(f"no checkpoint found in {self.ckpt_dir} (nothing to resume)")
        meta = self.learner.checkpoints.restore(self.ckpt_dir, step=self.cfg.resume_step)
        self.meta = dict(meta.get("runtime") or {})  # what save() handed in as extra_metadata
        rl_step = resume_rl_step(meta)
        self.meta["rl_steps"] = rl_step
        self.resumed_step = int(meta["checkpoint_step"])  # the step dir restored
        self.resume_line = (f"resumed from {self.ckpt_dir / str(meta['checkpoint_step'])} at RL step {rl_step} "
                            f"(version {self.learner.version}, optimizer step {self.learner.step})")
        return rl_step

    # ---------------------------------------------------------------- SFT
    def sft(self, steps: Optional[int] = None, progress: bool = True, stop: Optional[threading.Event] = None,
            until: Optional[int] = None) -> dict:
        """Cross-entropy on reference-solver demos (assistant tokens only), then the learner's
        proximal state is reset to the SFT'd params. Returns the last metrics.

        Continues from ``self.meta["sft_steps_done"]`` (a resumed SFT: the same demo batches as an
        uninterrupted one, the schedule at that step; the AdamW moments restart, they are not checkpointed).
        ``stop`` (a signal's event): set, SFT ends after the current step, ``self.meta["sft_steps_done"]``
        says where, the proximal state is not reset and the metrics get ``stopped=True``. ``until``: the same
        stop before SFT step ``until`` (the Ray driver runs SFT in parts, to check its signals in between)."""
        cfg = self.cfg
        steps = cfg.sft.steps if steps is None else steps
        if steps <= 0:
            return {}
        t = time.perf_counter()
        start = int(self.meta.get("sft_steps_done", 0))
        if getattr(self, "_sft_demos", None) is None:  # (built once: an SFT in parts builds them once)
            self._sft_demos = sft_examples(cfg, self.tokenizer, self.env_factory, cfg.sft.num_demos)
        demos = self._sft_demos
        rng = np.random.default_rng(cfg.run.seed)
        last: dict = {}
        pick = lambda: rng.choice(len(demos), size=cfg.sft.batch_size, replace=len(demos) < cfg.sft.batch_size)  # noqa: E731
        for _ in range(min(start, steps)):  # the batches the SFT before the stop trained on
            pick()
        if start:
            self.learner.set_sft_count(start)
        with TrainProgress(steps, enabled=progress and cfg.logging.progress, description="SFT") as bar:
            for s in range(start, steps):
                if (stop is not None and stop.is_set()) or (until is not None and s >= until):
                    self.meta["sft_steps_done"] = s
                    return {**last, "stopped": True, "sft_steps_done": s}
                batch = pad_examples([demos[i] for i in pick()], pad_id=self.tokenizer.pad_id)
                last = self.learner.sft_step(batch)
                bar.update(s + 1, {"sft_loss": last.get("sft_loss", last.get("loss", float("nan")))})
                if s % 10 == 0 or s == steps - 1:
                    self._sft_log(s + 1, last)
        self.meta["sft_steps_done"] = steps
        self.learner.reset_proximal()  # SFT ends here: EWMA <- params, re-snapshot the version
        last["sft_wall_s"] = time.perf_counter() - t
        return last

    def _sft_log(self, step: int, metrics: dict) -> None:
        with open(self.run_dir / "sft.jsonl", "a") as f:
            f.write(json.dumps({"step": step, **sanitize(metrics)[0]}) + "\n")

    def sft_and_eval(self, progress: bool = True, stop: Optional[threading.Event] = None) -> Optional[dict]:
        """SFT (``sft.steps``; none when 0), then the held-out eval ``after_sft``; both recorded in
        ``self.meta`` (``sft_done``, ``sft_success``, ``sft_metrics``, ``sft_eval``). Returns the eval, or None
        when ``stop`` was set before SFT and its eval were done (``self.meta`` says how far: a checkpoint of it
        resumes there). A stop during the eval lets that eval end (it is SFT's last step)."""
        m = self.sft(progress=progress, stop=stop) if self.cfg.sft.steps > 0 else {}
        if m.get("stopped") or (stop is not None and stop.is_set()):
            return None
        ev = self.evaluate(0, label="after_sft")
        self.meta.update(sft_done=True, sft_success=ev["success"], sft_metrics=m, sft_eval=ev)
        return ev

    def stopped_in_sft(self, stop: "StopFlag", command: str = "train") -> int:
        """A signal stopped SFT (:meth:`sft_and_eval` returned None, or set during its eval): commit a checkpoint
        at RL step 0 with SFT's progress (``--resume`` continues SFT there), say so, return 128 + the signal."""
        self.save(0, wait=True)
        done, total = int(self.meta.get("sft_steps_done", 0)), int(self.cfg.sft.steps)
        what = "after SFT" if self.meta.get("sft_done") else f"during SFT at step {done} of {total}"
        how = "--resume continues from it" if command == "train" else \
            "`jax-rl train --resume` continues from it (SFT, then RL; `jax-rl sft` starts over)"
        print(f"stopped by signal {stop.signum} {what}: checkpoint {self.ckpt_dir / '0'} committed; {how}", flush=True)
        return signal_exit_code(stop)

    # ---------------------------------------------------------------- eval
    def evaluate(self, step: int, label: str = "eval") -> dict:
        """Held-out avg@k / pass@k on seeds ``eval.seed_offset + i`` with the current params."""
        cfg = self.cfg
        t = time.perf_counter()
        if jax.process_count() > 1 and engines.split_processes(cfg):  # disaggregated across processes
            return self._evaluate_split(step, label, t)
        if jax.process_count() > 1:  # each host's eval engine receives its own shards (jax_rl.weight_sync)
            self._sync_eval_engine(runs=True)
        elif self._eval_gen is None:
            self._eval_gen = engines.build_generator(cfg, self.model_config, self.publisher.params(),
                                                     self.learner.version, temperature=cfg.eval.temperature)
        else:
            self.publisher.publish(self.learner.version, [self._eval_gen])
        summary = self._eval_here(step, label, t)
        if self.writer is not None:
            self.writer.write_eval(step, summary)
        return summary

    def _evaluate_split(self, step: int, label: str, t: float) -> dict:
        """:meth:`evaluate` in a run disaggregated across processes: a learner-only process runs no engine, so it
        sends its shards and takes the summary of the first rollout process (a collective every process calls)."""
        cfg = self.cfg
        runs = engines.rollout_rank(cfg)[0] is not None
        self._sync_eval_engine(runs)
        summary = self._eval_here(step, label, t) if runs else None
        every = allgather_json(summary, timeout_s=cfg.runtime.peer_timeout_s, what="eval summary")
        summary = next(x for x in every if x is not None)
        if self.writer is not None:
            self.writer.write_eval(step, summary)
        return summary

    def _sync_eval_engine(self, runs: bool) -> None:
        """Multi-process: push the learner's params to this process's eval engine shard by shard (a collective
        every process calls, :mod:`jax_rl.weight_sync`); the first call builds the engine empty and the sync.
        ``runs``: this process runs an eval engine (False on a learner-only process of a disaggregated run,
        which still sends its shards)."""
        if getattr(self, "_eval_sync", None) is None:
            gens, self._eval_sync, keys = engines.synced_generators(
                self.cfg, self.model_config, self.learner, [None] if runs else [], self.learner.version,
                temperature=self.cfg.eval.temperature, eval_only=True)
            if gens:
                self._eval_gen, self._eval_key = gens[0], keys[0]
        else:
            own = [self._eval_gen] if self._eval_gen is not None else []  # a learner-only process sends only
            self.publisher.publish(self.learner.version, own, sync=self._eval_sync,
                                   sync_keys=[self._eval_key] if own else [])

    def _eval_here(self, step: int, label: str, t: float) -> dict:
        """The held-out eval on this process's eval engine (:meth:`evaluate`)."""
        cfg = self.cfg
        seeds = eval_seeds(cfg.eval.num_tasks, cfg.eval.seed_offset)
        agent = AgentLoop(self._eval_gen, self.tokenizer, self.env_factory, cfg.rollout,
                          max_workers=max(cfg.rollout.slots, cfg.eval.k))
        try:
            groups = agent.run_groups(seeds, group_size=cfg.eval.k, first_group_id=10**9)
        finally:
            agent.close()
        results = [
            {"env": g[0].env if g else cfg.env.name, "task_seed": int(s), "rewards": [float(x.reward) for x in g],
             "task": (g[0].info or {}).get("task_id", int(s)) if g else int(s)}  # tau²: its task id
            for s, g in zip(seeds, groups)
        ]
        summary = summarize_eval(results, cfg.eval.k)
        summary["success"] = float(np.mean([r for res in results for r in res["rewards"]])) if results else 0.0
        summary["eval_s"] = time.perf_counter() - t
        summary["label"] = label
        summary["version"] = self.learner.version
        return summary

    def close(self) -> None:
        """Stop the evaluator and close the writer (the learner is closed by its owner)."""
        if self._eval_gen is not None:
            self._eval_gen.stop()
            self._eval_gen = None
        if getattr(self, "_user_gen", None) is not None:
            self._user_gen.stop()
            self._user_gen = None
        if self.writer is not None:
            self.writer.close()


def _load_hf_params(cfg: Config, model_config):
    """Params of ``model.checkpoint`` read tensor by tensor into their sharded layout: fp32, in the
    learner's layer layout (HF's ``model.layers.{i}.*`` stacked [L, ...] under ``model.scan_layers``)."""
    from flax import nnx

    mesh = resolve_mesh(cfg)
    # only the params are kept: fp32 (the learner's master dtype), the learner's layout
    kw = {k: v for k, v in learner_model_kwargs(cfg).items() if k not in ("dtype", "param_dtype")}
    try:
        model, _ = load_pretrained(cfg.model.checkpoint, dtype=jnp.float32, mesh=mesh, config=model_config, **kw)
    except CheckpointError as e:  # e.g. a tensor's bytes do not match its header
        raise ConfigError(f"model.checkpoint={cfg.model.checkpoint!r}: {e}") from None
    return nnx.state(model, nnx.Param), mesh


def _check_processes(cfg: Config) -> None:
    """Multi-process: every process generates an equal share of each step's groups (module
    :mod:`jax_rl.runtime.embedded`). Raises ConfigError (one line) when the groups do not split."""
    n = jax.process_count()
    if n > 1 and cfg.runtime.kind != "embedded":
        raise ConfigError(f"runtime={cfg.runtime.kind} with {n} jax processes: multi-process runs use runtime=embedded "
                          "(each process runs its own rollout threads)")
    groups = cfg.optim.batch_size // cfg.algo.group_size
    r = engines.rollout_rank(cfg)[1] if n > 1 else 1  # the processes that run engines (all of them unless disaggregated)
    if r > 1 and groups % r:
        raise ConfigError(f"optim.batch_size={cfg.optim.batch_size} / algo.group_size={cfg.algo.group_size} = "
                          f"{groups} groups per step do not split over the {r} processes that run rollout engines "
                          "(each generates an equal share): make the group count a multiple of their number")


def is_primary() -> bool:
    """True on JAX process 0 (the one that writes run files)."""
    return jax.process_index() == 0


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
    for s in learner.checkpoints.delete_after(restored_step, ckpt_dir):
        print(f"removed checkpoint {Path(ckpt_dir) / str(s)} (newer than the restored step {restored_step})",
              flush=True)


def raise_if_disk_full(e: BaseException, run_dir: Path, ckpt_dir: Path, learner=None) -> None:
    """A full disk, wherever it struck (a checkpoint, metrics.jsonl, TensorBoard, summary), ends
    the run with one line naming the run dir, the bytes a checkpoint needs and the last good
    checkpoint (raised as ``CheckpointDiskFullError``). Anything else: returns."""
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
