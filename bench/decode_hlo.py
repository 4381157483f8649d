"""Where one rollout decode step's bytes and kernels go, from the compiled program (no accelerator).

Usage::

    JAX_PLATFORMS=cpu .venv/bin/python bench/decode_hlo.py --preset qwen3_0p6b --slots 64,256 \\
        --cache 384 --live 320 --layout scan,per_layer [--backend cpu|tpu] [--dtype float32] [--top 12]

Compiles ``Qwen3Engine``'s jitted ``generate`` (one decode step for all slots, the state donated)
at the given shape, for ``--backend cpu`` (XLA:CPU on this host) or ``--backend tpu`` (libtpu's
AOT compiler for ``--topology``, the ``tpu`` extra), in each ``--layout``:

- ``scan``: stacked ``[L, ...]`` params and KV cache, layers under ``lax.scan`` (``scan_unroll=1``),
  the cache the scan carry: what the engine ran on a GPU before ``kv_per_layer`` defaulted on there;
- ``stacked``: the same stacked params and cache with the layer loop written out (``scan_unroll=full``);
- ``per_layer``: ``kv_per_layer=True``: unrolled layers, each with its own params and its own
  (key-transposed) cache buffer (the engine's default on every backend but a TPU);
- ``paged`` / ``paged_xla`` (issue 46): the same step (decode, the engine's ``sample_tokens``,
  ``behav_logp``) over a paged K/V pool (``jax_rl.models.qwen3.paged``, unrolled layers, one pool
  per layer), the pool sized to the live positions (``slots x ceil((live + 1) / --page-size)``
  pages, the reservation per slot gone; the page table still spans ``--cache``). ``paged`` runs
  the attention on the backend's path (TPU: the ragged paged attention kernel, which reads only
  the pages below each row's length; its custom call is charged its whole pool here, i.e. the
  live pages: an upper bound), ``paged_xla`` the XLA gather path (bucketed to the live pages).
  ``--sampler`` picks the paged step's untruncated sampler (``sample_tokens(impl=...)``): ``auto`` (the
  engine's choice for the backend: on a TPU the Pallas kernel of ``rollout.engine.sampler_kernel``,
  charged its operands and results like any custom call), ``xla`` or ``kernel``.

For each it prints, per decode step (a while body counted as many times as its known trip count):

- ``kernels``: top-level instructions that run (fusions, library calls, copies, ...; parameters,
  tuples, bitcasts and constants excluded): a proxy for kernel launches on a GPU;
- ``fusions``, ``copies`` and the bytes of *materialised slices* (a top-level fusion or op whose
  root is a ``dynamic-slice`` / ``slice`` of a bigger buffer: a copy of a layer's weights or cache
  before a library dot, read + written);
- ``traffic``: bytes read + written by the top-level instructions, each once, with in-place
  updates (a ``scatter`` / ``dynamic-update-slice`` into a buffer of the output's size) counted as
  the updates they write rather than the whole buffer; ``cost_analysis``'s own ``bytes accessed``
  (which charges the whole buffer to such an update, and counts a while body once) beside it;
- ``roofline``: what a decode step must move: every weight once (the tied LM head / embedding
  table once; the embedding gather of ``slots`` rows), the K/V of ``--live`` positions per slot
  read, one position per slot and layer written; and ``traffic / roofline``.

XLA:CPU computes bf16 dots in fp32 on this host (no bf16 instructions): in ``bfloat16`` its
program converts stacked params and caches to fp32, which a GPU or TPU program does not, so the
CPU structure is clearest in ``--dtype float32`` (same program, fp32 buffers; the roofline then
counts fp32 bytes too). Every figure is a compile-time count, never a measured time.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
from _record import ROOT  # noqa: E402,F401  (the bench preamble: the repository first on sys.path)

import hlo_traffic as _ht  # noqa: E402

_INPLACE = ("scatter", "dynamic-update-slice")
_SLICES = ("dynamic-slice", "slice")
_THROUGH = ("bitcast", "reshape", "convert", "copy", "transpose")
_NOT_KERNELS = _ht._FREE | {"while", "conditional", "call"}


def step_profile(hlo: str) -> dict:
    """Per-step counts of a compiled module's text (``compiled.as_text()``); see the module doc.

    Returns a dict: ``kernels``, ``fusions``, ``copies``, ``traffic`` (bytes, in-place aware),
    ``slice_bytes`` (materialised slices, read + written), ``inplace_bytes`` (what the in-place
    updates write), ``by_kind`` (Counter of traffic by a short label), ``rows`` (the instructions
    with their per-step bytes and multiplicity), ``unknown_trip_loops`` (while loops whose trip
    count the text does not give: counted once)."""
    internal = _ht.internal_computations(hlo)
    roots: dict[str, str] = {}  # computation -> opcode of its ROOT (through bitcasts, converts, ...)
    defs: dict[str, tuple[str, list[str]]] = {}  # instruction -> (opcode, operands)
    trips: dict[str, tuple[str, int]] = {}  # while body / condition -> (calling computation, trip count)
    sizes: dict[str, int] = {}
    insts = []
    unknown = 0  # while loops without a known trip count (their bodies are counted once)
    for comp, line, (name, shape, op, rest) in _ht.instructions(hlo):
        sizes[name] = _ht.shape_bytes(shape)
        defs[name] = (op, _ht.operand_names(rest))
        if line.lstrip().startswith("ROOT "):
            roots[comp] = name
        if op == "while":
            n = re.search(r'known_trip_count":\{"n":"(\d+)"', line)
            unknown += n is None
            for key in ("body", "condition"):
                b = re.search(key + r"=(%[\w.\-]+)", line)
                if b:
                    trips[b.group(1)] = (comp, int(n.group(1)) if n else 1)
        insts.append((comp, name, shape, op, rest, line))

    def root_op(c: str) -> str:
        op, ops = defs[roots[c]]
        while op in _THROUGH and ops and ops[0] in defs:
            op, ops = defs[ops[0]]
        return op

    def mult(c: str) -> int:
        k = 1
        while c in trips:
            c, n = trips[c]
            k *= n
        return k

    rows = []
    for comp, name, shape, op, rest, line in insts:
        if comp in internal or op in _NOT_KERNELS:
            continue
        ops = _ht.operand_names(rest)
        out = sizes[name]
        opb = [sizes.get(o, 0) for o in ops]
        callee = re.search(r"calls=(%[\w.\-]+)", line)
        root = root_op(callee.group(1)) if (op == "fusion" and callee and callee.group(1) in roots) else op
        kind = root
        if root in _INPLACE and opb and max(opb) == out:
            i = opb.index(max(opb))
            upd = sum(b for j, b in enumerate(opb) if j != i)
            traffic = upd + upd  # the updates (and indices) read, the updates written in place
            kind = "in-place " + root
        else:
            traffic = sum(opb) + out
            if root in _SLICES + ("gather",) and opb and max(opb) > out:
                # reads only the sliced / gathered part of its big operand
                traffic = sum(opb) - max(opb) + 2 * out
                kind = "gather" if root == "gather" else "materialised " + root
        meta = re.search(r'op_name="([^"]+)"', line)
        rows.append(dict(name=name, op=op, root=root, kind=kind, shape=shape, bytes=traffic,
                         n=mult(comp), op_name=_ht._short(meta.group(1)) if meta else ""))
    by_kind = collections.Counter()
    for r in rows:
        by_kind[r["kind"] if r["kind"].startswith(("in-place", "materialised")) else (
            "dot/conv" if r["root"] in ("dot", "convolution", "custom-call") else r["op"])] += r["bytes"] * r["n"]
    return dict(
        kernels=sum(r["n"] for r in rows),
        fusions=sum(r["n"] for r in rows if r["op"] == "fusion"),
        copies=sum(r["n"] for r in rows if r["op"] in ("copy", "copy-start")),
        traffic=sum(r["bytes"] * r["n"] for r in rows),
        slice_bytes=sum(r["bytes"] * r["n"] for r in rows if r["kind"].startswith("materialised")),
        inplace_bytes=sum(r["bytes"] * r["n"] // 2 for r in rows if r["kind"].startswith("in-place")),
        by_kind=by_kind, rows=rows, unknown_trip_loops=unknown)


def roofline_bytes(cfg, slots: int, live: int, itemsize: int) -> dict:
    """Bytes a decode step of ``slots`` slots with ``live`` cached positions each must move."""
    d, L, V = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
    N, K, H, F = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size
    layer = d * N * H * 2 + d * K * H * 2 + 3 * d * F + 2 * d + 2 * H
    head = V * d * (1 if cfg.tie_word_embeddings else 2) + d
    weights = (L * layer + head) * itemsize + (slots * d * itemsize if not cfg.tie_word_embeddings else 0)
    kv_tok = L * 2 * K * H * itemsize
    kv_read = slots * live * kv_tok
    return dict(weights=weights, kv_read=kv_read, kv_write=slots * kv_tok,
                total=weights + kv_read + slots * kv_tok)


def compile_generate(cfg, *, slots: int, cache: int, layout: str, dtype: str, backend: str,
                     topology: str = "v5p-8"):
    """``(compiled, seconds)`` of the engine's ``decode`` step in ``layout`` for ``backend``."""
    import jax

    from jax_rl.models.backend_target import target_backend
    from rollout.engine import EngineSpec, Qwen3Engine

    kw = dict(scan_layers=True, attention="xla", scan_unroll=1 if layout == "scan" else "full")
    eng = Qwen3Engine(cfg, None, EngineSpec(slots=slots, max_cache_len=cache, max_prefill_length=16, dtype=dtype,
                                            model_kwargs=kw, kv_per_layer=(layout == "per_layer"), kv_layout="contiguous"))
    params = eng.abstract_params
    with target_backend(backend):  # the cache that backend's engine holds (XLA:CPU: a bf16 cache's bits)
        state = jax.eval_shape(eng.programs["init_state"], params)
    t0 = time.perf_counter()
    if backend == "tpu":
        import numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

        from jax_rl import compile as aot

        topo = aot.get_topology(topology)
        mesh = Mesh(np.array(topo.devices[:1]), ("data",))
        rep = lambda t: jax.tree.map(  # noqa: E731
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, P())), t)
        with jax.default_matmul_precision("default"), aot.no_persistent_cache():
            compiled = eng.programs["decode"].lower(rep(params), rep(state)).compile()
    else:
        compiled = eng.programs["decode"].lower(params, state).compile()
    return compiled, time.perf_counter() - t0


