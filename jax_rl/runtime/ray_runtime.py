"""``runtime=ray``: rollout-worker actors, a learner actor and the buffer as an actor.

* ``runtime.ray_workers`` :class:`RolloutWorker` actors, each with its own engine, generator and
  agent loop. Each runs whole GRPO groups (``run_group``) and returns them as JSON-safe dicts.
* one :class:`LearnerActor` holding the :class:`~jax_rl.learner.Learner` (multi-host learners use
  ``runtime.coordinator`` / ``jax.distributed`` inside it).
* one :class:`BufferActor` wrapping :class:`rollout.buffer.TrajectoryBuffer`.

The driver dispatches groups (after buffer admission), collects results with ``ray.wait``, and
after each learner step puts the new params into the object store **once** and hands the same
ObjectRef to every worker. If a worker dies, it is replaced and its in-flight groups are re-issued
(counted in ``reissued_groups``); results are de-duplicated by group id, so no group is trained
twice. Ray runs with ``RAY_AUTH_MODE=disabled``, no dashboard, and its temp dir under the run dir.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np

from jax_rl.config import Config, dump_config

log = logging.getLogger("jax_rl.runtime")

__all__ = ["run_train_ray", "init_ray"]


def init_ray(run_dir: Path, num_cpus: Optional[int] = None):
    """Start a local Ray with auth off, no dashboard and its temp dir under ``run_dir``.

    Unix socket paths are limited to ~107 bytes; when ``run_dir/ray`` is too long, Ray's temp dir
    goes to a short dir under the system temp folder and a ``ray_tmp`` link in the run dir points
    to it.
    """
    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    if ray.is_initialized():
        return ray
    tmp = (Path(run_dir) / "ray").resolve()
    if len(str(tmp)) > 40:
        short = Path(tempfile.mkdtemp(prefix="jxrl-ray-"))
        link = Path(run_dir) / "ray_tmp"
        if not link.exists():
            link.symlink_to(short)
        tmp = short
    tmp.mkdir(parents=True, exist_ok=True)
    ray.init(num_cpus=num_cpus or os.cpu_count(), include_dashboard=False, _temp_dir=str(tmp),
             log_to_driver=False, ignore_reinit_error=True,
             runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled", "JAX_PLATFORMS": "cpu"}})
    return ray


def _actors():
    import ray

    @ray.remote(num_cpus=0, max_restarts=0)
    class RolloutWorker:
        def __init__(self, cfg_dict: dict, model_config_hf: dict, worker_id: int):
            from jax_rl.config import Config
            from jax_rl.models.qwen3 import Qwen3Config
            from jax_rl.runtime import components as C
            from rollout.agent import AgentLoop

            self.cfg = Config.model_validate(cfg_dict)
            self.mc = Qwen3Config.from_hf(model_config_hf)
            self.tok = C.build_tokenizer(self.cfg)
            self.env_factory = C.build_env_factory(self.cfg)
            self.gen = None
            self.agent_cls = AgentLoop
            self.agent = None
            self.worker_id = worker_id

        def pid(self) -> int:
            return os.getpid()

        def set_params(self, params, version: int) -> int:
            from jax_rl.runtime import components as C

            if self.gen is None:
                self.gen = C.build_generator(self.cfg, self.mc, params, version)
                self.agent = self.agent_cls(self.gen, self.tok, self.env_factory, self.cfg.rollout)
            else:
                self.gen.update_params(params, version)
            return version

        def run_group(self, group_id: int, task_seed: int) -> list[dict]:
            trajs = self.agent.submit_group(task_seed, group_id).result()
            return [t.to_dict() for t in trajs]

        def stop(self) -> None:
            if self.gen is not None:
                self.gen.stop()

    @ray.remote(num_cpus=0)
    class BufferActor:
        def __init__(self, group_size: int, max_staleness: int, groups_per_step: int, state: Optional[dict]):
            from rollout.buffer import TrajectoryBuffer

            self.buf = TrajectoryBuffer(group_size, max_staleness, groups_per_step=groups_per_step)
            if state:
                self.buf.import_state(state)

        def admit(self, version: int) -> bool:
            return self.buf.admit(version)

        def cancel(self, n: int = 1) -> None:
            self.buf.cancel(n)

        def put_group(self, group: list[dict]) -> int:
            from rollout.types import Trajectory

            return self.buf.put_group([Trajectory.from_dict(d) for d in group])

        def get_batch(self, n_groups: int, version: int) -> Optional[list[list[dict]]]:
            g = self.buf.get_batch(n_groups, version, timeout=0.0)
            return None if g is None else [[t.to_dict() for t in grp] for grp in g]

        def stats(self) -> dict:
            return self.buf.stats()

        def export_state(self) -> dict:
            return self.buf.export_state()

    return RolloutWorker, BufferActor


def run_train_ray(cfg: Config) -> int:
    """RL with Ray actors (SFT and eval run in the driver's learner, as in the embedded runtime)."""
    import ray

    from jax_rl.learner import collate
    from jax_rl.runtime import components as C
    from jax_rl.runtime.train import Trainer, _finish_sft, _json_safe, _save, _staleness_stats
    from rollout.types import Trajectory

    tr = Trainer(cfg)
    dump_config(cfg, tr.run_dir / "config.yaml")
    tr.open_writer()
    init_ray(tr.run_dir)
    RolloutWorker, BufferActor = _actors()
    K = cfg.async_.max_staleness
    n_groups = cfg.optim.batch_size // cfg.rollout.group_size
    counters = {"reissued_groups": 0, "worker_restarts": 0, "duplicate_groups": 0}
    try:
        if cfg.sft.steps > 0:
            tr.meta["sft_metrics"] = tr.sft()
        _finish_sft(tr.learner)
        ev = tr.evaluate(0, label="after_sft")
        tr.meta["sft_success"] = ev["success"]
        cfg_dict = cfg.to_dict()
        hf = tr.model_config.to_hf()
        buffer = BufferActor.remote(cfg.rollout.group_size, K, n_groups, None)
        params_ref = ray.put(tr.learner.get_params())
        version = tr.learner.version
        workers = [RolloutWorker.remote(cfg_dict, hf, i) for i in range(cfg.runtime.ray_workers)]
        ray.get([w.set_params.remote(params_ref, version) for w in workers])
        in_flight: dict = {}  # ref -> (worker index, gid, seed)
        next_gid = 0
        done_gids: set[int] = set()
        reissue: list[tuple[int, int]] = []
        per_worker = max(1, cfg.rollout.slots // cfg.rollout.group_size) + 1

        def dispatch():
            nonlocal next_gid
            for wi, w in enumerate(workers):
                busy = sum(1 for v in in_flight.values() if v[0] == wi)
                while busy < per_worker:
                    if reissue:
                        gid, seed = reissue.pop(0)
                    else:
                        if not ray.get(buffer.admit.remote(version)):
                            return
                        gid, seed = next_gid, cfg.env.train_seed_offset + next_gid
                        next_gid += 1
                    in_flight[w.run_group.remote(gid, seed)] = (wi, gid, seed)
                    busy += 1

        def collect(timeout: float):
            refs = list(in_flight)
            if not refs:
                time.sleep(timeout)
                return
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
            for ref in ready:
                if ref not in in_flight:  # already re-issued after its worker died
                    continue
                wi, gid, seed = in_flight.pop(ref)
                try:
                    group = ray.get(ref)
                except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError,
                        ray.exceptions.WorkerCrashedError) as e:
                    log.warning("rollout worker %d died (%s); restarting it and re-issuing its groups", wi, type(e).__name__)
                    _restart(wi)
                    reissue.append((gid, seed))
                    counters["reissued_groups"] += 1
                    continue
                if gid in done_gids:
                    counters["duplicate_groups"] += 1
                    continue
                done_gids.add(gid)
                ray.get(buffer.put_group.remote(group))

        def _restart(wi: int):
            # re-issue the dead worker's other in-flight groups too
            for ref, (w2, gid, seed) in list(in_flight.items()):
                if w2 == wi:
                    in_flight.pop(ref)
                    reissue.append((gid, seed))
                    counters["reissued_groups"] += 1
            workers[wi] = RolloutWorker.remote(cfg_dict, hf, wi)
            ray.get(workers[wi].set_params.remote(params_ref, version))
            counters["worker_restarts"] += 1

        tr.ray_workers = workers  # exposed for tests (kill a worker mid-run)
        last: dict = {}
        from jax_rl.console import TrainProgress

        with TrainProgress(cfg.run.steps, enabled=cfg.logging.progress) as bar:
            for step in range(cfg.run.steps):
                groups = None
                t_wait = time.perf_counter()
                while groups is None:
                    dispatch()
                    groups = ray.get(buffer.get_batch.remote(n_groups, version))
                    if groups is None:
                        collect(0.2)
                        _maybe_kill_for_test(tr, step, workers)
                groups = sorted([[Trajectory.from_dict(d) for d in g] for g in groups], key=lambda g: g[0].group_id)
                adv = C.compute_advantages(cfg, groups)
                trajs = [t for g in groups for t in g]
                batch = collate(trajs, np.concatenate(adv), cfg.optim.max_seq_len, pad_id=tr.tokenizer.pad_id)
                st = _staleness_stats(batch, version)
                metrics = tr.learner.train_step(batch)
                version = tr.learner.version
                params_ref = ray.put(tr.learner.get_params())  # one object-store copy per version
                for w in workers:
                    w.set_params.remote(params_ref, version)
                rewards = np.asarray([t.reward for t in trajs], np.float32)
                row = {"step": step + 1, "version": version, "prox_source": cfg.loss.correction,
                       "group_ids": [int(g[0].group_id) for g in groups], "reward_mean": float(rewards.mean()),
                       "success_rate": float((rewards >= 1.0 - 1e-6).mean()), **metrics,
                       **{k: v for k, v in st.items() if k not in metrics},
                       "wait_s": time.perf_counter() - t_wait,
                       **{f"buffer/{k}": v for k, v in ray.get(buffer.stats.remote()).items()},
                       **{f"ray/{k}": v for k, v in counters.items()},
                       "wall_s": time.perf_counter() - tr.t0}
                tr.writer.write(step + 1, row)
                last = row
                bar.update(step + 1, row)
        for w in workers:
            try:
                ray.get(w.stop.remote(), timeout=10)
            except Exception:
                pass
        tr.meta.update(rl_steps=int(last.get("step", 0)), buffer=ray.get(buffer.export_state.remote()),
                       buffer_stats=ray.get(buffer.stats.remote()), ray_counters=counters)
        _save(tr)
        final = tr.evaluate(int(last.get("step", 0)), label="final")
        summary = {"sft_success": tr.meta.get("sft_success"), "final_success": final.get("success"),
                   "final_pass_at_k": final.get(f"pass@{cfg.eval.k}"), "wall_s": time.perf_counter() - tr.t0,
                   "rl_steps": int(last.get("step", 0)), "runtime": "ray", **counters,
                   **{f"buffer_{k}": v for k, v in tr.meta["buffer_stats"].items()}}
        (tr.run_dir / "summary.json").write_text(json.dumps(_json_safe(summary), indent=2))
        print(json.dumps(_json_safe(summary), indent=2))
        return 0
    finally:
        tr.close()
        tr.learner.close()
        ray.shutdown()


def _maybe_kill_for_test(tr, step: int, workers) -> None:
    """Fault injection for the Ray smoke test: ``JAX_RL_TEST_KILL_WORKER_AT_STEP=N`` kills worker 0
    once when step N is reached (a test hook; unset in normal runs)."""
    at = os.environ.get("JAX_RL_TEST_KILL_WORKER_AT_STEP")
    if at is None or getattr(tr, "_killed", False) or step < int(at):
        return
    import ray

    tr._killed = True
    log.warning("test hook: killing rollout worker 0 at step %d", step)
    ray.kill(workers[0], no_restart=True)
