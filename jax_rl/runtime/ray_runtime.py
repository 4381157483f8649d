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
from jax_rl.runtime.loop import WeightSyncClock, buffer_columns

log = logging.getLogger("jax_rl.runtime")

__all__ = ["run_train_ray", "init_ray", "check_ray_endpoints", "RayDaemonWatch", "RayProducer", "RemoteLearner",
           "RayFailure"]


_LOOPBACK = ("127.0.0.1", "localhost", "::1")


class RayFailure(RuntimeError):
    """Ray itself failed the run, not the config: the local Ray node did not start (Ray gives its
    raylet 30 s to register, which a loaded host can miss), or the learner actor died or could not
    start. The CLI prints it in one line and exits 1 (a failed run, docs/usage.md#exit-codes)."""


def _kill_ray_started_under(tmp: Path) -> None:
    """After a failed ``ray.init``: end the Ray processes it started (their command lines name its
    temp dir ``tmp``; nothing else is touched), so a failed start leaves no daemon behind."""
    try:
        import ray

        ray.shutdown()
    except Exception:  # noqa: BLE001 - best effort: the processes are killed below anyway
        pass
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil ships with ray
        return
    root = str(tmp)
    for p in psutil.process_iter(["cmdline"]):
        try:
            if p.pid != os.getpid() and root in " ".join(p.info["cmdline"] or []):
                p.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue


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
        RayFailure: the local Ray node did not start (its processes are killed first).
        ConfigError: ``ray_address`` given and the cluster cannot be joined.
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
        try:
            ray.init(address=address, log_to_driver=False, ignore_reinit_error=True, runtime_env=runtime_env)
        except Exception as e:  # noqa: BLE001 - Ray's connection errors: ConnectionError, TimeoutError, RuntimeError
            from jax_rl.config import ConfigError

            try:
                ray.shutdown()
            except Exception:  # noqa: BLE001
                pass
            raise ConfigError(f"runtime.ray_address={address}: cannot join the Ray cluster "
                              f"({type(e).__name__}: {' '.join(str(e).split())[:300]})") from None
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
    try:
        ray.init(num_cpus=num_cpus or os.cpu_count(), include_dashboard=False, _temp_dir=str(tmp),
                 _node_ip_address="127.0.0.1" if loopback else (None if host in ("0.0.0.0", "::") else host),
                 log_to_driver=False, ignore_reinit_error=True, runtime_env=runtime_env)
    except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception when its node times out at startup
        _kill_ray_started_under(tmp)
        raise RayFailure(f"runtime=ray: the local Ray node did not start ({type(e).__name__}: "
                         f"{' '.join(str(e).split())[:300]}); on a loaded host Ray's 30 s startup wait can run "
                         "out: retry when the host is less busy, or use runtime=embedded") from None
    if loopback:
        ip = ray.util.get_node_ip_address()
        if ip != "127.0.0.1":
            ray.shutdown()
            raise RuntimeError(f"runtime.bind_host={host}: Ray started with node IP {ip}, not loopback")
    return ray