def compile_paged(cfg, spec, *, live: int, backend: str, topology: str = "v5p-8", kernel: bool = True):
    """``(compiled, seconds)`` of one paged decode step + sampling (module doc, ``paged``) of the engine ``spec``
    describes (a :class:`rollout.engine.EngineSpec`: its slots, ``max_cache_len`` (the page table's span),
    ``kv_page_size``, ``dtype`` and ``sampler``); the pool holds ``spec.kv_pages`` pages (None:
    ``slots x ceil((live + 1) / page_size)``, each row's live pages)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jax_rl.models.backend_target import target_backend
    from jax_rl.models.paged_attention import page_bucket, pages_for
    from jax_rl.models.qwen3 import Qwen3ForCausalLM
    from jax_rl.models.qwen3.paged import PagedKVCache, paged_decode_step
    from rollout.engine import sample_tokens

    slots, page_size, sampler = spec.slots, spec.kv_page_size, spec.sampler
    dt = jnp.dtype(spec.dtype)
    abstract = nnx.eval_shape(lambda: Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0), dtype=dt, param_dtype=dt,
                                                       scan_layers=False, attention="xla"))
    graphdef, params = nnx.split(abstract)
    per_row = pages_for(live + 1, page_size)
    P, M = spec.kv_pages or slots * per_row, pages_for(spec.max_cache_len, page_size)
    n = page_bucket(per_row, M)
    path = backend if kernel else "cpu"

    def step(params, cache, tokens, keys, temperature):
        model = nnx.merge(graphdef, params)
        dec = paged_decode_step(model, tokens, cache, num_pages=n, backend=path)
        keys = jax.vmap(jax.random.fold_in)(keys, cache.lengths.astype(jnp.uint32) + 1)
        tok, logp, _ = sample_tokens(dec.logits, keys, temperature, impl=sampler)
        return dec.cache, tok, logp

    kv = tuple(jax.ShapeDtypeStruct((P, page_size, 2 * cfg.num_key_value_heads, cfg.head_dim), dt)
               for _ in range(cfg.num_hidden_layers))
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    args = (params, PagedKVCache(kv=kv, page_table=i32(slots, M), lengths=i32(slots)), i32(slots),
            jax.ShapeDtypeStruct((slots, 2), jnp.uint32), jax.ShapeDtypeStruct((slots,), jnp.float32))
    fn = jax.jit(step, donate_argnums=(1,))
    t0 = time.perf_counter()
    if backend == "tpu":
        import numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P_

        from jax_rl import compile as aot

        mesh = Mesh(np.array(aot.get_topology(topology).devices[:1]), ("data",))
        args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, P_())), args)
        with jax.default_matmul_precision("default"), aot.no_persistent_cache(), jax.set_mesh(mesh), \
                target_backend(backend):
            compiled = fn.lower(*args).compile()
    else:
        compiled = fn.lower(*args).compile()
    return compiled, time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="qwen3_0p6b")
    p.add_argument("--layers", type=int, default=0, help="num_hidden_layers override (0 = preset)")
    p.add_argument("--slots", default="64,256")
    p.add_argument("--cache", type=int, default=384, help="max_cache_len S")
    p.add_argument("--live", type=int, default=0, help="cached positions per slot for the roofline (0 = S)")
    p.add_argument("--layout", default="scan,per_layer", help="comma list of scan, stacked, per_layer, paged, paged_xla")
    p.add_argument("--page-size", type=int, default=16, help="paged layouts: positions per page")
    p.add_argument("--dtype", default="float32", help="rollout dtype (see the module doc for bf16 on XLA:CPU)")
    p.add_argument("--backend", choices=("cpu", "tpu"), default="cpu")
    p.add_argument("--topology", default="v5p-8", help="--backend tpu: the topology (one chip of it is used)")
    p.add_argument("--sampler", choices=("auto", "xla", "kernel"), default="auto",
                   help="paged layouts: the untruncated sampler (module doc)")
    p.add_argument("--top", type=int, default=0, help="list the N heaviest instructions per step")
    a = p.parse_args(argv)

    import jax

    from jax_rl.models.qwen3 import get_preset
    from rollout.engine import EngineSpec

    if a.backend == "tpu":
        from jax_rl import compile as aot

        aot.quiet_libtpu_env(aot.resolve_topology(a.topology))
    cfg = get_preset(a.preset, **({"num_hidden_layers": a.layers} if a.layers else {}))
    itemsize = 2 if a.dtype in ("bfloat16", "bf16") else 4
    live = a.live or a.cache
    print(f"{a.preset} (L={cfg.num_hidden_layers} d={cfg.hidden_size} V={cfg.vocab_size}), cache {a.cache}, "
          f"roofline at {live} live positions, {a.dtype}, backend {a.backend}"
          f"{' ' + a.topology if a.backend == 'tpu' else ''}; sampler {a.sampler}; jax {jax.__version__}; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load {os.getloadavg()[0]:.1f}")
    mib = 2 ** 20
    for slots in [int(s) for s in a.slots.split(",")]:
        rl = roofline_bytes(cfg, slots, live, itemsize)
        print(f"\nslots={slots}: roofline {rl['total'] / mib:,.0f} MiB/step = weights {rl['weights'] / mib:,.0f} "
              f"+ KV read {rl['kv_read'] / mib:,.0f} + KV write {rl['kv_write'] / mib:.1f}")
        for layout in a.layout.split(","):
            try:
                if layout.startswith("paged"):
                    spec = EngineSpec(slots=slots, max_cache_len=a.cache, dtype=a.dtype, kv_layout="paged",
                                      kv_page_size=a.page_size, sampler=a.sampler)
                    compiled, secs = compile_paged(cfg, spec, live=live, backend=a.backend, topology=a.topology,
                                                   kernel=not layout.endswith("_xla"))
                else:
                    compiled, secs = compile_generate(cfg, slots=slots, cache=a.cache, layout=layout, dtype=a.dtype,
                                                      backend=a.backend, topology=a.topology)
            except Exception as e:  # noqa: BLE001 - report and go on
                print(f"  {layout:9s}: COMPILE FAILED {type(e).__name__}: {str(e)[:300]}")
                continue
            prof = step_profile(compiled.as_text())
            cost = compiled.cost_analysis() or {}
            mem = compiled.memory_analysis()
            print(f"  {layout:9s}: kernels/step {prof['kernels']:,} (fusions {prof['fusions']:,}, copies "
                  f"{prof['copies']}), traffic {prof['traffic'] / mib:,.0f} MiB = {prof['traffic'] / rl['total']:.2f}x "
                  f"roofline; materialised slices {prof['slice_bytes'] / mib:,.0f} MiB; in-place writes "
                  f"{prof['inplace_bytes'] / mib:,.1f} MiB; cost_analysis bytes {cost.get('bytes accessed', 0) / mib:,.0f} "
                  f"MiB (loop bodies once, whole buffer per update); temp {mem.temp_size_in_bytes / mib:,.0f} MiB; "
                  f"compile {secs:.0f}s", flush=True)
            if prof["unknown_trip_loops"]:
                print(f"             NOTE: {prof['unknown_trip_loops']} while loop(s) without a known trip count "
                      "in the compiled text (libtpu prints none): their bodies are counted ONCE above; "
                      "compare layouts whose layer loop is written out")
            print("             by kind: " + ", ".join(f"{k} {v / mib:,.0f}" for k, v in prof["by_kind"].most_common(8)))
            if a.top:
                for r in sorted(prof["rows"], key=lambda r: -r["bytes"] * r["n"])[:a.top]:
                    print(f"             {r['bytes'] * r['n'] / mib:9,.1f} MiB x{r['n']:<3d} {r['kind']:28s} "
                          f"{r['shape'][:44]:44s} {r['op_name'][-60:]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
