"""Learner train-step throughput: jax-rl vs transformers' Qwen3 (torch fp32) vs a plain matmul.

    .venv/bin/python bench/learner_step.py [--platform cpu|gpu|tpu] [--configs tiny,small] [--B 8] [--T 256] [--steps 3]
        [--scan-layers true,false]

For each model config (``tiny`` = the tiny_dense preset; ``small`` = 4 layers, d=256, V=1024,
8/4 heads, ff=768) it times, on ONE device, after a warm-up (compile) step:

- jax-rl ``Learner.train_step`` with ``loss.correction`` = ``ppo`` (no extra forward),
  ``decoupled`` (one no-grad forward) and ``ppo_ewma`` (one no-grad forward with the EWMA
  params + the EWMA update), all fp32, every token a loss token;
- transformers ``Qwen3ForCausalLM`` in torch fp32 with the same shapes: forward, token
  log-probs, backward, AdamW step;
- a jitted fp32 1024^3 matmul (the machine's attainable FLOP rate);
- the bare model forward+backward (jitted value_and_grad of the summed log-probs), to
  separate the learner's overhead (loss, AdamW, metrics) from the model's own speed;
- the EWMA bookkeeping alone (reset select + update over the params, jitted).

``decoupled`` with one update per step: its no-grad forward at the step-start params is the
same computation as the gradient forward, which XLA may or may not merge (runs vary).

FLOPs of a step: 6 * N_params_nonembedding * tokens + attention 12 * L * T * H * Dh * tokens / 2
(causal) + the LM head 6 * V * d * tokens; the no-grad forward of ppo_ewma/decoupled adds
1/3 of that (not counted in "model TFLOP/s", so those rows show the useful rate).
``--scan-layers``: the ``model.scan_layers`` values to time (comma list; default ``true``, the
config default: decoder layers stacked and run under ``jax.lax.scan``; ``false``: unrolled).
``--scan-unroll``: the ``model.scan_unroll`` values (comma list, default ``auto`` = the whole
stack written out on the CPU); the Tunix rows time one learner per value, interleaved with Tunix
in the same process (e.g. ``--scan-unroll 1,auto`` for one layer per loop iteration vs written
out); the table's scanned rows use the first.
Prints one table; no assertion. Numbers depend on the machine's load.

Tunix row (``--tunix-configs``, default ``small``; only when google-tunix 0.1.7 imports, i.e. in
the bench venv, see ``bench/_tunix.py``; otherwise it prints ``skipped: google-tunix not
installed``): jax-rl's ``Learner.train_step`` (``loss.correction=ppo``, scan_layers per
``--scan-layers``' first value) against Tunix's GRPO actor update (``tunix.rl.trainer.Trainer``
with ``algo_core.grpo_loss_fn``, beta=0, one iteration: one forward + backward + AdamW, like
ours), on the SAME weights (our learner's params written by ``hf_io.save_pretrained`` and read by
Tunix's safetensors loader) and the same [B, T] batch: the first ``--prompt-len`` tokens of each
row are the prompt (no loss), the rest the completion; both optimizers are
``chain(clip_by_global_norm(1), adamw(1e-4))``. Each side is warmed up (compiled) once, then
``--rounds`` interleaved rounds (ours, Tunix, ours, ...) each time one whole step, host batch to
host metrics, in this one process; it prints median [min-max] step seconds and the ratio.

    /work/bench-venv/bin/python bench/learner_step.py --configs small --tunix-configs small --rounds 5

Fixed cost per step (``--fixed-cost N``, issue 36; no torch or Tunix needed): ``N`` learner steps of
the ``tiny`` model (``loss.correction=ppo``) on batches shaped like ``bench/e2e_rl.py``'s (B=64 rows,
the runtime's :func:`jax_rl.learner.batch.collate`), whose longest row varies from step to step (uniform in
``--fixed-lens``, default 40-100 tokens: a prompt of ~43 plus 0-60 generated). It prints the train-step
programs compiled over the run (one per distinct padded length T) and the seconds they took, the
median ``step_time_s`` after them, the median device time of the bare jitted step at the same shape
(dispatch + compute, blocked) and the difference, the learner's host-side fixed cost (validation,
placement, the host step, metrics to the host)::

    .venv/bin/python bench/learner_step.py --fixed-cost 40 [--fixed-lens 40,100] [--fixed-B 64]

``--fetch``: the metrics' trip to the host alone, a dict of 64 device scalars through ``jax.device_get``
(the learner before issue 36) against one float32 vector (now).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from types import SimpleNamespace

from _record import ROOT  # noqa: E402,F401  (the bench preamble: the repository first on sys.path)

from _record import SMALL_DIMS, add_platform_arg, environment, median_time, mfu, select_platform  # noqa: E402

select_platform()  # --platform cpu|gpu|tpu, before jax is imported (default cpu)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import _tunix  # noqa: E402

from jax_rl.config import Config  # noqa: E402
from jax_rl.learner.learner import Learner, resolve_model_config  # noqa: E402

CONFIGS = {
    "tiny": {"preset": "tiny_dense", "hf_overrides": {}},
    "small": {"preset": "tiny_dense", "hf_overrides": {"vocab_size": 1024, **SMALL_DIMS}},
}


def _cfg(model: dict, correction: str, B: int, T: int) -> Config:
    return Config.model_validate({
        "model": model, "loss": {"correction": correction},
        "optim": {"batch_size": B, "max_seq_len": T, "lr": 1e-4},
        "algo": {"group_size": 1},
        "rollout": {"max_cache_len": T},
        "mesh": {"data": 1, "fsdp": 1, "tensor": 1, "expert": 1},
    })


def _batch(V: int, B: int, T: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    lm = np.ones((B, T), bool)
    lm[:, 0] = False
    return {
        "tokens": rng.integers(0, V, (B, T)).astype(np.int32),
        "attention_mask": np.ones((B, T), bool),
        "loss_mask": lm,
        "behav_logp": np.where(lm, -np.log(V), 0).astype(np.float32),
        "versions": np.where(lm, 0, -1).astype(np.int32),
        "turn_ids": np.where(lm, 0, -1).astype(np.int32),
        "advantages": np.where(lm, rng.normal(size=(B, 1)), 0).astype(np.float32),
    }


def step_flops(mc, tokens: int, T: int) -> float:
    d, L, V = mc.hidden_size, mc.num_hidden_layers, mc.vocab_size
    H, K, Dh, F = mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim, mc.intermediate_size
    per_layer = d * (H * Dh) * 2 + d * (K * Dh) * 2 + 3 * d * F
    dense = 6 * (L * per_layer + V * d) * tokens
    attn = 12 * L * T * H * Dh * tokens / 2
    return dense + attn


def bench_jax(model: dict, correction: str, B: int, T: int, steps: int, scan_layers: bool = True,
              scan_unroll="auto") -> dict:
    cfg = _cfg({**model, "scan_layers": scan_layers, "scan_unroll": scan_unroll}, correction, B, T)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1, 1), ("data", "fsdp", "tensor", "expert"))
    lrn = Learner(cfg, mesh=mesh)
    V = lrn.model_config.vocab_size
    b = _batch(V, B, T)
    t0 = time.perf_counter()
    lrn.train_step(b)
    compile_s = time.perf_counter() - t0
    times = []
    for i in range(steps):
        b["versions"] = np.where(b["loss_mask"], lrn.version, -1).astype(np.int32)
        times.append(lrn.train_step(b)["step_time_s"])
    extra = {}
    if correction == "ppo_ewma":
        extra["ewma_update_s"] = _time_ewma_update(lrn)
    if correction == "ppo":
        extra["fwdbwd_s"] = _time_model_fwd_bwd(lrn, b)
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(lrn.state))
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(lrn.state.params))
    dt = statistics.median(times)
    return {"step_s": dt, "tok_s": B * T / dt, "compile_s": compile_s, "state_MB": state_bytes / 2**20,
            "param_MB": param_bytes / 2**20, "mc": lrn.model_config, **extra}


def _time_ewma_update(lrn) -> float:
    """Seconds of the EWMA bookkeeping alone (reset select + bias-corrected update, jitted)."""
    from jax_rl.learner.correction import proximal

    def f(ew, p, W):
        ew, W = proximal.ewma_reset(ew, p, W < 0, W)
        return proximal.ewma_update(ew, p, 0.5, W)

    return median_time(jax.jit(f), lrn.state.correction.params, lrn.state.params, lrn.state.correction.count)


def _time_model_fwd_bwd(lrn, b) -> float:
    """Seconds of a bare jitted value_and_grad of the model's summed log-probs (no loss/optimizer)."""
    tok, am = jnp.asarray(b["tokens"]), jnp.asarray(b["attention_mask"])
    from jax_rl.learner.logprobs import sequence_logprobs

    f = jax.jit(jax.value_and_grad(lambda p: -jnp.mean(sequence_logprobs(lrn.model(p), tok, am).logp)))
    return median_time(f, lrn.state.params)


