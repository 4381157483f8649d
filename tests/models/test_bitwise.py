"""The bitwise mode's gate (issue 62): engine decode log-prob == engine re-score by prefill == the learner's
forward log-prob == the log-prob inside the learner's gradient program (the primal the loss differentiates), bit
for bit, whatever rows share the call; negative controls that must fail the same
assertion (the fast mode; a perturbed key-chunk order on the decode side); and a check that every dot and
reduction in the mode's programs runs on a row tile (no fallback to a non-invariant shape)."""

from __future__ import annotations

import functools
import math
import sys

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_rl.learner.logprobs import sequence_logprobs
from jax_rl.models import bitwise as bw
from jax_rl.models.qwen3 import Qwen3ForCausalLM, get_preset
from jax_rl.models.qwen3.paged import init_paged_cache, paged_decode_step, paged_extend
from jax_rl.sharding import make_mesh, state_shardings

LENS = (9, 23, 70)  # rows of different lengths; 70 > one key chunk (64)
PROMPT = 5  # tokens prefilled before decoding starts
PS = 8  # page size


def _programs():
    """The engine's and the learner's calls as the mode's programs (:func:`jax_rl.models.bitwise.jit`)."""
    def prefill(m, t, c):
        B = t.shape[0]
        return paged_extend(m, t, jnp.zeros((B,), jnp.int32), jnp.full((B,), PROMPT, jnp.int32), c,
                            return_expert_ids=True)

    def rescore(m, t, c):
        return paged_extend(m, t, jnp.zeros((1,), jnp.int32), jnp.full((1,), t.shape[1], jnp.int32), c)

    return {"learn": bw.jit(lambda m, t, a, **k: sequence_logprobs(m, t, a, **k)), "prefill": bw.jit(prefill),
            "decode": bw.jit(lambda m, t, c, num_pages=None: paged_decode_step(m, t, c, num_pages=num_pages,
                                                                               return_expert_ids=True),
                             static_argnames=("num_pages",)),
            "rescore": bw.jit(rescore), "logp": bw.jit(bw.token_logprobs_rows)}


_JIT = _programs()


def _model(moe: bool, dtype, bitwise: bool = True) -> Qwen3ForCausalLM:
    cfg = get_preset("tiny_moe" if moe else "tiny_dense")
    return Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0), dtype=dtype, attention="bitwise" if bitwise else "xla")


def _seqs(V: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(1, V, n).astype(np.int32) for n in LENS]


def _learner(model, seqs, order, T, forced=None, mesh=None) -> dict[int, np.ndarray]:
    """logp per sequence from one learner batch holding the sequences ``order`` right-padded to T."""
    return dict(_learner_rows(model, seqs, order, T, forced, mesh))


def _learner_rows(model, seqs, order, T, forced=None, mesh=None) -> list[tuple[int, np.ndarray]]:
    """(sequence, logp) per row of one learner batch holding the sequences ``order`` right-padded to T; with
    ``mesh`` the learner's layout on it: params sharded by its rules (``embed`` over ``fsdp``), rows over the
    batch axes, the program traced under ``jax.set_mesh``."""
    tok = np.zeros((len(order), T), np.int32)
    mask = np.zeros((len(order), T), bool)
    for r, i in enumerate(order):
        tok[r, :len(seqs[i])] = seqs[i]
        mask[r, :len(seqs[i])] = True
    kw = {}
    if forced is not None:  # routing replay (r3): the engine's routes per MoE layer, [B,T,k]
        kw["forced_expert_ids"] = [np.stack([np.pad(forced[i][li], ((0, T - len(forced[i][li])), (0, 0)))
                                             for i in order]) for li in range(len(forced[order[0]]))]
    if mesh is None:
        out = _JIT["learn"](model, tok, mask, **kw).logp
    else:
        gd, st = nnx.split(model)
        model = nnx.merge(gd, jax.device_put(st, state_shardings(st, mesh)))
        rows = NamedSharding(mesh, P(("data", "fsdp", "expert")))
        tok, mask = jax.device_put(tok, rows), jax.device_put(mask, rows)
        kw = {k: [jax.device_put(a, rows) for a in v] for k, v in kw.items()}
        with jax.set_mesh(mesh):
            out = _JIT["learn"](model, tok, mask, **kw).logp
    return [(i, np.asarray(out[r, 1:len(seqs[i])])) for r, i in enumerate(order)]


