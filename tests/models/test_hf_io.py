"""HF parity (transformers, torch fp32, eager attention) and checkpoint I/O errors.

Tiny HF models are built offline at test time, saved with ``save_pretrained`` and loaded with
ours from the saved safetensors.
"""

import json

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from jax_rl.models.hf_io import CheckpointError, load_pretrained, save_pretrained
from jax_rl.models.qwen3 import Qwen3ForCausalLM, get_preset

TOL = 1e-4

BASE = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,  # 4*16 != 32
            max_position_embeddings=64, rms_norm_eps=1e-6)
CASES = {
    "dense_tied_theta1e6": dict(tie_word_embeddings=True, rope_theta=1e6),
    "dense_untied_theta1e4": dict(tie_word_embeddings=False, rope_theta=1e4, head_dim=8),
    "moe_norm_topk_untied": dict(moe=True, tie_word_embeddings=False, norm_topk_prob=True,
                                 rope_theta=1e6),
    "moe_no_norm_tied_mlp_only": dict(
        moe=True, tie_word_embeddings=True, norm_topk_prob=False, num_hidden_layers=3,
        decoder_sparse_step=1, mlp_only_layers=[2], rope_theta=1e6),
    "moe_sparse_step2": dict(moe=True, tie_word_embeddings=False, norm_topk_prob=True,
                             num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3],
                             rope_theta=1e4),
}


def _hf_model(case, seed=0):
    import torch
    import transformers

    kw = dict(BASE)
    kw.update(CASES[case])
    moe = kw.pop("moe", False)
    theta = kw.pop("rope_theta")
    if moe:
        kw.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
        cfg = transformers.Qwen3MoeConfig(**kw, rope_parameters={"rope_type": "default",
                                                                   "rope_theta": theta})
        cls = transformers.Qwen3MoeForCausalLM
    else:
        cfg = transformers.Qwen3Config(**kw, rope_parameters={"rope_type": "default",
                                                               "rope_theta": theta})
        cls = transformers.Qwen3ForCausalLM
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    m = cls(cfg).eval().float()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:  # init is ones: perturb so the norms matter
                p.add_(torch.randn_like(p) * 0.3)
            elif "mlp.gate.weight" in name:  # decisive routing (no near-ties across backends)
                p.mul_(20)
    return m


def _hf_logits(m, ids, mask=None, hidden=False):
    import torch

    with torch.no_grad():
        out = m(torch.tensor(ids), attention_mask=None if mask is None else torch.tensor(mask),
                output_hidden_states=hidden)
    if hidden:
        return out.logits.numpy(), [h.numpy() for h in out.hidden_states]
    return out.logits.numpy()


