"""``jax-rl export``: a run checkpoint becomes an HF dir that transformers loads with the same
logits as jax-rl's forward of the trained params; bad inputs end in one line."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jax_rl.config import dump_config
from jax_rl.export import ExportError, export_checkpoint
from tests.learner._util import init_params, make_batch, make_cfg

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A tiny run (8-device fsdp mesh, one PPO step so params differ from any init) saved at
    version 1, exported on one device. Returns (out_dir, reference logits, ids, mask)."""
    from jax_rl.learner.learner import Learner

    tmp = tmp_path_factory.mktemp("export")
    run = tmp / "run"
    cfg = make_cfg("ppo", run={"dir": str(run), "seed": 3})
    lrn = Learner(cfg, init_params=init_params(cfg, seed=5))
    lrn.train_step(make_batch(1))
    lrn.checkpoints.save(run / "checkpoints")
    lrn.checkpoints.wait()
    dump_config(cfg, run / "config.yaml")
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 384, (2, 7)).astype(np.int32)
    mask = np.arange(7)[None] < np.array([[7], [4]])
    ref = np.asarray(lrn.model(lrn.params)(ids, attention_mask=mask))
    lrn.close()
    out = tmp / "hf"
    info = export_checkpoint(run / "checkpoints" / "1", out)
    return out, ref, ids, mask, info


@pytest.mark.slow
def test_export_loads_in_transformers_with_the_same_logits(exported):
    import torch
    import transformers

    out, ref, ids, mask, info = exported
    assert {"config.json", "model.safetensors", "tokenizer.json", "jax_rl_export.json"} <= {
        p.name for p in out.iterdir()}
    assert info["version"] == 1 and info["step"] == 1
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager",
                                                           dtype=torch.float32).eval()
    with torch.no_grad():
        got = hf(torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask)).logits.numpy()
    assert np.abs(got[mask] - ref[mask]).max() <= 1e-4
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"))
    assert tok.convert_tokens_to_ids("<|im_end|>") is not None


def test_export_refuses_a_non_empty_out_dir_in_one_line(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "1").mkdir(parents=True)  # a saved step: the source passes, OUT_DIR is the culprit
    (run / "config.yaml").write_text("{}\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(ExportError, match="not empty"):
        export_checkpoint(run, out)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-m", "jax_rl.cli", "export", str(run), str(out)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and str(out) in r.stderr, r.stderr
    assert (out / "keep.txt").read_text() == "x" and len(list(out.iterdir())) == 1
    with pytest.raises(ExportError, match="no checkpoints"):
        export_checkpoint(tmp_path / "nowhere", tmp_path / "o2")
    assert not (tmp_path / "o2").exists()


@pytest.mark.slow
def test_serve_an_exported_dir(exported):
    """`jax-rl serve OUT_DIR` on the export: says it uses the exported tokenizer, answers a Decode."""
    import grpc

    from rollout import jetstream_compat as jc
    from tests.rollout.test_serve import _start

    out = exported[0]
    pb, pb_grpc = jc.jetstream_pb2(), jc.jetstream_pb2_grpc()
    proc, lines = _start([str(out), "--port", "0", "--slots", "1", "--max-len", "32", "--temperature", "0.7"])
    try:
        text = "".join(lines)
        assert f"using tokenizer {out / 'tokenizer.json'}" in text, text
        port = int(re.search(r"listening on \S+:(\d+)", text).group(1))
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            req = pb.DecodeRequest(token_content=pb.DecodeRequest.TokenContent(token_ids=[72, 105]), max_tokens=3)
            ids = [t for r in pb_grpc.OrchestratorStub(ch).Decode(req, timeout=60)
                   for s in r.stream_content.samples for t in s.token_ids]
        assert 1 <= len(ids) <= 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_export_reads_a_checkpoint_in_either_layer_layout(tmp_path):
    """A run saved with unrolled layers whose config.yaml says ``scan_layers: true`` (runs saved
    before train honoured the key) exports: the HF tensors read back are the saved params."""
    import jax
    from flax import nnx

    from jax_rl.checkpoint import saved_layer_layout
    from jax_rl.learner.learner import Learner
    from jax_rl.models import hf_io

    run = tmp_path / "run"
    cfg = make_cfg("ppo", run={"dir": str(run), "seed": 3}, model={"scan_layers": False})
    lrn = Learner(cfg, init_params=init_params(cfg, seed=5))
    lrn.train_step(make_batch(1))
    lrn.checkpoints.save(run / "checkpoints")
    lrn.checkpoints.wait()
    saved = nnx.to_pure_dict(lrn.get_params(host=True))
    lrn.close()
    assert saved_layer_layout(run / "checkpoints") == "unrolled (one subtree per layer)"
    cfg.model.scan_layers = True
    dump_config(cfg, run / "config.yaml")
    export_checkpoint(run, tmp_path / "hf")
    model, _ = hf_io.load_pretrained(tmp_path / "hf")  # unrolled, as saved
    back = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    assert jax.tree.structure(back) == jax.tree.structure(saved)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(saved)):
        np.testing.assert_array_equal(np.asarray(a), b)
