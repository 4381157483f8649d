"""``jax-rl compile CONFIG --topology NAME``: AOT-compile a run's programs for a TPU topology on
any host, with nothing allocated, and estimate whether and how fast they run there.

What is compiled (libtpu's real TPU compiler, targeted through
``jax.experimental.topologies.get_topology_desc``; MaxText's ``train_compile.py`` is the model):

- ``train_step``: the learner's jitted step of ``loss.correction``
  (:func:`jax_rl.train_step.make_train_step`: the strategy's pi_prox forward, EWMA update and
  reset, ``ppo_epochs x minibatches`` updates over ``microbatches`` accumulation steps) for the
  worst-case batch ``[optim.batch_size, optim.max_seq_len]``;
- ``sft_step``: :func:`jax_rl.sft.make_sft_step` for ``[sft.batch_size, optim.max_seq_len]``;
- ``prefill`` and ``decode_step``: the rollout engine's (:class:`rollout.engine.Qwen3Engine`) at
  ``rollout.slots`` slots, ``rollout.max_cache_len`` cache and ``rollout.max_prefill_length``
  prompt tokens, params replicated as the engine places them;
- ``weight_sync``: a publish's reshard (:func:`weight_sync_fn`): the learner's params (fp32, the
  learner's shardings on the mesh) cast to ``rollout.dtype`` and gathered into the engine's
  layout (replicated on every chip, as ``decode_step`` reads them; the embedded runtime's engines
  hold that whole copy on the first chip: the same bytes there). It is loop-free, so its
  ``cost_analysis`` bytes need no pieces; model FLOPs do not apply (``mfu_bound`` None).

Arguments are ``jax.ShapeDtypeStruct`` trees with the run's shardings (params, optimizer moments,
EWMA, batch, KV cache), on the config's mesh built over the topology's devices.

Roles (``placement.*``, :func:`jax_rl.placement.resolve_roles` over the topology's devices): every row
has a ``role`` (``learner``, ``rollout``, ``scorer``, ``sync``), ``role_chips`` and ``device_ids`` (the
devices it is compiled for), and the table groups the rows by role.

- learner: ``train_step`` and ``sft_step`` on ``mesh.*`` over ``placement.learner``'s devices (all of
  them by default); model FLOPs per chip are over those chips.
- rollout: colocated (``placement.rollout`` null and a one-device ``rollout.mesh``), today's rows: the
  one-device engine's programs (params replicated); its engines sit on the learner's first chip. Sharded
  engines: ``prefill`` and ``decode_step`` of ``Qwen3Engine(..., mesh=make_mesh(**roles.engine_mesh,
  devices=roles.engines[0]))`` with the engine's own param and decode-state shardings; every engine has
  the same shape, so one compile stands for all (``same_shape_engines``). :func:`_on_chip` adds what the
  engine chips hold (engines sharing a device set add up; the eval engine is counted on engine 0's mesh;
  the learner's shard where the sets overlap): ``hbm_on_chip_bytes`` / ``fits_on_chip``, and
  ``hbm_on_chip_during_sync_bytes`` / ``fits_during_sync`` (a new params copy per updated engine).
- scorer (``placement.scorer``, ``old_logits.route=dedicated``): ``score_step``, the scorer's forward on
  an ``fsdp`` mesh over its devices, plus its ``async.max_staleness`` + 1 held versions.
- sync: ``weight_sync`` (colocated: :func:`weight_sync_fn`; sharded engines: :func:`cast_fn` on the
  learner's mesh, then a ``device_put`` per engine) with the bytes one engine receives in
  ``rollout.dtype`` and a roofline at the chip's ICI bandwidth (:func:`_weight_sync_row`).

Figures, per chip (every figure is a compile-time estimate, never a measurement):

- HBM: ``memory_analysis()`` of the full-depth program: arguments, temporaries, outputs
  (minus donated aliases), total against the chip's HBM (:data:`jax_rl.tpu.CHIPS`).
- FLOPs and bytes accessed: XLA's ``cost_analysis()`` counts a while-loop body once (the
  scanned layer stack, the microbatch / update scans, the chunked LM head). So the cost comes
  from loop-free pieces compiled for the same mesh, summed with their trip counts:

  * one piece per function: the train step's first-minibatch gradient
    (:func:`jax_rl.train_step.make_grads_fn`, one microbatch of ``r`` rows, with the strategy's
    pi_prox forward), the bare log-prob forward (only when ``ppo_epochs > 1`` and the strategy
    runs a forward), the optimizer update and the strategy's ``after_update`` (full depth: no
    loops), the SFT step at one microbatch, prefill and decode;
  * the layer-dependent pieces compiled with unrolled layers at depth 1 and 2 and the LM-head
    chunk loop at two chunk lengths C1 = T/8 < C2 = T/4 (``model.logits_chunk_tokens``); a piece
    is modelled as ``X(d, C) = a + d * layer + b * C`` (the loop body, counted once, grows with
    C) and evaluated at the config's depth L and the whole length:
    ``X(1, C1) + (L - 1) * layer + b * (T - C1)``;
  * ``train_step = U*m * grads + (epochs - 1)*U*m * (grads - f*forward) + epochs*U * update +
    after_update`` (U minibatches, m microbatches, f forwards in the strategy's pi_prox, counted
    by tracing it), ``sft_step = m * (step - update) + update``. The pieces cost a step without
    an EWMA reset: for ``ppo_ewma`` they are traced with ``loss.ewma_reset_threshold=0``, so
    they hold no reset ``lax.cond`` (XLA costs a conditional by its costliest branch, which
    would count the reset's second forward on every step). A step whose reset fires runs one
    more forward per microbatch: ``reset_step_extra_flops_per_chip`` /
    ``reset_step_extra_bytes_per_chip`` (``U*m*forward``) in the train row.

  The megablox grouped-matmul kernels of the MoE (``model.moe_matmul``, megablox for a TPU
  target) carry their own ``pl.CostEstimate`` (2 m k n FLOPs per call, bytes by tiles), which
  XLA's cost analysis adds; nothing is added for them here.
  XLA's cost analysis does not see into the splash kernels: the splash-attention calls of each
  piece (counted in its traced jaxpr: forward, dq, dkv; a ``lax.cond`` by its costliest branch,
  as XLA counts a conditional) are added analytically,
  2, 3 and 4 causal ``[T, T]`` matmuls over every head and row. Prefill's splash calls are not
  added (its FLOPs undercount the attention).

  The total is checked against the model-FLOPs formula (``model_flops``: 2 N per token per
  forward with N the active matmul params, LM head included, plus causal attention
  ``2 L H d_h T`` per token; backward = 2 x forward; one pi_prox forward where the strategy
  runs one; the rematerialised forward and the splash backward's recomputed scores are not
  model FLOPs): ``flops_ratio`` = counted FLOPs / model FLOPs (above
  1 by that recomputation; well below 1 would mean work the count cannot see).
- ``roofline_step_s = max(flops / peak FLOP/s, bytes / HBM bandwidth)`` per chip and
  ``mfu_bound = model FLOPs per chip / (roofline_step_s * peak)``: an upper bound on the MFU
  (no communication, perfect overlap). None for the rollout steps (model FLOPs do not apply).

:func:`compile_programs` returns one dict per function with the keys of ``--json`` (the issue's
contract): ``function, topology, chips, hbm_args_bytes, hbm_temp_bytes, hbm_out_bytes,
hbm_total_bytes, chip_hbm_bytes, fits, compile_s, flops_per_chip, bytes_accessed_per_chip,
roofline_step_s, mfu_bound`` plus ``model_flops_per_chip``, ``flops_ratio``, ``shape`` and
``cost_pieces_s`` (seconds spent compiling the cost pieces); with both the train and decode
steps, the decode row also has ``engines``, ``hbm_with_learner_bytes`` and ``fits_with_learner``
(the embedded runtime's engines share the first device with the learner's shard; with sharded engines
only where their devices are the learner's), and ``hbm_on_chip_bytes`` / ``fits_on_chip`` always. The decode row
also has ``params_and_kv_cache_bytes_per_chip`` and, with the cost pieces, ``bytes_accessed_ratio``
(bytes accessed over that; 1.0 = every weight and cache entry read once) and
``hbm_side_bytes_accessed_per_chip`` / ``hbm_side_ratio``: the same pieces compiled with
:data:`jax_rl.tpu.HBM_SIDE_OPTIONS` (no VMEM staging), whose every counted access is an HBM access.
The default count also holds the VMEM copies of the staged weights. A program the
TPU compiler refuses for lack of HBM gets ``fits: false``, ``error`` (the compiler's words) and
``hbm_required_bytes`` = the memory its message says is required (e.g. for the temporaries
alone; None if it names none); its HBM and cost figures are None.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from jax_rl.config import Config, ConfigError

if TYPE_CHECKING:  # annotations only: jax is imported inside the functions (the platform is chosen first)
    from jax_rl.learner_spec import LearnerSpec

__all__ = ["FUNCTIONS", "compile_programs", "format_table", "run_compile", "model_flops_per_token", "weight_sync_fn"]

FUNCTIONS = ("train_step", "sft_step", "prefill", "decode_step", "weight_sync", "score_step")


# ======================================================================================
# model FLOPs
# ======================================================================================


def _matmul_params(mc) -> tuple[int, int]:
    """(active matmul params per token, total) of a ``Qwen3Config``: attention and MLP/expert
    projections of every layer plus the LM head (the embedding lookup is not a matmul)."""
    D, L = mc.hidden_size, mc.num_hidden_layers
    H, K, dh = mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim
    attn = D * H * dh + 2 * D * K * dh + H * dh * D
    n_exp = int(getattr(mc, "num_experts", 0) or 0)
    active = total = 0
    for i in range(L):
        if mc.layer_is_moe(i):
            f = mc.moe_intermediate_size
            k = mc.num_experts_per_tok
            active += attn + k * 3 * D * f + D * n_exp
            total += attn + n_exp * 3 * D * f + D * n_exp
        else:
            f = mc.intermediate_size
            active += attn + 3 * D * f
            total += attn + 3 * D * f
    head = D * mc.vocab_size
    return active + head, total + head


def model_flops_per_token(mc, T: int) -> float:
    """Forward FLOPs per token of a [., T] sequence: ``2 * N_active`` (matmuls, LM head included)
    plus causal attention ``2 * L * H * head_dim * T`` (QK^T and AV over T/2 keys on average)."""
    active, _ = _matmul_params(mc)
    return 2.0 * active + 2.0 * mc.num_hidden_layers * mc.num_attention_heads * mc.head_dim * T


# ======================================================================================
# building blocks
# ======================================================================================


@dataclasses.dataclass
class _Target:
    cfg: Config
    topology: str
    spec: Any  # jax_rl.tpu.TopologySpec
    devices: list  # the learner's devices (placement.learner; every device by default)
    mesh: Any  # the learner's mesh (mesh.* over ``devices``)
    model_config: Any
    learner_kw: dict
    engine_kw: dict
    notes: list
    all_devices: list = dataclasses.field(default_factory=list)  # the topology's devices
    roles: Any = None  # jax_rl.placement.Roles over ``all_devices``


def _model_config(cfg: Config, notes: list):
    """The run's ``Qwen3Config``: the checkpoint's config.json when it exists, else the preset
    (a TPU config names a checkpoint path on the pod, usually absent on the compiling host)."""
    from jax_rl.model_builder import resolve_model_config
    from jax_rl.models.qwen3 import get_preset

    ck = cfg.model.checkpoint
    if ck and not (Path(ck) / "config.json").is_file():
        if not cfg.model.preset:
            raise ConfigError(f"model.checkpoint={ck}: no config.json there and no model.preset to take the "
                              "shapes from")
        notes.append(f"model.checkpoint {ck} has no config.json here: shapes from preset {cfg.model.preset}")
        return get_preset(cfg.model.preset, **cfg.model.hf_overrides)
    return resolve_model_config(cfg.model)


def _target(cfg: Config, topology: str) -> _Target:
    import jax.numpy as jnp

    from jax_rl.models.qwen3 import model_kwargs
    from jax_rl.sharding import make_mesh
    from jax_rl.tpu import get_topology, resolve_topology

    from jax_rl.placement import resolve_roles

    spec = resolve_topology(topology)
    all_devices = list(get_topology(topology).devices)
    try:
        roles = resolve_roles(cfg, all_devices)
    except ValueError as e:
        raise ConfigError(f"{e} (on {topology}: {len(all_devices)} devices)") from None
    devices = list(roles.learner)
    m = cfg.mesh
    where = "" if len(devices) == len(all_devices) else " given to the learner by placement.*"
    try:
        mesh = make_mesh(data=m.data, fsdp=m.fsdp, tensor=m.tensor, expert=m.expert, devices=devices)
    except ValueError as e:
        raise ConfigError(f"mesh {m.data}x{m.fsdp}x{m.tensor}x{m.expert} (data x fsdp x tensor x expert) on "
                          f"{topology} ({len(devices)} devices{where}): {e}") from None
    notes: list[str] = []
    mc = _model_config(cfg, notes)
    kw = model_kwargs(cfg.model)
    if kw.get("attention") == "auto":  # the target is a TPU, whatever this host is
        kw["attention"] = "splash"
    if kw.get("moe_matmul") == "auto":
        kw["moe_matmul"] = "megablox"
    if kw.get("scan_unroll") == "auto":  # one layer per loop iteration, as on a TPU
        kw["scan_unroll"] = 1
    learner_kw = dict(kw, dtype=jnp.dtype(cfg.model.dtype), param_dtype=jnp.float32)
    engine_kw = {k: kw[k] for k in ("moe_dispatch", "scan_layers", "attention", "moe_capacity_factor", "moe_matmul")
                 if k in kw}
    return _Target(cfg, topology, spec, devices, mesh, mc, learner_kw, engine_kw, notes, all_devices, roles)


def _short(a: dict) -> dict[str, float]:
    """:func:`jax_rl.tpu._analysis`'s dict under this module's short keys (bytes per device):
    ``args``, ``out``, ``alias``, ``temp``, ``flops``, ``bytes`` (accessed)."""
    return {"args": a.get("argument_size_in_bytes", 0), "out": a.get("output_size_in_bytes", 0),
            "alias": a.get("alias_size_in_bytes", 0), "temp": a.get("temp_size_in_bytes", 0),
            "flops": a.get("flops", 0.0), "bytes": a.get("bytes_accessed", 0.0)}


def _analysis(compiled) -> dict[str, float]:
    """Memory and cost analysis of a compiled program (:func:`_short` keys)."""
    from jax_rl.tpu import _analysis as analysis

    return _short(analysis(compiled))


# Pallas splash-attention kernels, and the causal matmuls each runs per head and row: the
# forward (S = QK^T, O = PV), dq (S, dP = dO V^T, dQ = dS K), dkv (S, dP, dV = P^T dO, dK = dS^T Q)
_SPLASH_MATMULS = {"fwd": 2, "dq": 3, "dkv": 4}


def _splash_calls(jaxpr) -> dict[str, int]:
    """How many splash kernels of each kind ``jaxpr`` runs (``pallas_call`` equations named
    ``splash_mha_{fwd,dq,dkv}*``), nested jaxprs included (scans by their length; a ``cond`` by
    its costliest branch, like XLA's cost analysis: ``ppo_ewma``'s reset forward counts)."""
    import re

    from jax.extend import core as jcore

    def subs(v):
        if isinstance(v, jcore.ClosedJaxpr):
            yield v.jaxpr
        elif isinstance(v, jcore.Jaxpr):
            yield v
        elif isinstance(v, (list, tuple)):
            for x in v:
                yield from subs(x)

    def walk(jx, mult: int, out: dict) -> dict:
        for eqn in jx.eqns:
            if eqn.primitive.name == "pallas_call":
                m = re.search(r"splash_mha_(fwd|dq|dkv)", str(eqn.params.get("name", "")))
                if m:
                    out[m.group(1)] += mult
                continue
            if eqn.primitive.name == "cond":  # the costliest branch, as XLA's cost analysis does
                per = [walk(b, mult, dict.fromkeys(_SPLASH_MATMULS, 0)) for b in subs(eqn.params["branches"])]
                best = max(per, key=lambda c: sum(_SPLASH_MATMULS[k] * n for k, n in c.items()))
                for k, n in best.items():
                    out[k] += n
                continue
            k = mult * int(eqn.params.get("length", 1)) if eqn.primitive.name == "scan" else mult
            for v in eqn.params.values():
                for sub in subs(v):
                    walk(sub, k, out)
        return out

    return walk(jaxpr, 1, dict.fromkeys(_SPLASH_MATMULS, 0))


def _compile(fn, args, mesh, attn_unit: Optional[float] = None) -> tuple[dict, float]:
    """``fn.lower(*args).compile()`` under the mesh (default matmul precision: the TPU's bf16
    passes); returns (analysis, seconds).

    XLA's cost analysis cannot see into a Pallas kernel, so with ``attn_unit`` (FLOPs of one
    causal [T, T] matmul over every head and row, per device) the splash-attention kernels the
    program calls are added analytically: ``_SPLASH_MATMULS`` matmuls each (fwd 2, dq 3, dkv 4)."""
    import jax

    from jax_rl.tpu import no_persistent_cache

    t0 = time.perf_counter()
    with jax.set_mesh(mesh), jax.default_matmul_precision("default"), no_persistent_cache():
        traced = fn.trace(*args)
        c = traced.lower().compile()
    a = _analysis(c)
    if attn_unit:
        calls = _splash_calls(traced.jaxpr.jaxpr)
        a["flops"] += attn_unit * sum(_SPLASH_MATMULS[k] * n for k, n in calls.items())
        a["splash_calls"] = calls
    return a, time.perf_counter() - t0


def _is_hbm_oom(e: BaseException) -> bool:
    """The TPU compiler's refusal of a program larger than the chip's HBM."""
    m = str(e)
    return "Ran out of memory" in m or ("RESOURCE_EXHAUSTED" in m and "HBM" in m)


def _oom_text(e: BaseException) -> str:
    import re

    m = re.search(r"(the total memory required.*?exceeds available HBM \([^)]*\))", str(e))
    return m.group(1) if m else " ".join(str(e).split())[:200]


def _oom_analysis(e: BaseException) -> dict:
    """An analysis dict for a program the compiler refused: ``oom`` (its message) and, when it
    names one, the memory it says is required as ``required`` bytes."""
    import re

    unit = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    m = re.search(r"required for [^(]*\(([\d.]+)([KMGT])\)", str(e))
    return {"oom": _oom_text(e), "required": int(float(m.group(1)) * unit[m.group(2)]) if m else None}


def _compile_or_oom(fn, args, mesh) -> tuple[dict, float]:
    """:func:`_compile`, or the :func:`_oom_analysis` of a program over the chip's HBM."""
    t0 = time.perf_counter()
    try:
        return _compile(fn, args, mesh)
    except Exception as e:  # noqa: BLE001
        if not _is_hbm_oom(e):
            raise
        return _oom_analysis(e), time.perf_counter() - t0


