"""``jax-rl`` command line: ``train``, ``sft``, ``eval``, ``export``, ``serve``, ``compile``, ``plot``.

Each subcommand has ``--help``. Exit codes: 0 done; 1 a failed run (e.g. the disk filled up:
one line naming the run dir and the bytes needed); 2 a config error or a bad input (missing
path, incompatible or corrupt checkpoint, a run dir another live ``train`` / ``sft`` holds: one
line naming the culprit); 128 + signal number
(130 Ctrl-C, 143 SIGTERM) for a run stopped by a signal after its checkpoint.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
import tempfile
import threading
import typing
from pathlib import Path
from typing import Optional

import yaml

from jax_rl.compile.chips import BackendUnavailable, require_backend
from jax_rl.config import ConfigError, RolloutConfig, load_config
from jax_rl.config.loading import _suggest, _valid_keys, resolve_config_path
from jax_rl.plots import plot_runs
from jax_rl.runtime.run_dir import multiprocess_start
from jax_rl.compile.topology import cpu_unless_tpu_present, libtpu_available

# The subcommands that run a model import jax (and flax, orbax...) inside their cmd_* function: main() must
# choose the platform (cpu_unless_tpu_present) before jax is imported, and `jax-rl --help` or a config error
# costs ~0.3 s of CPU instead of ~1.8 s with jax imported. Those imports are marked `# lazy:`.

EPILOG = "Overrides: key.sub=value, e.g. loss.correction=ppo async.max_staleness=0 mesh.fsdp=4"


BASE_HEADER = "# jax-rl base config:"


def refuse_base_config(path) -> None:
    """``configs/base.yaml`` (any file starting with its generated header) is the reference of every
    knob at its default that the shipped configs build on, not a run: refused in one line.

    Raises:
        ConfigError: ``path`` is that file.
    """
    p = resolve_config_path(path)  # a shipped config's name too
    try:
        with p.open(encoding="utf-8") as f:
            head = f.readline()
    except (OSError, UnicodeDecodeError):  # a missing / unreadable file: load_config names it
        return
    if head.startswith(BASE_HEADER):
        raise ConfigError(f"{path} is the generated base (every knob at its default, for deltas), not a run config: "
                          "give a config that starts with `base_config: base.yaml`, e.g. configs/tiny_cpu.yaml")


def check_writable(cfg) -> None:
    """``run.dir`` and ``checkpoint.dir`` can be made and written, checked before anything runs.

    Raises:
        ConfigError: naming the key, the path and the dir that cannot be written.
    """
    for key, d in (("run.dir", cfg.run.dir), ("checkpoint.dir", cfg.checkpoint.dir)):
        if d is None:
            continue
        p = Path(d).absolute()
        if p.exists() and not p.is_dir():
            raise ConfigError(f"{key}={d}: is a file, not a directory")
        q = p
        while not q.exists() and q != q.parent:
            q = q.parent
        if not q.is_dir():
            raise ConfigError(f"{key}={d}: {q} is a file, not a directory")
        if not os.access(q, os.W_OK | os.X_OK):
            raise ConfigError(f"{key}={d}: cannot write there ({q} is not writable)")
        try:  # what access() cannot see (root, /proc, a read-only or pseudo file system): make a dir there
            os.rmdir(tempfile.mkdtemp(prefix=".jax-rl-write-check-", dir=q))
        except OSError as e:
            raise ConfigError(f"{key}={d}: cannot write there (making a dir in {q}: "
                              f"{e.strerror or type(e).__name__})") from None


def check_writable_file(flag: str, path: str) -> None:
    """An output file ``path`` (given as ``flag``) can be written: its dir exists and takes a new file.

    Raises:
        ConfigError: naming the flag, the path and why.
    """
    p = Path(path).absolute()
    if p.is_dir():
        raise ConfigError(f"{flag} {path}: is a directory, not a file")
    if not p.parent.is_dir():
        raise ConfigError(f"{flag} {path}: its directory {p.parent} does not exist")
    try:
        fd, probe = tempfile.mkstemp(prefix=".jax-rl-write-check-", dir=p.parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"{flag} {path}: cannot write there ({p.parent}: {e.strerror or type(e).__name__})") from None


def _load(args) -> "object":
    if not getattr(args, "print_config", False):  # printing the resolved base is fine; running it is not
        refuse_base_config(args.config)
    overrides = list(args.overrides)
    if getattr(args, "resume", False):
        overrides.append("resume=true")
    if getattr(args, "overwrite", False):
        overrides.append("run.overwrite=true")
    if getattr(args, "step", None) is not None:
        overrides.append(f"resume_step={args.step}")
    return _checked(load_config(args.config, overrides))


def _checked(cfg):
    """``cfg`` after the registries' checks (:func:`jax_rl.learner.correction.check_config`: what the correction mode
    and its old-logit route allow), so a refused combination is one line and exit 2 before anything runs."""
    from jax_rl.learner.correction import check_config  # lazy: imports jax (the platform is chosen in main first)

    cfg = check_config(cfg)
    # JAX_PLATFORMS names a backend this host lacks: one line, exit 2 (BackendUnavailable). Not on a process of
    # a multi-process run: starting the backend here would come before jax.distributed.initialize (refused)
    if not multiprocess_start(cfg.runtime):
        require_backend()
    return cfg


class _VersionAction(argparse.Action):
    """``--version``: jax-rl, jax and jaxlib, the backend JAX starts here (``JAX_PLATFORMS`` honoured) and
    its devices, one per line (:func:`jax_rl.compile.chips.backend_report`); an absent backend is one ``backend:
    error: ...`` line, exit 0. Imports jax only when asked."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from jax_rl.compile.chips import backend_report, format_report  # lazy: imports jax, starts its backend

        print(format_report(backend_report()), flush=True)
        parser.exit()


