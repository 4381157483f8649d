"""``runtime=ray``'s actors (:func:`actor_classes`): :class:`RolloutWorker` (an engine, a generator
and an agent loop per process), :class:`BufferActor` (:class:`rollout.buffer.TrajectoryBuffer`) and
:class:`LearnerActor` (the :class:`~jax_rl.runtime.context.RunContext`: learner and held-out eval).

Trajectories cross processes as :class:`rollout.types.Trajectory` objects, numpy arrays inside
(:meth:`~rollout.types.Trajectory.to_record`): Ray's object store carries the arrays out of band (pickle
protocol 5) and a reader on the same node maps them without a copy (read-only views). A group is put
into the store once, as its worker's result; the buffer actor, the driver and the learner actor read that
copy by reference (:func:`jax_rl.runtime.ray_producer.read_groups`), and the learner actor builds the
batch itself. Only the buffer's checkpointed state is JSON.

Ray is an optional dependency (the ``[ray]`` extra), imported inside :func:`actor_classes` so that
this module loads without it. Importing the project modules below does not start JAX's CPU client,
so each role process still pins its CPUs (``runtime.*_cpus``) before JAX's thread pool exists.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Optional

import jax
import numpy as np

from jax_rl.config import Config
from jax_rl.models.qwen3 import Qwen3Config
from jax_rl.publish import hand_over
from jax_rl.runtime import engines
from jax_rl.affinity import pin_process, thread_affinities
from jax_rl.learner.batch import learner_batch
from jax_rl.runtime.context import RunContext, drop_newer_checkpoints
from jax_rl.runtime.ray_producer import group_source, read_groups
from jax_rl.runtime.envs import build_env_factory, build_tokenizer
from rollout.agent import AgentLoop
from rollout.buffer import TrajectoryBuffer
from rollout.types import Trajectory, json_safe

__all__ = ["actor_classes", "jax_tree_to_host"]


class RolloutWorker:
    """One rollout engine, generator and agent loop in its own process, pinned to
    ``runtime.rollout_cpus`` before JAX starts. Created with ``max_concurrency`` above the
    groups it is given at once (:attr:`RayProducer.per_worker`): its groups decode together in
    the engine's ``rollout.slots`` and a ``set_params`` is not queued behind them."""

    def __init__(self, cfg_dict: dict, model_config_hf: dict, worker_id: int, user_model: Optional[dict] = None):
        pin_process((cfg_dict.get("runtime") or {}).get("rollout_cpus"))  # before JAX's CPU client
        self.cfg = Config.model_validate(cfg_dict)
        self.mc = Qwen3Config.from_hf(model_config_hf)
        self.tok = build_tokenizer(self.cfg)
        self.env_factory = build_env_factory(self.cfg)
        self.gen = None
        self.agent_cls = AgentLoop
        self.agent = None
        self.worker_id = worker_id
        # env.tau2.user=model: the learner actor's frozen user model ({model_config_hf, params}), served here
        self._user_model = user_model
        self.user_gen = None

    def pid(self) -> int:
        return os.getpid()

    def affinity(self) -> list[list[int]]:
        """The distinct CPU masks of this process's threads (``[[1]]``: all pinned to CPU 1)."""
        return thread_affinities()

    def cpu_s(self) -> float:
        """This process's CPU seconds so far (all threads)."""
        return time.process_time()

    def set_params(self, params, version: int) -> float:
        """Build the generator (first call) or swap its weights; returns the seconds of the
        swap's cast/reshard (:func:`jax_rl.publish.hand_over`, the publish's last leg in both runtimes; 0.0
        for the first build)."""
        if self.gen is None:
            self.gen = engines.build_generator(self.cfg, self.mc, params, version)
            if self._user_model is not None:  # the tau² user model beside the engine: frozen, never published to
                self.user_gen = engines.build_generator(
                    self.cfg, Qwen3Config.from_hf(self._user_model["model_config_hf"]),
                    self._user_model["params"], 0)
                self.env_factory.user_model.bind(self.user_gen, self.tok)
                self._user_model = None
            self.agent = self.agent_cls(self.gen, self.tok, self.env_factory, self.cfg.rollout,
                                          group_size=self.cfg.algo.group_size)
            return 0.0
        return hand_over(params, version, [self.gen])

    def run_group(self, group_id: int, task_seed: int) -> list[Trajectory]:
        """Run one GRPO group; its trajectories go back as they are (arrays through the object store)."""
        return self.agent.submit_group(task_seed, group_id).result()

    def stop(self) -> None:
        if self.gen is not None:
            self.gen.stop()
        if self.user_gen is not None:
            self.user_gen.stop()

