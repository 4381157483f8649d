"""Shared by the bench scripts: their preamble, a figure's median with its range, the median time of a jitted call,
the JSON record file each run appends to
(``--json``), :data:`SMALL_DIMS`, the ``small`` model size they measure beside the tiny preset, and the
platform preamble: ``--platform cpu|gpu|tpu`` chosen before jax is imported (:func:`select_platform`,
:func:`add_platform_arg`), the versions and devices printed and put in every record
(:func:`environment`), and the figure beside its roofline from the one chip table,
:data:`jax_rl.compile.chips.CHIPS` (:func:`decode_roofline`, :func:`mfu`).

The preamble: a bench script's first project import is ``from _record import ...`` (``bench/`` is on
``sys.path`` as the script's own directory, or by ``tests/bench_module.load_bench``); importing this module
puts the repository root (:data:`ROOT`) first on ``sys.path``, so ``jax_rl`` and ``rollout`` come from the
checkout the script sits in, not from an installed copy (``bench/e2e_rl.py --src`` puts its other tree ahead
of it later, before it imports jax_rl). It imports no jax (a script chooses the platform first).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
"""The repository root (the bench scripts' checkout)."""
if not sys.path or sys.path[0] != str(ROOT):
    sys.path.insert(0, str(ROOT))

PLATFORMS = {"cpu": "cpu", "gpu": "cuda", "tpu": "tpu"}
"""``--platform`` -> ``JAX_PLATFORMS`` (``gpu``: the CUDA plugin of the ``gpu`` extra)."""


def _chips():
    """:mod:`jax_rl.compile.chips`, imported when first needed: a bench that runs another source tree's jax_rl
    (``bench/e2e_rl.py --src``) puts that tree on ``sys.path`` first; this checkout is only the fallback. A tree
    from before the chip table moved into ``jax_rl/compile/`` has it as ``jax_rl.chips``."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if root not in sys.path:
        sys.path.append(root)
    try:
        from jax_rl.compile import chips
    except ImportError:  # an older source tree (bench/e2e_rl.py --src)
        from jax_rl import chips

    return chips


def select_platform(argv: Optional[Sequence[str]] = None, default: str = "cpu") -> str:
    """Set ``JAX_PLATFORMS`` from ``--platform cpu|gpu|tpu`` in ``argv`` (default ``sys.argv``) before jax
    is imported; without the flag a ``JAX_PLATFORMS`` already set is kept, else ``default`` (the CPU: the
    figures in docs/ were measured so). Call at the top of a bench, before ``import jax``. Returns the
    value set. Raises SystemExit (one line) for an unknown platform."""
    argv = list(sys.argv[1:] if argv is None else argv)
    plat = None
    for i, a in enumerate(argv):
        if a == "--platform" and i + 1 < len(argv):
            plat = argv[i + 1]
        elif a.startswith("--platform="):
            plat = a.split("=", 1)[1]
    if plat is not None:
        if plat not in PLATFORMS:
            raise SystemExit(f"--platform {plat}: one of {', '.join(PLATFORMS)}")
        os.environ["JAX_PLATFORMS"] = PLATFORMS[plat]
    else:
        os.environ.setdefault("JAX_PLATFORMS", PLATFORMS[default])
    return os.environ["JAX_PLATFORMS"]


def add_platform_arg(parser) -> None:
    """``--platform cpu|gpu|tpu`` on a bench's argparse parser (read earlier by :func:`select_platform`)."""
    parser.add_argument("--platform", choices=sorted(PLATFORMS), default=None,
                        help="JAX backend to measure on (JAX_PLATFORMS=cpu|cuda|tpu; default: JAX_PLATFORMS "
                             "if set, else cpu)")


def environment(echo: bool = True) -> dict[str, Any]:
    """jax-rl / jax / jaxlib versions, the backend, its devices and the chip (:func:`jax_rl.compile.chips.backend_report`)
    plus the chip's vendor peaks (``hbm_bandwidth`` bytes/s, ``peak_bf16_flops`` FLOP/s; None on a CPU or an
    unknown chip). ``echo``: also print it as one ``env:`` line. Put it in every record."""
    chips = _chips()
    rep = chips.backend_report()
    spec = None
    if "error" not in rep and rep["devices"]:
        spec = chips.chip_for(rep["devices"][0]["kind"])
    rep["hbm_bandwidth"] = spec.hbm_bandwidth if spec else None
    rep["peak_bf16_flops"] = spec.peak_bf16_flops if spec else None
    if echo:
        if "error" in rep:
            print(f"env: jax-rl {rep['jax-rl']}, jax {rep['jax']}, jaxlib {rep['jaxlib']}; "
                  f"backend error: {rep['error']}")
        else:
            kinds = sorted({d["kind"] for d in rep["devices"]})
            chip = (f"; chip {spec.name}: HBM {spec.hbm_bandwidth / 1e12:.2f} TB/s, bf16 "
                    f"{spec.peak_bf16_flops / 1e12:.0f} TFLOP/s (vendor peaks)") if spec else ""
            print(f"env: jax-rl {rep['jax-rl']}, jax {rep['jax']}, jaxlib {rep['jaxlib']}; backend {rep['backend']}, "
                  f"{len(rep['devices'])} x {', '.join(kinds)}{chip}", flush=True)
    return rep


def decode_roofline(env: dict, bytes_per_step: float, tokens_per_step: int) -> Optional[float]:
    """Tokens/s a decode step moving ``bytes_per_step`` bytes (weights once + the K/V read) and making
    ``tokens_per_step`` tokens can reach at the chip's HBM bandwidth (``env`` from :func:`environment`); None
    off an accelerator (no roofline printed)."""
    bw = env.get("hbm_bandwidth")
    return tokens_per_step * bw / bytes_per_step if bw else None


def mfu(env: dict, flops_per_s: float) -> Optional[float]:
    """Model FLOP utilisation: ``flops_per_s`` / the chip's dense bf16 peak (``env`` from :func:`environment`),
    or None off an accelerator."""
    peak = env.get("peak_bf16_flops")
    return flops_per_s / peak if peak else None


SMALL_DIMS = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 8,
              "num_key_value_heads": 4, "head_dim": 32}