def cmd_train(args) -> int:
    cfg = _load(args)
    if args.print_config:  # the resolved config (base_config chain + overrides), then exit
        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
        return 0
    from jax_rl.learner.advantages import check_group_size  # lazy: imports jax (the platform is chosen first)

    try:
        check_group_size(cfg.algo)  # a config that cannot learn: one line, exit 2 (the dry run too)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if args.dry_run:
        from jax_rl.runtime.dry_run import run_dry_run  # lazy: jax, flax

        return run_dry_run(cfg)
    check_writable(cfg)
    from jax_rl.runtime.train import run_train  # lazy: jax, flax, orbax

    return run_train(cfg)


def cmd_sft(args) -> int:
    cfg = _load(args)
    check_writable(cfg)
    from jax_rl.runtime.train import run_sft  # lazy: jax, flax, orbax

    return run_sft(cfg)


def cmd_eval(args) -> int:
    refuse_base_config(args.config)
    cfg = _checked(load_config(args.config, list(args.overrides)))
    from jax_rl.runtime.train import run_eval  # lazy: jax, flax, orbax

    return run_eval(cfg, args.checkpoint_dir)


def cmd_serve(args) -> int:
    from jax_rl.runtime.serve import main as serve_main  # lazy: jax and JetStream's gRPC server

    return serve_main(args)


def cmd_export(args) -> int:
    from jax_rl.export import ExportError, export_checkpoint  # lazy: jax, orbax

    try:
        info = export_checkpoint(args.checkpoint, args.out_dir, dtype=args.dtype)
    except ExportError as e:
        print(f"jax-rl: error: {e}", file=sys.stderr)
        return 2
    print(f"jax-rl export: {args.out_dir} (checkpoint {info['step']}, version {info['version']}, "
          f"{info['dtype']}; files: {', '.join(info['files'])})")
    return 0


