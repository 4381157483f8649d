"""The bitwise mode end to end (issue 62): the paged engine's behaviour log-probs, sampled with several rows of
different lengths sharing every decode call, equal the learner's log-probs bit for bit, and a learner step on
them at staleness 0 keeps every token (train_infer_retained 1) with |prox_logp - behav_logp| = 0 and the log-prob
inside its gradient program equal to pi_prox (every ratio exactly 1); the fast
mode's engine, same params and tokens, does not give the learner's bits (the test can fail)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from rollout.engine import Qwen3Engine, SlotPrefill

PROMPTS = [[5, 40, 7, 300, 8, 9, 10, 11, 12], [11, 12, 13, 14, 15, 16, 17, 18, 19], [100, 101], [3, 4, 5, 6, 7, 8],
           [5, 40, 7, 300, 8, 9, 10, 11, 12], [200, 201, 202, 203, 204, 205, 206], [1, 2, 3, 4, 5], [50, 60]]
N_NEW = 10
T = 24


def _generate(model_config, params, bitwise: bool, mesh=None):
    """fp32 paged engine (on ``mesh`` if given), all prompts admitted in one call (prompts 0 and 4 the same: their
    pages shared), one decode step then the rest in one multi-step call: per prompt (tokens, behav logp)."""
    eng = Qwen3Engine(model_config, params, slots=len(PROMPTS), max_cache_len=32, max_prefill_length=16,
                      dtype="float32", kv_layout="paged", kv_page_size=8,
                      model_kwargs={"attention": "bitwise"} if bitwise else None, mesh=mesh)
    st = eng.init_decode_state()
    st, _ = eng.prefill_slots(eng.params, st, [SlotPrefill(p, slot=i, seed=10 + i) for i, p in enumerate(PROMPTS)])
    st, o1 = eng.decode(eng.params, st)
    st, o2 = eng.decode_steps(eng.params, st, N_NEW - 1)
    tok = np.concatenate([np.asarray(o1.token)[None], np.asarray(o2.token)])
    lp = np.concatenate([np.asarray(o1.behav_logp)[None], np.asarray(o2.behav_logp)])
    assert np.asarray(o2.valid).all()
    return [(list(tok[:, i]), list(lp[:, i])) for i in range(len(PROMPTS))]


def _batch(out):
    B = len(PROMPTS)
    seq, am, lm = np.zeros((B, T), np.int32), np.zeros((B, T), bool), np.zeros((B, T), bool)
    behav = np.zeros((B, T), np.float32)
    for i, p in enumerate(PROMPTS):
        P, n = len(p), len(p) + N_NEW
        seq[i, :n], am[i, :n], lm[i, P:n], behav[i, P:n] = p + out[i][0], True, True, out[i][1]
    adv = np.where(lm, np.repeat(np.linspace(-1, 1, B)[:, None], T, 1), 0.0).astype(np.float32)
    return {"tokens": seq, "attention_mask": am, "loss_mask": lm, "behav_logp": behav,
            "versions": np.where(lm, 0, -1).astype(np.int32), "turn_ids": np.where(lm, 0, -1).astype(np.int32),
            "advantages": adv}


@pytest.mark.parametrize("mode", ["decoupled"])
def test_bitwise_train_step_zero_gap_at_staleness_0(mode, devices):
    from jax_rl.learner.learner import Learner
    from jax_rl.sharding import make_mesh
    from tests.learner._util import init_params, make_cfg

    cfg = make_cfg(mode, B=8, model={"scan_layers": False, "bitwise": True}, rollout={"dtype": "float32"})
    # one device here; the learner on fsdp=8: test_bitwise_learner_on_fsdp8_equals_the_one_device_engine
    lrn = Learner(cfg, mesh=make_mesh(1, 1, 1, 1, devices=jax.devices()[:1]), init_params=init_params(cfg))
    try:
        params = lrn.get_params(host=True)
        b = _batch(_generate(lrn.model_config, params, bitwise=True))
        lm = b["loss_mask"]
        lp = np.asarray(lrn.logprobs(b))  # pi_prox at staleness 0: the learner's forward
        assert np.array_equal(lp[lm].view(np.uint32), b["behav_logp"][lm].view(np.uint32))
        fast = _batch(_generate(lrn.model_config, params, bitwise=False))
        assert not np.array_equal(np.asarray(lrn.logprobs(fast))[lm], fast["behav_logp"][lm])
        m = lrn.train_step(b)
    finally:
        lrn.close()
    print({k: m[k] for k in ("train_infer_retained", "loss", "ratio_min", "ratio_max", "kl_drift_k1")})
    assert m["train_infer_retained"] == 1.0
    # the step's one update differentiates logp at the params pi_prox was computed with: the gradient program's
    # primal equals pi_prox (the no-grad forward, hence the engine's) bit for bit iff every ratio is exactly 1
    assert m["updates"] == 1.0 and m["ratio_min"] == m["ratio_max"] == 1.0 and m["kl_drift_k1"] == 0.0
    assert np.isfinite(m["loss"]) and m["grad_norm"] > 0


def test_bitwise_engine_equals_the_learner_at_hidden_128(devices):
    """A wider model (tiny_dense at hidden 128 / MLP 256, fp32, one device, no mesh): the paged engine's
    behav_logp (64-row decode and prefill tiles) equals the learner's log-probs (8 x 24 = 192 rows) bit for bit.
    XLA:CPU's Eigen dot split a 256- or 512-long contraction by its thread pool (which the tests' 8 host devices
    change) and the row count; before the mode's projections contracted in 128-long chunks
    (``bitwise.K_CHUNK``) 28 of these 80 tokens differed by 1 ULP (39 at hidden 256)."""
    from jax_rl.learner.learner import Learner
    from jax_rl.sharding import make_mesh
    from tests.learner._util import init_params, make_cfg

    cfg = make_cfg("decoupled", B=8, model={"scan_layers": False, "bitwise": True,
                                             "hf_overrides": {"hidden_size": 128, "intermediate_size": 256}},
                   rollout={"dtype": "float32"})
    lrn = Learner(cfg, mesh=make_mesh(1, 1, 1, 1, devices=jax.devices()[:1]), init_params=init_params(cfg))
    try:
        assert lrn.model_config.hidden_size == 128
        b = _batch(_generate(lrn.model_config, lrn.get_params(host=True), bitwise=True))
        lp = np.asarray(lrn.logprobs(b))
    finally:
        lrn.close()
    lm = b["loss_mask"]
    assert np.array_equal(lp[lm].view(np.uint32), b["behav_logp"][lm].view(np.uint32))


def test_bitwise_learner_on_fsdp8_equals_the_one_device_engine(devices):
    """The learner on fsdp=8 (params split on ``embed``, the batch over the 8 devices; one length bucket of 30, so
    8 x 30 rows: padded to whole tiles they no longer split by batch row) gives the one-device paged engine's
    behav_logp bit for bit, tiny_dense fp32. Before the mode gathered each layer's weights on a mesh
    (``bitwise.WHOLE_ON_MESH``) 26 of the 80 tokens differed by 1 ULP."""
    from jax_rl.learner.learner import Learner
    from tests.learner._util import init_params, make_cfg

    cfg = make_cfg("decoupled", B=8, optim={"max_seq_len": 30, "seq_len_buckets": [30]},
                   model={"scan_layers": False, "bitwise": True}, rollout={"dtype": "float32", "max_cache_len": 30})
    lrn = Learner(cfg, init_params=init_params(cfg))  # cfg.mesh: fsdp over all 8 devices
    try:
        assert dict(lrn.mesh.shape)["fsdp"] == 8
        b = _batch(_generate(lrn.model_config, lrn.get_params(host=True), bitwise=True))
        lm = b["loss_mask"]
        lp = np.asarray(lrn.logprobs(b))
    finally:
        lrn.close()
    assert np.array_equal(lp[lm].view(np.uint32), b["behav_logp"][lm].view(np.uint32))


@pytest.mark.parametrize("data", [2, 1], ids=["data2_tensor2", "tensor2"])
def test_bitwise_engine_on_a_data_tensor_mesh_equals_one_device(data, monkeypatch, devices):
    """The paged engine on a data=2 x tensor=2 / a tensor=2 rollout mesh (slots over data; heads, MLP, vocab and kv
    heads over tensor) samples the one-device engine's tokens with its behav_logp bit for bit (tiny_dense fp32).
    Negative control: with ``bitwise.WHOLE_ON_MESH`` off (the o_proj / down_proj / LM-head contractions and the
    log-softmax split over tensor, programs traced afresh) 20 of the 80 behav_logp differed by 1 ULP (both meshes)."""
    from flax import nnx

    from jax_rl.models import bitwise
    from jax_rl.models.qwen3 import Qwen3ForCausalLM, get_preset
    from jax_rl.sharding import make_mesh

    mc = get_preset("tiny_dense")
    params = nnx.state(Qwen3ForCausalLM(mc, rngs=nnx.Rngs(0)), nnx.Param)
    mesh = make_mesh(data, 1, 2, 1, devices=jax.devices()[:2 * data])
    ref = _generate(mc, params, bitwise=True)

    def bits(out):
        return np.asarray([lp for _, lps in out for lp in lps], np.float32).view(np.uint32)

    out = _generate(mc, params, bitwise=True, mesh=mesh)
    assert [t for t, _ in out] == [t for t, _ in ref]
    assert np.array_equal(bits(out), bits(ref))
    monkeypatch.setattr(bitwise, "WHOLE_ON_MESH", False)
    assert not np.array_equal(bits(_generate(mc, params, bitwise=True, mesh=mesh)), bits(ref))


def test_behav_route_takes_old_logp_from_behav_logp(devices):
    """old_logits.route=behav under loss.correction=exact: pi_prox = log pi_v = behav_logp (no store, no scorer
    forward); the step keeps every token. Refused without model.bitwise or under rollout.partial=continue."""
    from jax_rl.learner.correction import check_config
    from jax_rl.learner.learner import Learner
    from jax_rl.sharding import make_mesh
    from tests.learner._util import init_params, make_cfg

    kw = dict(B=8, old_logits={"route": "behav"})
    for bad in ({"model": {"bitwise": False}, "rollout": {"partial": "recompute_kv"}},
                {"model": {"bitwise": True}, "rollout": {"partial": "continue"}}):
        with pytest.raises(ValueError, match="old_logits.route=behav needs"):
            check_config(make_cfg("exact", **kw, **bad))
    cfg = make_cfg("exact", **kw, model={"scan_layers": False, "bitwise": True},
                   rollout={"dtype": "float32", "partial": "recompute_kv"})
    check_config(cfg)
    lrn = Learner(cfg, mesh=make_mesh(1, 1, 1, 1, devices=jax.devices()[:1]), init_params=init_params(cfg))
    try:
        assert lrn.old_logits.store is None
        b = _batch(_generate(lrn.model_config, lrn.get_params(host=True), bitwise=True))
        m = lrn.train_step(b)
    finally:
        lrn.close()
    assert m["train_infer_retained"] == 1.0 and np.isfinite(m["loss"]) and lrn.old_logit_forwards == 0
