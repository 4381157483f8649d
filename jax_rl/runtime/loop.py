"""The one RL loop, shared by the embedded and the Ray runtime, and the one run summary.

:func:`run_rl` takes ``run.steps - start_step`` learner steps:

1. wait for ``optim.batch_size / group_size`` GRPO groups trainable at the learner's version
   (:meth:`Producer.poll`, repeated; a producer that fails systematically sets :attr:`Producer.fatal`
   and the run stops with ``rollout_failed`` in its summary and exit code 1);
2. group advantages and the padded batch; one learner step (:meth:`LearnerHandle.train_step`);
3. publish the new version to the rollouts (:meth:`Producer.publish`);
4. one ``metrics.jsonl`` row; periodic held-out eval and checkpoints (every row up to the step is
   flushed before its checkpoint);

then stops the producer, saves the final checkpoint (committed before anything is reported), runs
the final eval (not after a signal or a failed rollout), writes ``summary.json``, the plots and the
console summary (:func:`write_outputs`) and returns the exit code.

Who produces and who learns is behind two small interfaces:

* :class:`Producer`: the embedded :class:`~jax_rl.runtime.embedded.EmbeddedProducer` (rollout
  threads and a local buffer) or the Ray dispatcher (:class:`~jax_rl.runtime.ray_runtime.RayProducer`).
* :class:`LearnerHandle`: the :class:`~jax_rl.runtime.context.RunContext` itself (embedded), or a
  proxy of the Ray learner actor.

:data:`fault_hooks` is a fault-injection point for tests (``before_poll`` is called before every
poll); it does nothing unless a test replaces it.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Protocol, Sequence

import jax
import numpy as np

from jax_rl.learner import batch as B
from jax_rl.config import Config
from jax_rl.console import TrainProgress, print_summary
from jax_rl.metrics import read_jsonl
from jax_rl.plots import plot_runs
from jax_rl.runtime import engines
from jax_rl.runtime.context import StopFlag, signal_exit_code
from rollout.envs import env_spec
from rollout.types import json_safe

log = logging.getLogger("jax_rl.runtime")

__all__ = ["Producer", "LearnerHandle", "FaultHooks", "fault_hooks", "RunStart", "run_rl", "write_outputs", "sft_line",
           "buffer_columns", "step_row", "rollout_moe_drops", "tau2_episode_stats", "WeightSyncClock"]


class Producer(Protocol):
    """The rollout side of the loop (admission, generation, the trajectory buffer)."""

    @property
    def fatal(self) -> Optional[str]:
        """Why the run must stop (a systematically failing rollout), else None."""

    def start(self) -> None:
        """Start generating (idempotent)."""

    def poll(self, n_groups: int, version: int) -> Optional[list]:
        """One attempt (blocking at most about a second) at ``n_groups`` groups of
        :class:`~rollout.types.Trajectory` trainable at ``version``; None when not ready."""

    def publish(self, version: int) -> None:
        """Hand the learner's params of ``version`` to every rollout, then tell the buffer."""

    def row(self) -> dict:
        """The producer's columns of a ``metrics.jsonl`` row (buffer and episode counters)."""

    def summary(self) -> dict:
        """The producer's keys of ``summary.json`` (buffer and episode counters)."""

    def state(self) -> dict:
        """JSON-safe checkpoint metadata (buffer, producer state, counters) restored on resume."""

    def stop(self) -> None:
        """Stop generating; groups in flight stay in :meth:`state` for re-issue on resume."""


class LearnerHandle(Protocol):
    """The learner side: the embedded :class:`~jax_rl.runtime.context.RunContext` or a Ray proxy."""

    version: int
    opt_step: int

    def train_step(self, batch: dict, *, process_local: bool = False) -> dict: ...

    # optional (runtime=ray's RemoteLearner): ``train_groups(groups, pad_id, rows) -> (metrics, batch rows)``,
    # the learner's process collates the groups itself; the loop then calls it instead of train_step

    def evaluate(self, step: int, label: str = "eval") -> dict: ...

    def save(self, rl_step: int, meta: Optional[dict] = None, *, wait: bool = False) -> None: ...


class FaultHooks:
    """Fault-injection points of the loop; production runs use this no-op instance. Tests replace
    :data:`fault_hooks` (e.g. to kill a Ray rollout worker mid-run)."""

    def before_poll(self, step: int, producer: Producer) -> None:
        """Called before every :meth:`Producer.poll` of RL step ``step`` (0-based)."""