def _attn_unit(t: "_Target", rows: int, T: int) -> Optional[float]:
    """Per-device FLOPs of one causal attention matmul on [rows, T] (None unless splash): the
    kernel runs under shard_map over the batch and head axes, assumed to cover the mesh."""
    from jax_rl.models.attention import SPLASH_BLOCK

    if t.learner_kw.get("attention") != "splash":
        return None
    mc = t.model_config
    Tp = -(-T // SPLASH_BLOCK) * SPLASH_BLOCK
    return rows * mc.num_attention_heads * mc.head_dim * Tp * Tp / len(t.devices)


def _learner(t: _Target, model_config=None, cfg: Optional[Config] = None, **kw_over):
    """The learner's recipe on the target mesh, abstract (:func:`jax_rl.learner_spec.learner_spec`,
    the one ``Learner.__init__`` builds from); ``kw_over`` overrides model build options (e.g.
    ``scan_layers=False`` for the cost pieces)."""
    from jax_rl.learner_spec import learner_spec

    return learner_spec(cfg or t.cfg, model_config or t.model_config, t.mesh, abstract=True,
                        model_kw=dict(t.learner_kw, **kw_over))


def _batch(t: _Target, strategy, U: int, m: int, r: int, T: int):
    """The abstract learner batch [U, m, r, T] the run's train step reads (as ``Learner.abstract_batch``)."""
    from jax_rl.batch import abstract_batch
    from jax_rl.placement import BatchPlacement

    sh = BatchPlacement(t.mesh, U, m).batch_sharding(r)
    exact = strategy.needs_exact
    return abstract_batch((U, m, r, T), sh, prox=exact, old=not exact and strategy.learner_store), sh


def _layout(B: int, U: int, m: int, what: str) -> int:
    if B % (U * m):
        raise ConfigError(f"{what}: B={B} rows is not a multiple of minibatches*microbatches={U * m}")
    return B // (U * m)


def _depth(mc, L: int):
    return dataclasses.replace(mc, num_hidden_layers=L)


def _forwards_in_prox(strategy, cfg, lrn: LearnerSpec, U: int, m: int, r: int, T: int, t: _Target) -> int:
    """How many chunked forwards the strategy's in-jit pi_prox runs (counted while tracing it)."""
    import jax

    calls = []

    def chunk(params, tokens, attention_mask):
        calls.append(1)
        return jax.numpy.zeros(tokens.shape, jax.numpy.float32)

    b, _ = _batch(t, strategy, U, m, r, T)
    jax.eval_shape(lambda p, c, bb: strategy.prox_logp(chunk, p, c, bb, jax.numpy.int32(0)),
                   lrn.state.params, lrn.state.correction, b)
    return len(calls)


# ======================================================================================
# cost pieces
# ======================================================================================


def _chunks(T: int) -> tuple[int, int]:
    """Two LM-head chunk lengths for the cost fits: T/8 and T/4 (8 and 4 chunks)."""
    c1 = max(1, T // 8)
    return c1, max(c1 + 1, T // 4)


def _with_chunk(cfg: Config, c: int) -> Config:
    out = cfg.model_copy(deep=True)
    out.model.logits_chunk_tokens = int(c)
    return out


def _fit(build: Callable[[Config, Any], tuple[Any, tuple]], t: _Target, L: int, T: int,
         rows: int) -> tuple[dict, float]:
    """The loop-free cost of a piece at depth L and length T: ``build(cfg, model_config)``
    returns (jitted fn, abstract args) for an unrolled model (model_config's depth) with the LM
    head in ``cfg.model.logits_chunk_tokens`` chunks. Where the run's head is chunked (``rows``
    rows per forward), fits ``X(d, C) = a + d*layer + b*C`` from (d, C) = (1, C1), (2, C1),
    (1, C2) and returns ``X(1, C1) + (L-1)*layer + b*(T - C1)``; where it is one chunk (no loop),
    ``X(1) + (L-1)*layer`` from the run's own chunking. Returns ({flops, bytes}, compile seconds)."""
    from jax_rl.logprobs import _CHUNK_ELEMS, _chunk_len

    mc1, mc2 = _depth(t.model_config, 1), _depth(t.model_config, 2)
    chunked = _chunk_len(rows, T, t.model_config.vocab_size, _CHUNK_ELEMS, t.cfg.model.logits_chunk_tokens) < T
    c1, c2 = _chunks(T)
    cfg1 = _with_chunk(t.cfg, c1) if chunked else t.cfg
    secs = 0.0
    au = _attn_unit(t, rows, T)
    x11, s = _compile(*build(cfg1, mc1), t.mesh, au); secs += s  # noqa: E702
    x21, s = _compile(*build(cfg1, mc2), t.mesh, au); secs += s  # noqa: E702
    if chunked:
        x12, s = _compile(*build(_with_chunk(t.cfg, c2), mc1), t.mesh, au); secs += s  # noqa: E702
    out = {}
    for k in ("flops", "bytes"):
        v = x11[k] + (L - 1) * (x21[k] - x11[k])
        if chunked:
            v += (x12[k] - x11[k]) / (c2 - c1) * (T - c1)
        out[k] = max(v, 0.0)
    return out, secs


def _grads_piece(t: _Target, r: int, T: int, cfg_: Config, mc) -> tuple[Any, tuple]:
    """The train step's first-minibatch gradient (:func:`jax_rl.train_step.make_grads_fn`, the
    strategy's pi_prox forward included) on one microbatch of ``r`` rows x ``T`` tokens, layers
    unrolled, for model config ``mc`` under ``cfg_``: ``(jitted fn, abstract args)`` for
    ``fn.trace(*args)``. The piece :func:`_fit` costs the train step from."""
    from jax_rl.train_step import make_grads_fn

    p = _learner(t, mc, cfg_, scan_layers=False)
    b, sh = _batch(t, p.strategy, 1, 1, r, T)
    fn = make_grads_fn(cfg_, p.graphdef, p.strategy, t.mesh, rest=p.rest, param_shardings=p.param_shardings,
                       batch_sharding=sh, routing=p.routing)
    return fn, (p.state.params, p.state.correction, p.state.version, b)


def _steady(t: _Target, strategy) -> _Target:
    """The target whose config traces the train step as it runs on a step where no rare branch
    fires (:meth:`jax_rl.correction.Correction.steady_config`; for ``ppo_ewma`` the reset off: XLA
    costs its reset ``lax.cond`` with the second forward in full although that branch runs only
    on a reset step). ``t`` itself when the strategy has no such branch."""
    cfg = strategy.steady_config()
    return t if cfg is t.cfg else dataclasses.replace(t, cfg=cfg)


def _train_cost(t: _Target, lrn: LearnerSpec, B: int, T: int) -> tuple[dict, float, int, Optional[dict]]:
    """The train step's cost on a step without a reset (see :func:`_steady`), compile seconds of
    the pieces, the pi_prox forwards in that step, and the extra cost of a step whose EWMA reset
    fires (one more forward per microbatch; None when the strategy has no reset branch)."""
    import jax

    from jax_rl.correction import make_correction
    from jax_rl.train_step import make_logprob_fn

    cfg = t.cfg
    U, m, E = cfg.optim.minibatches, cfg.optim.microbatches, cfg.optim.ppo_epochs
    r = _layout(B, U, m, "optim.batch_size")
    L = t.model_config.num_hidden_layers
    f_all = _forwards_in_prox(lrn.strategy, cfg, lrn, U, m, r, T, t)
    ts = _steady(t, lrn.strategy)
    f = f_all if ts is t else _forwards_in_prox(make_correction(ts.cfg), ts.cfg, lrn, U, m, r, T, ts)

    grads, secs = _fit(functools.partial(_grads_piece, ts, r, T), ts, L, T, r)
    fwd = {"flops": 0.0, "bytes": 0.0}
    if (E > 1 and f) or f_all > f:
        def fwd_piece(cfg_, mc):
            p = _learner(t, mc, cfg_, scan_layers=False)
            b, sh = _batch(t, p.strategy, 1, 1, r, T)
            lp = make_logprob_fn(p.graphdef, p.rest, float(cfg_.rollout.temperature),
                                 cfg_.model.logits_chunk_tokens)
            s2 = jax.sharding.NamedSharding(t.mesh, jax.sharding.PartitionSpec(*sh.spec[2:]))
            fn = jax.jit(lp, in_shardings=(p.param_shardings, s2, s2))
            tok = jax.ShapeDtypeStruct((r, T), b.tokens.dtype, sharding=s2)
            am = jax.ShapeDtypeStruct((r, T), b.attention_mask.dtype, sharding=s2)
            return fn, (p.state.params, tok, am)

        fwd, s = _fit(fwd_piece, t, L, T, r)
        secs += s

    # one optimizer update and the strategy's after_update: elementwise over the (stacked) params
    st = lrn.state
    a, s = _opt_update_cost(t, lrn, lrn.tx)
    secs += s
    after = {"flops": 0.0, "bytes": 0.0}
    if jax.tree.leaves(st.correction):
        aft = jax.jit(lambda p, c: lrn.strategy.after_update(p, c),
                      in_shardings=(lrn.state_shardings.params, lrn.state_shardings.correction))
        after, s = _compile(aft, (st.params, st.correction), t.mesh)
        secs += s
    out = {k: U * m * grads[k] + (E - 1) * U * m * (grads[k] - f * fwd[k]) + E * U * a[k] + after[k]
           for k in ("flops", "bytes")}
    reset = {k: (f_all - f) * U * m * fwd[k] for k in ("flops", "bytes")} if f_all > f else None
    return out, secs, f, reset


def _sft_fn_args(t: _Target, p: LearnerSpec, tx, schedule, m: int, r: int, T: int, cfg: Optional[Config] = None):
    import jax

    from jax_rl.checkpoint import abstract_like
    import jax.numpy as jnp

    from jax_rl.placement import BatchPlacement
    from jax_rl.sft import SFT_FIELDS, make_sft_step
    from jax_rl.train_step import opt_state_shardings

    sh = BatchPlacement(t.mesh, 1, m).batch_sharding(r)
    opt_sh = opt_state_shardings(tx, p.params, p.param_shardings, t.mesh)
    opt = abstract_like(jax.eval_shape(tx.init, p.params), opt_sh)
    fn = make_sft_step(cfg or t.cfg, p.graphdef, tx, schedule, t.mesh, rest=p.rest, param_shardings=p.param_shardings,
                       opt_shardings=opt_sh, batch_sharding=sh)
    dts = {"tokens": jnp.int32, "attention_mask": jnp.bool_, "loss_mask": jnp.bool_}
    batch = {k: jax.ShapeDtypeStruct((1, m, r, T), dts[k], sharding=sh) for k in SFT_FIELDS}
    rep = jax.sharding.NamedSharding(t.mesh, jax.sharding.PartitionSpec())
    return fn, (p.state.params, opt, jax.ShapeDtypeStruct((), jnp.int32, sharding=rep), batch)


# ======================================================================================
# the programs
# ======================================================================================


def _devices_per_chip(t: _Target) -> float:
    """JAX devices per chip of the topology (1 on v5e/v6e and on v5p, whose two TensorCores are one
    megacore device; 2 where a chip's cores are separate devices): per-device cost -> per chip."""
    return len(t.all_devices or t.devices) / t.spec.num_chips


def _chips(t: _Target, devices: Sequence) -> int:
    """How many chips ``devices`` (some of the topology's) span."""
    return max(1, round(len(devices) / _devices_per_chip(t)))


def _row(t: _Target, function: str, a: dict, compile_s: float, cost: Optional[dict], model_flops: Optional[float],
         shape: Sequence[int], pieces_s: float, *, role: str = "learner", devices: Optional[Sequence] = None) -> dict:
    """One row. ``role``: learner / rollout / scorer / sync; ``devices``: the role's devices (default the
    learner's): ``role_chips`` and the model FLOPs per chip are over them."""
    chip = t.spec.chip
    chips = t.spec.num_chips
    devs = t.devices if devices is None else devices
    head = {"role": role, "role_chips": _chips(t, devs), "device_ids": [int(d.id) for d in devs]}
    if "oom" in a:  # refused by the compiler: only what its message says is known
        return {**head, "function": function, "topology": t.spec.topology_name, "chips": chips, "hbm_args_bytes": None,
                "hbm_temp_bytes": None, "hbm_out_bytes": None, "hbm_total_bytes": None,
                "hbm_required_bytes": a["required"],
                "chip_hbm_bytes": chip.hbm_bytes, "fits": False, "compile_s": round(compile_s, 2),
                "flops_per_chip": None, "bytes_accessed_per_chip": None, "roofline_step_s": None,
                "mfu_bound": None, "model_flops_per_chip": None, "flops_ratio": None, "shape": list(shape),
                "cost_pieces_s": 0.0, "error": f"compiler: {a['oom']}"}
    total = a["args"] + a["out"] - a["alias"] + a["temp"]
    row = {
        **head, "function": function, "topology": t.spec.topology_name, "chips": chips,
        "hbm_args_bytes": a["args"], "hbm_temp_bytes": a["temp"], "hbm_out_bytes": a["out"] - a["alias"],
        "hbm_total_bytes": total, "chip_hbm_bytes": chip.hbm_bytes, "fits": total <= chip.hbm_bytes,
        "compile_s": round(compile_s, 2), "flops_per_chip": None, "bytes_accessed_per_chip": None,
        "roofline_step_s": None, "mfu_bound": None, "model_flops_per_chip": None, "flops_ratio": None,
        "shape": list(shape), "cost_pieces_s": round(pieces_s, 2),
    }
    if cost is not None:
        per_dev = _devices_per_chip(t)
        fl, by = cost["flops"] * per_dev, cost["bytes"] * per_dev
        roof = max(fl / chip.peak_bf16_flops, by / chip.hbm_bandwidth)
        row.update(flops_per_chip=fl, bytes_accessed_per_chip=by, roofline_step_s=roof)
        if model_flops is not None:
            mf = model_flops / head["role_chips"]
            row.update(model_flops_per_chip=mf, flops_ratio=fl / mf if mf else None,
                       mfu_bound=(mf / (roof * chip.peak_bf16_flops)) if roof else None)
    return row


def compile_programs(cfg: Config, topology: str, *, functions: Sequence[str] = FUNCTIONS, cost: bool = True,
                     log: Callable[[str], None] = lambda s: None) -> list[dict]:
    """AOT-compile ``functions`` of the run ``cfg`` for ``topology`` (``v5p-32``, ``v5e:2x2``, ...).

    Args:
        cfg: the run config (model, mesh, optim, loss, rollout, sft sections are read).
        topology: a Cloud TPU type or raw topology (:func:`jax_rl.tpu.resolve_topology`).
        functions: a subset of :data:`FUNCTIONS`.
        cost: also compile the loop-free cost pieces (FLOPs, bytes, roofline; module docstring).
        log: progress lines (one per compiled program).

    Returns:
        one dict per function (module docstring: the ``--json`` keys). Bytes are per chip.

    Raises:
        ConfigError: a mesh that does not fit the topology, a batch that does not split, an
            unknown function. RuntimeError: libtpu is not installed.
    """
    bad = [f for f in functions if f not in FUNCTIONS]
    if bad:
        raise ConfigError(f"unknown function(s) {bad}; choose from {list(FUNCTIONS)}")
    t = _target(cfg, topology)
    for n in t.notes:
        log(n)
    mc = t.model_config
    L = mc.num_hidden_layers
    T = int(cfg.optim.max_seq_len)
    rows = []
    lrn = None
    if "train_step" in functions or "sft_step" in functions:
        lrn = _learner(t)
    if "train_step" in functions:
        from jax_rl.train_step import make_train_step

        B = int(cfg.optim.batch_size)
        U, m = cfg.optim.minibatches, cfg.optim.microbatches
        r = _layout(B, U, m, "optim.batch_size")
        b, sh = _batch(t, lrn.strategy, U, m, r, T)
        fn = make_train_step(cfg, lrn.graphdef, lrn.tx, lrn.strategy, t.mesh, rest=lrn.rest, schedule=lrn.schedule,
                             state_shardings=lrn.state_shardings, batch_sharding=sh, routing=lrn.routing)
        log(f"train_step: compiling [{B}, {T}] as [{U}, {m}, {r}, {T}] ({lrn.strategy.name}) ...")
        a, secs = _compile_or_oom(fn, (lrn.state, b), t.mesh)
        c, ps, mflops = None, 0.0, None
        if cost and "oom" not in a:
            log("train_step: cost pieces ...")
            c, ps, f, reset = _train_cost(t, lrn, B, T)
            E = cfg.optim.ppo_epochs
            # model FLOPs: policy forward + backward per epoch, plus one pi_prox forward if the
            # strategy runs any (the cost is of a step without a reset: one forward for ppo_ewma)
            mflops = B * T * model_flops_per_token(mc, T) * (3 * E + min(f, 1))
        rows.append(_row(t, "train_step", a, secs, c, mflops, [U, m, r, T], ps))
        if c is not None:
            per_dev = _devices_per_chip(t)
            rows[-1]["reset_step_extra_flops_per_chip"] = reset["flops"] * per_dev if reset else None
            rows[-1]["reset_step_extra_bytes_per_chip"] = reset["bytes"] * per_dev if reset else None
        log(f"train_step: {secs:.1f} s")
    if "sft_step" in functions:
        from jax_rl.learner_spec import make_sft_optimizer

        B = int(cfg.sft.batch_size)
        m = cfg.optim.microbatches
        r = _layout(B, 1, m, "sft.batch_size")
        tx, sched = make_sft_optimizer(cfg)
        fn, args = _sft_fn_args(t, lrn, tx, sched, m, r, T)
        log(f"sft_step: compiling [{B}, {T}] as [1, {m}, {r}, {T}] ...")
        a, secs = _compile_or_oom(fn, args, t.mesh)
        c, ps, mflops = None, 0.0, None
        if cost and "oom" not in a:
            log("sft_step: cost pieces ...")
            one, ps = _fit(lambda cfg_, mc_: _sft_fn_args(t, _learner(t, mc_, cfg_, scan_layers=False), tx, sched,
                                                          1, r, T, cfg_), t, L, T, r)
            upd = _opt_update_cost(t, lrn, tx)
            ps += upd[1]
            c = {k: m * (one[k] - upd[0][k]) + upd[0][k] for k in ("flops", "bytes")}
            mflops = B * T * model_flops_per_token(mc, T) * 3
        rows.append(_row(t, "sft_step", a, secs, c, mflops, [1, m, r, T], ps))
        log(f"sft_step: {secs:.1f} s")
    em = _engine_mesh(t)
    if em is not None and ("prefill" in functions or "decode_step" in functions):
        n = len(t.roles.engines)
        log(f"rollout: {n} engine(s), each on a {'x'.join(str(v) for v in t.roles.engine_mesh.values())} "
            f"(data x fsdp x tensor x expert) mesh of {len(t.roles.engines[0])} device(s); "
            + (f"the {n} engines have the same shape: compiled once, for engine 0 (devices "
               f"{[d.id for d in t.roles.engines[0]]})" if n > 1 else "compiled for its devices"))
    for fname in ("prefill", "decode_step"):
        if fname not in functions:
            continue
        rows.append(_rollout_row(t, fname, cost, log, em))
    if "score_step" in functions and t.roles.scorer is not None:
        rows.append(_scorer_row(t, log))
    if "weight_sync" in functions:
        rows.append(_weight_sync_row(t, lrn, cost, log, em))
    _on_chip(t, rows)
    return rows


def weight_sync_fn(abs_params, param_shardings, mesh, dtype: str):
    """The jitted reshard of a publish: learner params (``param_shardings``) -> the rollout
    engine's params: float leaves cast to ``dtype`` (``rollout.dtype``, as
    :meth:`rollout.engine.Qwen3Engine.load_params` casts them), every leaf replicated on ``mesh``.
    Returns ``(fn, args)`` with ``args`` the ``ShapeDtypeStruct`` params (nothing allocated)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jax_rl.checkpoint import abstract_like
    from rollout.engine import _resolve_dtype

    dt = _resolve_dtype(dtype)
    rep = NamedSharding(mesh, P())

    def cast(x, sh):  # in the learner's layout first, as load_params' eager astype: the gather moves rollout bytes
        return jax.lax.with_sharding_constraint(x.astype(dt), sh) if jnp.issubdtype(x.dtype, jnp.floating) else x

    def sync(params):
        return jax.tree.map(cast, params, param_shardings)

    fn = jax.jit(sync, in_shardings=(param_shardings,), out_shardings=jax.tree.map(lambda _: rep, abs_params))
    return fn, (abstract_like(abs_params, param_shardings),)


def cast_fn(abs_params, param_shardings, dtype: str):
    """The learner-side half of a publish to a sharded engine (:meth:`rollout.engine.Qwen3Engine.load_params`'s
    ``_cast_jit``): float leaves cast to ``dtype`` where the params are, in the learner's shardings; the
    shards then travel to the engine's devices by ``jax.device_put`` (a device-to-device copy over ICI, which
    no single program on one device set can express). Returns ``(fn, args)`` (nothing allocated)."""
    import jax
    import jax.numpy as jnp

    from jax_rl.checkpoint import abstract_like
    from rollout.engine import _resolve_dtype

    dt = _resolve_dtype(dtype)

    def cast(params):
        return jax.tree.map(lambda x: x.astype(dt) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)

    fn = jax.jit(cast, in_shardings=(param_shardings,), out_shardings=param_shardings)
    return fn, (abstract_like(abs_params, param_shardings),)


def _shard_bytes(abs_params, shardings, dtype) -> int:
    """Bytes of one device's shards of ``abs_params`` laid out by ``shardings``, float leaves in ``dtype``."""
    import math

    import jax
    import jax.numpy as jnp

    def one(x, sh):
        size = jnp.dtype(dtype).itemsize if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype.itemsize
        return math.prod(sh.shard_shape(x.shape)) * size

    return sum(jax.tree.leaves(jax.tree.map(one, abs_params, shardings)))


def _weight_sync_row(t: _Target, lrn: Optional[LearnerSpec], cost: bool, log, em=None) -> dict:
    """The ``weight_sync`` row (role ``sync``); its shape is ``[param count]``. Loop-free: the full
    program's ``cost_analysis`` is its cost.

    Colocated engines (``em`` None): :func:`weight_sync_fn` compiled for the learner's mesh. Sharded
    engines (``em``, engine 0's mesh): :func:`cast_fn`, the cast on the learner's mesh, whose shards
    ``device_put`` then moves to each engine.

    The ICI figures (vendor peaks, a lower bound on the time: one direction of every link of a chip busy,
    no hop, contention or latency counted): ``sync_bytes`` = one engine's params in ``rollout.dtype``;
    ``sync_engines`` engines receive them every publish (``rollout.threads``; the eval engine takes its
    copy only at eval time); ``sync_in_bytes_per_chip`` = what one engine chip receives (its shards:
    replicated leaves whole), ``sync_out_bytes_per_chip`` = all engines' bytes over the learner's chips
    (evenly spread: the best case); ``sync_ici_roofline_s`` = max(in, out) / (half the chip's
    bidirectional ICI bandwidth, :data:`jax_rl.tpu.CHIPS`). Colocated: each engine's whole copy goes to
    the learner's first chip (in = engines x (sync_bytes - that chip's own shard), out = one shard)."""
    import jax

    from jax_rl.model_builder import abstract_model_split
    from jax_rl.sharding import state_shardings

    if lrn is not None:
        abs_params, param_sh = lrn.params, lrn.param_shardings
    else:
        _, abs_params, _ = abstract_model_split(t.model_config, **t.learner_kw)
        param_sh = state_shardings(abs_params, t.mesh)
    n = sum(int(x.size) for x in jax.tree.leaves(abs_params))
    dt = t.cfg.rollout.dtype
    if em is None:
        log(f"weight_sync: compiling the publish reshard ({n} params, fp32 learner layout -> {dt} replicated) ...")
        fn, args = weight_sync_fn(abs_params, param_sh, t.mesh, dt)
    else:
        log(f"weight_sync: compiling the publish cast ({n} params, fp32 -> {dt} in the learner's layout; the "
            "shards then move to each engine's mesh by device_put) ...")
        fn, args = cast_fn(abs_params, param_sh, dt)
    a, secs = _compile_or_oom(fn, args, t.mesh)
    c = {"flops": a["flops"], "bytes": a["bytes"]} if cost and "oom" not in a else None
    log(f"weight_sync: {secs:.1f} s")
    row = _row(t, "weight_sync", a, secs, c, None, [n], 0.0, role="sync")

    from rollout.engine import _resolve_dtype

    rdt = _resolve_dtype(dt)
    one = sum(int(x.size) * (jax.numpy.dtype(rdt).itemsize if jax.numpy.issubdtype(x.dtype, jax.numpy.floating)
                             else x.dtype.itemsize) for x in jax.tree.leaves(abs_params))
    per_dev = _devices_per_chip(t)
    own = _shard_bytes(abs_params, param_sh, rdt) * per_dev  # one learner chip's shard, in the rollout dtype
    if em is None:
        engines = int(t.cfg.rollout.threads)
        into = engines * max(one - own, 0)
        out = into
        dest = [t.devices[0]]
    else:
        engines = len(t.roles.engines)
        into = _shard_bytes(abs_params, state_shardings(abs_params, em), rdt) * per_dev
        out = engines * into * _chips(t, t.roles.engines[0]) / row["role_chips"]
        dest = t.roles.engines[0]
    ici = t.spec.chip.ici_bandwidth
    row.update(sync_bytes=one, sync_engines=engines, sync_bytes_total=engines * one, sync_in_bytes_per_chip=into,
               sync_out_bytes_per_chip=out, ici_bandwidth=ici,
               sync_ici_roofline_s=(max(into, out) / (ici / 2)) if ici else None,
               sync_dest_device_ids=[int(d.id) for d in dest])
    return row


def _engine_mesh(t: _Target):
    """Engine 0's mesh (``rollout.mesh`` over its devices), or None for the colocated one-device engine."""
    if t.roles is None or t.roles.engines is None:
        return None
    from jax_rl.sharding import make_mesh

    return make_mesh(**t.roles.engine_mesh, devices=t.roles.engines[0])


def _on_chip(t: _Target, rows: list[dict]) -> None:
    """What the rollout chips hold beside one engine's programs (the ``decode_step`` row) and what the
    scorer's chips hold (the ``score_step`` row):

    * colocated default (``placement.rollout`` null, one-device engines): ``jax-rl train`` (embedded
      runtime) puts its ``rollout.threads`` + 1 (eval) engines on the learner's first device, beside its
      shard: ``engines``, ``hbm_with_learner_bytes`` = train_step total + engines x decode_step total,
      ``fits_with_learner`` (and the same as ``hbm_on_chip_bytes`` / ``fits_on_chip``);
    * sharded engines: the busiest engine mesh holds ``engines_on_chip`` engines (engines sharing a device
      set add up; the eval engine is counted on engine 0's mesh), each with its params and KV cache:
      ``hbm_on_chip_bytes`` = that many decode_step totals, plus the learner's train_step total where an
      engine's devices are also the learner's (then ``hbm_with_learner_bytes`` / ``fits_with_learner`` too);
    * both: ``hbm_on_chip_during_sync_bytes`` / ``fits_during_sync``: + one new params copy per rollout
      engine a publish updates on those chips, held beside the old one until the engine swaps (the eval
      engine is updated at eval time, between publishes: at most as many copies).
    """
    import collections

    by = {r["function"]: r for r in rows}
    tr, d = by.get("train_step"), by.get("decode_step")
    learner = tr["hbm_total_bytes"] if tr is not None else None
    if d is not None and d["hbm_total_bytes"] is not None:
        if t.roles is None or t.roles.engines is None:
            n, overlap = int(t.cfg.rollout.threads) + 1, True
            synced = n - 1
        else:
            sets = collections.Counter(tuple(x.id for x in e) for e in t.roles.engines)
            synced = max(sets.values())
            sets[tuple(x.id for x in t.roles.engines[0])] += 1  # the eval engine
            n = max(sets.values())
            lids = {x.id for x in t.devices}
            overlap = any(x.id in lids for e in t.roles.engines for x in e)
        d["engines"] = n
        d["engines_on_chip"] = n
        d["learner_on_chip"] = overlap
        if overlap and learner is None:
            d["hbm_on_chip_bytes"] = d["fits_on_chip"] = None  # the learner's share is unknown
        else:
            d["hbm_on_chip_bytes"] = n * d["hbm_total_bytes"] + (learner if overlap else 0)
            d["fits_on_chip"] = d["hbm_on_chip_bytes"] <= d["chip_hbm_bytes"]
            d["hbm_on_chip_during_sync_bytes"] = d["hbm_on_chip_bytes"] + synced * d["params_bytes_per_chip"]
            d["fits_during_sync"] = d["hbm_on_chip_during_sync_bytes"] <= d["chip_hbm_bytes"]
        if overlap and learner is not None:
            d["hbm_with_learner_bytes"] = d["hbm_on_chip_bytes"]
            d["fits_with_learner"] = d["fits_on_chip"]
    sc = by.get("score_step")
    if sc is not None and sc["hbm_total_bytes"] is not None:
        sc["hbm_on_chip_bytes"] = sc["hbm_total_bytes"] + (sc["versions_held"] - 1) * sc["params_bytes_per_chip"]
        sc["fits_on_chip"] = sc["hbm_on_chip_bytes"] <= sc["chip_hbm_bytes"]


def _scorer_row(t: _Target, log) -> dict:
    """The ``score_step`` row (role ``scorer``): the dedicated old-logit scorer's forward
    (:meth:`jax_rl.learner.Learner.make_scorer` with ``placement.scorer``: fp32 params on an
    ``fsdp`` mesh over the scorer's devices, one GRPO group of ``rollout.group_size`` rows x
    ``optim.max_seq_len`` per call). Its chips also hold ``versions_held`` = ``async.max_staleness`` + 1
    param versions (:func:`_on_chip` adds the other versions' params)."""
    import jax
    import jax.numpy as jnp

    from jax_rl.checkpoint import abstract_like
    from jax_rl.model_builder import abstract_model_split
    from jax_rl.placement import BatchPlacement
    from jax_rl.sharding import make_mesh, state_shardings
    from jax_rl.train_step import make_logprob_step

    cfg = t.cfg
    devs = t.roles.scorer
    mesh = make_mesh(fsdp=-1, devices=devs)
    graphdef, abs_params, rest = abstract_model_split(t.model_config, **t.learner_kw)
    sh = state_shardings(abs_params, mesh)
    fn = make_logprob_step(cfg, graphdef, rest=rest, param_shardings=sh)
    G, T = int(cfg.rollout.group_size), int(cfg.optim.max_seq_len)
    bs = BatchPlacement(mesh, 1, 1).batch_sharding(G)
    args = (abstract_like(abs_params, sh), jax.ShapeDtypeStruct((1, 1, G, T), jnp.int32, sharding=bs),
            jax.ShapeDtypeStruct((1, 1, G, T), jnp.bool_, sharding=bs))
    log(f"score_step: compiling the scorer's forward ([{G}, {T}], fsdp over {len(devs)} device(s)) ...")
    a, secs = _compile_or_oom(fn, args, mesh)
    log(f"score_step: {secs:.1f} s")
    row = _row(t, "score_step", a, secs, None, None, [1, 1, G, T], 0.0, role="scorer", devices=devs)
    row["versions_held"] = int(cfg.async_.max_staleness) + 1
    row["params_bytes_per_chip"] = _shard_bytes(abs_params, sh, jnp.float32) * _devices_per_chip(t)
    return row


def _opt_update_cost(t: _Target, lrn: LearnerSpec, tx) -> tuple[dict, float]:
    import jax

    from jax_rl.checkpoint import abstract_like

    from jax_rl.correction import tree_finite, tree_where
    from jax_rl.train_step import opt_state_shardings

    opt_sh = opt_state_shardings(tx, lrn.params, lrn.param_shardings, t.mesh)
    opt = abstract_like(jax.eval_shape(tx.init, lrn.params), opt_sh)

    def update(params, opt_state, grads_):
        upd, new_opt = tx.update(grads_, opt_state, params)
        new_p = jax.tree.map(lambda a, u: a + u, params, upd)
        ok = tree_finite(new_p)
        return tree_where(ok, new_p, params), tree_where(ok, new_opt, opt_state)

    fn = jax.jit(update, in_shardings=(lrn.param_shardings, opt_sh, lrn.param_shardings))
    return _compile(fn, (lrn.state.params, opt, lrn.state.params), t.mesh)


def _rollout_row(t: _Target, fname: str, cost: bool, log, em=None) -> dict:
    """A rollout row (role ``rollout``): the colocated engine's step (``em`` None: params replicated,
    as the one-device engine holds them) or a sharded engine's on its mesh ``em`` (engine 0's; every
    engine has the same shape, so one compile stands for all: ``same_shape_engines``)."""
    from jax_rl.tpu import HBM_SIDE_OPTIONS, compile_rollout

    r = t.cfg.rollout
    key = "prefill" if fname == "prefill" else "decode"
    kw = dict(slots=r.slots, max_cache_len=r.max_cache_len, prefill_len=r.max_prefill_length, dtype=r.dtype,
              only=(key,), mesh=em)
    devs = list(t.all_devices) if em is None else list(t.roles.engines[0])
    rk = dict(role="rollout", devices=devs)
    log(f"{fname}: compiling ({r.slots} slots, cache {r.max_cache_len}, prefill {r.max_prefill_length}) ...")
    shape = [1, r.max_prefill_length] if key == "prefill" else [r.slots, r.max_cache_len]
    t0 = time.perf_counter()
    try:
        full = compile_rollout(t.model_config, t.topology, model_kwargs=t.engine_kw, **kw)[key]
    except Exception as e:  # noqa: BLE001 - the TPU compiler refuses a program over HBM
        if not _is_hbm_oom(e):
            raise
        log(f"{fname}: does not fit ({_oom_text(e)})")
        row = _row(t, fname, _oom_analysis(e), time.perf_counter() - t0, None, None, shape, 0.0, **rk)
        _engine_keys(t, row, em)
        return row
    a = _short(full)
    c, ps = None, 0.0
    if cost:
        L = t.model_config.num_hidden_layers
        ek = dict(t.engine_kw, scan_layers=False)

        def pieces(options: Optional[dict]) -> tuple[dict, float]:
            """Unrolled depths 1 and 2, extrapolated to depth L: ({flops, bytes}, compile seconds)."""
            x = [compile_rollout(_depth(t.model_config, d), t.topology, model_kwargs=ek,
                                 compiler_options=options, **kw)[key] for d in (1, 2)]
            return ({k: x[0][src] + (L - 1) * (x[1][src] - x[0][src])
                     for k, src in (("flops", "flops"), ("bytes", "bytes_accessed"))},
                    sum(r_["compile_s"] for r_ in x))

        c, ps = pieces(None)
        if key == "decode":  # the same pieces with no VMEM staging: the HBM-side count
            hbm, s = pieces(HBM_SIDE_OPTIONS)
            c["hbm_side_bytes"], ps = hbm["bytes"], ps + s
    row = _row(t, fname, a, full["compile_s"], c, None, shape, ps, **rk)
    _engine_keys(t, row, em)
    if key == "decode":
        base = full["params_per_chip"] + full["kv_cache_per_chip"]
        per_dev = _devices_per_chip(t)
        row["params_and_kv_cache_bytes_per_chip"] = base * per_dev
        row["params_bytes_per_chip"] = full["params_per_chip"] * per_dev
        row["kv_cache_bytes_per_chip"] = full["kv_cache_per_chip"] * per_dev
        if c is not None:
            row["bytes_accessed_ratio"] = c["bytes"] / base
            row["hbm_side_bytes_accessed_per_chip"] = c["hbm_side_bytes"] * per_dev
            row["hbm_side_ratio"] = c["hbm_side_bytes"] / base
    log(f"{fname}: {full['compile_s']:.1f} s")
    return row


def _engine_keys(t: _Target, row: dict, em) -> None:
    """The engine layout of a rollout row: ``engine_mesh`` (axis sizes; None = the colocated one-device
    engine) and ``same_shape_engines`` (how many engines this one compile stands for)."""
    row["engine_mesh"] = None if em is None else dict(t.roles.engine_mesh)
    row["same_shape_engines"] = int(t.cfg.rollout.threads) if em is None else len(t.roles.engines)
    if em is None:  # the colocated engine lives on the learner's first device; the program is replicated
        row["device_ids"] = [int(t.devices[0].id)]
        row["role_chips"] = 1


# ======================================================================================
# output
# ======================================================================================


def _gib(n) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def format_table(rows: list[dict], title: str = "") -> Any:
    """A ``rich.table.Table`` of the rows (bytes in GiB per chip), grouped by role (learner, rollout,
    scorer, sync: one section each, with the role's chips)."""
    from rich.table import Table

    tb = Table(title=title or None, caption="compile-time estimates from libtpu's compiler (memory_analysis, "
                                            "cost_analysis with loop trip counts); not TPU measurements")
    order = {"learner": 0, "rollout": 1, "scorer": 2, "sync": 3}
    rows = sorted(rows, key=lambda r: order.get(r.get("role", "learner"), 9))  # stable: keeps the order inside a role
    for h in ("role", "function", "shape", "args GiB", "temp GiB", "out GiB", "total GiB", "chip GiB", "fits",
              "compile s", "TFLOP/chip", "GB accessed/chip", "roofline s", "MFU bound", "FLOPs/model"):
        tb.add_column(h, justify="left" if h in ("role", "function", "shape") else "right", no_wrap=h == "role")
    for i, r in enumerate(rows):
        role = r.get("role", "learner")
        first = i == 0 or rows[i - 1].get("role", "learner") != role
        last = i == len(rows) - 1 or rows[i + 1].get("role", "learner") != role
        if r["hbm_total_bytes"] is None:
            need = r.get("hbm_required_bytes")
            fits = f"NO (needs {_gib(need)} GiB)" if need else "NO (compiler)"
        else:
            head = r["chip_hbm_bytes"] - r["hbm_total_bytes"]
            fits = (f"yes ({100 * head / r['chip_hbm_bytes']:.0f}% free)" if r["fits"]
                    else f"NO (+{_gib(-head)} GiB)")
        tb.add_row(
            f"{role} ({r.get('role_chips', r['chips'])} chips)" if first else "", r["function"],
            "x".join(map(str, r["shape"])), _gib(r["hbm_args_bytes"]), _gib(r["hbm_temp_bytes"]),
            _gib(r["hbm_out_bytes"]), _gib(r["hbm_total_bytes"]), _gib(r["chip_hbm_bytes"]), fits,
            f"{r['compile_s']:.1f}",
            "-" if r["flops_per_chip"] is None else f"{r['flops_per_chip'] / 1e12:.2f}",
            "-" if r["bytes_accessed_per_chip"] is None else f"{r['bytes_accessed_per_chip'] / 1e9:.1f}",
            "-" if r["roofline_step_s"] is None else f"{r['roofline_step_s']:.4g}",
            "-" if r["mfu_bound"] is None else f"{100 * r['mfu_bound']:.0f}%",
            "-" if r["flops_ratio"] is None else f"{r['flops_ratio']:.2f}",
            end_section=last,
        )
    return tb


def summary_lines(rows: list[dict]) -> list[str]:
    """One line per role placement fact: what the rollout chips hold and whether it fits, the scorer's
    chips, and the weight sync's bytes and ICI roofline (compile-time estimates and vendor peaks)."""
    out = []
    for r in rows:
        if r["function"] == "decode_step" and r.get("hbm_on_chip_bytes") is not None:
            chip = _gib(r["chip_hbm_bytes"])
            if r.get("engine_mesh") is None:
                out.append(f"first device, learner + {r['engines']} rollout engines (rollout.threads + 1 eval): "
                           f"{_gib(r['hbm_on_chip_bytes'])} of {chip} GiB: "
                           f"{'fits' if r['fits_on_chip'] else 'DOES NOT FIT'}")
            else:
                mesh = "x".join(str(v) for v in r["engine_mesh"].values())
                out.append(f"rollout: {r['same_shape_engines']} engine(s) of mesh {mesh} (data x fsdp x tensor x "
                           f"expert, {r['role_chips']} chips each; same shape: compiled once); the busiest engine "
                           f"chips hold {r['engines_on_chip']} engine(s) (eval included)"
                           + (" and the learner's shard" if r["learner_on_chip"] else ", no learner") +
                           f": {_gib(r['hbm_on_chip_bytes'])} of {chip} GiB: "
                           f"{'fits' if r['fits_on_chip'] else 'DOES NOT FIT'}")
            out.append(f"  during a publish (+ a new params copy per updated engine until it swaps): "
                       f"{_gib(r['hbm_on_chip_during_sync_bytes'])} GiB: "
                       f"{'fits' if r['fits_during_sync'] else 'DOES NOT FIT'}")
        if r["function"] == "score_step" and r.get("hbm_on_chip_bytes") is not None:
            out.append(f"scorer: {r['role_chips']} chips, {r['versions_held']} param versions held: "
                       f"{_gib(r['hbm_on_chip_bytes'])} of {_gib(r['chip_hbm_bytes'])} GiB: "
                       f"{'fits' if r['fits_on_chip'] else 'DOES NOT FIT'}")
        if r["function"] == "weight_sync" and "sync_bytes" in r:
            roof = r["sync_ici_roofline_s"]
            out.append(f"weight sync: {_gib(r['sync_bytes'])} GiB per engine in the rollout dtype x "
                       f"{r['sync_engines']} engine(s); per chip {_gib(r['sync_in_bytes_per_chip'])} GiB in, "
                       f"{_gib(r['sync_out_bytes_per_chip'])} GiB out; ICI roofline "
                       + ("- (no per-chip ICI figure for this chip)" if roof is None else
                          f"{roof * 1e3:.1f} ms at half of {r['ici_bandwidth'] / 1e9:.0f} GB/s bidirectional "
                          "(vendor peak; a lower bound)"))
    return out


def run_compile(cfg: Config, topology: str, *, json_path: Optional[str] = None, functions=FUNCTIONS,
                cost: bool = True) -> int:
    """The CLI: compile, print the table (and write ``json_path``). Exit 0 when every program
    fits in the chip's HBM, 1 when one does not."""
    from rich.console import Console

    con = Console(width=200) if not sys.stdout.isatty() else Console()
    rows = compile_programs(cfg, topology, functions=functions, cost=cost, log=lambda s: con.print(s))
    con.print(format_table(rows, title=f"jax-rl compile: {topology} ({rows[0]['chips'] if rows else '?'} chips), "
                                       f"{cfg.model.preset or cfg.model.checkpoint}, {cfg.loss.correction}"))
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=1))
        con.print(f"wrote {json_path}")
    for line in summary_lines(rows):
        con.print(line)
    dec = next((r for r in rows if r["function"] == "decode_step" and r.get("fits_on_chip") is not None), None)
    for r in rows:
        if r.get("hbm_side_ratio") is not None:
            con.print(f"{r['function']}: bytes accessed per step = {r['bytes_accessed_ratio']:.2f} x (params + KV cache "
                      f"per chip, {_gib(r['params_and_kv_cache_bytes_per_chip'])} GiB); HBM-side count (no VMEM "
                      f"staging): {r['hbm_side_ratio']:.2f} x")
        if r.get("error"):
            con.print(f"{r['function']}: {r['error']}")
    over = [r["function"] for r in rows if not r["fits"]]
    if dec is not None and not dec["fits_on_chip"]:
        over.append("learner + rollout engines on the first device" if dec.get("engine_mesh") is None
                    else "rollout engines on their chips" + (" with the learner" if dec["learner_on_chip"] else ""))
    sc = next((r for r in rows if r["function"] == "score_step" and r.get("fits_on_chip") is False), None)
    if sc is not None:
        over.append(f"scorer with {sc['versions_held']} versions held")
    if over:
        con.print(f"does not fit in HBM: {', '.join(over)}")
        return 1
    return 0