def _batch(vocab, B=3, T=9, lengths=(9, 5, 2), seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (B, T))
    mask = np.arange(T)[None] < np.array(lengths)[:, None]
    return np.where(mask, ids, 0), mask


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scan_layers"])
@pytest.mark.parametrize("case", list(CASES))
def test_parity_with_transformers(case, scan, tmp_path):
    m = _hf_model(case)
    m.save_pretrained(tmp_path)
    model, cfg = load_pretrained(tmp_path, scan_layers=scan)
    # mixed dense/MoE stacks cannot be scanned and stay unrolled
    assert model.scan_layers == (scan and len({cfg.layer_is_moe(i)
                                                for i in range(cfg.num_hidden_layers)}) == 1)
    assert cfg.tie_word_embeddings == CASES[case]["tie_word_embeddings"]
    assert cfg.rope_theta == CASES[case]["rope_theta"]
    if CASES[case].get("moe"):
        assert cfg.moe_layers == tuple(i for i in range(cfg.num_hidden_layers)
                                       if m.model.layers[i].mlp.__class__.__name__.endswith("SparseMoeBlock"))
        assert cfg.moe_layers  # at least one MoE layer in every MoE case
    ids, mask = _batch(cfg.vocab_size)
    # right-padded batch with an attention mask: compare valid positions
    ref = _hf_logits(m, ids, mask)
    out = np.asarray(nnx.jit(lambda mo, i, k: mo(i, attention_mask=k))(model, ids, mask))
    assert np.abs(out[mask] - ref[mask]).max() <= TOL
    assert np.abs(out).max() > 0.1  # not a degenerate all-zeros model
    if case == "dense_tied_theta1e6":
        # per-layer hidden states, unpadded row
        ref_l, ref_h = _hf_logits(m, ids[:1], hidden=True)
        hs = model.forward(ids[:1], output_hidden_states=True).hidden_states
        assert len(hs) == len(ref_h) == cfg.num_hidden_layers + 1
        for a, b in zip(hs, ref_h):
            assert np.abs(np.asarray(a) - b).max() <= TOL


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scan_layers"])
@pytest.mark.parametrize("name", ["tiny_dense", "tiny_moe"])
def test_save_pretrained_loads_in_transformers(name, scan, tmp_path):
    import transformers

    cfg = get_preset(name, vocab_size=96, tie_word_embeddings=(name == "tiny_dense"))
    model = Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(1), scan_layers=scan)
    assert model.scan_layers == scan
    for path, v in nnx.iter_graph(model):
        if isinstance(v, nnx.Param) and path[-1] == "weight":
            v[...] = v[...] + 0.3 * jax.random.normal(jax.random.key(len(path)), v.shape)
    save_pretrained(model, cfg, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager").eval()
    assert type(hf).__name__ == ("Qwen3MoeForCausalLM" if cfg.is_moe else "Qwen3ForCausalLM")
    ids, mask = _batch(cfg.vocab_size)
    ref = _hf_logits(hf, ids, mask)
    out = np.asarray(model(ids, attention_mask=mask))
    assert np.abs(out[mask] - ref[mask]).max() <= TOL


# ---------------------------------------------------------------- our own round trips (no torch)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    cfg = get_preset("tiny_moe", vocab_size=64, num_hidden_layers=2, decoder_sparse_step=2)
    model = Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(3))
    path = tmp_path_factory.mktemp("ckpt")
    save_pretrained(model, cfg, path)
    return cfg, model, path