def bench_torch(mc, B: int, T: int, steps: int) -> dict:
    """Best of torch with 1 thread and with all cores (OpenMP oversubscription on a loaded
    machine can make the multi-threaded run 30x slower, which would flatter us)."""
    import torch

    best = None
    for threads in sorted({1, os.cpu_count() or 1}):
        torch.set_num_threads(threads)
        r = _bench_torch_once(mc, B, T, steps)
        r["threads"] = threads
        if best is None or r["step_s"] < best["step_s"]:
            best = r
    return best


def _bench_torch_once(mc, B: int, T: int, steps: int) -> dict:
    import torch
    import transformers

    torch.manual_seed(0)
    hf = mc.to_hf()
    hf.pop("dtype", None)
    hf.pop("torch_dtype", None)
    conf = transformers.Qwen3Config(**{k: v for k, v in hf.items() if k not in ("architectures", "model_type")})
    model = transformers.Qwen3ForCausalLM(conf).float()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, mc.vocab_size, (B, T))

    def step():
        logits = model(input_ids=ids).logits[:, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
        loss = -(lp.mean())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    dt = statistics.median(times)
    return {"step_s": dt, "tok_s": B * T / dt}


def bench_matmul(n: int = 1024, reps: int = 10) -> float:
    a = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda x, y: x @ y)
    f(a, a).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(reps):
        f(a, a).block_until_ready()
    return 2 * n**3 * reps / (time.perf_counter() - t0)


