"""Imports run one way: no import circle inside jax_rl/runtime, and nothing there imports the
entry module runtime/train.py (module-level and function-level imports both count)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from jax_rl.checkpoint import resolve_checkpoint_dir
from jax_rl.config import CONFIG_DIR, load_config

RUNTIME = Path(__file__).resolve().parents[2] / "jax_rl" / "runtime"


def _graph() -> dict[str, set[str]]:
    mods = {p.stem for p in RUNTIME.glob("*.py") if p.stem != "__init__"}
    graph: dict[str, set[str]] = {}
    for m in mods:
        deps = set()
        for n in ast.walk(ast.parse((RUNTIME / f"{m}.py").read_text())):
            if isinstance(n, ast.ImportFrom) and n.module == "jax_rl.runtime":
                deps |= {a.name for a in n.names if a.name in mods}
            elif isinstance(n, ast.ImportFrom) and (n.module or "").startswith("jax_rl.runtime."):
                deps.add(n.module.rsplit(".", 1)[1])
        graph[m] = deps - {m}
    return graph


def test_no_import_circle_in_runtime():
    graph = _graph()

    def reach(a):
        seen, todo = set(), [a]
        while todo:
            for b in graph.get(todo.pop(), ()):
                if b not in seen:
                    seen.add(b)
                    todo.append(b)
        return seen

    circles = sorted((a, b) for a in graph for b in graph[a] if a in reach(b))
    assert not circles, circles
    assert not [m for m, d in graph.items() if "train" in d], "only the CLI imports runtime.train"


def test_resolve_checkpoint_dir(tmp_path):
    cfg = load_config(CONFIG_DIR / "tiny_cpu.yaml", [f"run.dir={tmp_path / 'r'}"])
    assert resolve_checkpoint_dir(cfg) == (tmp_path / "r", tmp_path / "r" / "checkpoints", None)
    cfg.checkpoint.dir = str(tmp_path / "ck")
    assert resolve_checkpoint_dir(cfg)[1] == tmp_path / "ck"
    ck = tmp_path / "r" / "checkpoints"
    (ck / "3").mkdir(parents=True)
    for p in (tmp_path / "r", ck):
        assert resolve_checkpoint_dir(p) == (tmp_path / "r", ck, None)
    assert resolve_checkpoint_dir(ck / "3") == (tmp_path / "r", ck, 3)
    with pytest.raises(ValueError, match="no checkpoint step dir"):
        resolve_checkpoint_dir(ck / "4", error=ValueError)
    with pytest.raises(FileNotFoundError, match="no checkpoints at .*does not exist"):
        resolve_checkpoint_dir(tmp_path / "nowhere")


def _unused_imports(path: Path) -> list[str]:
    """Module-level imported names that nothing in the module reads (``__all__`` counts as a read)."""
    tree = ast.parse(path.read_text())
    imported = {}
    for n in tree.body:
        if isinstance(n, (ast.Import, ast.ImportFrom)) and getattr(n, "module", None) != "__future__":
            for a in n.names:
                imported[a.asname or a.name.split(".")[0]] = n.lineno
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    used |= {c.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
             and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets)
             for c in ast.walk(n.value) if isinstance(c, ast.Constant)}
    return sorted(f"{path.name}:{line} {name}" for name, line in imported.items() if name not in used)


def test_no_unused_imports_in_runtime():
    unused = [u for p in sorted(RUNTIME.glob("*.py")) if p.stem != "__init__" for u in _unused_imports(p)]
    assert not unused, unused
