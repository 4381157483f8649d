"""The run configuration's schema: one pydantic v2 model per section (``model``, ``mesh``,
``placement``, ``optim``, ``loss``, ``async``, ``algo``, ``rollout``, ``env``, ``runtime``, ``checkpoint``,
``eval``, ``run``, ``sft``, ``moe``, ``old_logits``, ``logging``) and :class:`Config`, their
cross-section checks. Every section has ``extra="forbid"``. The sections live in the package's modules
:mod:`~jax_rl.config.model` (model, mesh, placement, moe), :mod:`~jax_rl.config.training` (optim, loss,
async, algo, sft, old_logits), :mod:`~jax_rl.config.rollout` (rollout, env) and :mod:`~jax_rl.config.run`
(runtime, checkpoint, eval, run, logging) on :mod:`~jax_rl.config.base`; this module gathers them.

The config imports no learner registry (correction modes, old-logit routes, advantages;
``tests/test_structure.py``). It imports two things below it: the env registry's load-time knob checks and
tool-latency cap (:mod:`rollout.envs`: each env's ``env.<name>`` section is checked by its ``EnvSpec``) and
:func:`jax_rl.affinity.check_cpus` (``runtime.*_cpus``), neither of which imports jax. What a
correction mode allows with it (``old_logits.measure_error``, an ``old_logits.route``) is the registries'
knowledge, checked by :func:`jax_rl.learner.correction.check_config` where a run is built (the CLI's loader and
:func:`jax_rl.learner.correction.make_correction`).
"""

from __future__ import annotations

from typing import Any, Optional

from pydantic import ConfigDict, Field, model_validator

from jax_rl.config.base import (BPE_CORPUS_DEMOS, CONFIG_DIR, MOVED_KEYS, ConfigError, _noted,  # noqa: F401 (re-exported)
                                _Section, move_keys)
from jax_rl.config.model import MeshConfig, ModelConfig, MoEConfig, PlacementConfig
from jax_rl.config.rollout import (MAX_EPISODE_TIMEOUT_S, MAX_TOOL_LATENCY_S, CalculatorConfig,  # noqa: F401
                                   EnvConfig, RolloutConfig, RolloutMeshConfig, Tau2Config, Tau2UserModelConfig)
from jax_rl.config.run import CheckpointConfig, EvalConfig, LoggingConfig, RunConfig, RuntimeConfig
from jax_rl.config.training import AlgoConfig, AsyncConfig, LossConfig, OldLogitsConfig, OptimConfig, SFTConfig

__all__ = [
    "ConfigError",
    "Config",
    "ModelConfig",
    "MeshConfig",
    "OptimConfig",
    "LossConfig",
    "AsyncConfig",
    "AlgoConfig",
    "RolloutConfig",
    "EnvConfig",
    "CalculatorConfig",
    "RuntimeConfig",
    "CheckpointConfig",
    "EvalConfig",
    "RunConfig",
    "SFTConfig",
    "OldLogitsConfig",
    "LoggingConfig",
    "CONFIG_DIR",
    "MOVED_KEYS",
    "move_keys",
]