def _decode_paged(model, seqs, order, bucket_extra=0):
    """The engine's path on pages: prefill PROMPT tokens of the rows ``order`` in one call, then decode the
    rest teacher-forced, all rows in every call (a finished row keeps decoding garbage at its end). Pages are
    handed out in a shuffled order (any page position). Returns (logp per sequence, routes per sequence)."""
    B = len(order)
    M = -(-max(len(s) for s in seqs) // PS) + 1
    cache = init_paged_cache(model, B, B * M + 3, PS, M)
    pages = np.random.default_rng(1).permutation(B * M + 3)[:B * M].reshape(B, M)
    cache = cache.replace(page_table=jnp.asarray(pages, jnp.int32))
    n_pages = M if bucket_extra else None
    tok = np.stack([seqs[i][:PROMPT] for i in order])
    out = _JIT["prefill"](model, tok, cache)
    cache = out.cache
    lp = {i: [] for i in order}
    routes = {i: [[] for _ in out.expert_ids] for i in order}
    for r, i in enumerate(order):
        for li, e in enumerate(out.expert_ids):
            routes[i][li].extend(np.asarray(e[r, :PROMPT]))
    nxt = np.stack([seqs[i][PROMPT] for i in order])
    logits = out.logits[:, PROMPT - 1]
    dec = functools.partial(_JIT["decode"], num_pages=n_pages)
    for step in range(PROMPT, max(len(seqs[i]) for i in order)):
        lpn = np.asarray(_JIT["logp"](logits, nxt))
        for r, i in enumerate(order):
            if step < len(seqs[i]):
                lp[i].append(lpn[r])
        cur = nxt
        nxt = np.stack([seqs[i][min(step + 1, len(seqs[i]) - 1)] for i in order])
        out = dec(model, jnp.asarray(cur), cache)
        cache, logits = out.cache, out.logits
        for r, i in enumerate(order):
            if step < len(seqs[i]):
                for li, e in enumerate(out.expert_ids):
                    routes[i][li].append(np.asarray(e[r]))
    return {i: np.asarray(v) for i, v in lp.items()}, {i: [np.stack(x) for x in v] for i, v in routes.items()}


def _rescore(model, seqs, i):
    """The engine's re-score of sequence i by one prefill (paged_extend from 0) on its own."""
    n = len(seqs[i])
    M = -(-n // PS)
    cache = init_paged_cache(model, 1, M, PS, M).replace(page_table=jnp.arange(M, dtype=jnp.int32)[None])
    out = _JIT["rescore"](model, jnp.asarray(seqs[i][None]), cache)
    return np.asarray(_JIT["logp"](out.logits[0, :-1], jnp.asarray(seqs[i][1:])))


def _grad_program(model):
    """The mode's gradient program of a policy-gradient-shaped loss: ``value_and_grad`` (one
    :func:`jax_rl.models.bitwise.jit` program) of ``sum(logp * w)`` over the params, the per-token ``logp`` the
    loss differentiates returned as its aux output (the primal of the program), and the grads."""
    gdef, state = nnx.split(model)

    def loss(st, t, a, w, forced):
        lp = sequence_logprobs(nnx.merge(gdef, st), t, a, forced_expert_ids=forced).logp
        return jnp.sum(lp * w), lp

    vg = bw.jit(jax.value_and_grad(loss, has_aux=True))
    return lambda t, a, w, forced=None: vg(state, t, a, w, forced)


def _grad_primal(model, seqs, order, T, forced=None):
    """logp per sequence as the gradient program's primal computes it (the :func:`_learner` batch layout)."""
    tok = np.zeros((len(order), T), np.int32)
    mask = np.zeros((len(order), T), bool)
    for r, i in enumerate(order):
        tok[r, :len(seqs[i])] = seqs[i]
        mask[r, :len(seqs[i])] = True
    f = None
    if forced is not None:
        f = [np.stack([np.pad(forced[i][li], ((0, T - len(forced[i][li])), (0, 0))) for i in order])
             for li in range(len(forced[order[0]]))]
    w = np.random.default_rng(3).normal(size=tok.shape).astype(np.float32) * mask
    (_, lp), _ = _grad_program(model)(tok, mask, w, f)
    return {i: np.asarray(lp[r, 1:len(seqs[i])]) for r, i in enumerate(order)}


def _all_equal(model, moe: bool) -> list[str]:
    """Every comparison of the gate; returns the ones that differ (empty: bitwise)."""
    seqs = _seqs(model.config.vocab_size)
    bad = []
    dec_all, routes = _decode_paged(model, seqs, [0, 1, 2])
    dec_alone = {i: _decode_paged(model, seqs, [i], bucket_extra=1)[0][i] for i in (0, 2)}
    dec_rev = _decode_paged(model, seqs, [2, 0])[0]
    forced = routes if moe else None
    learn = [_learner(model, seqs, [0, 1, 2], 72, forced), _learner(model, seqs, [2], 70, forced),
             _learner(model, seqs, [1, 0], 128, forced)]
    # the logp inside the gradient program (the primal the loss differentiates), two compositions
    primal = [_grad_primal(model, seqs, [0, 1, 2], 72, forced), _grad_primal(model, seqs, [1, 0], 128, forced)]
    for i in range(3):
        ref = dec_all[i]  # the decoded tokens' log-probs (positions >= PROMPT)
        cands = {"decode alone": dec_alone.get(i), "decode other rows": dec_rev.get(i),
                 "rescore": _rescore(model, seqs, i)[PROMPT - 1:]}
        for j, lr in enumerate(learn):
            if i in lr:
                cands[f"learner batch {j}"] = lr[i][PROMPT - 1:]
        for j, pr in enumerate(primal):
            if i in pr:
                cands[f"grad primal batch {j}"] = pr[i][PROMPT - 1:]
        for name, c in cands.items():
            if c is not None and not np.array_equal(np.asarray(c).view(np.uint32), ref.view(np.uint32)):
                bad.append(f"seq {i}: {name}")
    return bad


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_bitwise_decode_rescore_learner_equal(moe, dtype):
    model = _model(moe, dtype)
    assert _all_equal(model, moe) == []


def test_fast_mode_fails_the_gate():
    """Negative control: the same assertion on the fast mode (bitwise off) finds differing log-probs."""
    assert _all_equal(_model(False, jnp.float32, bitwise=False), False) != []


def test_perturbed_chunk_order_fails_the_gate(monkeypatch):
    """Negative control: the decode side's key chunks of 16 instead of 64 (one reduction order changed)."""
    model = _model(False, jnp.float32)
    seqs = _seqs(model.config.vocab_size)
    ref = _learner(model, seqs, [0, 1, 2], 72)
    monkeypatch.setattr(bw, "KEY_CHUNK", 16)
    monkeypatch.setattr(sys.modules[__name__], "_JIT", _programs())  # programs traced afresh (not the cached)
    dec = _decode_paged(model, seqs, [0, 1, 2])[0]
    assert any(not np.array_equal(dec[i].view(np.uint32), ref[i][PROMPT - 1:].view(np.uint32))
               for i in range(3))


MESH_ORDER = (0, 1, 2, 0, 1, 2, 2, 1)  # 8 rows: one per device of fsdp=8
MESH_T = 70  # 8 x 70 rows: padding them to whole tiles breaks their batch split (GSPMD then split the contractions)


def _mesh_differs(moe: bool, dtype) -> list[str]:
    """The learner's forward on an fsdp=8 mesh (8 rows, T = 70) against the one-device paged decode of the same
    sequences; returns the rows that differ."""
    model = _model(moe, dtype)
    seqs = _seqs(model.config.vocab_size)
    dec, routes = _decode_paged(model, seqs, [0, 1, 2])
    rows = _learner_rows(model, seqs, MESH_ORDER, MESH_T, routes if moe else None, mesh=make_mesh(1, 8, 1, 1))
    return [f"row {r} (seq {i})" for r, (i, lp) in enumerate(rows)
            if not np.array_equal(lp[PROMPT - 1:].view(np.uint32), dec[i].view(np.uint32))]


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_bitwise_learner_on_an_fsdp_mesh_equals_one_device_decode(moe, dtype, devices):
    """The learner's layout on fsdp=8 (params split on ``embed``, rows over the devices) gives the one-device
    engine's decode log-probs bit for bit: the mode gathers each layer's weights and keeps whole tiles of rows per
    device (``bw.WHOLE_ON_MESH``), and rounds every bf16 op (``xla_allow_excess_precision=False``). Before: fp32
    dense 94 of 257 tokens differed (partial dots over 1/8 of ``embed`` + all-reduce), bf16 all 257."""
    assert _mesh_differs(moe, dtype) == []


def test_mesh_split_contractions_fail_the_gate(monkeypatch, devices):
    """Negative control: the same comparison with ``bw.WHOLE_ON_MESH`` off (GSPMD's own layout: the
    contractions split over fsdp, programs traced afresh) differs."""
    monkeypatch.setattr(bw, "WHOLE_ON_MESH", False)
    monkeypatch.setattr(sys.modules[__name__], "_JIT", _programs())
    assert _mesh_differs(False, jnp.float32) != []


def _untiled_ops(jaxpr, tile: int) -> list[str]:
    """dot_general / reduce ops of a jaxpr (recursively) whose rows are not a multiple of ``tile``:
    a dot's rows are its batch dims times the lhs free dims, a float reduction's its output size (an integer or
    bool reduction, e.g. the causal skip's max position, is exact in any order)."""
    bad = []
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            (lc, _), (lb, _) = eqn.params["dimension_numbers"]
            shape = eqn.invars[0].aval.shape
            rows = int(np.prod([d for a, d in enumerate(shape) if a not in lc]))
            if rows % tile:
                bad.append(f"dot_general {shape} rows {rows}")
        elif name in ("reduce_sum", "reduce_max", "argmax", "reduce_min"):
            n = int(np.prod(eqn.outvars[0].aval.shape))
            if n % tile and jnp.issubdtype(eqn.invars[0].aval.dtype, jnp.floating):  # int / bool ones are exact
                bad.append(f"{name} {eqn.invars[0].aval.shape} -> {n}")
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            bad += _untiled_ops(sub, tile)
    return bad


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_no_op_falls_back_to_an_untiled_shape(moe):
    """Every dot and float reduction of the mode's decode step and learner log-prob forward runs on a
    multiple of the row tile; the fast mode's decode does not (the check can fail)."""
    def decode_jaxpr(model):
        cache = init_paged_cache(model, 3, 12, PS, 4).replace(page_table=jnp.arange(12, dtype=jnp.int32).reshape(3, 4))
        f = lambda m, t, c: paged_decode_step(m, t, c).logits  # noqa: E731
        return jax.make_jaxpr(f)(model, jnp.ones((3,), jnp.int32), cache).jaxpr

    model = _model(moe, jnp.float32)
    learn = jax.make_jaxpr(lambda m, t: sequence_logprobs(m, t).logp)(model, jnp.ones((2, 30), jnp.int32)).jaxpr
    tile = math.gcd(bw.ROW_TILE, bw.QUERY_TILE)  # the attention's query tile is the smaller one
    assert _untiled_ops(decode_jaxpr(model), tile) == []
    assert _untiled_ops(learn, tile) == []
    assert _untiled_ops(decode_jaxpr(_model(moe, jnp.float32, bitwise=False)), tile) != []


CHUNK = 16  # rollout.prefill_chunk_size of the pressure case (its smallest)


def _engine_under_pressure(model, prompts, max_new: int):
    """The paged engine in ``model``'s mode under the Generator (continuous batching, 2-step windows), a pool
    of one max_cache_len sequence (8 pages) for 3 slots and chunked prefill of CHUNK positions: the long
    prompt runs in chunks, rows wait for pages, and decode preempts the most recently admitted row (its
    pages freed), which is re-admitted later by a re-prefill of prompt + generated-so-far. Sampled
    (temperature 1), fp32. Returns (completions, the generator's kv stats)."""
    from rollout.engine import Qwen3Engine
    from rollout.generator import Generator

    eng = Qwen3Engine(model.config, nnx.state(model, nnx.Param), slots=3, max_cache_len=64, max_prefill_length=64,
                      dtype="float32", kv_layout="paged", kv_page_size=PS, kv_pages=64 // PS, prefill_chunk_size=CHUNK,
                      model_kwargs={"attention": "bitwise"} if model.bitwise else None)
    gen = Generator(eng, decode_steps=2, prefix_cache=0)
    futs = [gen.submit(p, max_new_tokens=max_new, seed=i, temperature=1.0) for i, p in enumerate(prompts)]
    gen.run_until_idle()
    return [f.result() for f in futs], gen.kv_stats()


def _pressure_gaps(model) -> tuple[list[int], dict]:
    """Per request, the decoded tokens whose behav_logp differs (bits) from the learner's forward of prompt +
    completion in one batch; and the generator's kv stats."""
    rng = np.random.default_rng(2)
    prompts = [list(rng.integers(1, model.config.vocab_size, n)) for n in (37, 9, 12)]  # 37: chunks 16+16+5
    comps, kv = _engine_under_pressure(model, prompts, 20)
    seqs = [np.asarray(p + list(c.tokens), np.int32) for p, c in zip(prompts, comps)]
    learn = _learner(model, seqs, [0, 1, 2], 64)
    gaps = []
    for i, (p, c) in enumerate(zip(prompts, comps)):
        assert len(c.tokens) == 20 and c.finish_reason == "length"
        ref = learn[i][len(p) - 1:]  # logp of the tokens at positions len(p)..
        gaps.append(int((np.asarray(c.behav_logp, np.float32).view(np.uint32) != ref.view(np.uint32)).sum()))
    return gaps, kv


def test_bitwise_chunked_prefill_preemption_readmission_equal_the_learner():
    """Issue 62 item 1/3: chunked prefill (a 37-token prompt in chunks of 16), preemption (a row's pages
    freed under a pool of 8 pages) and re-admission (prompt + generated-so-far re-prefilled in chunks) in the
    mode: every sampled token's behav_logp equals the learner's forward bit for bit."""
    gaps, kv = _pressure_gaps(_model(False, jnp.float32))
    assert kv["kv_preempted_requests"] > 0 and kv["kv_reprefill_tokens"] > 0, kv  # the case ran
    assert gaps == [0, 0, 0]


def test_fast_mode_fails_the_pressure_gate():
    """Negative control of the case above: the fast mode's engine and learner differ in some token."""
    gaps, kv = _pressure_gaps(_model(False, jnp.float32, bitwise=False))
    assert kv["kv_preempted_requests"] > 0
    assert sum(gaps) > 0


def test_bitwise_row_count_above_768_equal():
    """The learner's forward of the same two sequences in a call of 2 x 56 positions (256 rows) and of
    2 x 512 positions (1024 rows): bit for bit equal in the mode. Without the mode's
    ``xla_cpu_experimental_ynn_fusion_type=""`` (XLA:CPU's YNNPACK fusions, which take over fused ops from about
    1024 rows) 4 and 6 tokens differed (also 16 x 64, 8 x 128, 10 x 100 = 1000 -> 1024 rows; 12 x 56 -> 768 rows
    was equal): the CLI run's one-ulp behav gap at default batching, where a batched prefill (4 x
    max_prefill_length positions) crosses the threshold (tests/runtime/test_resume_faults.py)."""
    model = _model(False, jnp.float32)
    rng = np.random.default_rng(0)
    seqs = [rng.integers(1, model.config.vocab_size, n).astype(np.int32) for n in (30, 40)]
    small, large = _learner(model, seqs, [0, 1], 56), _learner(model, seqs, [0, 1], 512)
    assert [int((small[i].view(np.uint32) != large[i].view(np.uint32)).sum()) for i in (0, 1)] == [0, 0]


@pytest.mark.parametrize("k,n", [(256, 128), (512, 256), (300, 64)])
def test_chunked_contraction_is_row_count_invariant(k, n):
    """The mode's contraction (:func:`jax_rl.models.bitwise.chunked_contract`, 128-long chunks; the tied LM head's
    [n, k] layout too): the first 64 rows alone and among 192 or 1,024 rows give the same bits. The plain dot did
    not for the first two shapes under the tests' 8 host devices (XLA:CPU's Eigen splits k by its thread pool and
    the row count: 7,350 and 14,679 elements differed at 64 vs 192 rows). Outside ``chunked_contractions`` (the fast
    mode) a projection is one dot (``k_chunks`` 1)."""
    assert bw.k_chunks(k) == 1
    with bw.chunked_contractions():
        assert bw.k_chunks(k) == -(-k // bw.K_CHUNK) and bw.k_chunks(bw.K_CHUNK) == 1
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(1024, k)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(k, n)), jnp.float32)
    for w_k_last in (False, True):
        f = bw.jit(lambda a, b, t=w_k_last: bw.chunked_contract(a, b, w_k_last=t))
        ww = w.T if w_k_last else w
        ref = np.asarray(f(x[:64], ww))
        for m in (192, 1024):
            assert np.array_equal(np.asarray(f(x[:m], ww))[:64].view(np.uint32), ref.view(np.uint32)), (m, w_k_last)
        np.testing.assert_allclose(ref, np.asarray(x[:64] @ w), rtol=1e-5, atol=1e-4)


def _attend_grads(q, k, v, q_pos, w):
    """jit(grad) of ``sum(chunked_attend(q, k, v, q_pos) * w)`` w.r.t. q, k, v, traced afresh (the module's
    ``CUSTOM_BACKWARD`` as it is now)."""
    def loss(q_, k_, v_):
        return jnp.sum(bw.chunked_attend(q_, k_, v_, q_pos).astype(jnp.float32) * w)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_custom_backward_grads_match_autodiff(dtype, monkeypatch):
    """chunked_attend's custom backward (a dense softmax-attention VJP) gives the gradient of the chunk scan's
    autodiff within rounding: GQA (4 q / 2 kv heads), 70 keys (two chunks), a row with padding queries at
    position -1 (zeros, zero gradient); and a wrong backward (the dense VJP without the causal mask) fails the
    same comparison."""
    import chex

    rng = np.random.default_rng(0)
    B, T, N, K, H = 2, 70, 4, 2, 16
    q = jnp.asarray(rng.normal(size=(B, T, N, H)), dtype)
    k, v = (jnp.asarray(rng.normal(size=(B, T, K, H)), dtype) for _ in range(2))
    q_pos = np.tile(np.arange(T, dtype=np.int32), (B, 1))
    q_pos[1, 50:] = -1
    w = jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.float32)
    custom = _attend_grads(q, k, v, jnp.asarray(q_pos), w)
    assert float(jnp.abs(custom[0][1, 50:]).max()) == 0.0
    monkeypatch.setattr(bw, "CUSTOM_BACKWARD", False)
    auto = _attend_grads(q, k, v, jnp.asarray(q_pos), w)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == jnp.float32 else {"rtol": 2e-2, "atol": 2e-2}
    chex.assert_trees_all_close(custom, auto, **tol)
    monkeypatch.setattr(bw, "CUSTOM_BACKWARD", True)
    monkeypatch.setattr(bw, "_dense_attend", lambda q_, k_, v_, _pos: _unmasked_attend(q_, k_, v_))
    with pytest.raises(AssertionError):
        chex.assert_trees_all_close(_attend_grads(q, k, v, jnp.asarray(q_pos), w), auto, **tol)


