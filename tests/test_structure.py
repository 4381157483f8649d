"""Structure of the packages: no import cycle between jax_rl / rollout modules, counting imports
inside functions too (a function-level import that closes a cycle is still a cycle: it only hides
it from the interpreter's import order) and imports under ``if TYPE_CHECKING:`` (a type-only
import is still a dependency of the reader's model of the code); importing ``a.b.c`` runs the
packages ``a`` and ``a.b`` first, so those are edges too. The config imports no registry (it is no
leaf: docs/design.md §4.1 Import order). Also: the registries and the config's allowed names agree, nothing outside a
registry branches on a route's name, a function-level project import says why it waits (``# lazy:``),
no import runs from a lower level up (:func:`upward_imports`) and no module is over 600 lines."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in ("jax_rl", "rollout"):
        for p in (ROOT / pkg).rglob("*.py"):
            parts = p.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            mods[name] = p
    return mods


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the nodes inside an ``if TYPE_CHECKING:`` body (never executed)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            t = node.test
            name = t.id if isinstance(t, ast.Name) else t.attr if isinstance(t, ast.Attribute) else None
            if name == "TYPE_CHECKING":
                out.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return out


def import_base(node: ast.ImportFrom, pkg: str) -> str:
    """The absolute module a ``from ... import`` statement in package ``pkg`` reads from (relative
    levels resolved)."""
    base = node.module or ""
    if node.level:
        up = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
        base = ".".join(up + ([base] if base else []))
    return base


def imports_project(node: ast.AST, pkg: str, mods: dict) -> bool:
    """Whether ``node`` is an import statement naming a project module (``from a.b import c``: ``a.b.c``
    or ``a.b``)."""
    if isinstance(node, ast.ImportFrom):
        base = import_base(node, pkg)
        return base in mods or any(f"{base}.{a.name}" in mods for a in node.names)
    if isinstance(node, ast.Import):
        return any(a.name in mods for a in node.names)
    return False


def import_graph(type_checking: bool = True) -> dict[str, set[str]]:
    """Module -> the project modules it imports (``from a.b import c`` counts ``a.b.c`` when that is
    a module, else ``a.b``), and the packages above each (their ``__init__`` runs first); package
    ``__init__`` re-exports are edges too. ``type_checking=False`` leaves out the imports under
    ``if TYPE_CHECKING:`` (what the interpreter runs)."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        pkg = m if p.name == "__init__.py" else m.rpartition(".")[0]
        tree = ast.parse(p.read_text())
        skip = set() if type_checking else _type_checking_only(tree)
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.ImportFrom):
                base = import_base(node, pkg)
                for a in node.names:
                    full = f"{base}.{a.name}"
                    if full in mods:
                        graph[m].add(full)
                    elif base in mods:
                        graph[m].add(base)
            elif isinstance(node, ast.Import):
                graph[m].update(a.name for a in node.names if a.name in mods)
    for m in graph:
        for dep in list(graph[m]):
            parts = dep.split(".")
            graph[m].update(p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if p in mods)
        graph[m] -= {m} | {".".join(m.split(".")[:i]) for i in range(1, m.count(".") + 1)}  # its own packages
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_type_checking_imports_are_found():
    """``import_graph(type_checking=False)`` leaves out exactly the ``if TYPE_CHECKING:`` imports."""
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\nimport b\n")
    skip = _type_checking_only(tree)
    kept = [n.names[0].name for n in ast.walk(tree) if isinstance(n, ast.Import) and id(n) not in skip]
    assert kept == ["b"]


def test_cycle_detector_finds_a_function_level_cycle():
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_cycle():
    found = cycles(import_graph())
    assert not found, f"import cycles (function-level and TYPE_CHECKING imports included): {found}"


def test_parent_packages_are_edges():
    """``from jax_rl.learner.correction.old_logits.routes import X`` runs ``jax_rl/learner/correction/old_logits/__init__.py`` first."""
    g = import_graph()
    assert {"jax_rl.learner.correction.old_logits.routes", "jax_rl.learner.correction.old_logits"} <= g["jax_rl.learner.correction.base"]


