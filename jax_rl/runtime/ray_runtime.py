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
twice. Every ``checkpoint.every`` steps (and at the end, or on SIGTERM/Ctrl-C) the learner saves
its state with the buffer, the next group id and the groups still in flight; ``--resume`` restores
them and re-issues those groups. Ray runs with ``RAY_AUTH_MODE=disabled``, no dashboard, and its
temp dir under the run dir.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Optional

from jax_rl.config import Config

log = logging.getLogger("jax_rl.runtime")

__all__ = ["run_train_ray", "init_ray"]


_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def init_ray(run_dir: Path, num_cpus: Optional[int] = None, runtime=None):
    """Start (or join) Ray for ``runtime=ray``: auth off, no dashboard, temp dir under ``run_dir``.

    Binding (``runtime``: a :class:`jax_rl.config.RuntimeConfig`; None = the defaults):

    * ``ray_address`` None and ``bind_host`` loopback (default ``127.0.0.1``): a local Ray whose node
      IP is 127.0.0.1, so gcs_server, raylet, the runtime-env agent, the autoscaler monitor, every
      worker and the driver's core worker listen on loopback only (checked by
      ``tests/runtime/test_ray_bind.py`` with the OS socket table).
    * ``bind_host`` another address: a local Ray with that node IP (multi-host head). Ray 2.60 then
      listens on all interfaces (its gRPC servers bind ``0.0.0.0``/``::`` whenever the node IP is not
      loopback) with auth disabled; a warning says so.
    * ``ray_address`` set: join that cluster (``ray.init(address=...)``); its own settings apply.

    Ray 2.60 turns a loopback ``_node_ip_address`` back into the machine's routable IP unless
    ``ray._private.ray_constants.ENABLE_RAY_CLUSTER`` (env ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``) is
    off, so for loopback both are set before Ray starts.

    Unix socket paths are limited to ~107 bytes; when ``run_dir/ray`` is too long, Ray's temp dir
    goes to a short dir under the system temp folder and a ``ray_tmp`` link in the run dir points
    to it.

    Raises:
        RuntimeError: a loopback bind was asked for but Ray came up with another node IP.
    """
    address = getattr(runtime, "ray_address", None)
    host = getattr(runtime, "bind_host", None) or "127.0.0.1"
    loopback = address is None and host in _LOOPBACK
    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if loopback:
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # read when ray_constants is imported
    import ray

    if ray.is_initialized():
        return ray
    runtime_env = {"env_vars": {"RAY_AUTH_MODE": "disabled", "JAX_PLATFORMS": "cpu"}}
    if address is not None:
        log.warning("runtime.ray_address=%s: joining an existing Ray cluster; its bind addresses and auth "
                    "settings apply (RISK: a cluster reachable off this machine accepts jobs from anyone "
                    "who reaches it)", address)
        ray.init(address=address, log_to_driver=False, ignore_reinit_error=True, runtime_env=runtime_env)
        return ray
    from ray._private import ray_constants

    if loopback:
        ray_constants.ENABLE_RAY_CLUSTER = False  # ray was imported before the env var was set
    else:
        log.warning("runtime.bind_host=%s: Ray listens on all interfaces with auth disabled (RISK: anyone "
                    "who reaches this machine can submit jobs); use only on a trusted network", host)
    tmp = (Path(run_dir) / "ray").resolve()
    if len(str(tmp)) > 40:
        short = Path(tempfile.mkdtemp(prefix="jxrl-ray-"))
        link = Path(run_dir) / "ray_tmp"
        if not link.exists():
            link.symlink_to(short)
        tmp = short
    tmp.mkdir(parents=True, exist_ok=True)
    ray.init(num_cpus=num_cpus or os.cpu_count(), include_dashboard=False, _temp_dir=str(tmp),
             _node_ip_address="127.0.0.1" if loopback else (None if host in ("0.0.0.0", "::") else host),
             log_to_driver=False, ignore_reinit_error=True, runtime_env=runtime_env)
    if loopback:
        ip = ray.util.get_node_ip_address()
        if ip != "127.0.0.1":
            ray.shutdown()
            raise RuntimeError(f"runtime.bind_host={host}: Ray started with node IP {ip}, not loopback")
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
        def __init__(self, group_size: int, max_staleness: int, groups_per_step: int, state: Optional[dict],
                     max_seq_len: Optional[int] = None):
            from rollout.buffer import TrajectoryBuffer

            self.buf = TrajectoryBuffer(group_size, max_staleness, groups_per_step=groups_per_step,
                                        max_seq_len=max_seq_len)
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

    @ray.remote(num_cpus=0, max_restarts=0)
    class LearnerActor:
        """The learner (and the held-out evaluator, which needs its params) in its own process."""

        def __init__(self, cfg_dict: dict):
            import logging as _logging

            from jax_rl.config import Config
            from jax_rl.runtime.train import Trainer

            _logging.basicConfig(level=_logging.WARNING)
            self.cfg = Config.model_validate(cfg_dict)
            self.tr = Trainer(self.cfg, create_dir=False)
            from jax_rl.metrics import MetricsWriter

            # eval.jsonl only: the driver writes metrics.jsonl and TensorBoard
            self.tr.writer = MetricsWriter(self.tr.run_dir, tensorboard=False, wandb=False)

        def model_config_hf(self) -> dict:
            return self.tr.model_config.to_hf()

        def pad_id(self) -> int:
            return int(self.tr.tokenizer.pad_id)

        def restore(self) -> dict:
            """Restore the newest good (or ``resume_step``) checkpoint; returns the runtime
            metadata the driver saved with it (buffer, producer, counters) with ``rl_steps`` set
            to the RL step the checkpoint recorded, and ``resume_line``. Writes nothing."""
            self.tr.resume()
            return {**self.tr.meta, "resume_line": self.tr.resume_line, "resumed_step": self.tr.resumed_step}

        def materialize(self, drop_after: Optional[int] = None) -> None:
            """After every check: write config.yaml (and the bpe tokenizer); on a resume, delete
            the checkpoints newer than the restored step."""
            from jax_rl.runtime.train import drop_newer_checkpoints

            self.tr.materialize()
            if drop_after is not None:
                drop_newer_checkpoints(self.tr.learner, self.tr.ckpt_dir, drop_after)

        def sft_and_eval(self) -> dict:
            m = self.tr.sft(progress=False) if self.cfg.sft.steps > 0 else {}
            ev = self.tr.evaluate(0, label="after_sft")
            self.tr.meta.update(sft_done=True, sft_success=ev["success"], sft_metrics=m, sft_eval=ev)
            return ev

        def get_params(self):
            return self.tr.learner.get_params(host=True)

        def version(self) -> int:
            return int(self.tr.learner.version)

        def train_step(self, batch: dict) -> dict:
            return self.tr.learner.train_step(batch)

        def evaluate(self, step: int, label: str) -> dict:
            return self.tr.evaluate(step, label=label)

        def save(self, meta: dict) -> str:
            from jax_rl.runtime.train import _save

            self.tr.meta.update(meta)
            _save(self.tr, rl_step=int(meta["rl_steps"]))
            self.tr.learner.wait_for_checkpoints()
            return str(self.tr.ckpt_dir)

        def close(self) -> None:
            self.tr.close()
            self.tr.learner.close()

    return RolloutWorker, BufferActor, LearnerActor


