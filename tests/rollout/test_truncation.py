"""Issue 14 item 7: the learner reproduces the sampler's top-k / top-p truncation.

Same fp32 params on both sides, ``top_p=0.9``, ``top_k=20``, temperature 0.7: the learner's
log pi on the engine's tokens equals the engine's behav logp (log mu) to 1e-5 on every
generated token, where the untruncated learner was ~2.5 nats off (the train-infer mask then
rejected every token and training silently stopped).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_rl.learner.logprobs import HeadOptions, sequence_logprobs
from jax_rl.models import qwen3 as q
from rollout.engine import Qwen3Engine

TEMP, TOP_K, TOP_P = 0.7, 20, 0.9


def _generate(model_config, params, prompts, n_new, seed0=10):
    """fp32 engine with the issue's sampling: per prompt (generated tokens, behav logp)."""
    eng = Qwen3Engine(model_config, params, slots=len(prompts), max_cache_len=64, max_prefill_length=32,
                      dtype="float32", temperature=TEMP, top_k=TOP_K, top_p=TOP_P, kv_layout="contiguous")
    st = eng.init_decode_state()
    for i, p in enumerate(prompts):
        st = eng.insert(eng.prefill_tokens(eng.params, p, seed=seed0 + i), st, i)
    out = [([], []) for _ in prompts]
    for _ in range(n_new):
        st, r = eng.decode(eng.params, st)
        r = jax.device_get(r)
        for i in range(len(prompts)):
            assert r.valid[i]
            out[i][0].append(int(r.token[i]))
            out[i][1].append(float(r.behav_logp[i]))
    return out


def _pad(prompts, out, T):
    seq = np.zeros((len(prompts), T), np.int32)
    am = np.zeros((len(prompts), T), bool)
    lm = np.zeros((len(prompts), T), bool)
    behav = np.zeros((len(prompts), T), np.float32)
    for i, p in enumerate(prompts):
        P, n = len(p), len(p) + len(out[i][0])
        seq[i, :n] = p + out[i][0]
        am[i, :n] = True
        lm[i, P:n] = True
        behav[i, P:n] = out[i][1]
    return seq, am, lm, behav


PROMPTS = [[11, 12, 13, 14, 15], [7, 8], [100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111, 112], [3, 4, 5]]


def test_learner_logp_equals_engine_behav_logp_under_top_k_top_p():
    cfg = q.get_preset("tiny_dense")
    model = q.Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    out = _generate(cfg, params, PROMPTS, n_new=16)
    seq, am, lm, behav = _pad(PROMPTS, out, 32)
    gd, st = nnx.split(model)
    f = jax.jit(lambda st, k, p: sequence_logprobs(nnx.merge(gd, st), seq, am, temperature=TEMP,
                                                        head=HeadOptions(top_k=k, top_p=p)).logp,
                static_argnums=(1, 2))
    on = np.asarray(f(st, TOP_K, TOP_P))
    off = np.asarray(f(st, 0, 1.0))  # the bug: the learner ignores the truncation
    gap_on = np.abs(on - behav)[lm]
    gap_off = (off - behav)[lm]
    print(f"|log pi - log mu| max: truncated learner {gap_on.max():.2e}; untruncated learner mean "
          f"{gap_off.mean():.3f}, min {gap_off.min():.3f} nats over {lm.sum()} tokens")
    assert lm.sum() == 64 and np.all(np.isfinite(on[lm]))
    assert gap_on.max() <= 1e-5
    # log(kept mass): top-20 of a near-uniform 384-token model keeps ~8%, log pi/mu ~ -2.5 everywhere
    assert gap_off.mean() < -1.0 and gap_off.max() < 0


@pytest.mark.parametrize("mode", ["decoupled"])
def test_train_step_on_engine_samples_keeps_the_tokens(mode, devices):
    """End to end: a decoupled learner step on a batch the fp32 engine sampled with top_k=20,
    top_p=0.9 keeps every token (train_infer_retained 1, nothing outside the kept set); the
    untruncated pi_prox would reject them all (|log pi_prox/mu| ~ 2.5 > log 2)."""
    from jax_rl.learner.learner import Learner
    from jax_rl.learner.losses import train_infer_factor
    from tests.learner._util import init_params, make_cfg

    cfg = make_cfg(mode, model={"scan_layers": False}, algo={"temperature": TEMP}, rollout={"top_k": TOP_K, "top_p": TOP_P,
                                                                  "dtype": "float32"})
    lrn = Learner(cfg, init_params=init_params(cfg))
    try:
        prompts = [[5 + i, 40 + 3 * i, 7, 300 - i] for i in range(8)]
        params = lrn.get_params(host=True)
        out = _generate(lrn.model_config, params, prompts, n_new=12)
        seq, am, lm, behav = _pad(prompts, out, 16)
        b = {"tokens": seq, "attention_mask": am, "loss_mask": lm, "behav_logp": behav,
             "versions": np.where(lm, 0, -1).astype(np.int32), "turn_ids": np.where(lm, 0, -1).astype(np.int32),
             "advantages": np.where(lm, np.repeat(np.linspace(-1, 1, 8)[:, None], 16, 1), 0.0).astype(np.float32)}
        lp = lrn.logprobs(b)  # the learner's forward (truncated: rollout.top_k / top_p)
        assert np.abs(lp - behav)[lm].max() <= 1e-5
        m = lrn.train_step(b)
    finally:
        lrn.close()
    print({k: m[k] for k in ("train_infer_retained", "masked_trunc_outside", "trunc_outside_frac", "loss")})
    assert m["train_infer_retained"] == 1.0
    assert m["masked_trunc_outside"] == 0.0 and m["trunc_outside_frac"] == 0.0
    assert np.isfinite(m["loss"]) and m["nonfinite_updates"] == 0.0 and m["grad_norm"] > 0
    # what the untruncated learner's pi_prox would have given: every token out of the band
    model = q.Qwen3ForCausalLM(lrn.model_config, rngs=nnx.Rngs(0), scan_layers=False)
    nnx.update(model, params)
    lp_full = np.where(lm, np.asarray(sequence_logprobs(model, seq, am, temperature=TEMP).logp), 0.0)
    ti = train_infer_factor(jnp.asarray(lp_full), jnp.asarray(behav), jnp.asarray(lm), cfg.loss)
    assert float(jnp.sum(ti.kept)) == 0.0