def _prompted_batch(V: int, B: int, T: int, P: int, seed: int = 0) -> dict:
    """``_batch`` with ids in [1, V) (Tunix reads id 0 as padding) and no loss on the first P
    tokens of each row (the prompt)."""
    b = _batch(V, B, T, seed)
    rng = np.random.default_rng(seed + 1)
    b["tokens"] = rng.integers(1, V, (B, T)).astype(np.int32)
    lm = np.zeros((B, T), bool)
    lm[:, P:] = True
    adv = rng.normal(size=(B, 1)).astype(np.float32)
    b.update(loss_mask=lm, behav_logp=np.where(lm, -np.log(V), 0).astype(np.float32),
             versions=np.where(lm, 0, -1).astype(np.int32), turn_ids=np.where(lm, 0, -1).astype(np.int32),
             advantages=np.where(lm, adv, 0).astype(np.float32))
    return b


def bench_vs_tunix(name: str, B: int, T: int, P: int, rounds: int, scan_layers: bool,
                   unrolls: list = ("auto",)) -> None:
    """jax-rl ``ppo`` learner step (one learner per ``model.scan_unroll`` value in ``unrolls``)
    vs Tunix's GRPO train step, all interleaved in this process (see module doc)."""
    import tempfile

    from jax_rl.models import hf_io

    err = _tunix.import_error()
    if err is not None:
        print(f"{name:10} {'Tunix GRPO train step':22} {err}\n")
        return
    model = CONFIGS[name]
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1, 1), ("data", "fsdp", "tensor", "expert"))
    learners = {}
    for u in unrolls:
        cfg = _cfg({**model, "scan_layers": scan_layers, "scan_unroll": u}, "ppo", B, T)
        learners[u] = Learner(cfg, mesh=mesh)
    lrn = learners[unrolls[0]]
    mc = lrn.model_config
    b = _prompted_batch(mc.vocab_size, B, T, P)
    with tempfile.TemporaryDirectory() as d:
        hf_io.save_pretrained(lrn.model(lrn.state.params), mc, d)
        tmodel = _tunix.load_model(d, mc, "float32")
    probe = b["tokens"][:2, :32]
    diff = _tunix.max_logit_diff(tmodel, lrn.model(lrn.state.params), probe)
    tstep = _tunix.make_grpo_step(tmodel, b, P, lr=cfg.optim.lr, max_grad_norm=cfg.optim.max_grad_norm,
                                  weight_decay=cfg.optim.weight_decay, epsilon=cfg.loss.clip_eps_low)

    def ours(learner: Learner):
        def fn() -> float:
            bb = dict(b, versions=np.where(b["loss_mask"], learner.version, -1).astype(np.int32))
            return _tunix.timed(lambda: learner.train_step(bb))
        return fn

    def theirs() -> float:
        return _tunix.timed(tstep)

    labels = {u: f"jax-rl ppo unroll={learners[u].model().scan_unroll if scan_layers else '-'}" for u in unrolls}
    unroll_desc = ", ".join(f"{u} -> {labels[u].split('=')[1]}" for u in unrolls)
    print(f"{name:10} jax-rl ppo vs Tunix {_tunix.version()} GRPO step: same weights (max |dlogits| {diff:.1e}), "
          f"B={B} T={T} (prompt {P}, completion {T - P}), scan_layers={str(scan_layers).lower()}, "
          f"model.scan_unroll {unroll_desc} (layers per loop "
          f"iteration); interleaved in this process (pid {os.getpid()}), {rounds} rounds after warm-up (ours 1 call, "
          f"Tunix 2: it compiles twice); {_tunix.machine_load()}")
    runners = {labels[u]: ours(learners[u]) for u in unrolls}
    runners["Tunix GRPO step"] = theirs
    # Tunix's jitted step compiles on its first AND second call (jit cache size 2): two warm-ups
    res = _tunix.interleaved(runners, rounds, warmup={**{k: 1 for k in runners}, "Tunix GRPO step": 2})
    mt = statistics.median(res["Tunix GRPO step"])
    for label, xs in res.items():
        m = statistics.median(xs)
        print(f"{name:10} {label:26} {m:8.3f} {B * T / m:9.0f}   step s median [{min(xs):.3f}-{max(xs):.3f}]")
    for u in unrolls:
        xs = res[labels[u]]
        paired = sorted(t / o for o, t in zip(xs, res["Tunix GRPO step"]))
        print(f"{name:10} {labels[u]} / Tunix tokens/s: {mt / statistics.median(xs):.2f}x (ratio of medians); "
              f"per-round {statistics.median(paired):.2f}x [{paired[0]:.2f}-{paired[-1]:.2f}]")
    print(f"{name:10} load after: {_tunix.machine_load()}\n")