def upward_imports(graph: dict[str, set[str]], mods: dict[str, Path] | None = None) -> list[str]:
    """``a -> b`` for each import from a module of folder F (its package: the module itself for a package's
    ``__init__``) to a module outside F's subfolders that reaches, transitively, a module of F (F's own
    ``__init__`` counts when it imports something; an empty one is no tie): the folder leans on something that
    leans on it, e.g. ``old_logits/stage.py`` -> ``learner.train_step`` -> ``correction`` -> ``old_logits/``."""
    mods = _modules() if mods is None else mods
    reach: dict[str, set[str]] = {}

    def reached(m: str) -> set[str]:
        if m not in reach:
            reach[m] = set()
            acc = set(graph[m])
            for d in graph[m]:
                acc |= reached(d)
            reach[m] = acc
        return reach[m]

    out = []
    for m in sorted(graph):
        f = m if mods[m].name == "__init__.py" else m.rpartition(".")[0]
        for d in sorted(graph[m]):
            if d == f or d.startswith(f + ".") or f.startswith(d + "."):  # down the tree, or its own packages
                continue
            if any(r.startswith(f + ".") or (r == f and graph[f]) for r in reached(d)):
                out.append(f"{m} -> {d}")
    return out


def test_upward_import_finder():
    """A module whose import reaches back into its own folder is flagged; down-the-tree imports, its own
    packages and an empty ``__init__`` are not."""
    mods = {m: Path(f"{m.replace('.', '/')}.py") for m in ("a.x", "a.y", "b.z", "b.w")}
    mods.update({"a": Path("a/__init__.py"), "b": Path("b/__init__.py")})
    graph = {"a": set(), "b": set(), "a.x": {"b.z"}, "a.y": set(), "b.z": {"a.y"}, "b.w": {"a.y"}}
    assert upward_imports(graph, mods) == ["a.x -> b.z"]
    graph["a.x"] = {"b.w", "a.y"}  # b.w reaches a.y, in a.x's folder: still upward; a.x -> a.y is its own folder
    assert upward_imports(graph, mods) == ["a.x -> b.w"]
    graph["b.w"] = {"a"}  # only a's empty __init__: no tie
    assert upward_imports(graph, mods) == []


# Upward imports still standing, each with why it must stay (``"a -> b": reason``); a fix deletes its line.
UPWARD_EXPLAINED: dict[str, str] = {}


def test_no_upward_import():
    """No import runs from a lower level up (:func:`upward_imports`): a folder leans only on folders that do not
    lean back on it; a shared piece moves down, or the dependency is inverted (a stage takes callables, as
    :class:`jax_rl.learner.correction.old_logits.stage.OldLogitStage` does). :data:`UPWARD_EXPLAINED` names any
    that must stay, with why."""
    found = upward_imports(import_graph())
    bad = [e for e in found if e not in UPWARD_EXPLAINED]
    assert not bad, "imports from a lower level up (move the shared piece down or invert it):\n" + "\n".join(bad)
    stale = sorted(set(UPWARD_EXPLAINED) - set(found))
    assert not stale, f"UPWARD_EXPLAINED names imports no longer upward: delete {stale}"


REGISTRIES = ("jax_rl.learner.correction", "jax_rl.learner.advantages", "jax_rl.learner.correction.old_logits")


def test_config_imports_no_registry():
    """The registries and the rest import the config, never the other way: no module of ``jax_rl.config`` imports a
    registry (nor anything that reaches one), at module level, in a function or for types only. The
    registries' knowledge of a config (what a mode allows) is :func:`jax_rl.learner.correction.check_config`."""
    g = import_graph()
    config = [m for m in g if m == "jax_rl.config" or m.startswith("jax_rl.config.")]
    seen, todo = set(config), list(config)
    while todo:
        for dep in g[todo.pop()]:
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    reached = sorted(m for m in seen if any(m == r or m.startswith(r + ".") for r in REGISTRIES))
    assert not reached, f"jax_rl.config reaches the registries {reached}"