def cmd_compile(args) -> int:
    refuse_base_config(args.config)
    cfg = _checked(load_config(args.config, list(args.overrides)))
    if args.json:  # the report is written after minutes of compiling: a path that cannot take it fails first
        check_writable_file("--json", args.json)
    if not libtpu_available():
        print("jax-rl: error: compiling for a TPU needs libtpu: pip install -e '.[tpu]'", file=sys.stderr)
        return 2
    from jax_rl.compile import FUNCTIONS, run_compile  # lazy: jax, libtpu

    try:
        return run_compile(cfg, args.topology, json_path=args.json, functions=tuple(args.functions or ()) or FUNCTIONS,
                           cost=not args.no_cost)
    except ValueError as e:  # an unknown topology name
        if isinstance(e, ConfigError):
            raise
        print(f"jax-rl: error: --topology {args.topology}: {e}", file=sys.stderr)
        return 2


def cmd_plot(args) -> int:
    group_by = [k.strip() for k in args.group_by.split(",") if k.strip()] if args.group_by else None
    if group_by:  # a misspelt key would group every run as "key=?" (one silent group): refuse it by name
        valid = _valid_keys()
        leaves = [v for v in valid if not any(w.startswith(v + ".") for w in valid)]
        for k in group_by:
            if k not in valid and not any(k.startswith(v + ".") for v in leaves):  # env.retail.num_users: a dict knob
                raise ConfigError(f"--group-by {k}: not a config key{_suggest(k)}")
    for d in args.run_dirs:
        p = Path(d)
        if not p.exists():
            raise FileNotFoundError(f"run dir not found: {d}")
        run = p.parent if p.is_file() else p  # a run's metrics.jsonl may be given for its dir
        if not (run / "metrics.jsonl").is_file():
            print(f"jax-rl: error: {d} holds no metrics.jsonl: not a run dir (give the run.dir of a `jax-rl train`)",
                  file=sys.stderr)
            return 2
    if not args.out:  # a reader never writes into a run dir (it may be live): the figures go under ./plots/
        first = Path(args.run_dirs[0])
        args.out = str(Path("plots") / (first.parent if first.is_file() else first).resolve().name)
    if args.out:  # a file there, or a dir that cannot be made: one line naming --out
        out = Path(args.out)
        if out.exists() and not out.is_dir():
            raise ConfigError(f"--out {args.out}: is a file, not a directory")
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"--out {args.out}: cannot make the directory ({e.strerror or type(e).__name__})") from None
    paths = plot_runs(args.run_dirs, out_dir=args.out, group_by=group_by)
    for p in paths:
        print(p)
    return 0


def _add_train_parser(sub: argparse._SubParsersAction) -> None:
    """The ``train`` subcommand. SFT warm start then async RL: the config, its overrides, --resume / --step,
    --overwrite, --print-config, --dry-run."""
    t = sub.add_parser("train", help="SFT warm start (sft.steps) then async RL", epilog=EPILOG)
    t.add_argument("config", help="YAML config, e.g. configs/tiny_cpu.yaml")
    t.add_argument("overrides", nargs="*", default=[], help="key.sub=value overrides")
    t.add_argument("--resume", action="store_true", help="continue from the newest good checkpoint in run.dir")
    t.add_argument("--step", type=int, default=None, metavar="N",
                   help="with --resume: resume from checkpoints/N (the RL step) instead of the newest")
    t.add_argument("--overwrite", action="store_true",
                   help="run.dir already holds a run (finished or not) and this is not a --resume: delete that "
                        "run's files and start over (run.overwrite=true); without it such a run dir is refused")
    t.add_argument("--print-config", action="store_true",
                   help="print the resolved config (base_config chain + overrides) as YAML and exit; creates nothing")
    t.add_argument("--dry-run", action="store_true",
                   help="build tokenizer, model, mesh and learner, check the KV cache fits, compile one train "
                        "step, print param count / KV-cache bytes / batch shape and exit; creates no run dir")
    t.set_defaults(func=cmd_train)


def _add_sft_parser(sub: argparse._SubParsersAction) -> None:
    """The ``sft`` subcommand. SFT on reference-solver demonstrations only: the config, its overrides, --overwrite."""
    s = sub.add_parser("sft", help="SFT on reference-solver demonstrations only", epilog=EPILOG)
    s.add_argument("config", help="YAML config, e.g. configs/tiny_cpu.yaml (sft.steps must be > 0)")
    s.add_argument("overrides", nargs="*", default=[], help="key.sub=value overrides")
    s.add_argument("--overwrite", action="store_true",
                   help="run.dir already holds a run: delete that run's files and start over (run.overwrite=true)")
    s.set_defaults(func=cmd_sft)


