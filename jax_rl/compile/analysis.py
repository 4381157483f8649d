"""Compiling one program (part of :mod:`jax_rl.compile`): its memory and cost analysis
(:func:`program_analysis`: bytes per chip, FLOPs, bytes accessed; the one vocabulary of every analysis dict in
the package: ``argument_size_in_bytes``, ``output_size_in_bytes``, ``alias_size_in_bytes``,
``temp_size_in_bytes``, ``peak_bytes_per_chip``, ``flops``, ``bytes_accessed``), the libtpu options for its
HBM-side byte count (:data:`HBM_SIDE_OPTIONS`), ``lower().compile()`` under the mesh (:func:`_compile`) with the
splash-attention kernels' FLOPs added from the traced jaxpr, and the TPU compiler's out-of-HBM refusal turned
into a row's ``error`` / ``hbm_required_bytes``. Imports jax inside its functions only."""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING, Any, Optional

from jax_rl.compile.topology import no_persistent_cache

if TYPE_CHECKING:  # annotations only
    from jax_rl.compile.target import _Target


def program_analysis(compiled) -> dict[str, Any]:
    """A compiled program's ``memory_analysis()`` fields (bytes per chip), ``peak_bytes_per_chip`` (arguments +
    outputs - aliases + temporaries), ``flops`` and ``bytes_accessed`` (``cost_analysis()``; a loop body is
    counted once). Compile-time estimates."""
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    if isinstance(cost, list):  # older jax: one dict per computation
        cost = cost[0] if cost else {}
    out = {k: int(getattr(mem, k)) for k in (
        "argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
        "temp_size_in_bytes", "generated_code_size_in_bytes") if hasattr(mem, k)}
    out["peak_bytes_per_chip"] = (out.get("argument_size_in_bytes", 0) + out.get(
        "output_size_in_bytes", 0) - out.get("alias_size_in_bytes", 0) + out.get("temp_size_in_bytes", 0))
    out["flops"] = float(cost.get("flops", 0.0))
    out["bytes_accessed"] = float(cost.get("bytes accessed", 0.0))
    return out


HBM_SIDE_OPTIONS = {"xla_msa_enable": False}
"""libtpu compile options for the *HBM-side count* of a program's bytes: memory-space assignment
(MSA) off, so no buffer is staged in VMEM. MSA runs after fusion, so the program has the same
fusions. ``cost_analysis`` counts every access in every memory space. With MSA on (the program
that runs), a weight prefetched into VMEM is counted three times: the HBM read, the VMEM write
and the VMEM read. With MSA off every access is an HBM access. Measured on libtpu 0.0.42 for a
one-layer Qwen3-4B decode step (64 slots x 4,096, v5e-4): 3,209 MiB counted by default, 2,536 MiB
with MSA off, for 1,958 MiB of params + cache (``bench/decode_compile.py``)."""


# Pallas splash-attention kernels, and the causal matmuls each runs per head and row: the
# forward (S = QK^T, O = PV), dq (S, dP = dO V^T, dQ = dS K), dkv (S, dP, dV = P^T dO, dK = dS^T Q)
_SPLASH_MATMULS = {"fwd": 2, "dq": 3, "dkv": 4}


def _splash_calls(jaxpr) -> dict[str, int]:
    """How many splash kernels of each kind ``jaxpr`` runs (``pallas_call`` equations named
    ``splash_mha_{fwd,dq,dkv}*``), nested jaxprs included (scans by their length; a ``cond`` by
    its costliest branch, like XLA's cost analysis: ``ppo_ewma``'s reset forward counts)."""
    from jax.extend import core as jcore  # lazy: jax after the CLI chooses the platform

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
    passes); returns (:func:`program_analysis`, seconds).

    XLA's cost analysis cannot see into a Pallas kernel, so with ``attn_unit`` (FLOPs of one
    causal [T, T] matmul over every head and row, per device) the splash-attention kernels the
    program calls are added analytically: ``_SPLASH_MATMULS`` matmuls each (fwd 2, dq 3, dkv 4)."""
    import jax  # lazy: jax after the CLI chooses the platform

    t0 = time.perf_counter()
    with jax.set_mesh(mesh), jax.default_matmul_precision("default"), no_persistent_cache():
        traced = fn.trace(*args)
        c = traced.lower().compile()
    a = program_analysis(c)
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
    m = re.search(r"(the total memory required.*?exceeds available HBM \([^)]*\))", str(e))
    return m.group(1) if m else " ".join(str(e).split())[:200]


def _oom_analysis(e: BaseException) -> dict:
    """An analysis dict for a program the compiler refused: ``oom`` (its message) and, when it
    names one, the memory it says is required as ``required`` bytes."""
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
    from jax_rl.models.attention import SPLASH_BLOCK  # lazy: imports jax

    if t.learner_kw.get("attention") != "splash":
        return None
    mc = t.model_config
    Tp = -(-T // SPLASH_BLOCK) * SPLASH_BLOCK
    return rows * mc.num_attention_heads * mc.head_dim * Tp * Tp / len(t.devices)