class BufferActor:
    """:class:`rollout.buffer.TrajectoryBuffer` in its own process: the rollout workers put groups, the driver
    admits, cancels and takes batches (never blocking: ``timeout=0``), and exports its state for a checkpoint.
    A group comes in by its worker's object reference and a batch goes out as references
    (:func:`~jax_rl.runtime.ray_producer.group_source`): the arrays stay in the worker's object-store copy, read
    in place here, by the driver and by the learner actor. A group restored from a checkpoint (no reference)
    goes out by value."""

    def __init__(self, group_size: int, max_staleness: int, groups_per_step: int, state: Optional[dict],
                 max_seq_len: Optional[int] = None):
        self.buf = TrajectoryBuffer(group_size, max_staleness, groups_per_step=groups_per_step,
                                    max_seq_len=max_seq_len)
        if state:
            self.buf.import_state(state)
        self._src: dict = {}  # group_id -> (worker's ref, the group as read): while the group is pending

    def admit(self, version: int) -> bool:
        return self.buf.admit(version)

    def cancel(self, n: int = 1) -> None:
        self.buf.cancel(n)

    def put_group(self, wrapped: list) -> int:
        """``wrapped``: ``[ref]``, a worker's ``run_group`` result (a list, so Ray hands the reference
        itself over; the group is read in place here). Returns the trajectories accepted."""
        import ray  # the actor runs under Ray: imported here so that this module loads without it

        group = ray.get(wrapped[0])
        n = self.buf.put_group(group)
        if n:
            self._src[group[0].group_id] = (wrapped[0], group)
        return n

    def get_batch(self, n_groups: int, version: int) -> Optional[list]:
        """``n_groups`` groups' sources (:func:`~jax_rl.runtime.ray_producer.group_source`), or None."""
        groups = self.buf.get_batch(n_groups, version, timeout=0.0)
        if groups is None:
            return None
        out = [group_source(g, self._src.pop(g[0].group_id, None)) for g in groups]
        live: set = set()  # forget the references of groups the buffer dropped (stale)
        self.buf.map_pending(lambda g: live.add(g[0].group_id))
        self._src = {k: v for k, v in self._src.items() if k in live}
        return out

    def stats(self) -> dict:
        return self.buf.stats()

    def export_state(self) -> dict:
        return self.buf.export_state()