def _add_eval_parser(sub: argparse._SubParsersAction) -> None:
    """The ``eval`` subcommand. Held-out avg@k / pass@k of a checkpoint: the checkpoint, the config, its overrides."""
    e = sub.add_parser("eval", help="held-out avg@k / pass@k of a checkpoint", epilog=EPILOG)
    e.add_argument("checkpoint_dir", help="a run dir, its checkpoints/ dir, or one step's dir checkpoints/N")
    e.add_argument("config", help="YAML config giving the eval and env settings (model, correction and "
                                  "staleness come from the run's config.yaml when it has one)")
    e.add_argument("overrides", nargs="*", default=[], help="key.sub=value overrides, e.g. eval.num_tasks=16 eval.k=4")
    e.set_defaults(func=cmd_eval)


def _add_export_parser(sub: argparse._SubParsersAction) -> None:
    """The ``export`` subcommand. Write a run's checkpoint as a Hugging Face dir: the checkpoint, the output dir, --dtype."""
    x = sub.add_parser("export", help="write a run's checkpoint as a Hugging Face dir (transformers, jax-rl serve)",
                       description="Export a checkpoint to OUT_DIR: config.json, model.safetensors, tokenizer.json "
                                   "and jax_rl_export.json. The model comes from the run's config.yaml.")
    x.add_argument("checkpoint", help="a run dir (latest checkpoint), its checkpoints/ dir, or checkpoints/N")
    x.add_argument("out_dir", help="new or empty output directory (refused if it holds anything)")
    x.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="storage dtype of the weights (default float32, the learner's master copy)")
    x.set_defaults(func=cmd_export)


def _add_serve_parser(sub: argparse._SubParsersAction) -> None:
    """The ``serve`` subcommand. The JetStream gRPC server for a checkpoint: bind address, port, tokenizer,
    slots, cache length, dtype, temperature, K/V layout and page size (``rollout.kv_layout`` /
    ``rollout.kv_page_size``'s defaults)."""
    v = sub.add_parser("serve", help="JetStream gRPC server for a checkpoint (127.0.0.1 by default)",
                       description="Serve a checkpoint over JetStream's gRPC Orchestrator API. A port already "
                                   "in use ends with one line naming it (exit 1).")
    v.add_argument("checkpoint", help="HF checkpoint dir (config.json + safetensors, e.g. from `jax-rl export`) "
                                      "or preset:NAME (random init, smoke tests)")
    v.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1; anything else exposes the unauthenticated server)")
    v.add_argument("--port", type=int, default=9000, help="TCP port (default 9000; 0 = a free port, printed)")
    v.add_argument("--tokenizer", default=None,
                   help="tokenizer.json path or 'compact' (default: CHECKPOINT/tokenizer.json, else the compact "
                        "demo tokenizer; the server prints which)")
    v.add_argument("--slots", type=int, default=4, help="concurrent decode slots (requests served at once; default 4)")
    v.add_argument("--max-len", type=int, default=256,
                   help="KV-cache length per slot in tokens, prompt + generated (default 256)")
    v.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="compute and KV-cache dtype (default float32)")
    v.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature for every request (default 0 = greedy)")
    kv = RolloutConfig.model_fields
    v.add_argument("--kv-layout", default=kv["kv_layout"].default, choices=list(typing.get_args(kv["kv_layout"].annotation)),
                   help=f"the engine's K/V layout, as rollout.kv_layout (default {kv['kv_layout'].default}: a pool of "
                        "slots x ceil(max-len / kv-page-size) pages, each slot taking the pages its positions reach; "
                        "contiguous: max-len positions reserved per slot)")
    v.add_argument("--kv-page-size", type=int, default=kv["kv_page_size"].default,
                   help=f"positions per K/V page with --kv-layout paged, as rollout.kv_page_size (default "
                        f"{kv['kv_page_size'].default})")
    v.set_defaults(func=cmd_serve)


