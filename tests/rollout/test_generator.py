"""Generator: continuous batching, stop conditions, version tags under weight swaps (all partial
modes, mid-generation and queued), threads, and greedy parity with transformers."""

from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_rl.learner.logprobs import sequence_logprobs
from rollout.engine import Qwen3Engine
from rollout.generator import Generator

S = 64
_T = 32


@pytest.fixture(scope="module")
def params1(model):
    return nnx.state(model, nnx.Param)


@pytest.fixture(scope="module")
def engine(model, params1):
    return Qwen3Engine(model.config, params1, slots=2, max_cache_len=S, dtype="float32", temperature=1.0, kv_layout="contiguous")


@pytest.fixture(scope="module")
def refs(model):
    """Reference log-probs computed with the model directly (fp32, jitted, fixed shapes)."""
    graphdef, _, rest = nnx.split(model, nnx.Param, ...)

    @jax.jit
    def full(params, seq, mask):
        m = nnx.merge(graphdef, params, rest)
        return sequence_logprobs(m, seq, mask, temperature=1.0).logp

    @jax.jit
    def mixed(p_old, p_new, seq, c):
        """KV of seq[:c] from p_old, then p_new decodes seq[c:], logp of seq[t] for t > c."""
        m_old, m_new = nnx.merge(graphdef, p_old, rest), nnx.merge(graphdef, p_new, rest)
        cache = m_old.init_cache(1, _T)
        cache = m_old.prefill(seq, jnp.reshape(c, (1,)), cache).cache

        def body(cache, t):
            i = jnp.minimum(c + t, _T - 2)
            out = m_new.decode_step(jax.lax.dynamic_slice(seq[0], (i,), (1,)), cache)
            logits, cache2 = out.logits, out.cache
            lp = jax.nn.log_softmax(logits[0])[seq[0, i + 1]]
            return cache2, lp

        _, lps = jax.lax.scan(body, cache, jnp.arange(_T - 1))
        return lps  # lps[t] = log p(seq[c+t+1]) after decoding seq[c..c+t] with p_new

    def seq_mask(prompt, toks):
        seq = np.zeros((1, _T), np.int32)
        mask = np.zeros((1, _T), bool)
        n = len(prompt) + len(toks)
        seq[0, :n] = prompt + toks
        mask[0, :n] = True
        return seq, mask

    def full_lp(params, prompt, toks):
        seq, mask = seq_mask(prompt, toks)
        return np.asarray(full(params, seq, mask))[0, len(prompt): len(prompt) + len(toks)]

    def mixed_lp(p_old, p_new, prompt, toks, k):
        """logps of toks[k:] when the swap happened after k tokens under partial=continue."""
        seq, _ = seq_mask(prompt, toks)
        c = len(prompt) + k - 1  # cache positions written under p_old at the swap
        lps = np.asarray(mixed(p_old, p_new, seq, jnp.int32(c)))
        return lps[: len(toks) - k]

    return full_lp, mixed_lp


PA, PB, PC = [5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]


def _swap_run(engine, params2, partial, n_before=4, max_new=12):
    gen = Generator(engine, partial=partial, version=0)
    fa = gen.submit(PA, max_new_tokens=max_new, seed=1)
    fb = gen.submit(PB, max_new_tokens=max_new, seed=2)
    fc = gen.submit(PC, max_new_tokens=max_new, seed=3)  # waits in the queue (2 slots)
    for _ in range(n_before):
        gen.step()
    assert gen.num_active == 2 and gen.num_queued == 1
    gen.update_params(params2, 1)
    assert gen.version == 0  # the swap happens at the next step, not before
    gen.run_until_idle()
    assert gen.version == 1
    return [f.result(timeout=0) for f in (fa, fb, fc)]


@pytest.mark.parametrize("partial", ["continue", "recompute_kv", "abort"])
def test_version_tags_under_weight_swap(engine, params1, params2, refs, partial):
    full_lp, mixed_lp = refs
    p1, p2 = engine.params, engine.load_params(params2)
    a, b, c = _swap_run(engine, params2, partial)
    k = 4
    for comp, prompt in ((a, PA), (b, PB)):
        assert len(comp.tokens) == len(comp.behav_logp) == len(comp.versions)
        if partial == "abort":
            # partial turn dropped, re-issued with the remaining budget: all tokens new version
            assert comp.info["reissues"] == 1 and comp.info["dropped_tokens"] == k
            assert comp.info["budget"] == 12 - k and len(comp.tokens) == 12 - k
            assert comp.versions.tolist() == [1] * (12 - k)
            np.testing.assert_allclose(comp.behav_logp, full_lp(p2, prompt, comp.tokens), atol=1e-5)
        else:
            assert comp.versions.tolist() == [0] * k + [1] * (12 - k)  # no off-by-one at the swap
            assert comp.info["reissues"] == 0 and comp.info["budget"] == 12
            np.testing.assert_allclose(comp.behav_logp[:k], full_lp(p1, prompt, comp.tokens)[:k], atol=1e-5)
            if partial == "recompute_kv":
                assert comp.info["recomputes"] == 1
                # KV re-prefilled under the new weights: later tokens equal a clean p2 forward
                np.testing.assert_allclose(comp.behav_logp[k:], full_lp(p2, prompt, comp.tokens)[k:], atol=1e-5)
            else:
                assert comp.info["recomputes"] == 0
                # old KV kept: later tokens = p2 decoding on top of the p1 cache
                np.testing.assert_allclose(comp.behav_logp[k:], mixed_lp(p1, p2, prompt, comp.tokens, k), atol=1e-5)
                assert np.max(np.abs(np.asarray(comp.behav_logp[k:]) - full_lp(p2, prompt, comp.tokens)[k:])) > 1e-4
        assert comp.finish_reason == "length"
    # C waited in the queue during the swap: prefilled and decoded entirely by version 1
    assert c.versions.tolist() == [1] * 12 and c.info["reissues"] == 0 and c.info["queue_s"] > 0
    np.testing.assert_allclose(c.behav_logp, full_lp(p2, PC, c.tokens), atol=1e-5)


