"""Where a TPU program's bytes go: one train-step gradient piece compiled by libtpu on this host,
its HLO instructions ranked by the HBM traffic they imply.

    .venv/bin/python bench/hlo_traffic.py [--config configs/qwen3_30b_a3b.yaml] [--topology v5p-64]
        [--depth 1] [--top 30] [--shape 327680] [key=value ...]

``jax-rl compile`` reports ``bytes_accessed_per_chip`` from XLA's ``cost_analysis()``, a single
number. This script compiles the same loop-free piece ``jax-rl compile`` costs the train step
from (:func:`jax_rl.learner.train_step.make_grads_fn` on one microbatch, layers unrolled to ``--depth``,
the LM head at its first chunk length) and, from the compiled module's text, lists:

- the compiler's own figures for the piece (FLOPs, bytes accessed, temporaries);
- the *top-level traffic*: for every instruction outside a fusion body or a reducer, the bytes of
  its operands plus its output, each instruction counted once (a fusion's inputs are read and its
  output written once; what happens inside it stays on chip). A while body (the LM-head chunk
  loop) is counted once, as in ``cost_analysis``. This is a lower-bound style estimate of real
  HBM traffic, not the compiler's cost model: compare the two to see what the model charges
  beyond reading and writing each buffer once (measured on libtpu 0.0.42: a row gather of a
  [327680, 2048] bf16 buffer is charged 4.5-8x its operands+output, a copy 1x);
- the instructions ranked by that traffic, totals by opcode and by computation, and, with
  ``--shape N``, the instructions whose output shape contains ``N`` grouped by their JAX op name
  (e.g. ``--shape 81920``: the MoE capacity buffers of 30B-A3B on v5p-64 at capacity factor
  1.25, ``EP x C`` rows per device, on the config's fsdp 4 x expert 8 mesh; 327680 on the former
  tensor 4 x expert 8 mesh).

Every figure is a compile-time estimate for one piece (one microbatch, ``--depth`` layers plus
embedding and head), never a TPU measurement. The 30B-A3B piece takes about 7 minutes to compile
on the 2-core host.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import time
from pathlib import Path

from _record import ROOT  # noqa: E402,F401  (the bench preamble: the repository first on sys.path)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_SHAPE = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([\d,]*)\]")
_INST = re.compile(r"\s*(?:ROOT )?(%[\w.\-]+) = (.+?) ([a-z][\w\-]*)\((.*)$")
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "copy-start", "copy-done"}


def shape_bytes(text: str) -> int:
    """Bytes of every array shape written in ``text`` (``bf16[4,8192,2048]{...}``; a tuple sums
    its elements)."""
    total = 0
    for dt, dims in _SHAPE.findall(text):
        n = 1
        for d in dims.split(","):
            if d:
                n *= int(d)
        total += n * _DTYPE_BYTES[dt]
    return total


def _logical_lines(hlo: str):
    """The module's lines with an instruction's continuation lines (a custom call's multi-line
    ``backend_config``, whose lines may start with ``}}``) joined to it."""
    cur = None
    for line in hlo.split("\n"):
        s = line.strip()
        starts = (s.startswith(("%", "ROOT ")) or line.startswith(("ENTRY", "HloModule")) or s in ("", "}"))
        if starts or cur is None:
            if cur is not None:
                yield cur
            cur = line
        else:
            cur += " " + s
    if cur is not None:
        yield cur


def internal_computations(hlo: str) -> set[str]:
    """Names of the computations that are fusion bodies (``calls=``) or reducers (``to_apply=``)."""
    return set(re.findall(r"calls=(%[\w.\-]+)", hlo)) | set(re.findall(r"to_apply=(%[\w.\-]+)", hlo))


def instructions(hlo: str):
    """Every instruction of a compiled HLO module's text, in order: ``(computation, line,
    (name, shape, opcode, rest))`` with ``rest`` the text after the opcode's ``(``; lines outside a
    computation or that are not instructions are skipped."""
    comp = None
    for line in _logical_lines(hlo):
        if line.endswith("{") and not line.startswith(" "):
            words = line.split()
            comp = words[1] if words[0] == "ENTRY" else words[0]
            continue
        if line.rstrip() == "}":
            comp = None
            continue
        if comp is None:
            continue
        m = _INST.match(line)
        if m:
            yield comp, line, m.groups()


def operand_names(rest: str) -> list[str]:
    """The ``%name`` operands of an instruction: ``rest`` up to the ``)`` that closes its operand list."""
    depth, end = 1, len(rest)
    for i, ch in enumerate(rest):
        depth += (ch == "(") - (ch == ")")
        if depth == 0:
            end = i
            break
    return re.findall(r"%[\w.\-]+", rest[:end])


def top_level_traffic(hlo: str) -> list[dict]:
    """One dict per top-level instruction of a compiled HLO module's text
    (``compiled.as_text()``): ``bytes`` (operands + output), ``op`` (HLO opcode), ``name``,
    ``shape`` (output), ``op_name`` (the JAX op from its metadata), ``target`` (a custom call's
    ``custom_call_target``, else "") and ``computation``.

    Top-level = in a computation that is not a fusion body (``calls=``) or a reducer
    (``to_apply=``). Operand bytes come from the operands' own output shapes (names are unique
    in a module). Parameters, constants, tuples and bitcasts move nothing and are skipped."""
    internal = internal_computations(hlo)
    sizes: dict[str, int] = {}
    rows: list[dict] = []
    for comp, line, (name, shape, op, rest) in instructions(hlo):
        out = shape_bytes(shape)
        sizes[name] = out
        if op in _FREE or comp in internal:
            continue
        operands = sum(sizes.get(o, 0) for o in operand_names(rest))
        meta = re.search(r'op_name="([^"]+)"', line)
        target = re.search(r'custom_call_target="([^"]+)"', line)
        rows.append(dict(bytes=operands + out, op=op, name=name, shape=shape, computation=comp,
                         op_name=meta.group(1) if meta else "", target=target.group(1) if target else ""))
    return rows


def _short(op_name: str) -> str:
    s = re.sub(r"^jit\([^)]*\)/", "", op_name)
    return s.replace("checkpoint/", "").replace("rematted_computation/", "remat:").replace("cond/branch_1_fun/", "cond:")


def report(rows: list[dict], top: int, shape: str | None) -> list[str]:
    """The printed breakdown of :func:`top_level_traffic` rows."""
    gib = lambda b: f"{b / 2**30:8.2f} GiB"
    rows = sorted(rows, key=lambda r: -r["bytes"])
    total = sum(r["bytes"] for r in rows)
    out = [f"top-level traffic: {total:.3e} B over {len(rows)} instructions"]
    for title, key in (("by opcode", "op"), ("by computation", "computation")):
        c = collections.Counter()
        for r in rows:
            c[r[key]] += r["bytes"]
        out.append(f"{title}: " + ", ".join(f"{k} {v / 2**30:.1f} GiB" for k, v in c.most_common(8)))
    out.append(f"top {top} instructions:")
    for r in rows[:top]:
        out.append(f"{gib(r['bytes'])} {r['op']:16s} {r['shape'][:48]:48s} {_short(r['op_name'])[-90:]}")
    if shape:
        sel = [r for r in rows if re.search(rf"[\[,]{shape}[,\]]", r["shape"])]
        g, n = collections.Counter(), collections.Counter()
        for r in sel:
            k = (r["op"], _short(r["op_name"]))
            g[k] += r["bytes"]
            n[k] += 1
        s = sum(g.values())
        out.append(f"instructions with {shape} in the output shape: {s / 2**30:.1f} GiB ({100 * s / max(total, 1):.0f}% "
                   f"of the top-level traffic), {len(sel)} instructions:")
        for (op, name), v in g.most_common(40):
            out.append(f"{gib(v)} x{n[op, name]:<3d} {op:14s} {name[-100:]}")
    return out


def compile_piece(config: str, topology: str, depth: int, overrides: list[str]):
    """The compiled train-step gradient piece ``jax-rl compile`` costs from
    (:func:`jax_rl.compile._grads_piece`, LM head at its first chunk length):
    ``(compiled, cfg, r, T)``."""
    import jax

    from jax_rl import compile as C
    from jax_rl.config import load_config
    from jax_rl.compile.topology import no_persistent_cache

    cfg = load_config(config, overrides)
    t = C._target(cfg, topology)
    r = C._layout(cfg.optim.batch_size, cfg.optim.minibatches, cfg.optim.microbatches, "optim.batch_size")
    T = cfg.optim.max_seq_len
    c1, _ = C._chunks(T)
    fn, args = C._grads_piece(t, r, T, C._with_chunk(t.cfg, c1), C._depth(t.model_config, depth))
    with jax.set_mesh(t.mesh), jax.default_matmul_precision("default"), no_persistent_cache():
        compiled = fn.trace(*args).lower().compile()
    return compiled, cfg, r, T


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "qwen3_30b_a3b.yaml"))
    ap.add_argument("--topology", default="v5p-64")
    ap.add_argument("--depth", type=int, default=1, help="decoder layers in the piece (unrolled)")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--shape", default=None, help="group the instructions whose output shape has this dimension")
    ap.add_argument("--hlo-out", default=None, help="also write the compiled module's text here")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args(argv)
    from jax_rl.compile.analysis import program_analysis

    t0 = time.perf_counter()
    compiled, cfg, r, T = compile_piece(a.config, a.topology, a.depth, a.overrides)
    secs = time.perf_counter() - t0
    an = program_analysis(compiled)
    print(f"{Path(a.config).name} on {a.topology}, {a.depth} layer(s), one microbatch of {r} rows x {T} tokens "
          f"(global shapes), moe_matmul={cfg.model.moe_matmul}, capacity factor {cfg.model.moe_capacity_factor}: "
          f"compiled in {secs:.0f} s (libtpu, compile-time estimate)")
    print(f"compiler: flops {an['flops']:.3e}, bytes accessed {an['bytes_accessed']:.3e}, "
          f"temporaries {an.get('temp_size_in_bytes', 0) / 2**30:.1f} GiB per chip")
    hlo = compiled.as_text()
    if a.hlo_out:
        Path(a.hlo_out).write_text(hlo)
    rows = top_level_traffic(hlo)
    for line in report(rows, a.top, a.shape):
        print(line)
    total = sum(x["bytes"] for x in rows)
    print(f"compiler bytes accessed / top-level traffic: {an['bytes_accessed'] / max(total, 1):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