def _rl_trajectories(rng, V: int, B: int, longest: int, prompt: int = 43) -> list[SimpleNamespace]:
    """B trajectories of a prompt of ``prompt`` tokens plus generated ones, the longest ``longest``
    tokens (as the runtime hands :func:`jax_rl.learner.batch.collate`)."""
    out = []
    for i in range(B):
        n = longest if i == 0 else int(rng.integers(min(prompt + 1, longest), longest + 1))
        lm = np.arange(n) >= min(prompt, n - 1)
        out.append(SimpleNamespace(tokens=rng.integers(1, V, n).astype(np.int32), loss_mask=lm,
                                   behav_logp=np.where(lm, -np.log(V), 0.0).astype(np.float32),
                                   versions=np.where(lm, 0, -1).astype(np.int32),
                                   turn_ids=np.where(lm, 0, -1).astype(np.int32)))
    return out


def bench_fixed_cost(steps: int, lens: tuple[int, int], B: int, max_seq_len: int = 256) -> None:
    """The learner's fixed cost per step and its compiles over a run of varying lengths (module doc)."""
    from jax_rl.learner.batch import LearnerBatch, collate

    cfg = _cfg({**CONFIGS["tiny"], "scan_layers": True}, "ppo", B, max_seq_len)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1, 1), ("data", "fsdp", "tensor", "expert"))
    lrn = Learner(cfg, mesh=mesh)
    V = lrn.model_config.vocab_size
    rng = np.random.default_rng(0)
    times, shapes, first = [], [], {}
    for i in range(steps):
        trajs = _rl_trajectories(rng, V, B, int(rng.integers(lens[0], lens[1] + 1)))
        for t in trajs:
            t.versions = np.where(t.loss_mask, lrn.version, -1).astype(np.int32)
        adv = rng.normal(size=B).astype(np.float32)
        b = collate(trajs, adv, cfg.optim.max_seq_len)
        m = lrn.train_step(b)
        T = int(m.get("padded_len", b["tokens"].shape[1]))
        times.append(m["step_time_s"])
        shapes.append(T)
        first.setdefault(T, i)
    warm = [t for i, t in enumerate(times) if i not in first.values()]
    med_step = statistics.median(warm) if warm else float("nan")
    compile_s = sum(times[i] - med_step for i in first.values())
    # at the last batch's shape, interleaved: the whole train_step (host batch in, host metrics out)
    # and the bare jitted step (dispatch + device compute, blocked, metrics left on the device)
    bb = lrn._bucketed(b) if hasattr(lrn, "_bucketed") else b
    dev, r = lrn.device_batch(bb, process_local=False)
    fn = lrn.train_step_fn(r)
    whole, bare = [], []
    for _ in range(max(5, steps // 3)):
        b["versions"] = np.where(b["loss_mask"], lrn.version, -1).astype(np.int32)
        whole.append(lrn.train_step(b)["step_time_s"])
        t0 = time.perf_counter()
        with jax.set_mesh(lrn.mesh):
            lrn.state, out = fn(lrn.state, LearnerBatch.from_dict(dev))
        jax.block_until_ready(out)
        bare.append(time.perf_counter() - t0)
    med_whole, med_bare = statistics.median(whole), statistics.median(bare)
    place = []
    for _ in range(5):
        t0 = time.perf_counter()
        d2, _ = lrn.device_batch(bb, process_local=False)
        jax.block_until_ready(d2)
        place.append(time.perf_counter() - t0)
    print(f"fixed cost: tiny model, ppo, B={B}, longest row uniform in {lens[0]}-{lens[1]} tokens, {steps} steps, "
          f"optim.max_seq_len={max_seq_len}; {_load()}")
    print(f"  padded lengths seen: {sorted(set(shapes))} -> {len(first)} train-step program(s) compiled, "
          f"{compile_s:.1f} s over the median step")
    print(f"  step_time_s median {med_step * 1e3:.1f} ms over the {len(warm)} steps after the compiles (mixed T)")
    print(f"  at T={shapes[-1]}, {len(whole)} interleaved rounds: train_step {med_whole * 1e3:.1f} ms, bare jitted step "
          f"{med_bare * 1e3:.1f} ms -> host-side fixed cost {(med_whole - med_bare) * 1e3:.1f} ms per step "
          f"(batch placement alone {statistics.median(place) * 1e3:.1f} ms)")


def bench_fetch(n: int = 64, reps: int = 300) -> None:
    """Metrics to the host: ``jax.device_get`` of a dict of ``n`` device scalars (one transfer each, the
    learner before issue 36) against ``np.asarray`` of one float32 [n] vector (one transfer, now)."""
    vals = {f"m{i}": jax.device_put(jnp.float32(i)) for i in range(n)}
    vec = jax.device_put(jnp.arange(n, dtype=jnp.float32))
    jax.block_until_ready((vals, vec))

    def per_call(fn) -> float:
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            ts.append((time.perf_counter() - t0) / reps)
        return statistics.median(ts)

    a = per_call(lambda: {k: float(v) for k, v in jax.device_get(vals).items()})
    b = per_call(lambda: dict(zip(vals, np.asarray(vec).tolist())))
    print(f"metrics to the host, {n} scalars: dict via jax.device_get {a * 1e6:.0f} us, one vector {b * 1e6:.0f} us "
          f"per step (median of 5 x {reps}); {_load()}")


def _load() -> str:
    la = os.getloadavg()
    return f"load avg {la[0]:.2f} / {la[1]:.2f} / {la[2]:.2f} on {os.cpu_count()} cpus"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="tiny,small")
    ap.add_argument("--B", type=int, default=8)
    ap.add_argument("--T", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--scan-layers", default="true", help="comma list of model.scan_layers values: true,false")
    ap.add_argument("--scan-unroll", default="auto",
                    help="comma list of model.scan_unroll values (auto, full, or an int) for the Tunix rows and "
                         "the scanned rows of the table")
    ap.add_argument("--tunix-configs", default="small",
                    help="configs for the jax-rl vs Tunix GRPO rows (comma list; empty: none)")
    ap.add_argument("--prompt-len", type=int, default=16, help="prompt tokens per row in the Tunix comparison")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds in the Tunix comparison")
    ap.add_argument("--fixed-cost", type=int, default=0,
                    help="only the fixed-cost-per-step run: this many learner steps of varying length (0: off)")
    ap.add_argument("--fixed-lens", default="40,100", help="min,max of the longest row per step (--fixed-cost)")
    ap.add_argument("--fixed-B", type=int, default=64, help="rows per batch (--fixed-cost)")
    ap.add_argument("--fetch", action="store_true", help="only the metrics-fetch comparison (bench_fetch)")
    add_platform_arg(ap)
    args = ap.parse_args()
    env = environment()  # versions, backend, devices, chip (and its peak bf16 FLOP/s on an accelerator)
    if args.fetch:
        bench_fetch()
        return
    if args.fixed_cost:
        lo, hi = (int(x) for x in args.fixed_lens.split(","))
        bench_fixed_cost(args.fixed_cost, (lo, hi), args.fixed_B)
        return
    scans = []
    for v in args.scan_layers.split(","):
        if v not in ("true", "false"):
            ap.error(f"--scan-layers: {v!r} is not true or false")
        scans.append(v == "true")
    unrolls = [int(u) if u.isdigit() else u for u in args.scan_unroll.split(",")]
    jax.config.update("jax_default_matmul_precision", "highest")
    mm = bench_matmul()
    print(f"devices: {jax.devices()}  cpu count: {os.cpu_count()}  load: {os.getloadavg()[0]:.1f}")
    print(f"plain jitted fp32 matmul 1024^3: {mm / 1e9:.1f} GFLOP/s")
    print(f"batch B={args.B} T={args.T} ({args.B * args.T} tokens), median of {args.steps} steps after warm-up\n")
    hdr = f"{'config':10} {'impl':22} {'step s':>8} {'tok/s':>9} {'GFLOP/s':>8} {'vs mm':>6} {'vs torch':>8} {'state MB':>9} {'compile s':>9}"
    print(hdr)
    print("-" * len(hdr))
    for name in [c for c in args.tunix_configs.split(",") if c]:
        bench_vs_tunix(name, args.B, args.T, args.prompt_len, args.rounds, scans[0], unrolls)
    for name in [c for c in args.configs.split(",") if c]:
        model = CONFIGS[name]
        mc = resolve_model_config(Config.model_validate({"model": model}).model)
        flops = step_flops(mc, args.B * args.T, args.T)
        tor = None if args.no_torch else bench_torch(mc, args.B, args.T, args.steps)
        for scan in scans:
            rows = []
            for corr in ("ppo", "decoupled", "ppo_ewma"):
                r = bench_jax(model, corr, args.B, args.T, args.steps, scan_layers=scan, scan_unroll=unrolls[0])
                rows.append((f"jax-rl {corr}", r))
            tag = f"{name}{'/scan' if scan else '/unr'}"
            for label, r in rows:
                vs_t = f"{r['tok_s'] / tor['tok_s']:.2f}x" if tor else "-"
                rate = flops / r["step_s"]
                u = mfu(env, rate)  # beside the chip's peak bf16 FLOP/s (accelerators only)
                print(f"{tag:10} {label:22} {r['step_s']:8.3f} {r['tok_s']:9.0f} {rate / 1e9:8.1f} {rate / mm:6.0%} "
                      f"{vs_t:>8} {r['state_MB']:9.2f} {r['compile_s']:9.1f}"
                      + (f"  MFU {u:.1%} of {env['peak_bf16_flops'] / 1e12:.0f} TFLOP/s ({env['chip']})" if u else ""))
            d = dict(rows)
            fb = d["jax-rl ppo"]["fwdbwd_s"]
            rate = flops / fb
            print(f"{tag:10} {'bare model fwd+bwd':22} {fb:8.3f} {args.B * args.T / fb:9.0f} {rate / 1e9:8.1f} "
                  f"{rate / mm:6.0%} {'':>8} {'':>9} {'':>9}")
            ew, dc = d["jax-rl ppo_ewma"], d["jax-rl decoupled"]
            print(f"{tag:10} ppo_ewma vs ppo: {ew['step_s'] / d['jax-rl ppo']['step_s'] - 1:+.1%} step time (one extra "
                  f"forward with theta_bar); EWMA bookkeeping alone {ew['ewma_update_s'] * 1e3:.1f} ms = "
                  f"{ew['ewma_update_s'] / ew['step_s']:.1%} of the step; state +{ew['state_MB'] - dc['state_MB']:.2f} MB "
                  f"(params {ew['param_MB']:.2f} MB: one fp32 copy)")
            print(f"{tag:10} ppo_ewma vs decoupled (both one no-grad forward): {ew['step_s'] / dc['step_s'] - 1:+.1%} "
                  f"step time\n")
        if tor:
            rate = flops / tor["step_s"]
            print(f"{name:10} {'torch fp32 HF Qwen3 t' + str(tor['threads']):22} {tor['step_s']:8.3f} {tor['tok_s']:9.0f} "
                  f"{rate / 1e9:8.1f} {rate / mm:6.0%} {'1.00x':>8} {'':>9} {'':>9}\n")

if __name__ == "__main__":
    main()
