"""Output (part of :mod:`jax_rl.compile`): the rows as a ``rich`` table grouped by role, the
placement summary lines, and :func:`run_compile`, the ``jax-rl compile`` command (table, ``--json``
file, exit status)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional

from rich.console import Console
from rich.table import Table

from jax_rl.compile.programs import FUNCTIONS, compile_programs
from jax_rl.config import Config


def _gib(n) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def format_table(rows: list[dict], title: str = "") -> Any:
    """A ``rich.table.Table`` of the rows (bytes in GiB per chip), grouped by role (learner, rollout,
    scorer, user, sync: one section each, with the role's chips)."""
    tb = Table(title=title or None, caption="compile-time estimates from libtpu's compiler (memory_analysis, "
                                            "cost_analysis with loop trip counts); not TPU measurements")
    order = {"learner": 0, "rollout": 1, "scorer": 2, "user": 3, "sync": 4}
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
    and the tau² user model's chips, and the weight sync's bytes and ICI roofline (compile-time estimates and vendor peaks)."""
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
        if r["function"] == "user_decode_step" and r.get("hbm_on_chip_bytes") is not None:
            mesh = "x".join(str(v) for v in r["user_mesh"].values())
            out.append(f"user model: {r['role_chips']} chips, mesh {mesh} (data x fsdp x tensor x expert), frozen "
                       f"params {_gib(r['params_bytes_per_chip'])} + KV cache {_gib(r['kv_cache_bytes_per_chip'])} GiB "
                       f"per chip: {_gib(r['hbm_on_chip_bytes'])} of {_gib(r['chip_hbm_bytes'])} GiB: "
                       f"{'fits' if r['fits_on_chip'] else 'DOES NOT FIT'}")
        if r["function"] == "weight_sync" and "sync_bytes" in r:
            roof = r["sync_ici_roofline_s"]
            out.append(f"weight sync: {_gib(r['sync_bytes'])} GiB per engine in the rollout dtype x "
                       f"{r['sync_engines']} engine(s); per chip {_gib(r['sync_in_bytes_per_chip'])} GiB in, "
                       f"{_gib(r['sync_out_bytes_per_chip'])} GiB out; ICI roofline "
                       + ("- (no per-chip ICI figure for this chip)" if roof is None else
                          f"{roof * 1e3:.1f} ms at half of {r['ici_bandwidth'] / 1e9:.0f} GB/s bidirectional "
                          "(vendor peak; a lower bound)"))
            if r.get("sync_staged_bytes_per_learner_chip") is not None:
                ici_x, dcn = r.get("sync_ici_cross_roofline_s"), r.get("sync_dcn_roofline_s")
                out.append(f"  across processes (jax_rl.weight_sync): each learner chip stages "
                           f"{_gib(r['sync_staged_bytes_per_learner_chip'])} GiB and sends "
                           f"{_gib(r['sync_send_bytes_per_learner_chip'])} GiB, each engine chip receives "
                           f"{_gib(r['sync_recv_bytes_per_engine_chip'])} GiB; roofline "
                           + ("-" if ici_x is None else f"{ici_x * 1e3:.1f} ms over ICI") + ", "
                           + ("- over DCN (no per-chip DCN figure for this chip)" if dcn is None else
                              f"{dcn:.2f} s over DCN at {r['dcn_bandwidth'] * 8 / 1e9:.0f} Gb/s per chip")
                           + " (vendor peaks; lower bounds)")
        if r["function"] == "train_step" and r.get("hbm_during_sync_bytes") is not None:
            out.append(f"learner during a publish (live state + the staged shard): "
                       f"{_gib(r['hbm_during_sync_bytes'])} of {_gib(r['chip_hbm_bytes'])} GiB: "
                       f"{'fits' if r['fits_during_sync'] else 'DOES NOT FIT'}")
    return out


def run_compile(cfg: Config, topology: str, *, json_path: Optional[str] = None, functions=FUNCTIONS,
                cost: bool = True) -> int:
    """The CLI: compile, print the table (and write ``json_path``). Exit 0 when every program
    fits in the chip's HBM, 1 when one does not."""
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
