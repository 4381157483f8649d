"""``jax-rl serve CHECKPOINT``: JetStream 0.2.2 gRPC serving of a checkpoint with our engine.

JetStream's orchestrator ``Driver`` (prefill / transfer / generate / detokenize threads) runs a
:class:`rollout.engine.Qwen3Engine`; its ``LLMOrchestrator`` servicer is mounted on a gRPC
``aio`` server that WE construct, because ``jetstream.core.server_lib`` hard-codes the bind
address ``[::]`` (all interfaces). We bind ``--host`` (default 127.0.0.1) only.

Any client of JetStream's ``Orchestrator.Decode`` works: a ``token_content`` request streams back
token ids, a ``text_content`` request token ids + text. Decoding is greedy by default;
``--temperature T`` (> 0) samples every request at T (JetStream 0.2.2's proto has no per-request
sampling fields and no log-probs). A request stops at ``<|im_end|>`` / ``<|endoftext|>`` or after
``max_tokens``.

The engine's K/V layout is ``--kv-layout`` (default ``rollout.kv_layout``'s, paged: one pool of
``slots x ceil(max_len / kv_page_size)`` pages, JetStream's ``insert`` taking a slot's pages for its prompt and
``generate`` the next page as a slot crosses a page boundary; ``contiguous``: ``max_len`` positions reserved per
slot). Both give the same tokens (fp32; :func:`build_engine`).

CHECKPOINT is an HF-format directory (config.json + safetensors, loaded with
``jax_rl.models.hf_io.load_pretrained``; ``jax-rl export`` writes one from a run) or
``preset:NAME`` (random init of a model preset, seed 0; for smoke tests). The tokenizer is
``--tokenizer`` or the checkpoint dir's tokenizer.json, else the compact demo tokenizer; the
server prints which one it uses.

The port is bound without ``SO_REUSEPORT``: a port already held (by another ``jax-rl serve`` or
any program) ends the command with one line naming it and exit code 1, before the model is
compiled.

SIGTERM / SIGINT stop the Driver threads and the gRPC server gracefully (exit code 0). Note
that JetStream's Driver SIGKILLs the whole process if one of its threads raises.

An application over the rollout engine, beside the training runtimes (it reads the config, the memory
budget of :mod:`jax_rl.runtime.resources` and the engine), so it lives here rather than in ``rollout/``,
which the config and the runtimes sit above (no import runs from a lower level up).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import logging
import math
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
from flax import nnx

from jax_rl.config import ModelConfig, RolloutConfig
from jax_rl.models import hf_io, qwen3 as q
from jax_rl.models.qwen3 import count_params, resolve_attention
from jax_rl.models.qwen3.config import PRESETS
from jax_rl.models.tokenizer import load_tokenizer
from jax_rl.runtime.resources import available_memory_bytes
from rollout import jetstream_compat as jc
from rollout.engine import EngineSpec, Qwen3Engine
from rollout.engine.layouts import kv_layout_class

__all__ = ["JetStreamGrpcServer", "PortInUseError", "build_engine", "check_port_free", "load_checkpoint",
           "resolve_tokenizer", "serve", "main", "ServeArgError", "check_args", "check_checkpoint"]

log = logging.getLogger(__name__)


def _default_scan_layers() -> bool:
    return bool(ModelConfig().scan_layers)


def load_checkpoint(checkpoint: str, *, scan_layers: Optional[bool] = None) -> tuple[Any, Any]:
    """``(Qwen3Config, params nnx.State)`` of an HF dir or ``preset:NAME`` (random init, seed 0).

    ``scan_layers`` (default: ``model.scan_layers``'s default): the params hold the decoder
    layers stacked [L, ...] (``params["layers"][name]``; a mixed dense/MoE stack stays unrolled),
    else one subtree per layer; give the same value to :class:`Qwen3Engine`'s ``model_kwargs``.

    Raises:
      FileNotFoundError: no such directory. ImportError: hf_io not available.
    """
    scan = _default_scan_layers() if scan_layers is None else bool(scan_layers)
    if checkpoint.startswith("preset:"):
        cfg = q.get_preset(checkpoint.split(":", 1)[1])
        model = q.Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0), scan_layers=scan)
        return cfg, nnx.state(model, nnx.Param)
    if not Path(checkpoint).is_dir():
        raise FileNotFoundError(f"checkpoint dir not found: {checkpoint}")
    out = hf_io.load_pretrained(checkpoint, scan_layers=scan)
    return config_and_params(out)


def config_and_params(out: Any) -> tuple[Any, Any]:
    """Normalise what ``hf_io.load_pretrained`` returns: a model, or a tuple holding a model /
    a config and params."""
    if isinstance(out, nnx.Module):
        return out.config, nnx.state(out, nnx.Param)
    if isinstance(out, (tuple, list)):
        models = [o for o in out if isinstance(o, nnx.Module)]
        if models:
            return models[0].config, nnx.state(models[0], nnx.Param)
        cfgs = [o for o in out if hasattr(o, "to_hf")]
        rest = [o for o in out if not hasattr(o, "to_hf")]
        if cfgs and rest:
            return cfgs[0], rest[0]
    raise TypeError(f"unexpected load_pretrained result of type {type(out).__name__}")


class PortInUseError(RuntimeError):
    """The serve address is already bound (by another server or program)."""


def check_port_free(host: str, port: int) -> None:
    """Fail fast, before the model compiles, if ``host:port`` cannot be bound.

    Binds a throw-away socket the way gRPC does (``SO_REUSEADDR``, no ``SO_REUSEPORT``), so a port
    with a live listener fails and one in TIME_WAIT does not. ``port=0`` is always free.

    Raises:
      PortInUseError: the port is held (the message names host and port).
      ServeArgError: the host is not an address of this machine, or the port needs privileges.
    """
    if int(port) == 0:
        return
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(fam, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host.strip("[]"), int(port)))
        except OSError as e:
            if e.errno == errno.EADDRNOTAVAIL:
                raise ServeArgError(f"--host {host}: not an address of this machine ({e.strerror})") from None
            if e.errno in (errno.EACCES, errno.EPERM):
                raise ServeArgError(f"--port {port}: not allowed on {host} ({e.strerror}; ports < 1024 need "
                                    "privileges)") from None
            raise PortInUseError(f"cannot serve on {host}:{port}: port {port} is in use ({e.strerror})") from e


def resolve_tokenizer(checkpoint: str, tokenizer: Optional[str]) -> tuple[Any, str]:
    """``(tokenizer, description)``: ``--tokenizer`` if given, else ``CHECKPOINT/tokenizer.json``,
    else the compact demo tokenizer; the description says which, and why for the fallback.

    Raises:
      FileNotFoundError: ``tokenizer`` names a missing file.
    """
    if tokenizer:
        return load_tokenizer(tokenizer), f"tokenizer {tokenizer} (--tokenizer)"
    p = Path(checkpoint)
    if p.is_dir() and (p / "tokenizer.json").is_file():
        return load_tokenizer(p), f"tokenizer {p / 'tokenizer.json'}"
    where = f"no tokenizer.json in {checkpoint}" if p.is_dir() else f"{checkpoint} has no tokenizer"
    return load_tokenizer("compact"), f"the compact demo tokenizer ({where}; pass --tokenizer PATH to change)"


def _load_tokenizer(checkpoint: str, tokenizer: Optional[str]) -> Any:
    return resolve_tokenizer(checkpoint, tokenizer)[0]


class _ServingEngine(Qwen3Engine):
    """Qwen3Engine that never raises on an empty request (a raise would SIGKILL the server)."""

    def prefill(self, *, params, existing_prefix=None, padded_tokens, true_length, seed=None, temperature=None):
        toks = np.asarray(padded_tokens).reshape(-1)[: int(true_length)]
        toks = toks[toks >= 0][-(self.max_cache_len - 1):]  # drop BOS placeholder, keep the tail
        if len(toks) == 0:
            toks = np.asarray([self.tokenizer.eos_id if self.tokenizer is not None else 0])
        return super().prefill(params=params, padded_tokens=toks, true_length=len(toks), seed=seed, temperature=temperature)


def build_engine(checkpoint: str, *, tokenizer: Any = None, slots: int = 4, max_len: int = 256,
                 dtype: str = "float32", temperature: float = 0.0,
                 scan_layers: Optional[bool] = None, kv_layout: Optional[str] = None,
                 kv_page_size: Optional[int] = None) -> Qwen3Engine:
    """Engine for serving: loaded params, tokenizer, compiled (one warm-up prefill + insert + generate).

    ``tokenizer``: a path / ``'compact'`` / None (see :func:`resolve_tokenizer`) or a loaded tokenizer.
    ``max_len``: KV-cache length in tokens (prompt + generated); ``temperature`` 0 = greedy.
    ``scan_layers`` (default: ``model.scan_layers``'s default): the engine's decoder layers are
    stacked and scanned; prefill attention is ``auto`` (splash on a TPU backend, else xla).
    ``kv_layout`` / ``kv_page_size`` (None: ``rollout.kv_layout`` / ``rollout.kv_page_size``'s defaults, paged
    and 16): the engine's K/V layout (:data:`rollout.engine.layouts.KV_LAYOUTS`). Paged, the pool holds
    ``slots x ceil(max_len / kv_page_size)`` pages (every slot's ``max_len``, as contiguous reserves: JetStream's
    Driver never frees a slot, so a finished request's slot decodes on until its next insert), JetStream's
    ``insert`` takes a slot's pages as its prompt needs them and ``generate`` the next one as a slot crosses a
    page boundary (:meth:`rollout.engine.paged.PagedLayout.insert`).

    Raises:
      ValueError: an unknown ``kv_layout``; ServeArgError: the engine does not fit in memory."""
    scan = _default_scan_layers() if scan_layers is None else bool(scan_layers)
    kv_defaults = RolloutConfig.model_fields
    kv_layout = kv_defaults["kv_layout"].default if kv_layout is None else str(kv_layout)
    page = int(kv_defaults["kv_page_size"].default if kv_page_size is None else kv_page_size)
    layout = kv_layout_class(kv_layout)
    cfg, params = load_checkpoint(checkpoint, scan_layers=scan)
    check_engine_fits(cfg, slots=slots, max_len=max_len, dtype=dtype,
                      positions=-(-max_len // page) * page if layout.pooled else None)
    tok = _load_tokenizer(checkpoint, tokenizer) if tokenizer is None or isinstance(tokenizer, str) else tokenizer
    mp = 16
    while mp * 2 <= max(16, max_len - 1):
        mp *= 2
    spec = EngineSpec(slots=slots, max_cache_len=max_len, max_prefill_length=mp, dtype=dtype, temperature=temperature,
                      model_kwargs=dict(scan_layers=scan, attention=resolve_attention("auto")), kv_layout=kv_layout,
                      kv_page_size=page)
    eng = _ServingEngine(cfg, params, spec, tokenizer=tok)
    st = eng.init_decode_state()
    st = eng.insert(eng.prefill_tokens(eng.params, [0, 1], seed=0), st, 0)
    st, res = eng.generate(eng.params, st)
    np.asarray(res.data)
    return eng


class JetStreamGrpcServer:
    """JetStream's ``LLMOrchestrator`` on a ``grpc.aio`` server bound to ``host:port`` only.

    Mirrors ``jetstream.core.server_lib.JetStreamServer`` (an asyncio loop in a thread), minus the
    hard-coded ``[::]``. ``port=0`` picks a free port; :attr:`port` is the bound one.

    The port is bound with ``grpc.so_reuseport=0`` (gRPC's default allows ``SO_REUSEPORT``, which
    let a second server share the port and both report success).

    Raises:
      PortInUseError: the address could not be bound (the message names host and port).
    """

    def __init__(self, driver: Any, host: str = "127.0.0.1", port: int = 9000, threads: int = 16) -> None:
        import grpc

        orch = jc.orchestrator()
        pb2_grpc = jc.jetstream_pb2_grpc()
        self._driver = driver
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=threads)
        self._loop = asyncio.new_event_loop()
        self._loop.set_default_executor(self._executor)
        self._loop_thread = threading.Thread(target=self._loop.run_forever, name="grpc-loop", daemon=True)
        self._loop_thread.start()

        async def make():
            return grpc.aio.server(self._executor, options=[("grpc.so_reuseport", 0)])

        self._server = asyncio.run_coroutine_threadsafe(make(), self._loop).result()
        pb2_grpc.add_OrchestratorServicer_to_server(orch.LLMOrchestrator(driver=driver), self._server)
        addr_host = f"[{host}]" if ":" in host and not host.startswith("[") else host
        try:
            bound = self._server.add_insecure_port(f"{addr_host}:{port}")
        except RuntimeError as e:
            bound = 0
            err = e
        else:
            err = None
        if not bound:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop_thread.join(10)
            self._executor.shutdown(wait=False)
            raise PortInUseError(f"cannot serve on {addr_host}:{port}: the port is in use or not bindable"
                                 + (f" ({err})" if err else "")) from err
        self.host, self.port = host, int(bound)
        self._stopped = False

    def start(self) -> "JetStreamGrpcServer":
        asyncio.run_coroutine_threadsafe(self._server.start(), self._loop).result()
        return self

    def stop(self, grace: float = 5.0) -> None:
        """Stop the Driver threads, then the gRPC server and its loop. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._driver.stop()
        asyncio.run_coroutine_threadsafe(self._server.stop(grace=grace), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop_thread.join(10)
        self._executor.shutdown(wait=False, cancel_futures=True)


def serve(engine: Qwen3Engine, *, host: str = "127.0.0.1", port: int = 9000, threads: Optional[int] = None) -> JetStreamGrpcServer:
    """Start a JetStream Driver (interleaved mode: one engine prefills and generates) and the
    gRPC server. Returns the started server; call ``.stop()`` to shut down."""
    orch = jc.orchestrator()
    driver = orch.Driver(
        prefill_engines=[engine],
        generate_engines=[engine],
        prefill_params=[engine.params],
        generate_params=[engine.params],
        interleaved_mode=True,
        jax_padding=False,
    )
    try:
        server = JetStreamGrpcServer(driver, host, port, threads or max(16, 2 * engine.max_concurrent_decodes))
    except Exception:
        driver.stop()
        raise
    return server.start()


class ServeArgError(ValueError):
    """A bad ``jax-rl serve`` argument or checkpoint (one line naming it; exit code 2)."""


def check_args(args: Any) -> None:
    """The arguments of ``jax-rl serve`` checked before anything is loaded or compiled.

    Raises:
        ServeArgError: naming the flag and its value: ``--port`` outside 0..65535, ``--slots`` < 1,
            ``--max-len`` < 2, ``--temperature`` negative or not finite, an unknown ``--kv-layout``, ``--kv-page-size`` outside
            1..``--max-len``, ``--host`` empty or not an address of this machine.
    """
    port, slots, max_len = int(args.port), int(getattr(args, "slots", 4)), int(getattr(args, "max_len", 256))
    temperature = float(getattr(args, "temperature", 0.0) or 0.0)
    if not 0 <= port <= 65535:
        raise ServeArgError(f"--port {port}: must be 0..65535 (0 = a free port, printed)")
    if slots < 1:
        raise ServeArgError(f"--slots {slots}: must be >= 1 (concurrent decode slots)")
    if max_len < 2:
        raise ServeArgError(f"--max-len {max_len}: must be >= 2 (KV-cache tokens per slot, prompt + generated)")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ServeArgError(f"--temperature {temperature:g}: must be a finite number >= 0 (0 = greedy)")
    layout = getattr(args, "kv_layout", None)
    if layout is not None:
        try:
            kv_layout_class(layout)
        except ValueError as e:
            raise ServeArgError(f"--kv-layout {layout}: {e}") from None
    page = getattr(args, "kv_page_size", None)
    if page is not None and not 1 <= int(page) <= max_len:
        raise ServeArgError(f"--kv-page-size {page}: must be 1..--max-len ({max_len}) positions per K/V page")
    host = str(args.host).strip("[]")
    if not host:
        raise ServeArgError("--host '': give an address to bind, e.g. 127.0.0.1")
    try:
        addrs = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise ServeArgError(f"--host {args.host}: not an address this machine can bind ({e})") from None
    # an address that resolves but is not this machine's (--host 8.8.8.8): a bind on its port 0 (any free
    # port) fails at once, before the model loads (check_port_free binds the given port only, not port 0)
    why = ""
    for fam, kind, proto, _, sa in addrs:
        try:
            with socket.socket(fam, kind, proto) as s:
                s.bind(sa)
            break
        except OSError as e:
            why = e.strerror or str(e)
    else:
        raise ServeArgError(f"--host {args.host}: not an address of this machine ({why})")


def check_engine_fits(model_config: Any, *, slots: int, max_len: int, dtype: str,
                      positions: Optional[int] = None) -> None:
    """The serving engine's allocation, from its arguments alone, against the free memory
    (:func:`jax_rl.runtime.resources.available_memory_bytes`): the weights in ``dtype``, the KV cache
    (layers x ``slots`` x ``positions`` x kv heads x head_dim x 2 x the dtype's bytes; ``positions`` the K/V
    positions a slot's share of the cache holds, None: ``max_len``; the paged pool's: ``max_len`` rounded up
    to whole pages) and the sampling buffers (float32 [slots, vocab] x 2). A lower bound of what the engine
    allocates.

    Raises:
        ServeArgError: naming ``--slots`` and ``--max-len``, the bytes needed and free, and the most
            slots that would fit.
    """
    mc = model_config
    item = 2 if dtype == "bfloat16" else 4
    per_slot = (int(mc.num_hidden_layers) * int(max_len if positions is None else positions) * int(mc.num_key_value_heads) * int(mc.head_dim) * 2 * item
                + 2 * int(mc.vocab_size) * 4)
    params = int(count_params(mc)) * item
    need = params + per_slot * int(slots)
    have, where = available_memory_bytes()
    if need > have:
        fit = max(0, (have - params) // per_slot)
        raise ServeArgError(f"--slots {slots} --max-len {max_len}: the engine needs at least {need:,} bytes (weights "
                            f"{params:,} + {per_slot:,} per slot: KV cache and sampling buffers, {dtype}) but "
                            f"{have:,} bytes of {where} are free; at most {fit} slot(s) of --max-len {max_len} fit")


def check_checkpoint(checkpoint: str) -> None:
    """``CHECKPOINT`` of ``jax-rl serve`` checked before the tokenizer or the model is loaded:
    ``preset:NAME`` names a preset; a path is an HF checkpoint dir (``config.json``). A jax-rl run
    dir (or its ``checkpoints/``) is refused with the ``jax-rl export`` command that makes one.

    Raises:
        ServeArgError: one line naming the checkpoint and what to give instead.
    """
    if checkpoint.startswith("preset:"):
        name = checkpoint.split(":", 1)[1]
        if name not in PRESETS:
            raise ServeArgError(f"checkpoint {checkpoint}: unknown model preset {name!r}; known: {sorted(PRESETS)}")
        return
    p = Path(checkpoint)
    if not p.exists():
        raise ServeArgError(f"checkpoint dir not found: {checkpoint}")
    if not p.is_dir():
        raise ServeArgError(f"checkpoint {checkpoint} is a file: give an HF checkpoint dir (config.json + "
                            "*.safetensors, e.g. from `jax-rl export`) or preset:NAME")
    if (p / "config.json").is_file():
        return
    run_dir = next((d for d in (p, p.parent, p.parent.parent)
                    if (d / "checkpoints").is_dir() or (d / "config.yaml").is_file()), None)
    if run_dir is not None:
        raise ServeArgError(f"{checkpoint} is a jax-rl run's checkpoint, not an HF export: run "
                            f"`jax-rl export {checkpoint} OUT_DIR`, then `jax-rl serve OUT_DIR`")
    raise ServeArgError(f"no config.json in {checkpoint}: serve takes an HF checkpoint dir (config.json + "
                        "*.safetensors, e.g. from `jax-rl export`) or preset:NAME")


def main(args: Any) -> int:
    """Entry point of ``jax-rl serve`` (``args``: checkpoint, host, port, tokenizer, slots, max_len,
    dtype; optional temperature, scan_layers (None: the ``model.scan_layers`` default), kv_layout and
    kv_page_size (None: ``rollout.kv_layout`` / ``rollout.kv_page_size``'s defaults)). Blocks until
    SIGTERM/SIGINT; returns the exit code: 0 after a clean stop, 1 when the port is in use, 2 for a
    bad argument, checkpoint or tokenizer (:func:`check_args`, :func:`check_checkpoint`); each error
    is one line on stderr naming the culprit."""
    logging.basicConfig(level=logging.WARNING)
    t0 = time.monotonic()
    temperature = float(getattr(args, "temperature", 0.0) or 0.0)
    try:  # bad arguments, paths and files: one line, exit 2 (as `jax-rl train`)
        check_args(args)
        check_checkpoint(args.checkpoint)
        check_port_free(args.host, int(args.port))
        tok, tok_desc = resolve_tokenizer(args.checkpoint, getattr(args, "tokenizer", None))
    except PortInUseError as e:
        print(f"jax-rl serve: error: {e}", file=sys.stderr)
        return 1
    except (ValueError, FileNotFoundError) as e:  # ServeArgError, a missing / bad tokenizer.json
        print(f"jax-rl serve: error: {e}", file=sys.stderr)
        return 2
    print(f"jax-rl serve: using {tok_desc}", flush=True)
    try:
        engine = build_engine(
            args.checkpoint,
            tokenizer=tok,
            slots=int(getattr(args, "slots", 4)),
            max_len=int(getattr(args, "max_len", 256)),
            dtype=str(getattr(args, "dtype", "float32")),
            temperature=temperature,
            scan_layers=getattr(args, "scan_layers", None),
            kv_layout=getattr(args, "kv_layout", None),
            kv_page_size=getattr(args, "kv_page_size", None),
        )
    except (ValueError, FileNotFoundError) as e:  # hf_io.CheckpointError: a corrupt / mismatched checkpoint
        print(f"jax-rl serve: error: {args.checkpoint}: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    stop = threading.Event()

    def on_signal(signum, frame):  # noqa: ARG001
        stop.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        server = serve(engine, host=args.host, port=int(args.port))
    except PortInUseError as e:  # taken between the check and the bind
        for s, h in old.items():
            signal.signal(s, h)
        print(f"jax-rl serve: error: {e}", file=sys.stderr)
        return 1
    print(f"jax-rl serve: listening on {server.host}:{server.port} "
          f"(slots={engine.max_concurrent_decodes}, max_len={engine.max_cache_len}, kv_layout={engine.kv.name}, "
          f"temperature={temperature:g}, "
          f"ready in {time.monotonic() - t0:.1f}s)", flush=True)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        server.stop()
        for s, h in old.items():
            signal.signal(s, h)
    print("jax-rl serve: stopped", flush=True)
    return 0


if __name__ == "__main__":  # pragma: no cover
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("checkpoint")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9000)
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--kv-layout", default=None)
    p.add_argument("--kv-page-size", type=int, default=None)
    sys.exit(main(p.parse_args()))