def _unmasked_attend(q, k, v):
    """A wrong attention for the control above: softmax over every key (no causal mask)."""
    B, T, N, H = q.shape
    K = k.shape[2]
    s = jnp.einsum("btkgh,bskh->bkgts", q.reshape(B, T, K, N // K, H), k) * H ** -0.5
    return jnp.einsum("bkgts,bskh->btkgh", jax.nn.softmax(s, axis=-1), v).reshape(B, T, N, H)


def test_mode_grads_match_the_fast_mode():
    """The mode's gradient (custom attention and boundary backwards) of a policy-gradient-shaped loss equals the
    fast mode's (same params, tiny_dense fp32) within fp32 rounding: a wrong custom backward fails this."""
    import chex

    seqs = _seqs(get_preset("tiny_dense").vocab_size)
    T = 72
    tok = np.zeros((3, T), np.int32)
    mask = np.zeros((3, T), bool)
    for r, s in enumerate(seqs):
        tok[r, :len(s)], mask[r, :len(s)] = s, True
    w = jnp.asarray(np.random.default_rng(3).normal(size=(3, T)) * mask, jnp.float32)
    grads = {}
    for on in (True, False):
        model = _model(False, jnp.float32, bitwise=on)
        gdef, state = nnx.split(model)

        def fn(st, gdef=gdef):
            return jnp.sum(sequence_logprobs(nnx.merge(gdef, st), tok, mask).logp * w)

        grads[on] = (bw.jit if on else jax.jit)(jax.grad(fn))(state)
    # measured: 1 of 2,048 elements of one v_proj gradient 1.6e-6 apart (the two forwards differ by ~5e-7 per token)
    chex.assert_trees_all_close(grads[True], grads[False], rtol=1e-4, atol=1e-5)


def _attend_cases(dtype):
    """chunked_attend calls whose rows have very different lengths (GQA 4 q / 2 kv heads, H = 16): the learner's
    T x T (3 rows of 9, 23 and 200 positions, padding at -1; 400 query rows: two skip blocks), a decode of 3 rows at
    positions 3, 70 and 130 over a 320-key bucket, a chunked prefill of 20 tokens at 100..119 over 256 keys, and
    queries past the keys (positions 130..137 over 100 keys: past the last chunk, the trip count clipped to the
    chunks there are)."""
    rng = np.random.default_rng(1)
    N, K, H = 4, 2, 16

    def case(B, T, S, q_pos):
        q = jnp.asarray(rng.normal(size=(B, T, N, H)), dtype)
        k, v = (jnp.asarray(rng.normal(size=(B, S, K, H)), dtype) for _ in range(2))
        return q, k, v, jnp.asarray(q_pos, jnp.int32)

    learner = np.full((3, 200), -1, np.int32)
    for b, n in enumerate((9, 23, 200)):
        learner[b, :n] = np.arange(n)
    return {"learner": case(3, 200, 200, learner), "decode": case(3, 1, 320, [[3], [70], [130]]),
            "prefill": case(2, 20, 256, np.tile(np.arange(100, 120), (2, 1))),
            "past_keys": case(2, 8, 100, np.tile(np.arange(130, 138), (2, 1)))}


def _attend(args):
    """``chunked_attend`` as a mode program (:func:`bw.jit`), traced afresh (the module's flags as they are now)."""
    return np.asarray(bw.jit(lambda *a: bw.chunked_attend(*a))(*args).astype(jnp.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_causal_skip_changes_no_bit(dtype, monkeypatch):
    """The causal skip (``bw.CAUSAL_SKIP``: per block of query tiles, only the key chunks up to the last one the
    block sees) gives the unskipped scan's bits on calls whose rows have very different lengths: the learner's,
    a decode's, a chunked prefill's, queries past the keys (the trip count clipped)."""
    cases = _attend_cases(dtype)
    skip = {n: _attend(a) for n, a in cases.items()}
    monkeypatch.setattr(bw, "CAUSAL_SKIP", False)
    full = {n: _attend(a) for n, a in cases.items()}
    assert [n for n in cases if not np.array_equal(skip[n].view(np.uint32), full[n].view(np.uint32))] == []
    assert all(np.isfinite(full[n]).all() and np.abs(full[n]).max() > 0 for n in cases)


def test_causal_skip_never_reads_chunks_past_every_query(monkeypatch):
    """NaN keys and values in the chunks above every query's position stay out with the skip on: those chunks are
    not computed at all. A probe step that turns its output NaN when its chunk holds a NaN shows it: with the skip
    it never fires (the output is the clean call's, bit for bit); without (the unskipped scan, where only the
    step's ``where`` kept such chunks out) it fires, so this test fails on a skip that computes them."""
    q, k, v, q_pos = _attend_cases(jnp.float32)["decode"]  # rows at 3, 70, 130 over 320 keys: chunks 3, 4 unseen
    clean = _attend((q, k, v, q_pos))
    k, v = (a.at[:, 192:].set(jnp.nan) for a in (k, v))
    step = bw._chunk_step

    def probe(carry, xs, *a):
        (m, l, o), ys = step(carry, xs, *a)
        return (m, l, o + jnp.where(jnp.isnan(xs[0]).any(), jnp.nan, 0.0)), ys

    monkeypatch.setattr(bw, "_chunk_step", probe)
    out = _attend((q, k, v, q_pos))
    assert np.array_equal(out.view(np.uint32), clean.view(np.uint32))
    monkeypatch.setattr(bw, "CAUSAL_SKIP", False)
    assert np.isnan(_attend((q, k, v, q_pos))).all()