def _add_compile_parser(sub: argparse._SubParsersAction) -> None:
    """The ``compile`` subcommand. AOT-compile the run's programs for a TPU topology: config, overrides,
    --topology, --json, --only, --no-cost."""
    c = sub.add_parser("compile", help="AOT-compile the run's programs for a TPU topology on this host (libtpu): "
                                       "HBM per chip, FLOPs, roofline",
                       description="Compile the learner train step, the SFT step, the rollout prefill / decode "
                                   "steps, the publish's weight_sync reshard, (placement.scorer) the scorer's "
                                   "score_step and (placement.user) the tau² user model's user_prefill / "
                                   "user_decode_step of CONFIG for a TPU topology with libtpu's compiler, nothing allocated, "
                                   "and print per-chip HBM (fits or not), compile seconds, FLOPs and bytes per "
                                   "step, the roofline step time and the MFU bound. Compile-time estimates, not "
                                   "measurements. Exit 0 if every program fits in HBM, 1 if one does not.",
                       epilog=EPILOG)
    c.add_argument("config", help="YAML config, e.g. configs/qwen3_4b.yaml")
    c.add_argument("overrides", nargs="*", default=[], help="key.sub=value overrides, e.g. mesh.tensor=8 optim.microbatches=16")
    c.add_argument("--topology", required=True, metavar="NAME",
                   help="Cloud TPU type (v5e-8, v5p-8, v5p-64, v6e-8, v4-16) or topology (v5p:4x4x4, v5e:2x2)")
    c.add_argument("--json", default=None, metavar="PATH",
                   help="also write the figures as JSON: a list with one object per compiled function")
    c.add_argument("--only", dest="functions", action="append", default=None,
                   choices=["train_step", "sft_step", "prefill", "append_prefill", "decode_step", "weight_sync",
                            "score_step", "user_prefill", "user_decode_step"],
                   help="compile only this function (repeatable; default: all of them; append_prefill: an "
                        "agent turn's new tokens appended to every slot's kept K/V; weight_sync: a "
                        "publish's reshard, learner params -> the rollout engine's dtype and layout; score_step: "
                        "the dedicated old-logit scorer's forward, with placement.scorer only; user_prefill / "
                        "user_decode_step: the tau² user model's engine, with placement.user only)")
    c.add_argument("--no-cost", action="store_true",
                   help="skip the cost pieces (FLOPs / bytes / roofline): memory and compile time only, faster")
    c.set_defaults(func=cmd_compile)


def _add_plot_parser(sub: argparse._SubParsersAction) -> None:
    """The ``plot`` subcommand. Training-dynamics PNGs for run dirs: the run dirs, --out, --group-by."""
    pl = sub.add_parser("plot", help="training-dynamics PNGs for one or more run dirs")
    pl.add_argument("run_dirs", nargs="+", help="run dirs holding metrics.jsonl")
    pl.add_argument("--out", default=None,
                    help="output dir (default: ./plots/<first run's dir name>: a reader never writes into a run dir)")
    pl.add_argument("--group-by", default=None, metavar="KEYS",
                    help="comma-separated config keys, e.g. loss.correction,async.max_staleness: also "
                         "groups.png, the mean +- std band over the runs of each group (seeds), with "
                         "EWMA reset markers")
    pl.set_defaults(func=cmd_plot)


def build_parser() -> argparse.ArgumentParser:
    """The ``jax-rl`` argument parser: ``--version`` and one subcommand each (train, sft, eval, export, serve,
    compile, plot), each added by its ``_add_<name>_parser``."""
    p = argparse.ArgumentParser(prog="jax-rl", description="Asynchronous RL for LLM agents in JAX.")
    p.add_argument("--version", action=_VersionAction,
                   help="print jax-rl, jax and jaxlib versions, the JAX backend and its devices, and exit")
    sub = p.add_subparsers(dest="command", required=True)
    _add_train_parser(sub)
    _add_sft_parser(sub)
    _add_eval_parser(sub)
    _add_export_parser(sub)
    _add_serve_parser(sub)
    _add_compile_parser(sub)
    _add_plot_parser(sub)
    return p