def check_ray_endpoints(runtime, timeout_s: float = 5.0) -> None:
    """``runtime.bind_host`` / ``runtime.ray_address`` checked before the run dir or Ray exist, so
    that one that does not answer fails in one line within ``timeout_s`` (Ray itself retries the GCS
    connection for minutes).

    * ``bind_host`` (a local Ray): resolvable and an address of this machine (a socket binds it).
    * ``ray_address`` (join a cluster): ``host:port`` or ``ray://host:port`` (``auto`` / ``local``
      are Ray's own lookups and are left to it) accepts a TCP connection within ``timeout_s``.

    Raises:
        ConfigError: naming the key, the value and what failed.
    """
    import socket

    from jax_rl.config import ConfigError

    address = getattr(runtime, "ray_address", None)
    if address is None:
        host = getattr(runtime, "bind_host", None) or "127.0.0.1"
        if host in _LOOPBACK or host in ("0.0.0.0", "::"):
            return
        try:
            infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError) as e:
            raise ConfigError(f"runtime.bind_host={host}: cannot be resolved ({e}); give an address of this "
                              "machine, e.g. 127.0.0.1") from None
        fam, _, _, _, sa = infos[0]
        with socket.socket(fam, socket.SOCK_STREAM) as s:
            try:
                s.bind((sa[0], 0))
            except OSError as e:
                raise ConfigError(f"runtime.bind_host={host}: not an address of this machine ({e.strerror}); "
                                  "Ray's node IP must be one of its own, e.g. 127.0.0.1") from None
        return
    if address in ("auto", "local"):
        return
    hostport = address.split("://", 1)[-1].rsplit("/", 1)[0]
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ConfigError(f"runtime.ray_address={address}: expected host:port or ray://host:port")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except (OSError, UnicodeError) as e:
        raise ConfigError(f"runtime.ray_address={address}: nothing answers at {host}:{port} within {timeout_s:g} s "
                          f"({getattr(e, 'strerror', None) or e}); start the cluster (`ray start --head`) or fix "
                          "the address") from None