class Config(_Section):
    """The whole run configuration."""

    base_config: Optional[str] = Field(None, exclude=True)
    model: ModelConfig = Field(default_factory=ModelConfig)
    mesh: MeshConfig = Field(default_factory=MeshConfig)
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    async_: AsyncConfig = Field(default_factory=AsyncConfig, alias="async")
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    run: RunConfig = Field(default_factory=RunConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    old_logits: OldLogitsConfig = Field(default_factory=OldLogitsConfig)
    moe: MoEConfig = Field(default_factory=MoEConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    resume: bool = False
    """Continue from the latest checkpoint in run.dir (buffer included)."""
    resume_step: Optional[int] = Field(None, ge=0)
    """With resume: the checkpoint step to resume from.

    With resume: the checkpoint step (checkpoints/<N>, the RL step) to resume from instead of the newest good one."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True,
                              use_attribute_docstrings=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        """Keys that moved (:data:`MOVED_KEYS`) are read under their new name, with a note."""
        return move_keys(data) if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _cross(self) -> "Config":
        if self.resume_step is not None and not self.resume:
            raise ValueError(f"resume_step={self.resume_step} needs resume=true (--resume --step N)")
        if self.optim.batch_size % self.algo.group_size != 0:
            raise ValueError(
                f"optim.batch_size={self.optim.batch_size} must be a multiple of "
                f"algo.group_size={self.algo.group_size}"
            )
        if self.optim.batch_size % (self.optim.microbatches * self.optim.minibatches) != 0:
            raise ValueError(
                f"optim.batch_size={self.optim.batch_size} must be divisible by "
                f"optim.minibatches*optim.microbatches={self.optim.minibatches * self.optim.microbatches}"
            )
        if self.sft.steps > 0 and self.sft.batch_size % self.optim.microbatches != 0:
            raise ValueError(
                f"sft.batch_size={self.sft.batch_size} must be divisible by optim.microbatches="
                f"{self.optim.microbatches} (an SFT step accumulates over the same microbatches; or sft.steps=0)"
            )
        pl = self.placement
        if pl.rollout is not None and self.runtime.kind == "ray":
            raise ValueError(f"placement.rollout={pl.rollout} places engines in this process's devices; runtime=ray "
                             "runs its engines in worker processes: use runtime=embedded or placement.rollout=null")
        if pl.user is not None and not (self.env.name == "tau2" and self.env.tau2.user == "model"):
            raise ValueError(f"placement.user={pl.user} places the tau² user simulator model, which only "
                             "env.name=tau2 with env.tau2.user=model runs: set placement.user=null")
        if pl.user is not None and self.runtime.kind == "ray":
            raise ValueError(f"placement.user={pl.user} places the user model in this process's devices; runtime=ray "
                             "runs it in each rollout worker process: use runtime=embedded or placement.user=null")
        if self.runtime.kind == "ray" and any(v > 1 for v in self.rollout.mesh.sizes().values()):
            raise ValueError(f"rollout.mesh={self.rollout.mesh.sizes()} shards engines over this process's devices; "
                             "runtime=ray runs each engine in a worker process of its own: use runtime=embedded")
        if self.rollout.max_cache_len > self.optim.max_seq_len:
            raise ValueError(
                f"rollout.max_cache_len={self.rollout.max_cache_len} must be <= "
                f"optim.max_seq_len={self.optim.max_seq_len} (the learner must accept every trajectory)"
            )
        self._held_out_disjoint()
        return self

    def training_seed_uses(self) -> dict[str, int]:
        """How many task seeds from ``env.train_seed_offset`` up each part of a run uses at least:
        ``rl`` = ``run.steps`` x groups per step (``optim.batch_size / algo.group_size``; one
        seed per GRPO group, the producers hand them out in order), ``sft`` = ``sft.num_demos``
        (when ``sft.steps > 0``), ``bpe`` = the demos a ``model.tokenizer=bpe`` is trained on."""
        uses = {"rl": int(self.run.steps) * (self.optim.batch_size // self.algo.group_size)}
        if self.sft.steps > 0:
            uses["sft"] = int(self.sft.num_demos)
        if self.model.tokenizer == "bpe":
            uses["bpe"] = BPE_CORPUS_DEMOS
        return uses

    def _held_out_disjoint(self) -> None:
        """The held-out guard at config time (every runtime): training seeds are
        ``[env.train_seed_offset, env.train_seed_offset + n)`` for each use n of
        :meth:`training_seed_uses`, held-out seeds start at ``eval.seed_offset``; refuse a config whose
        training seeds would reach them. The producers check each seed they hand out as well
        (groups dropped and re-drawn use more seeds than this lower bound)."""
        lo, ev = int(self.env.train_seed_offset), int(self.eval.seed_offset)
        if lo >= ev:
            raise ValueError(f"env.train_seed_offset={lo} must be < eval.seed_offset={ev}: training seeds start at "
                             "env.train_seed_offset and held-out seeds at eval.seed_offset, so training would run "
                             "on the held-out tasks")
        what = {"rl": f"run.steps={self.run.steps} x {self.optim.batch_size // self.algo.group_size} groups per "
                      "step (optim.batch_size / algo.group_size)",
                "sft": f"sft.num_demos={self.sft.num_demos}",
                "bpe": f"the {BPE_CORPUS_DEMOS} demos model.tokenizer=bpe is trained on"}
        for use, n in self.training_seed_uses().items():
            if lo + n > ev:
                raise ValueError(
                    f"{what[use]} from env.train_seed_offset={lo} use training seeds up to {lo + n - 1}, which "
                    f"reach the held-out seeds from eval.seed_offset={ev}: raise eval.seed_offset to at least "
                    f"{lo + n} (or lower env.train_seed_offset)")

    def to_dict(self) -> dict[str, Any]:
        """Plain dict with YAML-friendly keys (``async`` not ``async_``)."""
        return self.model_dump(mode="json", by_alias=True, exclude={"base_config"})