class LearnerActor:
    """The :class:`~jax_rl.runtime.context.RunContext` (learner and held-out evaluator) in its
    own process; the driver drives it through :class:`RemoteLearner`."""

    def __init__(self, cfg_dict: dict):
        pin_process((cfg_dict.get("runtime") or {}).get("learner_cpus"))  # before JAX's CPU client
        logging.basicConfig(level=logging.WARNING)
        self.cfg = Config.model_validate(cfg_dict)
        self.ctx = RunContext(self.cfg, create_dir=False)
        # eval.jsonl only: the driver writes metrics.jsonl and TensorBoard
        self.ctx.open_writer(tensorboard=False, wandb=False)

    def model_config_hf(self) -> dict:
        return self.ctx.model_config.to_hf()

    def describe(self) -> str:
        """The correction mode's cost line (embedded prints it; the driver prints this)."""
        return self.ctx.learner.describe()

    def cpu_s(self) -> float:
        """This process's CPU seconds so far (all threads: learner steps, evals, param copies)."""
        return time.process_time()

    def affinity(self) -> list[list[int]]:
        return thread_affinities()

    def pad_id(self) -> int:
        return int(self.ctx.tokenizer.pad_id)

    def restore(self) -> dict:
        """Restore the newest good (or ``resume_step``) checkpoint; returns the runtime
        metadata the driver saved with it (buffer, producer, counters) with ``rl_steps`` set
        to the RL step the checkpoint recorded, and ``resume_line``. Writes nothing."""
        self.ctx.resume()
        return {**self.ctx.meta, "resume_line": self.ctx.resume_line, "resumed_step": self.ctx.resumed_step}

    def materialize(self, drop_after: Optional[int] = None) -> None:
        """After every check: write config.yaml (and the bpe tokenizer); on a resume, delete
        the checkpoints newer than the restored step."""
        self.ctx.materialize()
        if drop_after is not None:
            drop_newer_checkpoints(self.ctx.learner, self.ctx.ckpt_dir, drop_after)

    def sft_and_eval(self) -> dict:
        return self.ctx.sft_and_eval(progress=False)

    def sft_part(self, until: int) -> tuple[int, bool]:
        """SFT up to step ``until`` (the driver checks its signals between parts): ``(steps done, SFT
        finished)``; finished, the proximal state is reset as :meth:`RunContext.sft` does."""
        m = self.ctx.sft(progress=False, until=until) if self.ctx.cfg.sft.steps > 0 else {}
        if not m.get("stopped"):
            self._sft_metrics = m
        return int(self.ctx.meta.get("sft_steps_done", 0)), not m.get("stopped")

    def eval_after_sft(self) -> dict:
        """SFT's held-out eval (after :meth:`sft_part` finished), recorded as :meth:`RunContext.sft_and_eval` does."""
        ev = self.ctx.evaluate(0, label="after_sft")
        self.ctx.meta.update(sft_done=True, sft_success=ev["success"], sft_metrics=getattr(self, "_sft_metrics", {}),
                             sft_eval=ev)
        return ev

    def get_params(self):
        """The params of a publish (:meth:`jax_rl.publish.Publisher.params`, numpy: one object-store copy)."""
        return self.ctx.publisher.params(host=True)

    def user_model(self) -> Optional[dict]:
        """env.tau2.user=model: the frozen user model this actor serves for held-out eval
        (:func:`~jax_rl.runtime.envs.start_tau2_user_model`: the checkpoint, or the run's
        starting weights), as ``{model_config_hf, params}`` (host arrays in ``rollout.dtype``) for the
        rollout workers to serve the same model; None without one."""
        g = getattr(self.ctx, "_user_gen", None)
        if g is None:
            return None
        return {"model_config_hf": g.engine.config.to_hf(),
                "params": jax_tree_to_host(g.engine.load_params())}

    def version(self) -> int:
        return self.ctx.version

    def opt_step(self) -> int:
        return self.ctx.opt_step

    def train_step(self, batch: dict) -> dict:
        return self.ctx.train_step(batch)

    def train_groups(self, sources: list, pad_id: int, rows: int) -> tuple[dict, int]:
        """One learner step on the groups of ``sources`` (the buffer actor's
        :func:`~jax_rl.runtime.ray_producer.group_source` entries), read in place from the object store
        and collated here (:func:`jax_rl.learner.batch.learner_batch`): the batch is never put into the
        store. Returns ``(metrics, rows of the batch)``."""
        import ray  # the actor runs under Ray

        _, _, batch = learner_batch(self.cfg, read_groups(ray, sources), pad_id, rows=rows)
        return self.ctx.train_step(batch), int(batch["tokens"].shape[0])

    def evaluate(self, step: int, label: str) -> dict:
        return self.ctx.evaluate(step, label=label)

    def save(self, rl_step: int, meta: dict) -> str:
        self.ctx.save(rl_step, meta, wait=True)
        return str(self.ctx.ckpt_dir)

    def save_meta(self, rl_step: int) -> dict:
        """:meth:`save` (committed) of the actor's own run metadata (SFT's progress); returns that metadata."""
        self.ctx.save(rl_step, wait=True)
        return json_safe(dict(self.ctx.meta), default=str)

    def close(self) -> None:
        self.ctx.close()
        self.ctx.learner.close()


def actor_classes() -> tuple:
    """``(RolloutWorker, BufferActor, LearnerActor)``: the Ray actor classes made from :class:`RolloutWorker`,
    :class:`BufferActor` and :class:`LearnerActor` (here so that Ray is imported only when ``runtime=ray``
    runs). None reserves a CPU of Ray's (each role pins its own, ``runtime.*_cpus``); the worker and the
    learner are never restarted (a crash ends the run with its error)."""
    import ray

    return (ray.remote(num_cpus=0, max_restarts=0)(RolloutWorker), ray.remote(num_cpus=0)(BufferActor),
            ray.remote(num_cpus=0, max_restarts=0)(LearnerActor))


def jax_tree_to_host(tree):
    """``tree`` with every leaf as a numpy array (what crosses Ray's object store)."""
    return jax.tree.map(np.asarray, tree)