def _reclaim_signals(stop) -> None:
    """Point SIGINT / SIGTERM at the run's :class:`~jax_rl.runtime.context.StopFlag` again:
    ``ray.init`` installs its own SIGTERM handler (``sys.exit``: the driver would die within
    seconds with no end checkpoint and no ``summary.json``). The handlers saved before Ray started
    stay the ones :meth:`StopFlag.restore` puts back."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, stop._handler)


class RayDaemonWatch:
    """Watches the local Ray's raylet and GCS server from the driver (their process handles, every
    ``period_s``). If one dies, Ray's core worker ends the driver within seconds with no word of
    what died; this ends it first, with one line naming the daemon, its pid and exit code, the RL
    step reached and the last checkpoint, a ``summary.json`` (``ray_failed``), the remaining Ray
    daemons killed, and exit code 1. The checkpoints are untouched (Orbax commits a step by
    renaming it, so the newest committed one is intact).

    A joined cluster (``runtime.ray_address``) has no local daemons to watch: nothing is started.
    """

    def __init__(self, cfg: Config, run_dir: Path, ckpt_dir: Path, t0: float, period_s: float = 0.5):
        import threading

        self.cfg, self.run_dir, self.ckpt_dir, self.t0, self.period_s = cfg, Path(run_dir), Path(ckpt_dir), t0, period_s
        self.procs: dict = {}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        try:
            import ray

            node = ray._private.worker._global_node
            for kind in ("raylet", "gcs_server"):
                for info in (node.all_processes.get(kind) or []) if node is not None else []:
                    self.procs[kind] = info.process
        except Exception:  # noqa: BLE001 - a Ray without these internals: nothing to watch
            self.procs = {}

    def start(self) -> "RayDaemonWatch":
        import threading

        if self.procs:
            self._thread = threading.Thread(target=self._run, name="ray-daemon-watch", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching (before ``ray.shutdown``, which ends the daemons on purpose)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def dead(self) -> Optional[tuple[str, int, int]]:
        """``(daemon, pid, exit code)`` of the first watched daemon that has exited, else None."""
        for kind, p in self.procs.items():
            rc = p.poll()
            if rc is not None:
                return kind, int(p.pid), int(rc)
        return None

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            d = self.dead()
            if d is not None and not self._stop.is_set():
                self.fail(*d)

    def fail(self, kind: str, pid: int, rc: int, *, exit: bool = True) -> str:
        """Write ``summary.json``, print the one line, kill what is left of Ray, exit 1 (``exit=False``:
        return the line instead; tests)."""
        import json
        import sys

        from jax_rl.metrics import read_jsonl

        rows = read_jsonl(self.run_dir / "metrics.jsonl") if (self.run_dir / "metrics.jsonl").exists() else []
        rl_steps = int(rows[-1]["step"]) if rows else 0
        steps = sorted(int(p.name) for p in self.ckpt_dir.glob("[0-9]*") if p.is_dir() and p.name.isdigit()) \
            if self.ckpt_dir.is_dir() else []
        last = str(self.ckpt_dir / str(steps[-1])) if steps else None
        what = f"Ray's {kind} (pid {pid}) died (exit code {rc})"
        line = (f"{what}: the run stopped after RL step {rl_steps}; last checkpoint: {last or 'none'}"
                + (" (jax-rl train ... --resume continues from it)" if last else ""))
        summary = {"rl_steps": rl_steps, "interrupted": False, "runtime": "ray", "ray_failed": what,
                   "last_checkpoint": last, "correction": self.cfg.loss.correction,
                   "max_staleness": self.cfg.async_.max_staleness, "wall_s": time.perf_counter() - self.t0}
        try:
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        except OSError:
            pass
        if not exit:
            return line
        print(f"jax-rl: {line}", file=sys.stderr, flush=True)
        try:
            import ray

            ray._private.worker._global_node.kill_all_processes(check_alive=False, allow_graceful=False)
        except Exception:  # noqa: BLE001 - best effort: the exit below must happen
            pass
        os._exit(1)


def _actors():
    import ray

    @ray.remote(num_cpus=0, max_restarts=0)
    class RolloutWorker:
        """One rollout engine, generator and agent loop in its own process, pinned to
        ``runtime.rollout_cpus`` before JAX starts. Created with ``max_concurrency`` above the
        groups it is given at once (:attr:`RayProducer.per_worker`): its groups decode together in
        the engine's ``rollout.slots`` and a ``set_params`` is not queued behind them."""

        def __init__(self, cfg_dict: dict, model_config_hf: dict, worker_id: int, user_model: Optional[dict] = None):
            from jax_rl.runtime.affinity import pin_process

            pin_process((cfg_dict.get("runtime") or {}).get("rollout_cpus"))  # before JAX's CPU client
            from jax_rl.config import Config
            from jax_rl.models.qwen3 import Qwen3Config
            from jax_rl.runtime.envs import build_env_factory, build_tokenizer
            from rollout.agent import AgentLoop

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
            from jax_rl.runtime.affinity import thread_affinities

            return thread_affinities()

        def cpu_s(self) -> float:
            """This process's CPU seconds so far (all threads)."""
            return time.process_time()

        def set_params(self, params, version: int) -> float:
            """Build the generator (first call) or swap its weights; returns the seconds of the
            swap's cast/reshard (``Generator.update_params``; 0.0 for the first build)."""
            from jax_rl.runtime import engines

            if self.gen is None:
                self.gen = engines.build_generator(self.cfg, self.mc, params, version)
                if self._user_model is not None:  # the tau² user model beside the engine: frozen, never published to
                    from jax_rl.models.qwen3 import Qwen3Config

                    self.user_gen = engines.build_generator(
                        self.cfg, Qwen3Config.from_hf(self._user_model["model_config_hf"]),
                        self._user_model["params"], 0)
                    self.env_factory.user_model.bind(self.user_gen, self.tok)
                    self._user_model = None
                self.agent = self.agent_cls(self.gen, self.tok, self.env_factory, self.cfg.rollout,
                                              group_size=self.cfg.algo.group_size)
                return 0.0
            return float(self.gen.update_params(params, version))

        def run_group(self, group_id: int, task_seed: int) -> list[dict]:
            trajs = self.agent.submit_group(task_seed, group_id).result()
            return [t.to_dict() for t in trajs]

        def stop(self) -> None:
            if self.gen is not None:
                self.gen.stop()
            if self.user_gen is not None:
                self.user_gen.stop()

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
        """The :class:`~jax_rl.runtime.context.RunContext` (learner and held-out evaluator) in its
        own process; the driver drives it through :class:`RemoteLearner`."""

        def __init__(self, cfg_dict: dict):
            from jax_rl.runtime.affinity import pin_process

            pin_process((cfg_dict.get("runtime") or {}).get("learner_cpus"))  # before JAX's CPU client
            import logging as _logging

            from jax_rl.config import Config
            from jax_rl.runtime.context import RunContext

            _logging.basicConfig(level=_logging.WARNING)
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
            from jax_rl.runtime.affinity import thread_affinities

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
            from jax_rl.runtime.context import drop_newer_checkpoints

            self.ctx.materialize()
            if drop_after is not None:
                drop_newer_checkpoints(self.ctx.learner, self.ctx.ckpt_dir, drop_after)

        def sft_and_eval(self) -> dict:
            return self.ctx.sft_and_eval(progress=False)

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

        def evaluate(self, step: int, label: str) -> dict:
            return self.ctx.evaluate(step, label=label)

        def save(self, rl_step: int, meta: dict) -> str:
            self.ctx.save(rl_step, meta, wait=True)
            return str(self.ctx.ckpt_dir)

        def close(self) -> None:
            self.ctx.close()
            self.ctx.learner.close()

    return RolloutWorker, BufferActor, LearnerActor


