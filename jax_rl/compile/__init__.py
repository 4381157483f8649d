"""Ahead-of-time compiling for a TPU topology from any host, in one package: ``jax-rl compile CONFIG
--topology NAME`` AOT-compiles a run's programs with nothing allocated and estimates whether and how fast
they run there; the chip table, the topology names and the rollout engine's programs are here too.

What is compiled (libtpu's real TPU compiler, targeted through
``jax.experimental.topologies.get_topology_desc``; MaxText's ``train_compile.py`` is the model):

- ``train_step``: the learner's jitted step of ``loss.correction``
  (:func:`jax_rl.learner.train_step.make_train_step`: the strategy's pi_prox forward, EWMA update and
  reset, ``ppo_epochs x minibatches`` updates over ``microbatches`` accumulation steps) for the
  worst-case batch ``[optim.batch_size, optim.max_seq_len]``;
- ``sft_step``: :func:`jax_rl.learner.sft.make_sft_step` for ``[sft.batch_size, optim.max_seq_len]``;
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
has a ``role`` (``learner``, ``rollout``, ``scorer``, ``user``, ``sync``), ``role_chips`` and ``device_ids`` (the
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
- user (``placement.user``, ``env.tau2.user=model``): ``user_prefill`` and ``user_decode_step``, the tau²
  user simulator model's engine (``env.tau2.user_model.checkpoint``'s architecture, else the policy's) on
  its own devices (:func:`jax_rl.placement.user_mesh_sizes`); HBM only, no cost pieces.
- sync: ``weight_sync`` (colocated: :func:`weight_sync_fn`; sharded engines: :func:`cast_fn` on the
  learner's mesh, then a ``device_put`` per engine) with the bytes one engine receives in
  ``rollout.dtype`` and a roofline at the chip's ICI bandwidth (:func:`_weight_sync_row`); for a publish
  across processes (:class:`jax_rl.weight_sync.ShardedWeightSync`) ``sync_staged_bytes_per_learner_chip``
  (one engine chip's shard, held beside the learner's live state: the train_step row's
  ``hbm_during_sync_bytes`` / ``fits_during_sync``), ``sync_send_bytes_per_learner_chip``,
  ``sync_recv_bytes_per_engine_chip`` and rooflines over ICI (``sync_ici_cross_roofline_s``, one direction)
  and DCN (``sync_dcn_roofline_s``, the chip's ``dcn_bandwidth``, v5p only: 50 Gb/s, Cloud TPU v5p page).

Figures, per chip (every figure is a compile-time estimate, never a measurement):

- HBM: ``memory_analysis()`` of the full-depth program: arguments, temporaries, outputs
  (minus donated aliases), total against the chip's HBM (:data:`jax_rl.compile.topology.CHIPS`).
- FLOPs and bytes accessed: XLA's ``cost_analysis()`` counts a while-loop body once (the
  scanned layer stack, the microbatch / update scans, the chunked LM head). So the cost comes
  from loop-free pieces compiled for the same mesh, summed with their trip counts:

  * one piece per function: the train step's first-minibatch gradient
    (:func:`jax_rl.learner.train_step.make_grads_fn`, one microbatch of ``r`` rows, with the strategy's
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
:data:`jax_rl.compile.analysis.HBM_SIDE_OPTIONS` (no VMEM staging), whose every counted access is an HBM access.
The default count also holds the VMEM copies of the staged weights. A program the
TPU compiler refuses for lack of HBM gets ``fits: false``, ``error`` (the compiler's words) and
``hbm_required_bytes`` = the memory its message says is required (e.g. for the temporaries
alone; None if it names none); its HBM and cost figures are None.

The map (docs/design.md §4 Layout; ``from jax_rl.compile import ...`` reaches the names used
outside the package):

- :mod:`jax_rl.compile.chips`: the one chip table (:data:`~jax_rl.compile.chips.CHIPS`: per-chip HBM bytes,
  peak bf16 FLOP/s, HBM and ICI bandwidth, vendor figures with their sources, for roofline estimates, not
  measurements) and the backend report of ``jax-rl backend``.
- :mod:`jax_rl.compile.topology`: a Cloud TPU type (``v5e-8``, ``v5p-64``, ...) or a raw topology name
  (``v5p:4x4x4``) -> ``jax.experimental.topologies.get_topology_desc``'s arguments
  (:func:`~jax_rl.compile.topology.resolve_topology`; Cloud names count TensorCores for v4 and v5p, chips for
  v5e and v6e), ``cpu_unless_tpu_present`` (a CPU host with libtpu installed does not probe for a TPU) and
  ``no_persistent_cache`` (JAX's persistent compilation cache off around a TPU compile).
- :mod:`jax_rl.compile.analysis`: one compiled program's memory and cost analysis
  (:func:`~jax_rl.compile.analysis.program_analysis`, the one vocabulary of every analysis dict here),
  ``HBM_SIDE_OPTIONS``, compiling one program (``_compile``), the splash kernels' FLOPs, the compiler's
  out-of-HBM refusal.
- :mod:`jax_rl.compile.engine`: :func:`~jax_rl.compile.engine.compile_rollout`, the rollout engine's prefill,
  append-prefill and decode programs (``rollout.engine.Qwen3Engine``) compiled for a topology.
- :mod:`jax_rl.compile.flops`: model FLOPs (:func:`model_flops_per_token`, the active matmul params).
- :mod:`jax_rl.compile.target`: the target (``_Target``, ``_target``: the topology's devices, the
  roles, the learner's mesh, the model config) and the abstract learner and batch the programs are
  built from.
- :mod:`jax_rl.compile.pieces`: the loop-free cost pieces and their fit (``_fit``, ``_train_cost``),
  the optimizer update's cost, the SFT step's program.
- :mod:`jax_rl.compile.programs`: :data:`FUNCTIONS`, :func:`compile_programs` and its rows (rollout,
  scorer, weight sync: :func:`weight_sync_fn`, :func:`cast_fn`), what the rollout and scorer chips
  hold (``_on_chip``).
- :mod:`jax_rl.compile.table`: :func:`format_table`, :func:`summary_lines` and :func:`run_compile`
  (the ``jax-rl compile`` command).

This ``__init__`` imports none of them: a name is loaded from its module on first use (``__getattr__``), so
the CLI reads :mod:`~jax_rl.compile.chips` and :mod:`~jax_rl.compile.topology` (which import no jax) before
it chooses the platform; the compiling modules import jax once used.
"""

