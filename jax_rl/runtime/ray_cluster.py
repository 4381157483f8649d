"""``runtime=ray``'s cluster side: start or join Ray (:func:`init_ray`, loopback by default), check
the configured endpoints before anything starts (:func:`check_ray_endpoints`), watch the local
raylet and GCS server from the driver (:class:`RayDaemonWatch`), and :func:`ray_get`, which
re-raises an actor's exception as itself.

Ray is an optional dependency (the ``[ray]`` extra): it is imported inside the functions that use
it, so that this module (and the CLI) load without it.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Optional

from jax_rl.config import Config, ConfigError
from jax_rl.metrics import read_jsonl

log = logging.getLogger("jax_rl.runtime")

__all__ = ["RayFailure", "init_ray", "check_ray_endpoints", "reclaim_signals", "RayDaemonWatch", "ray_get"]


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


def _join_cluster(ray, address: str, runtime_env: dict):
    """Join the Ray cluster at ``address`` (its own bind and auth settings apply: a warning says so); returns
    ``ray``. Raises ConfigError (one line) when it cannot be joined."""
    log.warning("runtime.ray_address=%s: joining an existing Ray cluster; its bind addresses and auth "
                "settings apply (RISK: a cluster reachable off this machine accepts jobs from anyone "
                "who reaches it)", address)
    try:
        ray.init(address=address, log_to_driver=False, ignore_reinit_error=True, runtime_env=runtime_env)
    except Exception as e:  # noqa: BLE001 - Ray's connection errors: ConnectionError, TimeoutError, RuntimeError
        try:
            ray.shutdown()
        except Exception:  # noqa: BLE001
            pass
        raise ConfigError(f"runtime.ray_address={address}: cannot join the Ray cluster "
                          f"({type(e).__name__}: {' '.join(str(e).split())[:300]})") from None
    return ray


def _ray_temp_dir(run_dir: Path) -> Path:
    """Ray's temp dir, made: ``run_dir/ray``, or (a Unix socket path is limited to ~107 bytes) a short dir
    under the system temp folder with a ``ray_tmp`` link to it in the run dir when that path is long."""
    tmp = (Path(run_dir) / "ray").resolve()
    if len(str(tmp)) > 40:
        short = Path(tempfile.mkdtemp(prefix="jxrl-ray-"))
        link = Path(run_dir) / "ray_tmp"
        if not link.exists():
            link.symlink_to(short)
        tmp = short
    tmp.mkdir(parents=True, exist_ok=True)
    return tmp


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
    # the actors start JAX on the driver's platform (JAX_PLATFORMS as the driver has it, "" = JAX's own
    # choice; the CLI has set "cpu" already where libtpu is installed on a host without a TPU), not the CPU
    runtime_env = {"env_vars": {"RAY_AUTH_MODE": "disabled", "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "")}}
    if address is not None:
        return _join_cluster(ray, address, runtime_env)
    from ray._private import ray_constants

    if loopback:
        ray_constants.ENABLE_RAY_CLUSTER = False  # ray was imported before the env var was set
    else:
        log.warning("runtime.bind_host=%s: Ray listens on all interfaces with auth disabled (RISK: anyone "
                    "who reaches this machine can submit jobs); use only on a trusted network", host)
    tmp = _ray_temp_dir(run_dir)
    try:
        with warnings.catch_warnings():  # Ray starts its daemons with subprocess (fork + exec at once, a preexec_fn),
            # which runs JAX's at-fork hook: its "os.fork() ... deadlock" warning is about a fork that keeps running
            # Python, not one that execs; said twice at every start, it was noise
            warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
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


def reclaim_signals(stop) -> None:
    """Point SIGINT / SIGTERM at the run's :class:`~jax_rl.runtime.context.StopFlag` again:
    ``ray.init`` installs its own SIGTERM handler (``sys.exit``: the driver would die within
    seconds with no end checkpoint and no ``summary.json``). The handlers saved before Ray started
    stay the ones :meth:`StopFlag.restore` puts back."""
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


def ray_get(ref):
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