def _flag_to_end(argv: list[str], flag: str) -> list[str]:
    """Move ``flag VALUE`` / ``flag=VALUE`` to the end, so it may come between overrides."""
    rest, moved, i = [], [], 0
    while i < len(argv):
        if argv[i] == flag and i + 1 < len(argv):
            moved += argv[i:i + 2]
            i += 2
            continue
        (moved if argv[i].startswith(flag + "=") else rest).append(argv[i])
        i += 1
    return rest + moved


def main(argv: Optional[list[str]] = None) -> int:
    # libtpu installed (the tpu/test extras) on a host without a TPU: use the CPU without
    # libtpu's initialisation errors; a TPU VM (or JAX_PLATFORMS set) is left alone
    cpu_unless_tpu_present()
    argv = list(sys.argv[1:] if argv is None else argv)
    # ``--resume`` (and the other train switches) may come anywhere (``train CONFIG --resume run.dir=D``):
    # argparse would take what follows them for an unknown argument, so move the flags to the end
    flags = ("--resume", "--print-config", "--dry-run", "--no-cost", "--overwrite")
    argv = [a for a in argv if a not in flags] + [a for a in argv if a in flags]
    for flag in ("--step", "--topology", "--json", "--only"):
        argv = _flag_to_end(argv, flag)
    args = build_parser().parse_args(argv)
    try:
        return _dispatch(args)
    except Exception as e:  # a multi-process run whose peer is gone: one line naming it, no hang at exit
        _exit_if_peer_lost(e)
        raise


def _exit_if_peer_lost(e: BaseException) -> None:
    """Multi-process (``jax.distributed``): when ``e`` ended the run because a peer process is gone (a
    :class:`jax_rl.collectives.PeerLostError`, e.g. a :class:`jax_rl.weight_sync.WeightSyncError`, or a collective
    whose peer closed the connection), print ONE
    line naming the lost process(es) and leave with exit code 3 at once (``os._exit``: jax's exit-time shutdown
    barrier would wait for the dead peer). The lost processes are the ones the ``jax.distributed`` coordination
    service no longer lists as alive (the coordinator's own loss: process 0). Returns otherwise."""
    jx = sys.modules.get("jax")
    ws = sys.modules.get("jax_rl.collectives")
    if jx is None:
        return
    try:
        from jax._src import distributed

        client = distributed.global_state.client
        if client is None or jx.process_count() < 2:
            return
        n, me = jx.process_count(), jx.process_index()
    except Exception:  # noqa: BLE001 - no distributed runtime: nothing to name
        return
    text = " ".join(str(e).split())
    peerish = (ws is not None and isinstance(e, ws.PeerLostError)) or any(
        k in text for k in ("Connection closed by peer", "Connection reset", "UNAVAILABLE", "heartbeat", "Gloo"))
    if not peerish:
        return
    lost: list = []
    if not (ws is not None and isinstance(e, ws.PeerLostError)):  # (that one names its peer already)
        got: list = []

        def ask() -> None:  # a collective over the live processes: returns once the dead are known to the service
            try:
                live = set(client.get_live_nodes(list(range(n))))
                got.append([q for q in range(n) if q not in live])
            except Exception:  # noqa: BLE001 - the coordination service itself is gone: process 0 was lost
                got.append([0] if me != 0 else [])

        t = threading.Thread(target=ask, daemon=True)
        t.start()
        t.join(timeout=10.0)  # the service has not noticed yet (its heartbeat timeout): do not wait for it
        lost = got[0] if got else []
    others = [q for q in range(n) if q != me]
    if lost or len(others) == 1:  # two processes: the collective's only peer is the lost one
        what = f"lost peer process(es) {lost or others}: "
    else:
        what = f"a peer among process(es) {others} is lost: "
    print(f"jax-rl: error: {what}{text[:300]} (process {me} stops; relaunch every process with resume=true)",
          file=sys.stderr, flush=True)
    os._exit(3)


