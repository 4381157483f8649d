"""Runtime wiring that needs no rollout: HF checkpoint loading, model config errors, advantages."""

from __future__ import annotations

import numpy as np
import pytest

from jax_rl.config import CONFIG_DIR, ConfigError, load_config
from jax_rl.model_builder import build_model_config
from jax_rl.runtime.envs import _train_bpe, build_env_factory, build_tokenizer
from jax_rl.runtime.run_dir import resolve_run_dir
from jax_rl.runtime.envs import sft_examples


def test_run_context_starts_from_hf_checkpoint(tmp_path):
    import jax
    from flax import nnx

    from jax_rl.models.hf_io import save_pretrained
    from jax_rl.models.qwen3 import Qwen3ForCausalLM, get_preset
    from jax_rl.runtime.context import RunContext

    mc = get_preset("tiny_dense")
    model = Qwen3ForCausalLM(mc, rngs=nnx.Rngs(123), scan_layers=True)  # the learner's default layout
    save_pretrained(model, mc, tmp_path / "hf")
    cfg = load_config(CONFIG_DIR / "tiny_cpu.yaml", [f"model.checkpoint={tmp_path / 'hf'}", "model.hf_overrides={}",
                                                     "model.tokenizer=compact",
                                                     f"run.dir={tmp_path / 'run'}", "logging.tensorboard=false"])
    tr = RunContext(cfg)
    try:
        got = tr.learner.get_params(host=True)
        want = nnx.state(model, nnx.Param)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    finally:
        tr.close()
        tr.learner.close()


def test_model_config_errors_name_the_culprit(tmp_path):
    tok = build_tokenizer(load_config(CONFIG_DIR / "tiny_cpu.yaml"))
    with pytest.raises(ConfigError, match="model.preset='nope'"):
        build_model_config(load_config(CONFIG_DIR / "tiny_cpu.yaml", ["model.preset=nope"]), tok)
    with pytest.raises(ConfigError, match="vocab"):
        build_model_config(load_config(CONFIG_DIR / "tiny_cpu.yaml", ["model.hf_overrides={vocab_size: 100}"]), tok)
    with pytest.raises(ConfigError, match="model"):
        build_model_config(load_config(CONFIG_DIR / "tiny_cpu.yaml", ["model.hf_overrides={hiden_size: 8}"]), tok)


def test_bpe_tokenizer_from_config_is_reproducible_and_compact():
    """``model.tokenizer=bpe``: the same vocabulary in every process (rebuilt, not cached), and a
    demo of the default config is well under a third of its byte length."""
    cfg = load_config(CONFIG_DIR / "tiny_cpu.yaml")
    tok = build_tokenizer(cfg)
    assert build_tokenizer(cfg) is tok  # cached in-process
    rebuilt = _train_bpe(cfg, build_env_factory(cfg))
    assert rebuilt.tokenizer.to_str() == tok.tokenizer.to_str()
    assert tok.vocab_size <= cfg.model.bpe_vocab_size
    assert tok.vocab_size <= build_model_config(cfg, tok).vocab_size
    toks, mask = sft_examples(cfg, tok, build_env_factory(cfg), 1, seed_offset=10**6)[0]
    text = tok.decode(toks.tolist())
    assert len(toks) * 3 < len(text.encode())
    assert tok.decode(toks[mask].tolist()).startswith("<tool_call>")


def test_group_advantages_per_group():
    from rollout.types import Trajectory

    def traj(r, g):
        z = np.zeros(3)
        return Trajectory(tokens=z.astype(np.int32), loss_mask=z.astype(bool), behav_logp=z.astype(np.float32),
                          versions=z.astype(np.int32) - 1, turn_ids=z.astype(np.int32) - 1, reward=r, group_id=g,
                          env="calculator", seed=g, info={})

    cfg = load_config(CONFIG_DIR / "tiny_cpu.yaml")
    groups = [[traj(1.0, 0), traj(0.0, 0)], [traj(1.0, 1), traj(1.0, 1)]]
    from jax_rl.learner.batch import group_advantages

    adv = group_advantages(cfg.algo, groups)
    assert adv[0][0] > 0 > adv[0][1]
    np.testing.assert_array_equal(adv[1], [0.0, 0.0])  # equal rewards: exactly zero


def test_resume_without_run_dir_fails_clearly(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(CONFIG_DIR / "tiny_cpu.yaml", ["resume=true"])
    with pytest.raises(ConfigError, match="resume=true"):
        resolve_run_dir(cfg)


def test_embedded_publish_is_timed_into_weight_sync_columns(tmp_path):
    """Issue 13 item 3: a publish (learner params -> every generator, cast to rollout.dtype) is
    timed into the producer's row (``weight_sync_s``: seconds since the previous row) and the run
    summary (totals and the count); the generators really receive the cast params."""
    import time

    import jax
    import jax.numpy as jnp

    from jax_rl.runtime.context import RunContext
    from jax_rl.runtime.embedded import EmbeddedProducer

    cfg = load_config(CONFIG_DIR / "tiny_cpu.yaml", ["model.tokenizer=compact", "rollout.threads=2",
                                                     "rollout.dtype=bfloat16", "logging.tensorboard=false",
                                                     f"run.dir={tmp_path / 'run'}"])
    ctx = RunContext(cfg)
    prod = None
    try:
        prod = EmbeddedProducer(ctx)
        before = prod.row()
        assert before["weight_sync_s"] == 0.0 and before["weight_sync_cast_s"] == 0.0  # nothing published yet
        v = int(ctx.learner.version) + 1
        prod.publish(v)
        row = prod.row()
        assert row["weight_sync_s"] > 0.0
        assert 0.0 < row["weight_sync_cast_s"] <= row["weight_sync_s"]
        for g in prod.generators:  # handed over: the (started) decode thread swaps in bf16 params of v
            deadline = time.monotonic() + 60.0
            while g.version != v and time.monotonic() < deadline:
                time.sleep(0.01)
            assert g.version == v
            floats = [x for x in jax.tree.leaves(g._params) if jnp.issubdtype(x.dtype, jnp.floating)]
            assert floats and all(x.dtype == jnp.bfloat16 for x in floats)
        assert prod.row()["weight_sync_s"] == 0.0  # per row: the publishes since the previous row
        prod.publish(v)
        s = prod.summary()
        assert s["weight_syncs"] == 2
        assert s["weight_sync_s_total"] >= row["weight_sync_s"]
        assert 0.0 < s["weight_sync_cast_s_total"] <= s["weight_sync_s_total"]
    finally:
        if prod is not None:
            prod.stop()
        ctx.close()
        ctx.learner.close()