def test_registries_agree_with_the_config():
    """``loss.correction``, ``old_logits.route`` and ``algo.advantage`` accept exactly the registries' names."""
    import typing

    from jax_rl.learner.advantages import REGISTRY as ADVANTAGES
    from jax_rl.config import AlgoConfig, LossConfig, OldLogitsConfig
    from jax_rl.learner.correction import REGISTRY
    from jax_rl.learner.correction.old_logits.routes import ROUTES

    assert set(typing.get_args(LossConfig.model_fields["correction"].annotation)) == set(REGISTRY)
    assert set(typing.get_args(OldLogitsConfig.model_fields["route"].annotation)) == set(ROUTES)
    assert set(typing.get_args(AlgoConfig.model_fields["advantage"].annotation)) == set(ADVANTAGES)
    from jax_rl.config import RolloutConfig
    from rollout.engine.layouts import KV_LAYOUTS

    assert set(typing.get_args(RolloutConfig.model_fields["kv_layout"].annotation)) == set(KV_LAYOUTS)


def test_envs_agree_with_the_config():
    """One env convention: ``env.name`` accepts exactly the :data:`rollout.envs.ENVS` names, and each env's knobs
    are the config section ``env.<name>`` its :class:`EnvSpec` names (``section``); the env sections are all
    that ``env`` holds besides ``name`` and ``train_seed_offset``. The tool-latency cap is defined once."""
    import typing

    from jax_rl.config import MAX_TOOL_LATENCY_S, EnvConfig
    from rollout.envs import ENVS
    from rollout.envs import base as env_base

    assert set(typing.get_args(EnvConfig.model_fields["name"].annotation)) == set(ENVS)
    assert {n: s.section for n, s in ENVS.items()} == {n: n for n in ENVS}
    assert set(EnvConfig.model_fields) - {"name", "train_seed_offset"} == set(ENVS)
    assert MAX_TOOL_LATENCY_S is env_base.MAX_TOOL_LATENCY_S
    defs = [f"{p.relative_to(ROOT)}:{n.lineno}" for p in list((ROOT / "jax_rl").rglob("*.py")) + list((ROOT / "rollout").rglob("*.py"))
            for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, (ast.Assign, ast.AnnAssign))
            and any(isinstance(t, ast.Name) and t.id == "MAX_TOOL_LATENCY_S"
                    for t in (n.targets if isinstance(n, ast.Assign) else [n.target]))]
    assert len(defs) == 1, f"MAX_TOOL_LATENCY_S defined more than once: {defs}"


def _string_constants(path: Path) -> list[tuple[int, str]]:
    """(line, value) of the string constants of a module that are not docstrings."""
    tree = ast.parse(path.read_text())
    docs = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docs.add(id(body[0].value))
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):  # attribute docstrings
            docs.add(id(node.value))
    return sorted({(node.lineno, node.value) for node in ast.walk(tree)  # f-string pieces are Constants too
                   if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs})


def test_route_names_only_in_the_registry_and_the_config():
    """No module but the route registry and the config's section that names them holds an ``old_logits.route`` name
    in its code (a literal equal to it, or a message naming ``route=<name>``): the others ask the
    route object. Docstrings may name routes."""
    import re

    from jax_rl.learner.correction.old_logits.routes import ROUTES

    allowed = {ROOT / "jax_rl" / "learner" / "correction" / "old_logits" / "routes.py", ROOT / "jax_rl" / "config" / "training.py"}
    pat = re.compile(r"route=(" + "|".join(ROUTES) + r")\b")
    bad = []
    for p in list((ROOT / "jax_rl").rglob("*.py")) + list((ROOT / "rollout").rglob("*.py")):
        if p in allowed:
            continue
        for line, v in _string_constants(p):
            if v in ROUTES or pat.search(v):
                bad.append(f"{p.relative_to(ROOT)}:{line}: {v!r}")
    assert not bad, "route names outside the registry:\n" + "\n".join(bad)