def test_stop_ids_budget_and_cache_full(engine):
    gen = Generator(engine)
    ref = gen.generate([PA], max_new_tokens=10, seeds=[7])[0]
    assert ref.finish_reason == "length" and len(ref.tokens) == 10
    j = next(i for i, t in enumerate(ref.tokens) if i >= 2 and t not in ref.tokens[:i])
    stop = gen.generate([PA], max_new_tokens=10, seeds=[7], stop_ids=[ref.tokens[j], 100000])[0]
    assert stop.finish_reason == "stop" and stop.tokens == ref.tokens[: j + 1]  # stop token included
    np.testing.assert_allclose(stop.behav_logp, ref.behav_logp[: j + 1], rtol=0, atol=1e-6)
    long_prompt = list(range(1, S - 2))  # 61 tokens: cache fits 3 more
    full = gen.generate([long_prompt], max_new_tokens=10)[0]
    assert full.finish_reason == "length" and len(long_prompt) + len(full.tokens) == S
    zero = gen.submit(PA, max_new_tokens=0).result(timeout=0)
    assert zero.tokens == [] and zero.finish_reason == "length"
    with pytest.raises(ValueError):
        gen.submit(list(range(S)), max_new_tokens=1)
    with pytest.raises(ValueError):
        gen.submit([], max_new_tokens=1)


def test_completion_holds_the_step_outputs_bit_for_bit(engine, params2, monkeypatch):
    """``Completion.behav_logp`` / ``versions`` are the engine's ``StepOutput`` columns, bit for bit
    (written in place into the request's float32 / int32 buffers), also after ``abort`` drops a
    partial turn and its re-issue overwrites the buffers from index 0."""
    stream: dict[int, list] = {0: [], 1: []}  # slot -> (behav_logp, version) of every valid step
    decode = engine.decode

    def spy(params, state, **k):
        state, out = decode(params, state, **k)
        host = jax.device_get(out)
        for slot in np.flatnonzero(host.valid):
            stream[int(slot)].append((host.behav_logp[slot], host.version[slot]))
        return state, out

    monkeypatch.setattr(engine, "decode", spy)
    gen = Generator(engine, partial="abort", version=0)
    fa, fb = gen.submit(PA, max_new_tokens=8, seed=1), gen.submit(PB, max_new_tokens=8, seed=2)
    for _ in range(3):
        gen.step()
    gen.update_params(params2, 1)
    gen.run_until_idle()
    for slot, f in enumerate((fa, fb)):  # the two requests took slots 0 and 1 (FIFO), kept them on re-issue
        c = f.result(timeout=0)
        assert c.info["reissues"] == 1 and len(c.tokens) == 8 - c.info["dropped_tokens"] > 0
        lp, ver = zip(*stream[slot][-len(c.tokens):])
        assert c.behav_logp.dtype == np.float32 and c.versions.dtype == np.int32
        assert c.behav_logp.tobytes() == np.asarray(lp, np.float32).tobytes()
        assert c.versions.tolist() == [int(v) for v in ver] == [1] * len(c.tokens)


def test_continuous_batching_more_requests_than_slots(engine):
    gen = Generator(engine)
    prompts = [[i + 1, i + 2, i + 3] for i in range(5)]
    budgets = [3, 9, 2, 6, 4]
    futs = [gen.submit(p, max_new_tokens=m, seed=i) for i, (p, m) in enumerate(zip(prompts, budgets))]
    gen.run_until_idle()
    outs = [f.result(timeout=0) for f in futs]
    assert [len(o.tokens) for o in outs] == budgets
    # continuous batching: 2 slots, 24 tokens -> at most ceil-ish steps, far fewer than 24
    assert gen.stats["steps"] <= 14 and gen.stats["tokens"] == sum(budgets)
    # same seeds alone give the same tokens (slot/batch independence)
    alone = Generator(engine).generate([prompts[3]], max_new_tokens=6, seeds=[3])[0]
    assert alone.tokens == outs[3].tokens


