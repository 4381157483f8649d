"""The wheel trains without JetStream (issue 63 item 2): google-jetstream is installed apart (``pip install
--no-deps google-jetstream==0.2.2``) and only ``jax-rl serve`` needs it, so ``train`` (and eval, export, the dry
run, the Ray runtime) import none of it; a missing JetStream at ``serve`` is one line naming the command that
installs it. Run in a subprocess with every ``jetstream`` import blocked (what a venv without it sees)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}

BLOCK = """
import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "jetstream":
            raise ImportError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, _Block())
"""


def _py(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK + code, *args], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=600)


def test_train_path_imports_no_jetstream():
    r = _py("""
import jax_rl.cli, jax_rl.runtime.train, jax_rl.runtime.ray_runtime, jax_rl.runtime.dry_run, jax_rl.export
import rollout.engine, rollout.generator
from jax_rl.cli import main
rc = main(["train", "tiny_cpu", "--dry-run", "model.tokenizer=compact", "optim.batch_size=4", "algo.group_size=2",
           "optim.max_seq_len=32", "rollout.max_cache_len=32", "rollout.slots=4", "rollout.max_prefill_length=16"])
print("RC", rc, "JETSTREAM", sorted(m for m in sys.modules if m.split(".")[0] == "jetstream"))
""")
    assert "RC 0 JETSTREAM []" in r.stdout, (r.stdout[-2000:], r.stderr[-3000:])


def test_serve_without_jetstream_names_the_install_command(tmp_path):
    r = _py("from jax_rl.cli import main; sys.exit(main(sys.argv[1:]))", "serve", "preset:tiny_dense", "--port", "0")
    err = r.stderr.strip().splitlines()
    assert r.returncode == 1, (r.stdout[-2000:], r.stderr[-3000:])
    assert err[-1].startswith("jax-rl: error: cannot import jetstream") and "Traceback" not in r.stderr, r.stderr
    assert "pip install --no-deps google-jetstream==0.2.2" in err[-1], err[-1]