def _state_np(model):
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def test_roundtrip_single_file_sharded_index_and_bf16(saved, tmp_path):
    cfg, model, path = saved
    names = set(load_file(path / "model.safetensors"))
    assert "lm_head.weight" not in names  # tied
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in names
    assert "model.layers.0.mlp.gate_proj.weight" in names  # layer 0 dense (sparse step 2)
    loaded, cfg2 = load_pretrained(path)
    assert cfg2 == cfg
    for a, b in zip(_state_np(loaded), _state_np(model)):
        np.testing.assert_array_equal(a, b)
    # sharded index
    save_pretrained(model, cfg, tmp_path / "sharded", max_shard_bytes=20_000)
    idx = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(idx["weight_map"].values())) > 1
    loaded, _ = load_pretrained(tmp_path / "sharded")
    for a, b in zip(_state_np(loaded), _state_np(model)):
        np.testing.assert_array_equal(a, b)
    # bf16 file -> fp32 params equal to the bf16-rounded originals; bf16 params too
    save_pretrained(model, cfg, tmp_path / "bf16", dtype="bfloat16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    l32, _ = load_pretrained(tmp_path / "bf16")
    l16, _ = load_pretrained(tmp_path / "bf16", dtype="bfloat16")
    for a, b, c in zip(_state_np(l32), _state_np(model), _state_np(l16)):
        rounded = b.astype(ml_dtypes.bfloat16)
        assert a.dtype == np.float32 and c.dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(a, rounded.astype(np.float32))
        np.testing.assert_array_equal(c, rounded)


def _corrupt(path, dest, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    dest.mkdir()
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    (dest / "config.json").write_text((path / "config.json").read_text())
    return dest


def test_corrupt_checkpoints_give_one_error_listing_all_problems(saved, tmp_path):
    _, _, path = saved
    q = "model.layers.0.self_attn.q_norm.weight"
    up = "model.layers.0.mlp.up_proj.weight"
    exp = "model.layers.1.mlp.experts.2.gate_proj.weight"

    def edit(t):
        del t[up]
        t[q] = np.zeros((3,), np.float32)
        t[exp] = t[exp].astype(np.int32)
        t["model.layers.7.extra.weight"] = np.zeros((2,), np.float32)

    bad = _corrupt(path, tmp_path / "bad", edit)
    with pytest.raises(CheckpointError) as ei:
        load_pretrained(bad)
    msg = str(ei.value)
    assert f"missing (1): {up}" in msg
    assert "unexpected (1): model.layers.7.extra.weight" in msg
    assert f"wrong shape (1): {q}: file [3], expected [16]" in msg
    assert f"wrong dtype (1): {exp}: I32" in msg

    def only_missing(t):
        del t["model.norm.weight"]

    with pytest.raises(CheckpointError, match=r"missing \(1\): model\.norm\.weight$"):
        load_pretrained(_corrupt(path, tmp_path / "m", only_missing))


def test_broken_index_and_config_errors(saved, tmp_path):
    cfg, model, path = saved
    d = tmp_path / "idx"
    save_pretrained(model, cfg, d, max_shard_bytes=20_000)
    index = d / "model.safetensors.index.json"
    good = json.loads(index.read_text())
    files = sorted(set(good["weight_map"].values()))

    index.write_text("{not json")
    with pytest.raises(CheckpointError, match="broken index"):
        load_pretrained(d)
    index.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(CheckpointError, match="no 'weight_map'"):
        load_pretrained(d)
    wm = dict(good["weight_map"])
    wm["model.norm.weight"] = "model-99999-of-99999.safetensors"
    index.write_text(json.dumps({"weight_map": wm}))
    with pytest.raises(CheckpointError, match="shard file.*not found.*99999"):
        load_pretrained(d)
    wm = dict(good["weight_map"])
    other = next(f for f in files if f != wm["model.norm.weight"])
    wm["model.norm.weight"] = other
    index.write_text(json.dumps({"weight_map": wm}))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight \(index says"):
        load_pretrained(d)

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps(cfg.to_hf()))
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_pretrained(empty)
    (empty / "config.json").write_text(json.dumps(
        {**cfg.to_hf(), "rope_scaling": {"rope_type": "yarn", "factor": 2.0}}))
    with pytest.raises(CheckpointError, match="rope_scaling.rope_type"):
        load_pretrained(empty)
    trunc = tmp_path / "trunc"
    trunc.mkdir()
    (trunc / "config.json").write_text(json.dumps(cfg.to_hf()))
    (trunc / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes()[:500])
    with pytest.raises(CheckpointError):
        load_pretrained(trunc)


def test_scanned_and_unrolled_layouts_round_trip_through_hf(tmp_path):
    """Unrolled -> HF files -> scanned -> HF files -> unrolled gives the same tensors and the
    scanned model the same logits (the stacked [L, ...] params map to model.layers.{i}.*)."""
    cfg = get_preset("tiny_moe", vocab_size=64)
    m0 = Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(5))
    save_pretrained(m0, cfg, tmp_path / "a")
    ms, _ = load_pretrained(tmp_path / "a", scan_layers=True)
    assert ms.scan_layers and ms.layers.attn.q_proj[...].shape[0] == cfg.num_hidden_layers
    save_pretrained(ms, cfg, tmp_path / "b")
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    ids, mask = _batch(cfg.vocab_size)
    f = nnx.jit(lambda mo, i, k: mo(i, attention_mask=k))
    np.testing.assert_array_equal(np.asarray(f(m0, ids, mask))[mask], np.asarray(f(ms, ids, mask))[mask])