def test_no_metric_suffix_rules():
    """No module decides how a metric combines from its name's suffix (``key.endswith("_max")``,
    ``"/tokens"``...): each metric declares its reduction (:data:`jax_rl.learner.losses.METRIC_REDUCTIONS`)."""
    import re

    pat = re.compile(r"^(_max|_min|_mean|_sum|_frac|/tokens)$")
    bad = []
    for p in (ROOT / "jax_rl").rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "endswith"
                    and any(isinstance(a, ast.Constant) and isinstance(a.value, str) and pat.match(a.value)
                            for a in node.args)):
                bad.append(f"{p.relative_to(ROOT)}:{node.lineno}")
    assert not bad, "metric name rules:\n" + "\n".join(bad)


def function_level_imports() -> list[tuple[str, int, str]]:
    """``(path, line, source)`` of every import of a project module inside a function body (what runs when the
    function runs, not at import; ``if TYPE_CHECKING:`` blocks left out), the statement's lines joined."""
    mods = _modules()
    out = []
    for m, p in sorted(mods.items()):
        pkg = m if p.name == "__init__.py" else m.rpartition(".")[0]
        text = p.read_text()
        lines = text.splitlines()
        tree = ast.parse(text)
        skip = _type_checking_only(tree)
        inside = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                  for s in f.body for n in ast.walk(s)}
        for node in ast.walk(tree):
            if id(node) not in inside or id(node) in skip:
                continue
            if imports_project(node, pkg, mods):
                src = "\n".join(lines[node.lineno - 1: node.end_lineno])
                out.append((str(p.relative_to(ROOT)), node.lineno, src))
    return out


LAZY = re.compile(r"#\s*lazy:\s*\S")

# Modules whose function-level project imports have not been sorted yet (issue 40, the files other changes
# own): at most this many without a `# lazy:` reason. Lower a ceiling when a change removes some; delete the
# entry at 0.
LAZY_CEILINGS: dict[str, int] = {}


def test_lazy_pattern():
    assert LAZY.search("from jax_rl.x import y  # lazy: Ray, an optional extra")
    assert not LAZY.search("from jax_rl.x import y  # lazy:")
    assert not LAZY.search("from jax_rl.x import y  # jax: only for the commands that run")


def test_function_level_imports_say_why():
    """A project import inside a function (run when the function runs) is there for a reason: a heavy or
    optional dependency (Ray, tau2, jax before the CLI chose the platform) or a real cycle. Each says it on
    the statement, ``# lazy: <reason>``; everything else is imported at module level. The modules of
    :data:`LAZY_CEILINGS` may hold that many unexplained ones until they are sorted."""
    found = function_level_imports()
    assert found, "the walker finds nothing: it is broken"
    bare: dict[str, list[str]] = {}
    for path, line, src in found:
        if not LAZY.search(src):
            bare.setdefault(path, []).append(f"{path}:{line}: {src.strip()}")
    over = [line for path, lines in sorted(bare.items()) if len(lines) > LAZY_CEILINGS.get(path, 0) for line in lines]
    assert not over, ("function-level project imports without a `# lazy: <reason>` comment (move them to module "
                      "level, or say why they must wait):\n" + "\n".join(over))
    stale = {p: (n, len(bare.get(p, []))) for p, n in LAZY_CEILINGS.items() if len(bare.get(p, [])) < n}
    assert not stale, f"LAZY_CEILINGS above what the modules hold now (ceiling, held): lower them: {stale}"


MAX_LINES = 600
# Modules still over MAX_LINES (issue 40, owned by other changes): they may not grow past this until split.
OVER_MAX_LINES: dict[str, int] = {}
# The packages the size rules (modules, functions) and the private-import rule cover.
RULED_PACKAGES = ("jax_rl", "rollout")