fault_hooks: FaultHooks = FaultHooks()


def finished_run_line(cfg: Config, run_dir: Path, start_step: int) -> Optional[str]:
    """A resume of a run that already finished: its ``summary.json`` says it reached ``run.steps``
    with the final eval (not interrupted, no failed rollout) and the checkpoint resumed from is at
    ``start_step >= run.steps``. Returns the line to print (nothing is run or written: exit 0), else
    None (a stopped or failed run resumes as usual; so does ``--step N`` of an earlier checkpoint)."""
    if start_step < cfg.run.steps:
        return None
    try:
        s = json.loads((Path(run_dir) / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    if s.get("interrupted") or s.get("rollout_failed") or s.get("ray_failed") or int(s.get("rl_steps", -1)) < cfg.run.steps:
        return None
    return (f"run.dir={str(run_dir)!r} is finished (RL step {start_step} of run.steps={cfg.run.steps}, final eval in "
            f"summary.json): nothing to do; raise run.steps to train it further")


def sft_line(cfg: Config, ev: dict) -> str:
    """The console line after SFT's held-out eval (``sft.steps=0``: the initial policy's, no SFT ran)."""
    what = "after SFT" if cfg.sft.steps > 0 else "at the start (sft.steps=0: no SFT)"
    return f"held-out success {what}: {ev['success']:.3f} ({cfg.eval.num_tasks} tasks x {cfg.eval.k})"


def _next_groups(producer: Producer, stop: StopFlag, step: int, n_groups: int,
                 version: int) -> tuple[Optional[list], Optional[str]]:
    """``(groups, None)``: the groups of learner step ``step`` from ``producer`` (polled until they are there);
    ``(None, None)`` when a stop is asked first; ``(None, reason)`` when the rollout failed systematically
    (:attr:`Producer.fatal`: one bad episode is dropped, a failing rollout stops the run)."""
    groups = None
    while groups is None and not stop.event.is_set():
        fault_hooks.before_poll(step, producer)
        groups = producer.poll(n_groups, version)
        if groups is None and producer.fatal:  # one bad episode is dropped; a failing rollout stops
            return None, producer.fatal
    return groups, None


def _train_and_publish(cfg: Config, learner: LearnerHandle, producer: Producer, groups: list, *, step: int,
                       version: int, pad_id: int, batch_rows: int, split: bool,
                       nproc: int) -> tuple[dict, int, int, float]:
    """One learner step on ``groups`` and the publish of its version: ``(metrics row of step + 1, the new
    version, trajectories trained, the publish's start time)``."""
    v_train = version
    # disaggregated: the global batch on every process; colocated multi-process: each process trains its
    # own groups' rows, the learner the union
    if hasattr(learner, "train_groups"):  # runtime=ray: the learner actor collates what it reads in place
        metrics, batch = learner.train_groups(groups, pad_id, batch_rows)  # batch: its row count
        groups, trajs = B.sorted_groups(groups)
    else:
        groups, trajs, batch = B.learner_batch(cfg, groups, pad_id, rows=batch_rows)
        metrics = learner.train_step(batch, process_local=nproc > 1 and not split)
    version = learner.version
    t_pub = time.perf_counter()
    producer.publish(version)
    row = step_row(cfg, step + 1, version, metrics, batch, groups, trajs, v_train)
    if nproc > 1:  # the rollout columns of this row are process 0's share (disaggregated: the step's)
        row["process_count"] = nproc
    return row, version, len(trajs), t_pub


def _eval_and_checkpoint(cfg: Config, learner: LearnerHandle, producer: Producer, writer, step: int) -> None:
    """After learner step ``step``: the periodic held-out eval (``eval.every``, not at the last step) and
    checkpoint (``checkpoint.every``, its metrics rows flushed first)."""
    if cfg.eval.every and (step + 1) % cfg.eval.every == 0 and step + 1 < cfg.run.steps:
        ev = learner.evaluate(step + 1, "eval")
        print(f"eval @ step {step + 1}: held-out success {ev['success']:.3f}", flush=True)
    if cfg.checkpoint.every and (step + 1) % cfg.checkpoint.every == 0:
        writer.flush()  # every row up to this step is on disk before its checkpoint
        learner.save(step + 1, producer.state())


@dataclass(frozen=True)
class RunStart:
    """Where :func:`run_rl` starts and writes: ``start_step`` (the first RL step to take, 0 or the resumed
    one), ``pad_id`` (the tokenizer's pad token id, the batch's padding), ``sft_success`` (the SFT eval's
    held-out success, None without one; the summary's ``sft_success``), ``run_dir`` (metrics, summary, plots),
    ``ckpt_dir`` (checkpoints) and ``t0`` (the run's ``time.perf_counter()`` start: ``wall_s``)."""

    start_step: int
    pad_id: int
    sft_success: Optional[float]
    run_dir: Path
    ckpt_dir: Path
    t0: float


def _finish_run(cfg: Config, learner: LearnerHandle, producer: Producer, writer, stop: StopFlag, run: RunStart, *,
                last: dict, version: int, rollout_failed: Optional[str]) -> int:
    """The end of RL: the final checkpoint (committed), the final held-out eval (not after a stop or a failed
    rollout), ``summary.json``, plots and console summary. Returns the exit code (see :func:`run_rl`)."""
    rl_steps = int(last.get("step", run.start_step))
    writer.flush()
    learner.save(rl_steps, producer.state(), wait=True)  # committed before we report or exit
    interrupted = stop.event.is_set()
    final = learner.evaluate(rl_steps, "final") if not (interrupted or rollout_failed) else {}
    if final:  # the final eval's progress line, as the periodic ones (which skip the last step for it)
        print(f"eval @ step {rl_steps} (final): held-out success {final['success']:.3f}", flush=True)
    k = cfg.eval.k
    summary = {
        "sft_success": run.sft_success,
        "final_success": final.get("success"),
        f"final_pass_at_{k}": final.get(f"pass@{k}"),
        f"final_avg_at_{k}": final.get(f"avg@{k}"),
        "wall_s": time.perf_counter() - run.t0,
        "rl_steps": rl_steps,
        "version": version,
        "opt_step": learner.opt_step,
        "correction": cfg.loss.correction,
        "max_staleness": cfg.async_.max_staleness,
        "interrupted": interrupted,
        "runtime": cfg.runtime.kind,
        "tokens_per_s_mean": _mean_metric(run.run_dir, "tokens_per_s"),
        **producer.summary(),
    }
    if rollout_failed:
        summary["rollout_failed"] = rollout_failed
    write_outputs(run.run_dir, run.ckpt_dir, summary)
    if rollout_failed:  # checkpoint, metrics and summary are written: fix the env/config, then --resume
        print(f"jax-rl: {rollout_failed}", file=sys.stderr)
        return 1
    return signal_exit_code(stop)


def run_rl(cfg: Config, learner: LearnerHandle, producer: Producer, writer, stop: StopFlag, run: RunStart) -> int:
    """RL from ``run.start_step`` to ``cfg.run.steps``, the final checkpoint, eval and summary (``run``: where it
    starts and writes, :class:`RunStart`).

    Returns:
        the exit code: 0; 1 when the rollout failed systematically (checkpoint, metrics and summary
        written); 128 + signal number when stopped by a signal.
    """
    nproc = jax.process_count()
    n_groups = engines.local_groups_per_step(cfg)  # this process's share (0 on a learner-only process)
    split = engines.split_processes(cfg)  # disaggregated across processes: the groups cross to the learner's processes
    batch_rows = cfg.optim.batch_size if split else n_groups * cfg.algo.group_size
    last: dict = {}
    rollout_failed: Optional[str] = None
    version = learner.version
    cpu0 = time.process_time()  # this process's CPU seconds, all threads (cpu_s: load-independent work)

    try:
        producer.start()
        t_row = time.perf_counter()  # the previous row's time: a step's wall is the time between rows
        with TrainProgress(cfg.run.steps, enabled=cfg.logging.progress) as bar:
            for step in range(run.start_step, cfg.run.steps):
                if stop.event.is_set():
                    break
                t_wait = time.perf_counter()
                groups, rollout_failed = _next_groups(producer, stop, step, n_groups, version)
                if groups is None:
                    break
                if split:  # every process gets every process's groups; the learner trains the global batch
                    groups = engines.exchange_groups(cfg, groups)
                wait_s = time.perf_counter() - t_wait
                row, version, n_trajs, t_pub = _train_and_publish(
                    cfg, learner, producer, groups, step=step, version=version, pad_id=run.pad_id,
                    batch_rows=batch_rows, split=split, nproc=nproc)
                now = time.perf_counter()
                row.update({"wait_s": wait_s, "publish_s": now - t_pub, **producer.row(),
                            "wall_s": now - run.t0, "cpu_s": time.process_time() - cpu0,
                            # the step's wall (since the previous row) and the episodes it trained per second of it
                            "step_wall_s": now - t_row, "episodes_per_s": n_trajs / max(now - t_row, 1e-9)})
                t_row = now
                writer.write(step + 1, row)
                last = row
                bar.update(step + 1, row)
                _eval_and_checkpoint(cfg, learner, producer, writer, step)
    finally:
        producer.stop()
    return _finish_run(cfg, learner, producer, writer, stop, run, last=last, version=version,
                       rollout_failed=rollout_failed)


def write_outputs(run_dir: Path, ckpt_dir: Path, summary: dict) -> None:
    """End of a train run: ``summary.json``, the plots, the console summary."""
    (run_dir / "summary.json").write_text(json.dumps(json_safe(summary, default=str), indent=2))
    try:
        plot_runs([run_dir])
    except Exception as e:  # plotting must never lose a finished run
        log.warning("plotting failed: %r", e)

    print_summary(summary, {"run dir": run_dir, "metrics": run_dir / "metrics.jsonl",
                            "eval": run_dir / "eval.jsonl", "checkpoints": ckpt_dir,
                            "plots": run_dir / "plots", "summary": run_dir / "summary.json"})


def _mean_metric(run_dir: Path, key: str) -> Optional[float]:
    vals = [r[key] for r in read_jsonl(run_dir / "metrics.jsonl") if isinstance(r.get(key), (int, float))]
    return float(np.mean(vals)) if vals else None


def buffer_columns(stats: dict, episode_errors: int, *, row: bool, by_reason: Optional[dict] = None) -> dict:
    """The buffer / episode counters of a metrics row (``buffer/<k>``) or of the summary
    (``buffer_<k>``); both runtimes' producers report them through this. A row also carries
    ``dropped_overlong`` on its own (the console's and the plots' column); the summary has it once, as
    ``buffer_dropped_overlong``. ``by_reason`` (:attr:`EpisodeGuard.by_reason`): the lost episodes so far
    by kind, ``episode_failures_by_reason`` (a dict in the summary; ``episode_failures_by_reason/<kind>``
    columns in a row)."""
    sep = "/" if row else "_"
    own = {"dropped_overlong": stats["dropped_overlong"]} if row else {}
    return {"episode_errors": int(episode_errors), "episode_failures_by_reason": dict(sorted((by_reason or {}).items())),
            **own, **{f"buffer{sep}{k}": v for k, v in stats.items()}}


class WeightSyncClock:
    """Seconds spent publishing weights (learner params -> rollout engines), for both runtimes'
    producers: ``weight_sync_s`` (the whole publish: the learner's param copy, the cast to
    ``rollout.dtype`` and the reshard to the engine's layout, the hand-over) and its
    ``weight_sync_cast_s`` part (``engine.load_params``: cast + reshard, summed over the rollout
    engines; the rest is the copy and the hand-over). Timed with ``jax.block_until_ready`` on the
    arrays (async dispatch would otherwise hide the work). Not thread-safe: one caller thread.

    :meth:`row` gives the seconds since the previous row (the publishes in between: one per
    learner step in :func:`run_rl`), :meth:`summary` the totals and the number of publishes of
    this process (not checkpointed: a resumed run counts from its resume). Where the producer counts
    them (the embedded runtime), ``weight_sync_bytes``: the bytes the publishes since the previous row
    moved on this process (one process: the engines' params in ``rollout.dtype`` they received;
    multi-process: this process's shards sent to and received from other processes plus its own engines'
    local copies, :attr:`jax_rl.weight_sync.ShardedWeightSync.last`).
    """

    def __init__(self) -> None:
        self.total_s = 0.0
        self.cast_total_s = 0.0
        self.count = 0
        self._row_s = 0.0
        self._row_cast_s = 0.0
        self._row_bytes: Optional[float] = None

    def add(self, seconds: float, cast_s: float = 0.0, nbytes: Optional[float] = None) -> None:
        """One publish that took ``seconds`` (wall, on the publishing side), ``cast_s`` of it casting,
        moving ``nbytes`` bytes on this process (None: not counted)."""
        self.total_s += float(seconds)
        self._row_s += float(seconds)
        self.count += 1
        self.add_cast(cast_s)
        if nbytes is not None:
            self._row_bytes = (self._row_bytes or 0.0) + float(nbytes)

    def add_cast(self, cast_s: float) -> None:
        """Cast/reshard seconds reported on their own (Ray workers report theirs when they finish)."""
        self.cast_total_s += float(cast_s)
        self._row_cast_s += float(cast_s)

    def row(self) -> dict:
        """``weight_sync_s`` / ``weight_sync_cast_s``: seconds since the previous row (then reset)."""
        out = {"weight_sync_s": self._row_s, "weight_sync_cast_s": self._row_cast_s}
        if self._row_bytes is not None:
            out["weight_sync_bytes"] = self._row_bytes
            self._row_bytes = 0.0
        self._row_s = self._row_cast_s = 0.0
        return out

    def summary(self) -> dict:
        """``weight_sync_s_total``, ``weight_sync_cast_s_total`` (seconds) and ``weight_syncs`` (publishes)."""
        return {"weight_sync_s_total": self.total_s, "weight_sync_cast_s_total": self.cast_total_s,
                "weight_syncs": self.count}


def step_row(cfg: Config, step: int, version: int, metrics: dict, batch: dict, groups, trajs,
             version_trained: int) -> dict:
    """The ``metrics.jsonl`` fields every runtime writes for one learner step.

    ``batch``: the learner batch, or its row count (``runtime=ray``: the learner actor built it).
    ``staleness_mean`` / ``staleness_max`` (versions) come from the learner's metrics; they are
    computed here from the trajectories' ``versions`` against ``version_trained`` only when missing.
    """
    row = dict(metrics)
    row["padded_rows"] = (batch if isinstance(batch, int) else int(batch["tokens"].shape[0])) - len(trajs)
    s = np.concatenate([version_trained - t.versions[t.loss_mask & (t.versions >= 0)] for t in trajs] or [[]])
    row.setdefault("staleness_mean", float(s.mean()) if s.size else 0.0)
    row.setdefault("staleness_max", int(s.max()) if s.size else 0)
    rewards = np.asarray([t.reward for t in trajs], np.float32)
    row.update({
        "step": step,
        "version": version,
        "group_ids": [int(g[0].group_id) for g in groups],
        "reward_mean": float(rewards.mean()),
        "success_rate": float((rewards >= 1.0 - 1e-6).mean()),
        "episode_len_mean": float(np.mean([len(t) for t in trajs])),
        # the engines' prefill work for these trajectories (re-prefills included; a GRPO group's shared
        # prompt counted once) against their own lengths: ~turns/2 when every turn re-prefills
        "prefill_tokens": int(sum(int(t.info.get("prefill_tokens", 0)) for t in trajs)),
        "episode_tokens": int(sum(len(t) for t in trajs)),
        "prefix_cache_hits": int(sum(int(t.info.get("prefix_hits", 0)) for t in trajs)),
        "gen_tokens_mean": float(np.mean([t.num_generated for t in trajs])),
    })
    if any("moe_copies" in (t.info or {}) for t in trajs):  # the engines drop MoE copies (capacity)
        row.update(rollout_moe_drops(trajs))
    if env_spec(cfg.env.name).agentic:  # the agentic workload's shape: per-episode means over the batch
        row.update(tau2_episode_stats(trajs))
    return row


def rollout_moe_drops(trajs) -> dict:
    """The rollout engines' MoE capacity drops on ``trajs``' tokens (``Trajectory.info``, summed):
    ``rollout/moe_dropped_copies`` (token copies an engine's MoE layers dropped for capacity,
    ``rollout.moe_capacity_factor``), ``rollout/moe_copies`` (the copies those tokens routed:
    prefilled and decoded positions x MoE layers x k; a GRPO group's shared prompt once) and
    ``rollout/moe_dropped_frac`` (their ratio, 0 when nothing was routed). A dropped copy makes the
    behaviour policy differ from the learner's (dropless) forward: docs/correction.md."""
    dropped = int(sum(int((t.info or {}).get("moe_dropped_copies", 0)) for t in trajs))
    copies = int(sum(int((t.info or {}).get("moe_copies", 0)) for t in trajs))
    return {"rollout/moe_dropped_copies": dropped, "rollout/moe_copies": copies,
            "rollout/moe_dropped_frac": dropped / copies if copies else 0.0}


def tau2_episode_stats(trajs) -> dict:
    """The agentic workload's shape per step, from each ``Trajectory.info``.

    Per-episode means over ``trajs``: assistant turns, user turns, tool calls, tool errors, tokens (the
    trajectory's length), prompt tokens, prefill tokens (what the engine ran through prefill for the
    episode, prefix-cache and kept-K/V reuse counted out), submitted context tokens (the sum over turns of
    the context each turn was generated from: what an engine without any reuse prefills), the user model's
    generated tokens, and seconds: waiting on the policy's generator (``gen_s``), in the env (``env_s``:
    tools, tau²'s evaluator, ``reset``, the user's tools: everything but the two models) and waiting on
    the user model (``user_s``).

    ``episode_time_frac_{policy,env,user_model}``: each part's share of the episodes' wall seconds
    (summed over the step's episodes; the rest is the loop's own work). Episodes run concurrently and
    beside the learner, so these are shares of episode time, not of the step's wall: that is the
    row's ``step_wall_s`` (with ``step_time_s`` the learner's update and ``episodes_per_s``)."""
    infos = [t.info or {} for t in trajs]

    def mean(f) -> float:
        return float(np.mean([f(i) for i in infos])) if infos else 0.0

    def env_s(i) -> float:  # reset and the user's turns include the user model's waits: count those out
        return max(0.0, i.get("tool_s", 0.0) + i.get("reset_s", 0.0) + i.get("user_s", 0.0) - i.get("user_model_s", 0.0))

    total = sum(i.get("total_s", 0.0) for i in infos)

    def frac(f) -> float:
        return float(sum(f(i) for i in infos) / total) if total > 0 else 0.0

    return {
        "episode_turns_mean": mean(lambda i: i.get("turns", 0)),
        "episode_user_turns_mean": mean(lambda i: i.get("user_turns", 0)),
        "episode_tool_calls_mean": mean(lambda i: i.get("tool_calls", 0)),
        "episode_tool_errors_mean": mean(lambda i: len(i.get("tool_errors", []))),
        "episode_tokens_mean": float(np.mean([len(t) for t in trajs])) if trajs else 0.0,
        "episode_prompt_len_mean": mean(lambda i: i.get("prompt_len", 0)),
        "episode_prefill_tokens_mean": mean(lambda i: i.get("prefill_tokens", 0)),
        "episode_submitted_tokens_mean": mean(lambda i: sum(i.get("turn_starts", []))),
        "episode_user_model_tokens_mean": mean(lambda i: i.get("user_model_tokens", 0)),
        "episode_user_tool_calls_mean": mean(lambda i: i.get("user_tool_calls", 0)),
        "episode_gen_s_mean": mean(lambda i: i.get("gen_s", 0.0)),
        "episode_env_s_mean": mean(env_s),
        "episode_user_s_mean": mean(lambda i: i.get("user_model_s", 0.0)),
        "episode_total_s_mean": mean(lambda i: i.get("total_s", 0.0)),
        "episode_time_frac_policy": frac(lambda i: i.get("gen_s", 0.0)),
        "episode_time_frac_env": frac(env_s),
        "episode_time_frac_user_model": frac(lambda i: i.get("user_model_s", 0.0)),
    }


class EpisodeGuard:
    """Counts unusable episodes for a runtime, says why each was lost, and decides when a rollout is
    failing systematically.

    An episode is unusable when it failed (an env/tool exception, ``info["failed"]``; or its group's
    loop raised) or its prompt did not fit (``info["overlong"]``). Each is dropped and counted and the
    run goes on; ``rollout.max_consecutive_episode_errors`` of them in a row (no usable episode in
    between) set :attr:`fatal`, the message the runtime stops with. An episode longer than
    ``max_seq_len`` (the buffer drops it alone) is lost too, but does not break the run of usable ones.
    Every lost episode is counted by kind in :attr:`by_reason` (``failed:<exception type>``,
    ``prompt_overlong``, ``over_max_seq_len``, ``group_error:<type>``, ``put_error:<type>``,
    ``old_logits_error:<type>``; the run's ``episode_failures_by_reason``) and logged as one warning
    line: each of the first ``log_first``, then one line with the counts every ``log_every`` lost
    episodes. Thread-safe.

    Attributes:
        episode_errors: failed episodes so far (overlong ones are counted by the buffer).
        consecutive: unusable episodes since the last usable one.
        fatal: None, or the reason to stop.
        by_reason: lost episodes so far by kind (restored from a checkpoint's producer state).
    """

    def __init__(self, limit: int, episode_errors: int = 0, *, by_reason: Optional[dict] = None,
                 max_seq_len: Optional[int] = None, log_first: int = 5, log_every: int = 100):
        self.limit = int(limit)
        self.episode_errors = int(episode_errors)
        self.consecutive = 0
        self.last: str = ""
        self.fatal: Optional[str] = None
        self.by_reason: dict[str, int] = {str(k): int(v) for k, v in (by_reason or {}).items()}
        self.max_seq_len = max_seq_len
        self.log_first, self.log_every = int(log_first), max(1, int(log_every))
        self._logged = 0  # lost episodes seen by this process (the rate limit counts these)
        self._lock = threading.Lock()

    @staticmethod
    def _info(t: Any) -> dict:
        return (t.get("info") if isinstance(t, dict) else getattr(t, "info", None)) or {}

    @staticmethod
    def _where(t: Any) -> str:
        get = t.get if isinstance(t, dict) else (lambda k, d=None: getattr(t, k, d))
        return f"env {get('env', '?')}, group {get('group_id', '?')}, seed {get('seed', '?')}"

    @staticmethod
    def _type_of(text: str) -> str:
        """``ValueError`` of ``"ValueError: ..."`` / ``"ValueError('...')"`` (a repr), else ``error``."""
        head = text.split(":", 1)[0].split("(", 1)[0].strip()
        return head if head.isidentifier() else "error"

    def _lost(self, kind: str, n: int, where: str, why: str) -> None:
        """Count ``n`` lost episodes of ``kind`` and log them (rate limited). Called under the lock."""
        self.by_reason[kind] = self.by_reason.get(kind, 0) + int(n)
        for _ in range(int(n)):
            self._logged += 1
            if self._logged <= self.log_first:
                log.warning("episode lost (%s): %s: %s", kind, where, " ".join(str(why).split())[:300])
                if self._logged == self.log_first:
                    log.warning("episode lost: further lost episodes are summed up every %d (episode_failures_by_reason "
                                "in metrics.jsonl and summary.json)", self.log_every)
            elif self._logged % self.log_every == 0:
                log.warning("episodes lost so far in this process: %d, by reason %s", self._logged,
                            dict(sorted(self.by_reason.items())))

    def record(self, trajectories: Sequence[Any]) -> None:
        """Account one finished group (Trajectory objects or their ``to_dict()``)."""
        with self._lock:
            for t in trajectories:
                info = self._info(t)
                if info.get("failed"):
                    self.episode_errors += 1
                    self.consecutive += 1
                    self.last = f"episode failed: {info.get('fail_reason', '?')}"
                    self._lost(f"failed:{self._type_of(str(info.get('fail_reason', '')))}", 1, self._where(t),
                               info.get("fail_reason", "?"))
                elif info.get("overlong"):
                    self.consecutive += 1
                    self.last = f"over-long: {info.get('drop_reason', info.get('overlong'))}"
                    self._lost("prompt_overlong", 1, self._where(t),
                               f"the prompt leaves no room in rollout.max_cache_len "
                               f"({info.get('drop_reason', info.get('overlong'))})")
                else:
                    self.consecutive = 0
                    n = len(t["tokens"]) if isinstance(t, dict) and "tokens" in t else len(t) if hasattr(t, "__len__") \
                        else 0
                    if self.max_seq_len is not None and n > self.max_seq_len:
                        self._lost("over_max_seq_len", 1, self._where(t),
                                   f"{n} tokens > optim.max_seq_len={self.max_seq_len} (dropped by the buffer)")
            self._check()

    def record_error(self, n_episodes: int, message: str, kind: str = "group_error") -> None:
        """Account ``n_episodes`` lost to an exception outside an episode (a group's loop); ``kind``
        (``group_error``, ``put_error``, ``old_logits_error``) gets the exception's type appended."""
        with self._lock:
            self.episode_errors += int(n_episodes)
            self.consecutive += int(n_episodes)
            self.last = message
            self._lost(f"{kind}:{self._type_of(message.split(': ', 1)[-1])}", n_episodes, "", message)
            self._check()

    def _check(self) -> None:
        if self.limit and self.fatal is None and self.consecutive >= self.limit:
            self.fatal = (f"rollout failed: {self.consecutive} episodes in a row were unusable (env/tool errors or "
                          f"over-long prompts; rollout.max_consecutive_episode_errors={self.limit}); last: {self.last}")
