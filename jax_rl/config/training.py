"""The learner's algorithm sections (part of :mod:`jax_rl.config`): ``optim``, ``loss``, ``async``, ``algo``,
``sft``, ``old_logits``. ``loss.correction``, ``algo.advantage`` and ``old_logits.route`` list the registries'
names (``tests/test_structure.py`` checks they agree)."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, model_validator

from jax_rl.config.base import _Section


class OptimConfig(_Section):
    """Optimizer: optax chain of global-norm clipping then AdamW, warmup + constant|cosine."""

    lr: float = Field(1e-4, gt=0)
    """Peak learning rate of the RL AdamW."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warmup of the RL lr, in optimizer updates.

    Linear warmup of the RL lr from 0 over this many optimizer updates, counted from the first RL
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
    """Padded lengths T a learner batch may take.

    Padded lengths T a learner batch may take (the learner pads each batch to the smallest that fits,
    so at most one train-step program per length is compiled; ``max_seq_len`` is always one of them).
    null = powers of two from 16 and their 1.5x midpoints (16, 24, 32, 48, 64, 96, ...) up to ``max_seq_len``, then ``max_seq_len`` itself (``jax_rl.learner.batch.seq_buckets``);
    ``[N]`` with N = ``max_seq_len``: one shape, as Tunix pads every batch to prompt + completion length."""
    max_skipped_steps: int = Field(10, ge=0)
    """Stop after this many consecutive all-skipped (non-finite) learner steps.

    Stop the run (NonFiniteTrainingError) after this many consecutive learner steps (RL or SFT) in
    which every optimizer update was skipped as non-finite (loss, grad norm or updated params); 0 = never stop."""

    @model_validator(mode="after")
    def _buckets(self) -> "OptimConfig":
        if self.seq_len_buckets is not None:
            bad = [n for n in self.seq_len_buckets if not 1 <= n <= self.max_seq_len]
            if bad:
                raise ValueError(f"optim.seq_len_buckets {bad} outside [1, optim.max_seq_len={self.max_seq_len}]")
        return self


class LossConfig(_Section):
    """Policy loss and the source of pi_prox. See ``jax_rl.learner.losses.policy_loss``.

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
    """Granularity of the train-infer factor.

    Granularity of the train-infer factor: token, sequence (log-space product), geometric (length-normalised), turn."""
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
    ewma_reset: Literal["current", "guarded"] = "guarded"
    """What a triggered EWMA reset does.

    What a triggered reset does: guarded (default) = theta_bar <- theta only if theta keeps more of the batch's tokens in the mask than theta_bar; current = theta_bar <- theta always (the paper's rule; collapsed 6 of 10 runs at K=8 in docs/paper_repro.md's drift setting)."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient (verl entropy_coeff).

    Entropy bonus coefficient (verl ``entropy_coeff``): the loss adds ``-entropy_coef * agg(H)``
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


class AlgoConfig(_Section):
    """The RL algorithm's knobs: the group, the advantage estimator, the policy's temperature.

    The RL algorithm's knobs: the group, the advantage estimator and the policy's temperature (Tunix's
    ``algo_config``: ``GRPOConfig.num_generations``; verl's ``algorithm.adv_estimator``,
    ``algorithm.norm_adv_by_std_in_grpo``). The estimators are the registry in :mod:`jax_rl.learner.advantages`."""

    group_size: int = Field(8, ge=1)
    """GRPO group: samples per task (Tunix ``num_generations``, AReaL ``group_size``)."""
    advantage: Literal["grpo", "rloo"] = "grpo"
    """Group advantage estimator.

    Group advantage estimator (``jax_rl.learner.advantages.REGISTRY``): grpo (reward minus the group mean, see
    advantage_std_normalize) or rloo (leave-one-out baseline)."""
    advantage_std_normalize: bool = True
    """GRPO: divide by the group's reward std (verl ``norm_adv_by_std_in_grpo``)."""
    temperature: float = Field(1.0, gt=0)
    """The policy's sampling temperature, applied in every log-prob.

    The policy's temperature: the rollout engines sample at it and every learner and SFT log-prob applies
    it, so pi and mu are the same distribution (rollout.top_k / rollout.top_p are reproduced the same way)."""


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


class OldLogitsConfig(_Section):
    """Exact old logits (pi_v at each token's behaviour version) for loss.correction=exact."""

    route: Literal["snapshot", "dedicated", "interrupt", "retire", "behav"] = "snapshot"
    """How exact old logits are computed for loss.correction=exact.

    Exact old-logit route for loss.correction=exact: snapshot (the learner keeps the last K+1
    versions' params and runs one forward per version present in each batch), dedicated (a
    scorer thread holding the live versions scores each finished trajectory before it enters the
    buffer), interrupt (at each publish the rollouts pause while the outgoing version's tokens,
    finished and partial, are scored; 1 extra param copy, a stall per publish) or retire (the
    same scoring in the background while the rollouts generate at the new version; 1-2 copies
    whatever K is). dedicated/interrupt/retire: the learner runs no old-logit forward;
    runtime=embedded only. behav: log pi_v is the behaviour log-prob itself (model.bitwise, where the engine's
    log-prob is the learner's bit for bit; rollout.partial=recompute_kv|abort, so no token is decoded over K/V
    an older version computed): no forward, no copy."""
    max_queued_groups: int = Field(4, ge=1)
    """Finished groups waiting for the scorer (backpressure).

    route=dedicated|interrupt|retire: finished GRPO groups waiting for the scorer; a full queue blocks the
    rollout thread that finished the next one (backpressure)."""
    store: Literal["host", "disk"] = "host"
    """Snapshot store: host (numpy in RAM) or disk (Orbax under the run dir)."""
    dir: Optional[str] = None
    """Snapshot dir for store=disk; default <run.dir>/old_logits."""
    measure_error: bool = False
    """Also compute exact old logits under ppo_ewma/linear_prox/decoupled and log the approximation error."""