"""The benches' ``small`` Qwen3 (HF config names, over the ``tiny_dense`` preset; the vocabulary is each
bench's own): where compute rather than dispatch dominates a step on the CPU."""


def median_range(xs: Sequence[float]) -> tuple[float, float, float]:
    """``(median, min, max)`` of one figure over the rounds."""
    return statistics.median(xs), min(xs), max(xs)


def median_time(fn: Callable, *args: Any, reps: int = 3) -> float:
    """Median wall seconds of ``fn(*args)`` over ``reps`` calls, each waited for (``jax.block_until_ready``),
    after one untimed call (compile, warm-up)."""
    import jax

    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def append_record(path: str, rec: dict[str, Any]) -> None:
    """Append ``rec`` to the JSON list at ``path`` (created with its directory when missing)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    old = []
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
    with open(path, "w") as f:
        json.dump(old + [rec], f, indent=1)
    print(f"appended to {path}")


def finish(args: Any, load_before: tuple, load_after: tuple, results: dict, **extra: Any) -> dict:
    """Print the load average after the rounds and, with ``args.json``, append the run's record (date, the
    arguments, both load averages, ``results`` and ``extra``) to that file. Returns the record."""
    import datetime as dt

    print(f"load average after: {load_after[0]:.1f} {load_after[1]:.1f} {load_after[2]:.1f}")
    if "env" not in extra:  # the versions and devices in every record
        extra = {"env": environment(echo=False), **extra}
    rec = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "args": vars(args), **extra,
           "load_before": load_before, "load_after": load_after, "results": results}
    if getattr(args, "json", None):
        append_record(args.json, rec)
    return rec