def test_no_module_over_600_lines():
    """No ``jax_rl`` or ``rollout`` module over :data:`MAX_LINES` lines: a module that grows past it is split
    by concern (e.g. ``jax_rl/config/``, ``rollout/engine/``). :data:`OVER_MAX_LINES` names the ones still
    over, with a ceiling; an entry whose module is back under the limit is deleted."""
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines())
             for pkg in RULED_PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    over = {p: n for p, n in sizes.items() if n > max(MAX_LINES, OVER_MAX_LINES.get(p, 0))}
    assert not over, f"modules over {MAX_LINES} lines (split them by concern): {over}"
    stale = sorted(p for p in OVER_MAX_LINES if sizes.get(p, 0) <= MAX_LINES)
    assert not stale, f"OVER_MAX_LINES names modules no longer over {MAX_LINES} lines: delete {stale}"


MAX_FUNCTION_LINES = 80
# The packages whose functions the 80-line rule covers (tests/ are not; bench/ has its own test below).
FUNCTION_RULE_PACKAGES = ("rollout", "jax_rl")
# Functions still over MAX_FUNCTION_LINES ("path:Class.function" -> ceiling), owned by other changes: they may
# not grow past it until split; an entry back under the limit is deleted.
LONG_FUNCTIONS: dict[str, int] = {}