from __future__ import annotations

import importlib
from typing import Any

_NAMES = {
    "chips": ("ChipSpec", "GB"),
    "topology": ("CHIPS", "TopologySpec", "resolve_topology", "get_topology", "cpu_unless_tpu_present",
                 "libtpu_available", "quiet_libtpu_env", "no_persistent_cache"),
    "analysis": ("program_analysis", "HBM_SIDE_OPTIONS",
                 "_attn_unit", "_compile"),  # the private helpers tests/ and bench/ reach as jax_rl.compile._name
    "engine": ("compile_rollout",),
    "flops": ("model_flops_per_token",),
    "programs": ("FUNCTIONS", "compile_programs", "cast_fn", "weight_sync_fn"),
    "table": ("format_table", "run_compile", "summary_lines"),
    "pieces": ("_chunks", "_grads_piece", "_train_cost", "_with_chunk"),
    "target": ("_batch", "_depth", "_layout", "_learner", "_model_config", "_target"),
}
_MODULE_OF = {name: mod for mod, names in _NAMES.items() for name in names}

__all__ = [n for n in _MODULE_OF if not n.startswith("_")]


def __getattr__(name: str) -> Any:
    """``jax_rl.compile.<name>``: the name from its module (imported on first use, then cached here)."""
    mod = _MODULE_OF.get(name)
    if mod is None:
        raise AttributeError(f"module 'jax_rl.compile' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"jax_rl.compile.{mod}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_MODULE_OF])