def run_train_ray(cfg: Config) -> int:
    """RL with Ray actors: SFT, eval and training run in the learner actor; the driver dispatches
    groups to rollout workers, feeds the buffer actor, and broadcasts each version's params."""
    import ray

    from jax_rl.metrics import MetricsWriter
    from jax_rl.runtime import components as C
    from jax_rl.runtime.train import (_json_safe, _raise_if_disk_full, _mean_metric, _StopFlag, signal_exit_code,
                                      write_outputs)
    from rollout.types import Trajectory

    t0 = time.perf_counter()
    C.rollout_preflight(cfg, C.build_tokenizer(cfg), C.build_env_factory(cfg))  # warnings; ConfigError if nothing fits
    run_dir = C.resolve_run_dir(cfg)
    ckpt_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"
    # config.yaml is written by the learner actor once the restore and its checks have passed
    stop = _StopFlag()
    stop.install()
    init_ray(run_dir, runtime=cfg.runtime)
    RolloutWorker, BufferActor, LearnerActor = _actors()
    K = cfg.async_.max_staleness
    n_groups = cfg.optim.batch_size // cfg.rollout.group_size
    counters = {"reissued_groups": 0, "worker_restarts": 0, "duplicate_groups": 0}
    writer = None
    cfg_dict = cfg.to_dict()
    learner = LearnerActor.remote(cfg_dict)
    workers: list = []
    try:
        hf = _ray_get(learner.model_config_hf.remote())
        pad_id = ray.get(learner.pad_id.remote())
        meta: dict = {}
        if cfg.resume:
            meta = _ray_get(learner.restore.remote())  # one-line errors; nothing written yet
            print(meta.pop("resume_line"), flush=True)
        start_step = int(meta.get("rl_steps", 0))
        _ray_get(learner.materialize.remote(meta.pop("resumed_step", None)))
        writer = MetricsWriter(run_dir, tensorboard=cfg.logging.tensorboard, wandb=cfg.logging.wandb,
                               resume_step=start_step if cfg.resume else None)
        if meta.get("sft_done"):
            sft_eval = dict(meta.get("sft_eval") or {"success": meta.get("sft_success")})
        else:
            sft_eval = ray.get(learner.sft_and_eval.remote())
            print(f"held-out success after SFT: {sft_eval['success']:.3f}", flush=True)
        counters.update({k: int(v) for k, v in (meta.get("ray_counters") or {}).items() if k in counters})
        buffer = BufferActor.remote(cfg.rollout.group_size, K, n_groups, meta.get("buffer"), cfg.optim.max_seq_len)
        version = ray.get(learner.version.remote())
        params_ref = learner.get_params.remote()  # lives in the object store; every worker reads it
        workers = [RolloutWorker.remote(cfg_dict, hf, i) for i in range(cfg.runtime.ray_workers)]
        ray.get([w.set_params.remote(params_ref, version) for w in workers])
        in_flight: dict = {}  # ref -> (worker index, gid, seed)
        prod = meta.get("producer") or {}
        next_gid = int(prod.get("next_group", 0))
        guard = C.EpisodeGuard(cfg.rollout.max_consecutive_episode_errors, int(prod.get("episode_errors", 0)))
        done_gids: set[int] = set()
        # groups in flight at the checkpoint are re-issued first (their admission is in the buffer's state)
        reissue: list[tuple[int, int]] = [(int(g), int(sd)) for g, sd in prod.get("reissue", [])]
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
                    in_flight[workers[wi].run_group.remote(gid, seed)] = (wi, gid, seed)
                    busy += 1

        def restart(wi: int):
            for ref, (w2, gid, seed) in list(in_flight.items()):
                if w2 == wi:
                    in_flight.pop(ref)
                    reissue.append((gid, seed))
                    counters["reissued_groups"] += 1
            workers[wi] = RolloutWorker.remote(cfg_dict, hf, wi)
            ray.get(workers[wi].set_params.remote(params_ref, version))
            counters["worker_restarts"] += 1

        def collect(timeout: float):
            refs = list(in_flight)
            if not refs:
                time.sleep(timeout)
                return
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
            for ref in ready:
                if ref not in in_flight:  # already re-issued after its worker died
                    continue
                wi, gid, seed = in_flight[ref]
                try:
                    group = ray.get(ref)
                except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError) as e:
                    log.warning("rollout worker %d died (%s): restarting it, re-issuing its groups", wi,
                                type(e).__name__)
                    restart(wi)
                    continue
                except Exception as e:  # the group's loop raised: drop it, give its slot back, count it
                    log.warning("group %d failed on rollout worker %d: %r", gid, wi, e)
                    in_flight.pop(ref)
                    ray.get(buffer.cancel.remote(1))
                    guard.record_error(cfg.rollout.group_size, f"group {gid}: {type(e).__name__}")
                    continue
                in_flight.pop(ref)
                if gid in done_gids:
                    counters["duplicate_groups"] += 1
                    continue
                done_gids.add(gid)
                try:
                    ray.get(buffer.put_group.remote(group))
                except Exception as e:  # a malformed group: drop it, give its slot back, count it
                    log.warning("group %d could not be put into the buffer: %r", gid, e)
                    ray.get(buffer.cancel.remote(1))
                    guard.record_error(len(group), f"put group {gid}: {type(e).__name__}")
                    continue
                guard.record(group)

        def save(rl_steps: int) -> None:
            pending = sorted([(g, sd) for (_, g, sd) in in_flight.values()] + reissue)
            writer.flush()  # every row up to rl_steps is on disk before its checkpoint
            _ray_get(learner.save.remote(_json_safe({
                "rl_steps": rl_steps, "buffer": ray.get(buffer.export_state.remote()),
                "buffer_stats": ray.get(buffer.stats.remote()), "ray_counters": counters,
                "producer": {"next_group": next_gid, "reissue": [[int(g), int(sd)] for g, sd in pending],
                             "episode_errors": guard.episode_errors},
            })))

        last: dict = {}
        from jax_rl.console import TrainProgress

        with TrainProgress(cfg.run.steps, enabled=cfg.logging.progress) as bar:
            for step in range(start_step, cfg.run.steps):
                if stop.event.is_set():
                    break
                groups = None
                t_wait = time.perf_counter()
                while groups is None and not stop.event.is_set():
                    _maybe_kill_for_test(step, workers)
                    collect(0.0)
                    dispatch()
                    groups = ray.get(buffer.get_batch.remote(n_groups, version))
                    if groups is None:
                        collect(0.2)
                    if groups is None and guard.fatal:  # one bad episode is dropped; a failing rollout stops
                        raise RuntimeError(guard.fatal)
                if groups is None:
                    break
                wait_s = time.perf_counter() - t_wait
                groups = [[Trajectory.from_dict(d) for d in g] for g in groups]
                groups, trajs, batch = C.learner_batch(cfg, groups, pad_id)
                v_train = version
                metrics = ray.get(learner.train_step.remote(batch))
                version = ray.get(learner.version.remote())
                params_ref = learner.get_params.remote()  # one object-store copy per version
                for w in workers:
                    w.set_params.remote(params_ref, version)
                row = C.step_row(cfg, step + 1, version, metrics, batch, groups, trajs, v_train)
                bstats = ray.get(buffer.stats.remote())
                row.update({"wait_s": wait_s, "episode_errors": guard.episode_errors,
                            "dropped_overlong": bstats["dropped_overlong"],
                            **{f"buffer/{k}": v for k, v in bstats.items()},
                            **{f"ray/{k}": v for k, v in counters.items()},
                            "wall_s": time.perf_counter() - t0})
                writer.write(step + 1, row)
                last = row
                bar.update(step + 1, row)
                if cfg.eval.every and (step + 1) % cfg.eval.every == 0 and step + 1 < cfg.run.steps:
                    ev = ray.get(learner.evaluate.remote(step + 1, "eval"))
                    print(f"eval @ step {step + 1}: held-out success {ev['success']:.3f}", flush=True)
                if cfg.checkpoint.every and (step + 1) % cfg.checkpoint.every == 0:
                    save(step + 1)
        for w in workers:
            try:
                ray.get(w.stop.remote(), timeout=10)
            except Exception:
                pass
        rl_steps = int(last.get("step", start_step))
        save(rl_steps)
        bstats = ray.get(buffer.stats.remote())
        interrupted = stop.event.is_set()
        final = ray.get(learner.evaluate.remote(rl_steps, "final")) if not interrupted else {}
        writer.close()
        summary = {"sft_success": sft_eval.get("success"), "final_success": final.get("success"),
                   f"final_pass_at_{cfg.eval.k}": final.get(f"pass@{cfg.eval.k}"),
                   "final_pass_at_k": final.get(f"pass@{cfg.eval.k}"),
                   f"final_avg_at_{cfg.eval.k}": final.get(f"avg@{cfg.eval.k}"),
                   "wall_s": time.perf_counter() - t0, "rl_steps": rl_steps, "version": version,
                   "correction": cfg.loss.correction, "max_staleness": K, "interrupted": interrupted,
                   "runtime": "ray", "tokens_per_s_mean": _mean_metric(run_dir, "tokens_per_s"), **counters,
                   "episode_errors": guard.episode_errors, "dropped_overlong": bstats["dropped_overlong"],
                   **{f"buffer_{k}": v for k, v in bstats.items()}}
        write_outputs(run_dir, ckpt_dir, _json_safe(summary))
        return signal_exit_code(stop)
    except Exception as e:
        _raise_if_disk_full(e, run_dir, ckpt_dir)
        raise
    finally:
        if writer is not None:
            writer.close()
        try:
            ray.get(learner.close.remote(), timeout=30)
        except Exception:
            pass
        ray.shutdown()
        stop.restore()


def _ray_get(ref):
    """``ray.get`` that re-raises an actor's exception as itself (its one-line message, not the
    RayTaskError with the remote traceback), so the CLI reports it like the embedded runtime."""
    import ray

    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, Exception):
            raise cause from None
        raise


_KILLED = {"done": False}


def _maybe_kill_for_test(step: int, workers) -> None:
    """Fault injection for the Ray smoke test: ``JAX_RL_TEST_KILL_WORKER_AT_STEP=N`` kills worker 0
    once when step N is reached (a test hook; unset in normal runs)."""
    at = os.environ.get("JAX_RL_TEST_KILL_WORKER_AT_STEP")
    if at is None or _KILLED["done"] or step < int(at):
        return
    import ray

    _KILLED["done"] = True
    log.warning("test hook: killing rollout worker 0 at step %d", step)
    ray.kill(workers[0], no_restart=True)
