"""The model and device sections (part of :mod:`jax_rl.config`): ``model``, ``mesh``, ``placement``, ``moe``."""

from __future__ import annotations

import math
from typing import Annotated, Any, ClassVar, Literal, Optional, Union

from pydantic import Field, field_validator, model_validator

from jax_rl.config.base import _Section


class ModelConfig(_Section):
    """The policy model (Qwen3 dense or MoE)."""

    preset: Optional[str] = "tiny_dense"
    """Name of a preset in ``jax_rl.models.qwen3.PRESETS`` (ignored when ``checkpoint`` is set)."""
    checkpoint: Optional[str] = None
    """Path to an HF checkpoint dir (config.json + safetensors). Overrides ``preset``."""
    hf_overrides: dict[str, Any] = Field(default_factory=dict)
    """HF config.json field overrides applied on top of the preset, e.g. ``{hidden_size: 64}``."""
    tokenizer: str = "compact"
    """The tokenizer: compact, bpe or a tokenizer.json path.

    ``compact`` (byte-level demo tokenizer), ``bpe`` (a byte-level BPE trained at startup on the
    environment's reference demonstrations of training seeds, saved as ``<run.dir>/tokenizer.json``),
    or a path to tokenizer.json / a dir holding it."""
    bpe_vocab_size: int = Field(1024, ge=282)
    """Upper bound on the bpe tokenizer's vocabulary.

    Upper bound on the ``bpe`` tokenizer's vocabulary (incl. 256 bytes and 26 added tokens);
    must not exceed the model's ``vocab_size``."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Learner compute dtype. Master params are always fp32; logits are always fp32."""
    moe_dispatch: Literal["dense", "ragged"] = "dense"
    """MoE dispatch path: dense one-hot (small/CPU) or grouped ``jax.lax.ragged_dot``. With
    ``ragged`` and ``mesh.expert`` > 1 the MoE is expert-parallel: token copies go to the expert
    shards and back by ``all_to_all`` inside a ``shard_map`` (``jax_rl.models.expert_parallel``);
    ``num_experts`` must divide by ``mesh.expert``."""
    moe_capacity_factor: Optional[float] = Field(None, gt=0)
    """Learner expert capacity on the expert-parallel path (null = no drops).

    Expert-parallel path only (``moe_dispatch: ragged``, ``mesh.expert`` > 1): slots per
    (device, expert shard) pair as a multiple of the uniform load (GShard capacity factor, e.g.
    1.25); token copies over it are dropped (no expert output; the residual passes), which makes
    the learner's forward differ from an undropped rollout; padding takes no slot. The learner
    logs the drops (moe_dropped_copies, moe_copies, moe_dropped_frac). Unset: dropless, with
    exchange buffers sized for the worst case (mesh.expert times the uniform load)."""
    moe_matmul: Literal["auto", "ragged_dot", "megablox"] = "auto"
    """The expert-parallel path's grouped matmul kernel.

    The expert-parallel path's grouped matmul: ``ragged_dot`` (``jax.lax.ragged_dot``),
    ``megablox`` (the Pallas TPU megablox ``gmm``/``tgmm`` kernels, MaxText's ``megablox``), or
    ``auto`` = megablox on a TPU backend, ragged_dot elsewhere. On TPU ragged_dot's weight
    gradient is lowered densely (G local experts times the FLOPs, ``jax_rl.models.expert_parallel``);
    megablox runs only on a TPU (``jax-rl compile`` targets it for TPU topologies)."""
    remat: bool = False
    """Rematerialise each decoder layer in the backward pass.

    Rematerialise each decoder layer in the backward pass (saves activation memory);
    shorthand for ``remat_policy: full`` when ``remat_policy`` is not set."""
    remat_policy: Optional[Literal["none", "full", "minimal", "save_dot_except_mlp",
                                   "save_dot_with_context_except_mlp", "save_dot_except_mlpwi",
                                   "save_qkv_proj", "save_out_proj"]] = None
    """Per-layer rematerialisation policy (MaxText names).

    Per-layer rematerialisation, MaxText ``remat_policy`` names: ``none`` keeps every
    activation, ``full`` only the layer inputs, ``minimal`` every matmul output, the
    ``save_*`` ones the named projections (``jax_rl.models.qwen3.remat_policy_fn``). Unset:
    ``full`` if ``remat`` else ``none``."""
    scan_layers: bool = True
    """Run the decoder layers under jax.lax.scan (MaxText scan_layers).

    Stack the decoder layers' params on a leading ``layers`` axis and run them under
    ``jax.lax.scan`` (MaxText ``scan_layers``): compile time and program size independent of
    depth. The learner, every rollout engine (embedded and Ray), eval, export, serve and the HF
    import (``model.checkpoint``) build this one layout. Changes the checkpoint layout
    (``params/layers/<name>`` [L, ...] instead of ``params/layers/<i>/<name>``): a resume from a
    checkpoint of the other layout is refused in one line naming the value to set; eval and
    export read either. Mixed dense/MoE stacks stay unrolled."""
    scan_unroll: Union[Literal["auto", "full"], Annotated[int, Field(ge=1, strict=True)]] = "auto"
    """Layers per iteration of the scanned stack (its unroll).

    Layers per iteration of the scanned stack's ``jax.lax.scan`` (its ``unroll``), with
    ``scan_layers``: ``auto`` = the whole stack written out (no loop) on the CPU backend, 1 (one
    layer per iteration) on TPU/GPU; ``full`` = the whole stack; an int n >= 1. Changes neither
    the params layout nor any op, only the compiled program (values agree to fp32 rounding). A
    written-out stack compiles in time proportional to depth; ``jax-rl compile`` always costs the
    TPU program (1)."""
    logits_chunk_tokens: Optional[int] = Field(None, ge=1)
    """Positions per chunk of the learner's LM head + log-softmax.

    Positions per chunk of the learner's LM head + log-softmax (the full [rows, T, vocab]
    logits are never materialised): the largest divisor of the sequence length not above this.
    Unset: the largest chunk with rows x chunk x vocab <= 4M logits (~16 MB fp32), which is a
    handful of positions for a 152k vocabulary; on a TPU set a few hundred (the TPU configs use
    512) so the head's matmuls are MXU-sized and its weights are not re-read per position."""
    attention: Literal["auto", "xla", "splash", "cudnn"] = "auto"
    """Attention core for full forwards and prefill.

    Attention core for full forwards and prefill: ``splash`` = Pallas TPU splash attention
    kernel, ``xla`` = einsum softmax (HF eager numerics), ``cudnn`` = cuDNN flash attention on a GPU
    (``jax.nn.dot_product_attention``; bf16 compute; right-padded rows), ``auto`` = splash on a
    TPU backend, xla elsewhere. Decode steps always use ``xla``."""
    bitwise: bool = False
    """Engine and learner log-probs equal bit for bit (batch-invariant pieces; slower).

    The bitwise mode: the rollout engine's decode, its re-score by prefill and the learner's forward
    run batch-invariant pieces (every per-token op on a 256-row tile, attention over fixed 64-key chunks with an
    online softmax in position order, XLA:CPU's loop fusion emitters: ``jax_rl.models.bitwise``), so a token's
    log-prob has the same bits whatever rows share the call. Off: the fast path, its numbers unchanged."""


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
    """Which devices each role runs on: learner, rollout engines, scorer, tau² user model.

    docs/placement.md. The learner's mesh is mesh.*, each engine's rollout.mesh.*. All null = colocated, the default: the
    learner on every device, each engine on the learner's first device(s), the scorer on the learner's mesh,
    the user model on the eval engine's devices."""

    learner: Optional[int | list[int]] = None
    """The learner's devices (int, id list or null).

    The learner's devices: an int n = the first n of jax.devices(), a list = jax device ids, null = every
    device that placement.rollout and placement.scorer do not take."""
    rollout: Optional[int | list[int]] = None
    """The rollout engines' devices (int, id list or null).

    The rollout engines' devices: an int n = the last n of jax.devices(), a list = ids (may overlap the
    learner's: colocated sharded engines), null = colocated on the learner's first devices (one rollout.mesh
    each; a single device by default). Split evenly over the rollout.threads engines."""
    scorer: Optional[int | list[int]] = None
    """The dedicated old-logit scorer's devices.

    old_logits.route=dedicated: the scorer's own devices (an int n = the last n devices that
    placement.rollout does not take, a list = ids; never the learner's or the rollout's); null = the scorer
    shares the learner's mesh."""
    user: Optional[int | list[int]] = None
    """The tau2 user simulator model's devices.

    env.tau2.user=model: the user simulator model's own devices (an int n = the last n devices that
    placement.rollout and placement.scorer do not take, a list = ids; never the learner's, the rollout's or
    the scorer's); its engine lays rollout.mesh over them, or fsdp over all of them when rollout.mesh is one
    device. null = the user model runs on the eval engine's devices."""

    _devs = field_validator("learner", "rollout", "scorer", "user", mode="after")(classmethod(
        lambda cls, v: _check_devices_spec(v)))


class MoEConfig(_Section):
    """Mixture-of-experts training options (read only for an MoE policy)."""

    routing_replay: Literal["none", "r2", "r3"] = "none"
    """Routing replay for MoE forwards.

    Routing replay: ``none`` (every forward routes by its own router), ``r3`` (the rollout
    engine records the top-k expert ids of every MoE layer at every token, prefill and decode,
    and every learner forward: theta, pi_prox and the exact old-logit forwards (snapshot,
    dedicated, interrupt/retire incl. the in-flight prefixes scored at a publish), uses them; the
    gates are still the router's softmax at those ids, so the router gets gradient), ``r2`` (the
    learner's no-grad routing forward at the params of the start of the step records its own
    routes and the gradient forward replays them). r2 and r3 log ``routing_agreement`` (the
    engine records routes under both). Needs an MoE model."""