def test_a_failing_prefill_fails_its_request_only(engine, monkeypatch):
    # one bad request used to fail every request in the generator's slots and queue (_fail_all);
    # the batched prefill (one call for the three) is retried row by row to find the culprit
    orig = engine.prefill_slots

    def prefill_slots(params, state, rows):
        if any(list(r.tokens) == [9, 9, 9] for r in rows):
            raise OverflowError("bad request")
        return orig(params, state, rows)

    monkeypatch.setattr(engine, "prefill_slots", prefill_slots)
    gen = Generator(engine, prefill_budget=100)
    futs = [gen.submit(p, max_new_tokens=3, seed=i) for i, p in enumerate([[1, 2, 3], [9, 9, 9], [4, 5, 6]])]
    gen.run_until_idle()
    with pytest.raises(OverflowError):
        futs[1].result(timeout=0)
    assert [len(futs[i].result(timeout=0).tokens) for i in (0, 2)] == [3, 3]
    assert gen.stats["prefill_errors"] == 1


def test_background_thread_with_concurrent_updates(engine, params1, params2):
    gen = Generator(engine, partial="recompute_kv").start()
    results, errors = [], []

    def agent(i):
        try:
            results.append(gen.submit([i + 1, i + 2], max_new_tokens=20, seed=i).result(timeout=120))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=agent, args=(i,)) for i in range(5)]
    for t in threads:
        t.start()
    for v, p, at in ((1, params2, 10), (2, params1, 50)):  # swap after `at` tokens were decoded
        t0 = time.monotonic()
        while gen.stats["tokens"] < at and time.monotonic() - t0 < 60:
            time.sleep(0.001)
        gen.update_params(p, v)
    for t in threads:
        t.join(120)
    gen.stop()
    assert not errors and len(results) == 5
    for r in results:
        assert len(r.tokens) == 20 and r.versions.tolist() == sorted(r.versions.tolist())
        assert set(r.versions) <= {0, 1, 2}
    assert gen.version == 2
    assert set().union(*(r.versions for r in results)) == {0, 1, 2}
    assert any(len(set(r.versions)) > 1 for r in results)  # swapped mid-generation
    assert gen.stats["recomputes"] >= 2
    with pytest.raises(RuntimeError):  # stopped generator fails requests instead of hanging
        f = gen.submit([1, 2], max_new_tokens=2)
        gen.stop()
        f.result(timeout=5)


def _params_from_hf(hf_model, abstract_params, tmp_path):
    """Our params from an HF torch model: via ``jax_rl.models.hf_io`` when it exists, else by the
    layout documented in ``jax_rl/models/qwen3/__init__.py`` (HF Linear [out, in] -> ours [in, ...])."""
    try:
        from jax_rl.models import hf_io
    except ImportError:
        hf_io = None
    if hf_io is not None:
        from jax_rl.runtime.serve import config_and_params

        hf_model.save_pretrained(tmp_path)
        return config_and_params(hf_io.load_pretrained(str(tmp_path)))[1]
    sd = {k: v.detach().numpy() for k, v in hf_model.state_dict().items()}

    def conv(keys, shape):
        keys = list(keys)
        if keys == ["embed_tokens"]:
            return sd["model.embed_tokens.weight"]
        if keys == ["norm", "weight"]:
            return sd["model.norm.weight"]
        if keys[0] == "lm_head":
            return sd["lm_head.weight"].T
        pre = f"model.layers.{keys[1]}."
        name = ".".join(str(k) for k in keys[2:]).replace("attn.", "self_attn.")
        w = sd[pre + name + ("" if name.endswith("weight") else ".weight")]
        return w if w.ndim == 1 else w.T.reshape(shape)

    flat = [(k, v.replace(jnp.asarray(conv(k, v.shape)))) for k, v in nnx.to_flat_state(abstract_params)]
    return nnx.from_flat_state(flat)


def test_greedy_equals_transformers_generate(model, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = model.config
    hf_cfg = transformers.Qwen3Config(**{k: v for k, v in cfg.to_hf().items()
                                         if k not in ("architectures", "model_type", "dtype", "torch_dtype")})
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(hf_cfg).eval().float()
    with torch.no_grad():  # make the norms matter
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.add_(0.3 * torch.randn_like(p))
    params = _params_from_hf(hf, nnx.state(model, nnx.Param), tmp_path)
    eng = Qwen3Engine(cfg, params, slots=2, max_cache_len=S, dtype="float32", temperature=0.0, kv_layout="contiguous")
    prompts = [[5, 6, 7, 8], [9, 10, 11], [100, 200, 300, 12, 13, 14, 15, 16, 17]]
    ours = Generator(eng).generate(prompts, max_new_tokens=12)
    for p, c in zip(prompts, ours):
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                              use_cache=True, pad_token_id=0, eos_token_id=None)
        assert c.tokens == out[0, len(p):].tolist()