class RemoteLearner:
    """The driver's :class:`~jax_rl.runtime.loop.LearnerHandle` over the learner actor."""

    def __init__(self, actor):
        self.actor = actor

    @property
    def version(self) -> int:
        return int(_ray_get(self.actor.version.remote()))

    @property
    def opt_step(self) -> int:
        return int(_ray_get(self.actor.opt_step.remote()))

    def train_step(self, batch: dict, *, process_local: bool = False) -> dict:
        """One learner step on the actor. ``process_local`` must be False: the Ray driver is one
        process and sends the whole batch. Raises ValueError otherwise."""
        if process_local:
            raise ValueError("runtime=ray: the driver sends whole batches; process_local=True is a multi-process embedded option")
        return _ray_get(self.actor.train_step.remote(batch))

    def evaluate(self, step: int, label: str = "eval") -> dict:
        return _ray_get(self.actor.evaluate.remote(step, label))

    def save(self, rl_step: int, meta: Optional[dict] = None, *, wait: bool = False) -> None:
        """Always committed before it returns (the actor waits)."""
        from rollout.types import json_safe

        _ray_get(self.actor.save.remote(int(rl_step), json_safe(meta or {}, default=str)))


class RayProducer:
    """The Ray runtime's :class:`~jax_rl.runtime.loop.Producer`: dispatches groups (after buffer
    admission) to ``runtime.ray_workers`` :class:`RolloutWorker` actors, collects them with
    ``ray.wait`` into the buffer actor, replaces a worker that died and re-issues its groups
    (``reissued_groups``), and drops a group that arrives twice (``duplicate_groups``).

    Args:
        cfg: the run config.
        learner_actor: the learner actor (its params are put in the object store once per version).
        model_config_hf: the model config as an HF dict (the workers rebuild it).
        meta: the run metadata restored on resume (``buffer``, ``producer``, ``ray_counters``).
        actor_classes: ``(RolloutWorker, BufferActor)`` as returned by :func:`_actors`.
    """

    def __init__(self, cfg: Config, learner_actor, model_config_hf: dict, meta: Optional[dict] = None, *,
                 actor_classes: tuple):
        import ray

        from jax_rl.runtime.loop import EpisodeGuard

        self._ray = ray
        meta = meta or {}
        self.cfg = cfg
        self._cfg_dict = cfg.to_dict()
        self._hf = model_config_hf
        self._learner = learner_actor
        self._worker_cls, buffer_cls = actor_classes
        self.counters = {"reissued_groups": 0, "worker_restarts": 0, "duplicate_groups": 0}
        self.counters.update({k: int(v) for k, v in (meta.get("ray_counters") or {}).items() if k in self.counters})
        n_groups = cfg.optim.batch_size // cfg.algo.group_size
        self.buffer = buffer_cls.remote(cfg.algo.group_size, cfg.async_.max_staleness, n_groups,
                                        meta.get("buffer"), cfg.optim.max_seq_len)
        prod = meta.get("producer") or {}
        self.next_gid = int(prod.get("next_group", 0))
        self.guard = EpisodeGuard(cfg.rollout.max_consecutive_episode_errors, int(prod.get("episode_errors", 0)))
        # groups in flight at the checkpoint are re-issued first (their admission is in the buffer's state)
        self.reissue: list[tuple[int, int]] = [(int(g), int(sd)) for g, sd in prod.get("reissue", [])]
        self.in_flight: dict = {}  # ref -> (worker index, gid, seed)
        self.done_gids: set[int] = set()
        # groups a worker holds at once: its slots' worth plus one step's batch, so that it keeps
        # decoding while the driver is blocked in a learner step (groups are dispatched only between
        # steps); admission (async.max_staleness) bounds them all the same
        self.per_worker = max(1, cfg.rollout.slots // cfg.algo.group_size) + n_groups
        self.workers: list = []
        self.version = 0
        self.params_ref = None
        self.user_ref = None  # env.tau2.user=model: the learner actor's user model, in the object store
        self.weight_sync = WeightSyncClock()  # publish timings (weight_sync_s columns)
        self._fatal: Optional[str] = None
        self._syncs: list = []  # set_params refs of publishes whose worker seconds are not collected yet
        self.stop_event = None
        """A ``threading.Event`` (the run's :class:`~jax_rl.runtime.context.StopFlag` event) that ends
        :meth:`start`'s wait for the workers' first weights early: a SIGTERM while the workers build
        their engines stops the run at once instead of after every engine has compiled."""

    @property
    def fatal(self) -> Optional[str]:
        """Why the run must stop (a systematically failing rollout, no training seed left below
        ``eval.seed_offset``, a dead Ray daemon), else None."""
        return self._fatal or self.guard.fatal

    def start(self) -> None:
        if self.workers:
            return
        ray = self._ray
        self.version = int(ray.get(self._learner.version.remote()))
        self.params_ref = self._learner.get_params.remote()  # lives in the object store; every worker reads it
        if self.cfg.env.name == "tau2" and self.cfg.env.tau2.user == "model":  # one copy for every worker
            self.user_ref = self._learner.user_model.remote()
        self.workers = [self._new_worker(i) for i in range(self.cfg.runtime.ray_workers)]
        pending = [w.set_params.remote(self.params_ref, self.version) for w in self.workers]
        while pending:  # each worker builds its engine (compiles) here: minutes on a loaded host
            if self.stop_event is not None and self.stop_event.is_set():
                return  # stopped: the loop sees the flag before its first step; stop() ends the workers
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=0.5)
            ray.get(ready)  # a worker that failed to build raises here

    def _new_worker(self, i: int):
        # its per_worker groups run at once (one thread each, blocked on the group's future) and a
        # set_params and the cpu_s / affinity probes beside them
        return self._worker_cls.options(max_concurrency=self.per_worker + 2).remote(self._cfg_dict, self._hf, i,
                                                                                   self.user_ref)

    def poll(self, n_groups: int, version: int) -> Optional[list]:
        from rollout.types import Trajectory

        ray = self._ray
        self._collect(0.0)
        self._dispatch()
        groups = ray.get(self.buffer.get_batch.remote(n_groups, version))
        if groups is None:
            self._collect(0.2)
            return None
        return [[Trajectory.from_dict(d) for d in g] for g in groups]

    def publish(self, version: int) -> None:
        """Put the learner's params of ``version`` in the object store (one copy per version) and
        send them to every worker. Timed on the driver into :attr:`weight_sync` (``weight_sync_s``):
        the learner's device-to-host copy and put, waited for (``ray.wait``), and the sends. The
        workers' own cast/reshard seconds (``set_params``' return, ``weight_sync_cast_s``) are
        collected when they are done, possibly a row later: a worker runs ``set_params`` after the
        groups already queued on it, so the driver does not wait for it."""
        ray = self._ray
        t0 = time.perf_counter()
        self.version = int(version)
        self.params_ref = self._learner.get_params.remote()  # one object-store copy per version
        ray.wait([self.params_ref], fetch_local=False)  # the copy is in the store: its seconds are timed here
        self._syncs += [w.set_params.remote(self.params_ref, self.version) for w in self.workers]
        self.weight_sync.add(time.perf_counter() - t0)

    def _collect_syncs(self) -> None:
        """Add the cast/reshard seconds of the workers' finished ``set_params`` (a dead worker's
        is dropped: :meth:`_restart` gives its replacement the params again)."""
        if not self._syncs:
            return
        ready, self._syncs = self._ray.wait(self._syncs, num_returns=len(self._syncs), timeout=0)
        for ref in ready:
            try:
                self.weight_sync.add_cast(self._ray.get(ref))
            except Exception:  # noqa: BLE001 - the worker died; counted by the restart
                pass

    def cpu_columns(self) -> dict:
        """``learner_cpu_s`` / ``rollout_cpu_s``: CPU seconds so far of the learner actor's process and
        of the rollout workers' processes (summed; a replaced worker's count restarts), so that per
        role busy cores = CPU seconds / wall seconds (``bench/async_speedup.py`` reads them)."""
        ray = self._ray
        try:
            out = {"learner_cpu_s": float(ray.get(self._learner.cpu_s.remote(), timeout=30))}
            out["rollout_cpu_s"] = float(sum(ray.get([w.cpu_s.remote() for w in self.workers], timeout=30)))
        except Exception:  # noqa: BLE001 - a dead worker: no figure this row (the restart is counted)
            return {}
        return out

    def row(self) -> dict:
        self._collect_syncs()
        return {**buffer_columns(self._ray.get(self.buffer.stats.remote()), self.guard.episode_errors, row=True),
                **{f"ray/{k}": v for k, v in self.counters.items()}, **self.weight_sync.row(), **self.cpu_columns()}

    def summary(self) -> dict:
        self._collect_syncs()
        return {**buffer_columns(self._ray.get(self.buffer.stats.remote()), self.guard.episode_errors, row=False),
                **self.counters, **self.weight_sync.summary()}

    def state(self) -> dict:
        ray = self._ray
        pending = sorted([(g, sd) for (_, g, sd) in self.in_flight.values()] + self.reissue)
        return {"buffer": ray.get(self.buffer.export_state.remote()), "buffer_stats": ray.get(self.buffer.stats.remote()),
                "ray_counters": dict(self.counters),
                "producer": {"next_group": self.next_gid, "reissue": [[int(g), int(sd)] for g, sd in pending],
                             "episode_errors": self.guard.episode_errors}}

    def stop(self) -> None:
        for w in self.workers:
            try:
                self._ray.get(w.stop.remote(), timeout=10)
            except Exception:
                pass

    # ------------------------------------------------------------------ dispatch
    def _dispatch(self) -> None:
        """Admitted groups to the least busy worker, one at a time, until every worker holds
        :attr:`per_worker` groups or admission refuses."""
        ray = self._ray
        busy = [0] * len(self.workers)
        for wi, _, _ in self.in_flight.values():
            busy[wi] += 1
        while busy and min(busy) < self.per_worker:
            wi = busy.index(min(busy))
            if self.reissue:
                gid, seed = self.reissue.pop(0)
            else:
                gid, seed = self.next_gid, self.cfg.env.train_seed_offset + self.next_gid
                if seed >= self.cfg.eval.seed_offset:  # the held-out guard (the config's check is a lower bound)
                    self._fatal = (f"training task seed {seed} reached eval.seed_offset={self.cfg.eval.seed_offset}: "
                                   "raise eval.seed_offset so held-out tasks stay disjoint")
                    return
                if not ray.get(self.buffer.admit.remote(self.version)):
                    return
                self.next_gid += 1
            self.in_flight[self.workers[wi].run_group.remote(gid, seed)] = (wi, gid, seed)
            busy[wi] += 1

    def _restart(self, wi: int) -> None:
        for ref, (w2, gid, seed) in list(self.in_flight.items()):
            if w2 == wi:
                self.in_flight.pop(ref)
                self.reissue.append((gid, seed))
                self.counters["reissued_groups"] += 1
        self.workers[wi] = self._new_worker(wi)
        self._ray.get(self.workers[wi].set_params.remote(self.params_ref, self.version))
        self.counters["worker_restarts"] += 1

    def _collect(self, timeout: float) -> None:
        ray = self._ray
        refs = list(self.in_flight)
        if not refs:
            time.sleep(timeout)
            return
        # back as soon as one group is done (not after all of them or the timeout), with every done one
        ready, _ = ray.wait(refs, num_returns=1, timeout=timeout)
        if ready:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        for ref in ready:
            if ref not in self.in_flight:  # already re-issued after its worker died
                continue
            wi, gid, seed = self.in_flight[ref]
            try:
                group = ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError) as e:
                log.warning("rollout worker %d died (%s): restarting it, re-issuing its groups", wi, type(e).__name__)
                self._restart(wi)
                continue
            except Exception as e:  # the group's loop raised: drop it, give its slot back, count it
                log.warning("group %d failed on rollout worker %d: %r", gid, wi, e)
                self.in_flight.pop(ref)
                ray.get(self.buffer.cancel.remote(1))
                self.guard.record_error(self.cfg.algo.group_size, f"group {gid}: {type(e).__name__}")
                continue
            self.in_flight.pop(ref)
            if gid in self.done_gids:
                self.counters["duplicate_groups"] += 1
                continue
            self.done_gids.add(gid)
            try:
                ray.get(self.buffer.put_group.remote(group))
            except Exception as e:  # a malformed group: drop it, give its slot back, count it
                log.warning("group %d could not be put into the buffer: %r", gid, e)
                ray.get(self.buffer.cancel.remote(1))
                self.guard.record_error(len(group), f"put group {gid}: {type(e).__name__}")
                continue
            self.guard.record(group)


