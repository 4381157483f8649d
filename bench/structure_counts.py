"""The code's shape, counted: project imports (and how many sit inside functions), import cycles (type-only
imports and parent packages counted, as ``tests/test_structure.py`` counts them) and the largest modules.

    .venv/bin/python bench/structure_counts.py [--top 10] [--list-function-level] [--list-upward] [--list-long]

An import statement counts once however many names it imports; "project" means a module of ``jax_rl/``
or ``rollout/``. Also: modules; import levels (the longest chain of project imports, a module that imports
none is level 1); upward imports (an import from a module of folder F to a module outside F's subfolders
that itself reaches a module of F, an empty ``__init__`` aside: the folder leans on something that leans on it, e.g.
``old_logits/stage.py`` -> ``train_step`` -> ``correction`` -> ``old_logits/``); functions over 80 lines and
modules over 600 lines in ``jax_rl/``, ``rollout/`` and ``bench/``. Prints figures; asserts nothing (the
structure test guards the rules).
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


def levels(graph: dict[str, set[str]]) -> dict[str, int]:
    """Module -> its import level (1 + the highest level it imports; 1 for a module that imports none)."""
    out: dict[str, int] = {}

    def level(m: str) -> int:
        if m not in out:
            out[m] = 0  # a cycle (the structure test forbids them) would stop here
            out[m] = 1 + max((level(d) for d in graph[m]), default=0)
        return out[m]

    for m in graph:
        level(m)
    return out


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """``a -> b`` for each import from a module of folder F to a module outside F's subfolders that reaches
    (transitively) a module of F (the structure test's finder, :func:`test_structure.upward_imports`)."""
    return ts.upward_imports(graph)


def long_functions(limit: int = 80) -> list[tuple[int, str]]:
    """(lines, ``path:name``) of each function over ``limit`` lines in jax_rl/, rollout/ and bench/ (a nested
    function counts in its own right and inside its parent)."""
    out = []
    for pkg in ("jax_rl", "rollout", "bench"):
        for p in sorted((ROOT / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(p.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    n = node.end_lineno - node.lineno + 1
                    if n > limit:
                        out.append((n, f"{p.relative_to(ROOT)}:{node.name}"))
    return sorted(out, reverse=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--top", type=int, default=10, help="largest modules to list")
    ap.add_argument("--list-function-level", action="store_true", help="print every function-level import")
    ap.add_argument("--list-upward", action="store_true", help="print every upward import")
    ap.add_argument("--list-long", action="store_true", help="print every function over 80 lines")
    args = ap.parse_args(argv)
    graph = ts.import_graph()
    lv = levels(graph)
    print(f"modules (jax_rl/, rollout/): {len(graph)}; import levels: {max(lv.values())}")
    up = upward_imports(graph)
    print(f"upward imports: {len(up)}" + "".join(f"\n  {e}" for e in up if args.list_upward))
    longf = long_functions()
    print(f"functions over 80 lines (jax_rl/, rollout/, bench/): {len(longf)}"
          + "".join(f"\n  {n} {w}" for n, w in longf if args.list_long))
    total, inside = project_imports()
    print(f"project import statements: {total}; inside functions: {len(inside)}")
    if args.list_function_level:
        print("\n".join(inside))
    found = ts.cycles(ts.import_graph())
    print(f"import cycles (function-level, TYPE_CHECKING and parent packages counted): {len(found)}"
          + "".join(f"\n  {len(c)} modules: {', '.join(c)}" for c in found))
    sizes = sorted(((len(p.read_text().splitlines()), str(p.relative_to(ROOT)))
                    for pkg in ("jax_rl", "rollout", "bench") for p in (ROOT / pkg).rglob("*.py")), reverse=True)
    print("largest modules (lines): " + ", ".join(f"{n} {p}" for n, p in sizes[: args.top]))
    for pkg in ("jax_rl", "rollout", "bench"):
        print(f"{pkg} modules over 600 lines: {sum(1 for n, p in sizes if n > 600 and p.startswith(pkg + '/'))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
