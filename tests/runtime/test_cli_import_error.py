"""The CLI reports a broken install as what it is: a failed import names the module and exits 1 (no
"not built yet", no exit 3)."""

import sys

from jax_rl.cli import main
from jax_rl.config import CONFIG_DIR


def test_a_failed_import_is_one_line_naming_the_module(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "jax_rl.runtime.train", None)  # importing it raises ImportError
    rc = main(["train", str(CONFIG_DIR / "tiny_cpu.yaml"), f"run.dir={tmp_path / 'r'}"])
    err = capsys.readouterr().err
    assert rc == 1, err
    assert "cannot import jax_rl.runtime.train" in err and "not built" not in err
    assert len(err.strip().splitlines()) == 1