def jax_tree_to_host(tree):
    """``tree`` with every leaf as a numpy array (what crosses Ray's object store)."""
    import jax
    import numpy as np

    return jax.tree.map(np.asarray, tree)


def run_train_ray(cfg: Config) -> int:
    """RL with Ray actors: SFT, eval and training run in the learner actor; the driver runs the one
    RL loop (:func:`jax_rl.runtime.loop.run_rl`) with a :class:`RayProducer` (rollout workers, the
    buffer actor, one object-store copy of each version's params)."""
    import ray

    from jax_rl.checkpoint import resolve_checkpoint_dir
    from jax_rl.metrics import MetricsWriter
    from jax_rl.model_builder import build_model_config
    from jax_rl.runtime.context import StopFlag, raise_if_disk_full, start_of_run_lines
    from jax_rl.runtime.envs import build_env_factory, build_tokenizer
    from jax_rl.runtime.loop import finished_run_line, run_rl, sft_line
    from jax_rl.runtime.run_dir import delete_earlier_run, resolve_run_dir

    t0 = time.perf_counter()
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
    delete_earlier_run(cfg, resolve_run_dir(cfg, create=False))  # run.overwrite (a fresh run only)
    fresh = not resolve_run_dir(cfg, create=False).exists()
    run_dir = resolve_run_dir(cfg)
    _, ckpt_dir, _ = resolve_checkpoint_dir(cfg)
    # config.yaml is written by the learner actor once the restore and its checks have passed
    stop = StopFlag()
    stop.install()
    try:
        init_ray(run_dir, runtime=cfg.runtime)
    except RayFailure:
        stop.restore()
        if fresh:  # nothing of the run exists yet: leave no run dir (nor Ray's temp dir) behind
            import shutil

            link = run_dir / "ray_tmp"
            if link.is_symlink():
                shutil.rmtree(link.resolve(), ignore_errors=True)
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    _reclaim_signals(stop)  # SIGTERM: finish the step, checkpoint, summary.json, exit 143 (as embedded)
    # the driver beside its learner (after Ray's daemons started, which stay unpinned)
    from jax_rl.runtime.affinity import pin_process

    pin_process(cfg.runtime.learner_cpus)
    RolloutWorker, BufferActor, LearnerActor = _actors()
    watch = RayDaemonWatch(cfg, run_dir, ckpt_dir, t0).start()  # a dead raylet / GCS: one line + summary.json
    writer = None
    actor = LearnerActor.remote(cfg.to_dict())
    producer = None
    try:
        hf = _ray_get(actor.model_config_hf.remote())
        print(_ray_get(actor.describe.remote()), flush=True)  # what the correction mode costs, as embedded
        pad_id = ray.get(actor.pad_id.remote())
        meta: dict = {}
        if cfg.resume:
            meta = _ray_get(actor.restore.remote())  # one-line errors; nothing written yet
            print(meta.pop("resume_line"), flush=True)
        start_step = int(meta.get("rl_steps", 0))
        done = finished_run_line(cfg, run_dir, start_step) if cfg.resume else None
        if done:  # nothing to train, evaluate or write
            print(done, flush=True)
            return 0
        _ray_get(actor.materialize.remote(meta.pop("resumed_step", None)))
        writer = MetricsWriter(run_dir, tensorboard=cfg.logging.tensorboard, wandb=cfg.logging.wandb,
                               resume_step=start_step if cfg.resume else None)
        if meta.get("sft_done"):
            sft_eval = dict(meta.get("sft_eval") or {"success": meta.get("sft_success")})
        else:
            sft_eval = _ray_get(actor.sft_and_eval.remote())
            print(sft_line(cfg, sft_eval), flush=True)
        producer = RayProducer(cfg, actor, hf, meta, actor_classes=(RolloutWorker, BufferActor))
        producer.stop_event = stop.event  # a SIGTERM while the workers compile does not wait for them
        return run_rl(cfg, RemoteLearner(actor), producer, writer, stop, start_step=start_step, pad_id=pad_id,
                      sft_success=sft_eval.get("success"), run_dir=run_dir, ckpt_dir=ckpt_dir, t0=t0)
    except Exception as e:
        raise_if_disk_full(e, run_dir, ckpt_dir)
        if isinstance(e, (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError)) \
                and watch.dead() is None:  # an actor died or never started (not a daemon): one line, exit 1
            steps = sorted(int(p.name) for p in Path(ckpt_dir).glob("[0-9]*") if p.is_dir() and p.name.isdigit()) \
                if Path(ckpt_dir).is_dir() else []
            last = str(Path(ckpt_dir) / str(steps[-1])) if steps else "none"
            aid = getattr(e, "actor_id", None)
            try:
                learner = None if aid is None else aid == actor._actor_id.hex()
            except Exception:  # noqa: BLE001 - a Ray without these internals: say it may be either
                learner = None
            who = {True: "the learner actor", False: "a rollout-worker actor"}.get(learner, "a Ray actor of the run")
            raise RayFailure(f"runtime=ray: {who} died or could not start ({type(e).__name__}: "
                             f"{' '.join(str(e).split())[:300]}); last checkpoint: {last}") from None
        raise
    finally:
        if writer is not None:
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
