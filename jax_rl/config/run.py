"""The run's process and output sections (part of :mod:`jax_rl.config`): ``runtime``, ``checkpoint``,
``eval``, ``run``, ``logging``."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field, field_validator, model_validator

from jax_rl.config.base import _Section
from jax_rl.affinity import check_cpus


class RuntimeConfig(_Section):
    """``runtime=embedded`` (threads, one process) or ``runtime=ray``. A bare string sets kind."""

    kind: Literal["embedded", "ray"] = "embedded"
    """embedded: one process, rollout + learner threads; ray: actors."""
    ray_workers: int = Field(2, ge=1)
    """Rollout-worker actors for runtime=ray."""
    coordinator: Optional[str] = None
    """jax.distributed coordinator address host:port (multi-process); None = single process."""
    num_processes: Optional[int] = Field(None, ge=1)
    """jax.distributed process count (multi-host)."""
    process_id: Optional[int] = Field(None, ge=0)
    """This process's jax.distributed index."""
    transfer_address: Optional[str] = None
    """host:port of this process's cross-host weight-transfer server.

    host:port this process's cross-host weight-transfer server listens on (multi-process); None = the coordinator's host, port coordinator port + 1 + process_id (docs/placement.md "Multi-host")."""
    peer_timeout_s: float = Field(100.0, gt=0)
    """Multi-process: seconds a process waits for a peer.

    Multi-process: seconds a process waits for a peer (a weight sync's confirmation, the transfer's metadata exchange, a disaggregated run's groups of a step, jax.distributed's heartbeat) before it stops with one line naming the lost peer."""
    ray_address: Optional[str] = None
    """runtime=ray: an existing Ray cluster to join (null = start a local one).

    runtime=ray: address of an existing Ray cluster to join (host:port or ray://...); None = start a local Ray bound to bind_host. RISK: that cluster's own bind and auth settings apply."""
    bind_host: str = "127.0.0.1"
    """runtime=ray: node IP of the local Ray started when ray_address is None. Loopback = every Ray socket on 127.0.0.1; anything else (multi-host) makes Ray 2.60 listen on all interfaces with auth disabled: anyone who reaches the machine can submit jobs."""
    learner_cpus: Optional[list[int]] = None
    """runtime=ray: CPU ids the learner actor and the driver are pinned to.

    runtime=ray: CPU ids (os.sched_getaffinity numbering) the learner actor and the driver are pinned to, e.g. [0]; their XLA thread pool then uses those cores only. null = no pinning. Ids must be ones this process may run on; may overlap rollout_cpus."""
    rollout_cpus: Optional[list[int]] = None
    """runtime=ray: CPU ids every rollout-worker actor is pinned to.

    runtime=ray: CPU ids every rollout-worker actor is pinned to, e.g. [1] (with learner_cpus=[0]: the roles on separate cores, bench/async_speedup.py --separate-roles). null = no pinning."""

    @field_validator("learner_cpus", "rollout_cpus")
    @classmethod
    def _cpus_exist(cls, v: Optional[list[int]]) -> Optional[list[int]]:
        return check_cpus(v)

    @model_validator(mode="after")
    def _pinning_needs_ray(self) -> "RuntimeConfig":
        pinned = [k for k in ("learner_cpus", "rollout_cpus") if getattr(self, k) is not None]
        if pinned and self.kind != "ray":
            raise ValueError(f"runtime.{pinned[0]} pins a role's process; runtime={self.kind} runs every role in "
                             "one process (XLA's thread pool is shared): use runtime=ray or "
                             f"runtime.{pinned[0]}=null")
        return self

    @model_validator(mode="before")
    @classmethod
    def _bare_kind(cls, v: Any) -> Any:
        if isinstance(v, str):
            return {"kind": v}
        return v


class CheckpointConfig(_Section):
    """Orbax checkpoints (state, EWMA, snapshots, buffer, metadata)."""

    every: int = Field(0, ge=0)
    """Save every N learner steps (0 = only at the end and on Ctrl-C/SIGTERM)."""
    max_to_keep: int = Field(2, ge=1)
    """Checkpoints kept on disk."""
    async_save: bool = True
    """Orbax async saves (training continues while writing)."""
    dir: Optional[str] = None
    """Checkpoint dir; default ``<run.dir>/checkpoints``."""


class EvalConfig(_Section):
    """Held-out evaluation (avg@k, pass@k) on seeds disjoint from training."""

    every: int = Field(0, ge=0)
    """Evaluate every N learner steps (0 = only after SFT and at the end)."""
    k: int = Field(4, ge=1)
    """Samples per held-out task (avg@k, pass@k)."""
    num_tasks: int = Field(64, ge=1)
    """Held-out tasks per evaluation."""
    seed_offset: int = Field(1_000_000, ge=0)
    """First held-out seed; training seeds are below it.

    Held-out seeds start here; training seeds are below it (RL groups, SFT demos and bpe demos from env.train_seed_offset up: a config whose training seeds would reach it is refused)."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature for evaluation."""


class RunConfig(_Section):
    """Run identity, length, seed and output dir."""

    name: Optional[str] = None
    """Run name; default: the config file's stem."""
    dir: Optional[str] = None
    """Output dir; default ``runs/<name>-<UTC timestamp>``."""
    overwrite: bool = False
    """A fresh run into a dir holding a run deletes that run's files.

    A fresh run (no ``resume``) into a ``dir`` that already holds a run, finished or not: delete that run's files (config.yaml, metrics, checkpoints, ...) and start over (CLI ``--overwrite``); false refuses it."""
    steps: int = Field(100, ge=0)
    """RL learner steps."""
    seed: int = 0
    """Seed for params, sampling and task order (reproducible runs)."""
    log_every: int = Field(1, ge=1)
    """Console progress refresh every N steps."""


class LoggingConfig(_Section):
    """Metric sinks and console."""

    tensorboard: bool = True
    """Write TensorBoard event files (tensorboardX) under run.dir/tb."""
    wandb: bool = False
    """Also log to Weights & Biases when installed."""
    progress: bool = True
    """Live progress bar on the console."""
