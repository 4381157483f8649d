"""``python -m build`` makes an sdist and, from it, a wheel that install in a fresh venv and run: ``jax-rl
--help``, ``jax-rl --version`` and a ``train --dry-run`` of a shipped config named from a directory that
holds no ``configs/`` (the packaged copy), with the tau² glue (``rollout.envs.tau2``) inside the wheel.

The fresh venvs get the dependencies without reinstalling them: a ``.pth`` line pointing at this
interpreter's site-packages (a plain path line: the editable install's own ``.pth`` finder there is not
run), then ``pip install --no-deps`` of the wheel (and, in a second venv, of the sdist). Everything runs
from a temp dir with no PYTHONPATH, and each run checks that ``jax_rl`` comes from the installed copy, not
this checkout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_SKIP = shutil.ignore_patterns(".git", ".venv", "runs", "__pycache__", "*.egg-info", ".pytest_cache",
                               ".hypothesis", "build", "dist")


def _run(cmd, cwd, env=None, timeout=600) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, (f"{' '.join(map(str, cmd))} exited {r.returncode}:\n{r.stdout[-1500:]}\n"
                               f"{r.stderr[-3000:]}")
    return r


def _fresh_venv(path: Path) -> Path:
    """A venv at ``path`` without pip whose site-packages also sees this interpreter's (one .pth line)."""
    base = getattr(sys, "_base_executable", sys.executable)
    _run([base, "-m", "venv", "--without-pip", str(path)], cwd=path.parent)
    py = path / "bin" / "python"
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     cwd=path.parent).stdout.strip())
    (site / "_deps_from_test_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return py


def _install(py: Path, target: Path, cwd: Path) -> None:
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-build-isolation",
          "--no-index", "-q", str(target)], cwd=cwd)


def _check_installed(py: Path, cwd: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "JAX_COMPILATION_CACHE_DIR")}
    env["JAX_PLATFORMS"] = "cpu"
    where = _run([str(py), "-c", "import jax_rl, rollout.envs.tau2 as t; print(jax_rl.__file__); print(t.__file__)"],
                 cwd=cwd, env=env).stdout.split()
    venv = py.parent.parent
    assert all(Path(w).is_relative_to(venv) for w in where), (where, venv)  # the installed copy, not the checkout
    jax_rl = venv / "bin" / "jax-rl"
    assert "train" in _run([str(jax_rl), "--help"], cwd=cwd, env=env).stdout
    assert "backend: cpu" in _run([str(jax_rl), "--version"], cwd=cwd, env=env).stdout
    assert not (cwd / "configs").exists()
    for name in ("tiny_cpu", "configs/tiny_cpu.yaml"):  # the shipped copy, by name or by its checkout path
        out = _run([str(jax_rl), "train", name, "--dry-run", "model.tokenizer=compact", "optim.batch_size=4",
                    "algo.group_size=2", "optim.max_seq_len=32", "rollout.max_cache_len=32", "rollout.slots=4",
                    "rollout.max_prefill_length=16"], cwd=cwd, env=env).stdout
        assert "parameters" in out and "train-step compile" in out, out


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_wheel_and_sdist_install_in_a_fresh_venv_and_run(tmp_path):
    pytest.importorskip("build")
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, symlinks=True, ignore=_SKIP)  # the working tree; the checkout stays clean
    dist = tmp_path / "dist"
    # --no-isolation: the build backend from this venv (offline); setuptools >= 70.1 builds wheels itself
    _run([sys.executable, "-m", "build", "--no-isolation", "--skip-dependency-check", "--outdir", str(dist), str(src)],
         cwd=tmp_path)
    whl, = dist.glob("jax_rl-*.whl")
    sdist, = dist.glob("jax_rl-*.tar.gz")
    names = set(zipfile.ZipFile(whl).namelist())
    shipped = {p.name for p in (ROOT / "configs").glob("*.yaml")}
    assert {f"jax_rl/configs/{n}" for n in shipped} <= names, sorted(shipped - {Path(n).name for n in names})
    assert "rollout/envs/tau2.py" in names and "jax_rl/compile/chips.py" in names
    work = tmp_path / "work"
    work.mkdir()
    for i, target in enumerate((whl, sdist)):
        py = _fresh_venv(tmp_path / f"venv{i}")
        _install(py, target, work)
        _check_installed(py, work)


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_wheel_trains_in_an_isolated_venv(tmp_path):
    """The wheel alone trains (issue 63 item 2): a venv that does not see this one's site-packages, ``pip install``
    of the wheel with its declared dependencies (from the configured indexes and pip's cache: 3 min 9 s here), no
    JetStream in it, then ``jax-rl train tiny_cpu run.steps=2 sft.steps=2`` from another directory (3 min 35 s
    here on 2 loaded cores)."""
    pytest.importorskip("build")
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, symlinks=True, ignore=_SKIP)
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "build", "--no-isolation", "--skip-dependency-check", "--wheel", "--outdir", str(dist),
          str(src)], cwd=tmp_path)
    whl, = dist.glob("jax_rl-*.whl")
    base = getattr(sys, "_base_executable", sys.executable)
    venv = tmp_path / "venv"
    _run([base, "-m", "venv", str(venv)], cwd=tmp_path)  # no .pth to this venv: its own site-packages only
    py = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "JAX_COMPILATION_CACHE_DIR", "VIRTUAL_ENV")}
    env["JAX_PLATFORMS"] = "cpu"
    _run([str(py), "-m", "pip", "install", "-q", str(whl)], cwd=tmp_path, env=env, timeout=1500)
    work = tmp_path / "elsewhere"
    work.mkdir()
    mine = sysconfig.get_paths()["purelib"]
    probe = _run([str(py), "-c", "import sys, importlib.util as u; print(u.find_spec('jetstream') is None); "
                  "print('\\n'.join(sys.path))"], cwd=work, env=env).stdout.splitlines()
    assert probe[0] == "True", probe  # JetStream is not a dependency: train must not need it
    assert mine not in probe and not any(str(ROOT) == p for p in probe), probe  # isolated from this venv and checkout
    r = _run([str(venv / "bin" / "jax-rl"), "train", "tiny_cpu", "run.steps=2", "sft.steps=2", f"run.dir={work / 'run'}"],
             cwd=work, env=env, timeout=1200)
    assert (work / "run" / "summary.json").is_file() and (work / "run" / "checkpoints" / "2").is_dir(), r.stdout[-2000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
