"""The code's shape, counted: project imports (and how many sit inside functions), import cycles (type-only
imports and parent packages counted, as ``tests/test_structure.py`` counts them) and the largest modules.

    .venv/bin/python bench/structure_counts.py [--top 10] [--list-function-level]

An import statement counts once however many names it imports; "project" means a module of ``jax_rl/``
or ``rollout/``. Prints figures; asserts nothing (the structure test guards the cycle).
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import test_structure as ts  # noqa: E402  (the structure test's module map and import graph)


def project_imports() -> tuple[int, list[str]]:
    """(project import statements, ``path:line`` of those inside a function body)."""
    mods = ts._modules()
    total, inside = 0, []
    for m, p in sorted(mods.items()):
        pkg = m if p.name == "__init__.py" else m.rpartition(".")[0]
        tree = ast.parse(p.read_text())
        in_func = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for s in f.body for n in ast.walk(s)}
        for node in ast.walk(tree):
            if ts.imports_project(node, pkg, mods):
                total += 1
                if id(node) in in_func:
                    inside.append(f"{p.relative_to(ROOT)}:{node.lineno}")
    return total, inside


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--top", type=int, default=10, help="largest modules to list")
    ap.add_argument("--list-function-level", action="store_true", help="print every function-level import")
    args = ap.parse_args(argv)
    total, inside = project_imports()
    print(f"project import statements: {total}; inside functions: {len(inside)}")
    if args.list_function_level:
        print("\n".join(inside))
    found = ts.cycles(ts.import_graph())
    print(f"import cycles (function-level, TYPE_CHECKING and parent packages counted): {len(found)}"
          + "".join(f"\n  {len(c)} modules: {', '.join(c)}" for c in found))
    sizes = sorted(((len(p.read_text().splitlines()), str(p.relative_to(ROOT))) for p in (ROOT / "jax_rl").rglob("*.py")),
                   reverse=True)
    print("largest jax_rl modules (lines): " + ", ".join(f"{n} {p}" for n, p in sizes[: args.top]))
    print(f"jax_rl modules over 600 lines: {sum(1 for n, _ in sizes if n > 600)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