def long_functions(root: Path = ROOT, packages: tuple = FUNCTION_RULE_PACKAGES,
                   limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
    """``{"path:Qualified.name": lines}`` of the functions (methods and nested functions, each counted whole:
    its docstring and nested bodies included) over ``limit`` lines in ``root``'s ``packages``."""
    out: dict[str, int] = {}

    def walk(node: ast.AST, prefix: str, path: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                n = child.end_lineno - child.lineno + 1
                if not isinstance(child, ast.ClassDef) and n > limit:
                    out[f"{path}:{name}"] = n
                walk(child, name + ".", path)
            else:
                walk(child, prefix, path)

    for pkg in packages:
        for p in sorted((root / pkg).rglob("*.py")):
            walk(ast.parse(p.read_text()), "", str(p.relative_to(root)))
    return out


def test_long_function_finder(tmp_path):
    """The finder counts a function whole (docstring and nested bodies) and names it by its class."""
    (tmp_path / "pkg").mkdir()
    body = "".join(f"        x{i} = {i}\n" for i in range(4))
    (tmp_path / "pkg" / "m.py").write_text(
        f"class A:\n    def f(self):\n        \"\"\"Doc.\"\"\"\n{body}\n"
        f"def g():\n    def h():\n{body}    return h\n\n\ndef short():\n    pass\n")
    assert long_functions(tmp_path, ("pkg",), limit=5) == {"pkg/m.py:A.f": 6, "pkg/m.py:g": 7}


def test_no_function_over_80_lines():
    """No function of :data:`FUNCTION_RULE_PACKAGES` over :data:`MAX_FUNCTION_LINES` lines (counted whole): a
    longer one is split into named steps. :data:`LONG_FUNCTIONS` holds the ones still over, with a ceiling."""
    found = long_functions()
    over = {f: n for f, n in found.items() if n > LONG_FUNCTIONS.get(f, MAX_FUNCTION_LINES)}
    assert not over, f"functions over {MAX_FUNCTION_LINES} lines (split them into named steps): {over}"
    stale = sorted(f for f in LONG_FUNCTIONS if f not in found)
    assert not stale, f"LONG_FUNCTIONS names functions no longer over {MAX_FUNCTION_LINES} lines: delete {stale}"


def private_imports_across_packages(mods: dict[str, Path] | None = None, packages: tuple = RULED_PACKAGES,
                                    root: Path = ROOT) -> list[str]:
    """``path:line: module._name`` of every import, by a module of ``packages``, of a private name (``_x``,
    not dunder) of a project module in another package: a private name is its package's own. "Package":
    the module's parent package (``rollout.engine`` for ``rollout.engine.core``; a package's ``__init__``
    belongs to it; a subpackage's modules count as their parent's), so ``rollout.generator`` may not import
    ``rollout.engine.core._x``, while ``rollout.engine.core`` may import ``rollout.engine.programs._x``."""
    mods = _modules() if mods is None else mods
    out = []
    for m, p in sorted(mods.items()):
        if m.split(".")[0] not in packages:
            continue
        own = m if p.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(p.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = import_base(node, own)
            if base not in mods:
                continue
            home = base if mods[base].name == "__init__.py" else base.rpartition(".")[0]
            for a in node.names:
                private = a.name.startswith("_") and not a.name.startswith("__")
                if private and f"{base}.{a.name}" not in mods and not (own == home or own.startswith(home + ".")):
                    out.append(f"{p.relative_to(root)}:{node.lineno}: {base}.{a.name}")
    return out


def test_private_import_finder(tmp_path):
    """The finder flags a private name imported from another package and lets a package's own modules
    (and its subpackages) share one."""
    files = {"pkg/__init__.py": "", "pkg/a/__init__.py": "", "pkg/a/x.py": "_p = 1\nq = 2\n",
             "pkg/a/y.py": "from pkg.a.x import _p\n", "pkg/a/sub/__init__.py": "",
             "pkg/a/sub/z.py": "from pkg.a.x import _p\n", "pkg/b.py": "from pkg.a.x import _p, q\n",
             "pkg/c.py": "from .a.x import _p\n"}
    mods = {}
    for rel, text in files.items():
        f = tmp_path / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
        parts = Path(rel).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    found = private_imports_across_packages(mods, ("pkg",), tmp_path)
    assert found == ["pkg/b.py:1: pkg.a.x._p", "pkg/c.py:1: pkg.a.x._p"]


# Modules still importing a private name across packages (issue 49, owned by other changes): at most this
# many; lower a ceiling when one is fixed, delete it at 0.
PRIVATE_IMPORT_CEILINGS: dict[str, int] = {"jax_rl/cli.py": 2}


def test_no_private_import_across_packages():
    """No module of :data:`RULED_PACKAGES` imports another package's private (``_x``) name: what a package
    shares with others is public. :data:`PRIVATE_IMPORT_CEILINGS` holds the modules not sorted yet."""
    per: dict[str, list[str]] = {}
    for f in private_imports_across_packages():
        per.setdefault(f.split(":")[0], []).append(f)
    over = [f for path, fs in sorted(per.items()) if len(fs) > PRIVATE_IMPORT_CEILINGS.get(path, 0) for f in fs]
    assert not over, "private names imported across packages (make them public):\n" + "\n".join(over)
    stale = {p: (n, len(per.get(p, []))) for p, n in PRIVATE_IMPORT_CEILINGS.items() if len(per.get(p, [])) < n}
    assert not stale, f"PRIVATE_IMPORT_CEILINGS above what the modules hold now (ceiling, held): lower them: {stale}"


def test_env_names_only_in_the_registry():
    """No module outside ``rollout/envs/`` and the config (whose ``env.name`` choices and sections name them)
    compares a value with an env's name (``env.name == "tau2"``): it asks the env's registry entry
    (:data:`rollout.envs.ENVS`, :class:`rollout.envs.EnvSpec`) instead."""
    from rollout.envs import ENVS

    bad = []
    for p in list((ROOT / "jax_rl").rglob("*.py")) + list((ROOT / "rollout").rglob("*.py")):
        rel = p.relative_to(ROOT).parts
        if rel[:2] in (("rollout", "envs"), ("jax_rl", "config")):
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Compare) and any(isinstance(c, ast.Constant) and c.value in ENVS
                                                     for c in [node.left, *node.comparators]):
                bad.append(f"{p.relative_to(ROOT)}:{node.lineno}")
    assert not bad, "env names compared outside the registry:\n" + "\n".join(bad)


def layout_name_compares(files: list[Path], names: set[str], root: Path = ROOT) -> list[str]:
    """``path:line`` of each comparison (``==``, ``!=``, ``in``, ...) with a constant in ``names`` in ``files``."""
    bad = []
    for p in files:
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Compare) and any(isinstance(c, ast.Constant) and c.value in names
                                                     for c in [node.left, *node.comparators]):
                bad.append(f"{p.relative_to(root)}:{node.lineno}")
    return bad


def test_layout_name_finder(tmp_path):
    """The finder sees a comparison with a layout's name, in either order, and not an assignment or a call."""
    f = tmp_path / "m.py"
    f.write_text('a = "paged"\nif a == "paged":\n    pass\nb = "contiguous" != a\nf(kv_layout="paged")\n')
    assert layout_name_compares([f], {"paged", "contiguous"}, root=tmp_path) == ["m.py:2", "m.py:4"]


def test_kv_layout_names_only_in_the_registry():
    """No module of jax_rl / rollout / bench outside the K/V layout registry (``rollout/engine/layouts.py``, the
    layout classes' own ``name``) and the config compares a value with a layout's name (``kv_layout == "paged"``):
    it asks the engine's layout object (``engine.kv``) or the registry's class
    (:data:`rollout.engine.layouts.KV_LAYOUTS`)."""
    from rollout.engine.layouts import KV_LAYOUTS

    files = [p for pkg in ("jax_rl", "rollout", "bench") for p in sorted((ROOT / pkg).rglob("*.py"))
             if p.relative_to(ROOT).parts[:2] != ("jax_rl", "config") and p != ROOT / "rollout" / "engine" / "layouts.py"]
    bad = layout_name_compares(files, set(KV_LAYOUTS))
    assert not bad, "K/V layout names compared outside the registry:\n" + "\n".join(bad)


MAX_PARAMS = 10
# Functions still over MAX_PARAMS parameters ("path:Class.function" -> ceiling), owned by other changes: they may
# not take more until they get a typed argument object or are split; lower an entry when a change shrinks it,
# delete it when it is back under.
PARAM_CEILINGS: dict[str, int] = {}


def param_counts(files: list[Path], limit: int = MAX_PARAMS, root: Path = ROOT) -> dict[str, int]:
    """``{"path:Qualified.name": parameters}`` of each function (methods and nested functions) of ``files`` over
    ``limit`` parameters: positional, keyword-only, ``*args`` and ``**kwargs`` each one; a method's leading
    ``self`` / ``cls`` not counted."""
    out: dict[str, int] = {}

    def count(f: ast.AST) -> int:
        a = f.args
        names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
        if names and names[0] in ("self", "cls"):
            names = names[1:]
        return len(names) + (a.vararg is not None) + (a.kwarg is not None)

    def walk(node: ast.AST, prefix: str, path: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef) and count(child) > limit:
                    out[f"{path}:{name}"] = count(child)
                walk(child, name + ".", path)
            else:
                walk(child, prefix, path)

    for p in files:
        walk(ast.parse(p.read_text()), "", str(p.relative_to(root)))
    return out


def test_param_count_finder(tmp_path):
    """The finder counts positional, keyword-only, ``*args`` and ``**kwargs`` parameters, not ``self``."""
    f = tmp_path / "m.py"
    f.write_text("class A:\n    def f(self, a, b, *c, d, **e):\n        pass\n\n\ndef g(a, b):\n    pass\n")
    assert param_counts([f], limit=4, root=tmp_path) == {"m.py:A.f": 5}
    assert param_counts([f], limit=5, root=tmp_path) == {}


def test_no_function_over_10_parameters():
    """No function of jax_rl / rollout / bench takes more than :data:`MAX_PARAMS` parameters: a longer list gets a
    typed argument object (a frozen dataclass, e.g. :class:`rollout.engine.EngineSpec`) or the function is split.
    :data:`PARAM_CEILINGS` holds the ones still over, with a ceiling that can only go down."""
    files = [p for pkg in ("jax_rl", "rollout", "bench") for p in sorted((ROOT / pkg).rglob("*.py"))]
    found = param_counts(files)
    over = {f: n for f, n in found.items() if n > PARAM_CEILINGS.get(f, MAX_PARAMS)}
    assert not over, f"functions over {MAX_PARAMS} parameters (a typed argument object, or split them): {over}"
    stale = {f: (n, found.get(f, 0)) for f, n in PARAM_CEILINGS.items() if found.get(f, 0) < n}
    assert not stale, f"PARAM_CEILINGS above what the functions take now (ceiling, now): lower or delete them: {stale}"


# ------------------------------------------------------------------------------------------------ bench/
# bench/'s scripts follow the package rules too (issue 49 item 6): 600 lines a module, 80 a function, no
# private name imported from jax_rl / rollout. (No upward-import rule: nothing imports a bench script.) The
# ceilings below name what is still over; lower one when a change shrinks it, delete it when it is back under.
BENCH_OVER_MAX_LINES: dict[str, int] = {}
BENCH_MAX_FUNCTION_LINES = 80
BENCH_LONG_FUNCTIONS: dict[str, int] = {}


def _bench_files() -> list[Path]:
    return sorted((ROOT / "bench").glob("*.py"))


def bench_long_functions(files: list[Path], limit: int = BENCH_MAX_FUNCTION_LINES, root: Path = ROOT) -> dict[str, int]:
    """``{"path:name": lines}`` of each function (nested ones too, each counted whole) over ``limit`` lines."""
    return {f"{p.relative_to(root)}:{n.name}": n.end_lineno - n.lineno + 1
            for p in files for n in ast.walk(ast.parse(p.read_text()))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > limit}


def bench_private_imports(files: list[Path], root: Path = ROOT) -> list[str]:
    """``path:line: module._name`` of each ``from jax_rl... / rollout... import _name`` in ``files``."""
    out = []
    for p in files:
        for node in ast.walk(ast.parse(p.read_text())):
            if (isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("jax_rl", "rollout")
                    and node.level == 0):
                out += [f"{p.relative_to(root)}:{node.lineno}: {node.module}.{a.name}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
    return out


def test_bench_rule_finders(tmp_path):
    """The finders see a long function and a private project import, and nothing else."""
    body = "".join(f"    x{i} = {i}\n" for i in range(6))
    f = tmp_path / "b.py"
    f.write_text(f"from jax_rl.tpu import _analysis, CHIPS\nfrom _record import ROOT\n\n\ndef g():\n{body}\n\ndef h():\n    pass\n")
    assert bench_long_functions([f], limit=5, root=tmp_path) == {"b.py:g": 7}
    assert bench_private_imports([f], root=tmp_path) == ["b.py:1: jax_rl.tpu._analysis"]


def test_bench_modules_under_600_lines():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in _bench_files()}
    over = {p: n for p, n in sizes.items() if n > max(MAX_LINES, BENCH_OVER_MAX_LINES.get(p, 0))}
    assert not over, f"bench scripts over {MAX_LINES} lines (split them): {over}"
    stale = sorted(p for p in BENCH_OVER_MAX_LINES if sizes.get(p, 0) <= MAX_LINES)
    assert not stale, f"BENCH_OVER_MAX_LINES names scripts no longer over {MAX_LINES} lines: delete {stale}"


def test_bench_functions_under_80_lines():
    found = bench_long_functions(_bench_files())
    over = {f: n for f, n in found.items() if n > BENCH_LONG_FUNCTIONS.get(f, BENCH_MAX_FUNCTION_LINES)}
    assert not over, f"bench functions over {BENCH_MAX_FUNCTION_LINES} lines (split them into named steps): {over}"
    stale = sorted(f for f in BENCH_LONG_FUNCTIONS if f not in found)
    assert not stale, f"BENCH_LONG_FUNCTIONS names functions no longer over {BENCH_MAX_FUNCTION_LINES} lines: {stale}"


def test_bench_imports_no_private_project_name():
    """A bench script uses jax_rl's and rollout's public names only (what it needs is made public)."""
    found = bench_private_imports(_bench_files())
    assert not found, "private project names imported by bench/:\n" + "\n".join(found)