def _dispatch(args) -> int:
    """Run the subcommand; the one-line errors and their exit codes (:func:`main`)."""
    try:
        rc = args.func(args)
    except ConfigError as e:
        print(f"jax-rl: config error: {e}", file=sys.stderr)
        return 2
    except BackendUnavailable as e:  # JAX_PLATFORMS=cuda on a host without a GPU: the platform, one line
        print(f"jax-rl: error: {e}", file=sys.stderr)
        return 2
    except ImportError as e:  # a broken or partial install: say which module and the command that fixes it
        print(f"jax-rl: error: cannot import {e.name or 'a module'}: {e} ({install_fix(e.name)})", file=sys.stderr)
        return 1
    except RuntimeError as e:  # non-finite training (optim.max_skipped_steps in a row), Ray failing: one line, exit 1
        rd = sys.modules.get("jax_rl.runtime.run_dir")
        if rd and isinstance(e, rd.RunDirHeldError):  # another live train / sft holds run.dir: exit 2, nothing touched
            print(f"jax-rl: error: {e}", file=sys.stderr)
            return 2
        lrn = sys.modules.get("jax_rl.learner.learner")
        rr = sys.modules.get("jax_rl.runtime.ray_runtime")
        ck = sys.modules.get("jax_rl.checkpoint")  # a save that did not commit: the step and its dir
        if not ((lrn and isinstance(e, lrn.NonFiniteTrainingError)) or (rr and isinstance(e, rr.RayFailure))
                or (ck and isinstance(e, ck.CheckpointCommitError))):
            raise
        print(f"jax-rl: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # a second Ctrl-C: stop without the checkpoint
        print("jax-rl: interrupted", file=sys.stderr)
        return 130
    except (OSError, ValueError) as e:  # a missing / incompatible / corrupt input, a full disk: one line
        # the checkpoint errors can only exist once jax_rl.checkpoint is imported; looking them
        # up here keeps that 2 s import (orbax) off the start of every command
        ckpt = sys.modules.get("jax_rl.checkpoint")
        if ckpt and isinstance(e, ckpt.CheckpointDiskFullError):
            print(f"jax-rl: error: {e}", file=sys.stderr)
            return 1
        denied = _unwritable(e)
        if denied is not None:  # a read-only dir or file: the path, not a traceback
            print(f"jax-rl: error: cannot write {denied.filename or 'a path'}: {denied.strerror or denied}",
                  file=sys.stderr)
            return 2
        hf = sys.modules.get("jax_rl.models.hf_io")
        ex = sys.modules.get("jax_rl.export")
        bad_input = isinstance(e, FileNotFoundError) or (
            ckpt and isinstance(e, (ckpt.CheckpointMismatchError, ckpt.CheckpointCorruptError))) or (
            hf and isinstance(e, hf.CheckpointError)) or (ex and isinstance(e, ex.ExportError))
        if not bad_input:
            raise
        print(f"jax-rl: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    return int(rc or 0)


def install_fix(module: Optional[str]) -> str:
    """The command that installs a missing ``module`` (the ImportError line's advice)."""
    top = (module or "").split(".")[0]
    if top in ("jetstream", "seqio"):  # only `jax-rl serve` imports JetStream (rollout/jetstream_compat.py)
        return "jax-rl serve needs JetStream, installed apart: pip install --no-deps google-jetstream==0.2.2"
    return ("a broken or partial install: pip install --force-reinstall jax-rl (in a checkout: pip install -e . "
            "with the extras the command needs)")


def _unwritable(e: Optional[BaseException]) -> Optional[OSError]:
    """The write refused by permissions or a read-only file system in ``e`` or its causes (Orbax
    wraps them), else None."""
    for _ in range(8):
        if e is None:
            return None
        if isinstance(e, OSError) and e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return e
        e = e.__cause__ or e.__context__
    return None


def entry() -> None:
    """Console-script entry point (``jax-rl``): :func:`main`, then exit with its code."""
    sys.exit(main())


if __name__ == "__main__":
    entry()
