"""bench/_tunix.py (the Tunix rows of bench/rollout_decode.py and bench/learner_step.py): Tunix's
Qwen3, read from the checkpoint folder our ``hf_io.save_pretrained`` writes, gives our logits, and
its Sampler's log-probs are those of the sampled tokens. Skipped unless google-tunix imports
(the bench venv; never the main venv, see pyproject's ``bench`` extra)."""

import os
import sys

import numpy as np
import pytest

pytest.importorskip("tunix", reason="google-tunix not installed (bench venv only)")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))


def _setup(tmp_path):
    from flax import nnx

    import _tunix
    from jax_rl.models import hf_io
    from jax_rl.models import qwen3 as q

    if _tunix.import_error():
        pytest.skip(_tunix.import_error())
    cfg = q.get_preset("tiny_dense")
    m = q.Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0))
    hf_io.save_pretrained(m, cfg, tmp_path)
    return _tunix, cfg, m, _tunix.load_model(str(tmp_path), cfg)


def test_tunix_qwen3_from_our_checkpoint_gives_our_logits(tmp_path):
    _tunix, cfg, m, tm = _setup(tmp_path)
    tok = np.random.default_rng(0).integers(1, cfg.vocab_size, (2, 12))
    scale = float(np.abs(np.asarray(m(tok))).max())
    assert _tunix.max_logit_diff(tm, m, tok) <= 1e-5 * max(1.0, scale)


def test_tunix_sampler_logprobs_are_the_sampled_tokens_logprobs(tmp_path):
    import jax

    _tunix, cfg, m, tm = _setup(tmp_path)
    prompts = [[int(t) for t in np.random.default_rng(i).integers(1, cfg.vocab_size, 8)] for i in range(2)]
    sampler = _tunix.make_sampler(tm, cfg, cache_size=8 + 6)
    n, out = _tunix.sample(sampler, prompts, 6, seed=3)
    assert n == 12
    for p, toks, lps in zip(prompts, out.tokens, out.logprobs):
        full = np.asarray(p + [int(t) for t in toks])[None]
        logp = np.asarray(jax.nn.log_softmax(m(full)[0], axis=-1))
        want = [logp[len(p) - 1 + j, int(t)] for j, t in enumerate(toks)]
        np.testing.assert_allclose(lps, want, atol=1e-4)
