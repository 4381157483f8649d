"""`jax-rl serve`: a subprocess serves a tiny model over JetStream gRPC; a Decode request gets
tokens back; SIGTERM stops it cleanly. In a subprocess because JetStream's Driver threads
SIGKILL their process on any error."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rollout import jetstream_compat as jc

ROOT = Path(__file__).resolve().parents[2]


def _start(args, timeout=180):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    env["XLA_FLAGS"] = ""  # one CPU device is enough for the server
    proc = subprocess.Popen([sys.executable, "-m", "jax_rl.cli", "serve", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    ready = threading.Event()

    def pump():
        for line in proc.stdout:
            lines.append(line)
            if "listening on" in line:
                ready.set()

    threading.Thread(target=pump, daemon=True).start()
    t0 = time.monotonic()
    while not ready.wait(0.5):
        if proc.poll() is not None or time.monotonic() - t0 > timeout:
            proc.kill()
            raise AssertionError("server did not come up:\n" + "".join(lines[-40:]))
    return proc, lines


@pytest.mark.parametrize("layout", [None, "contiguous"])  # None: the default, paged
def test_serve_grpc_decode_and_clean_stop(layout):
    import grpc

    pb, pb_grpc = jc.jetstream_pb2(), jc.jetstream_pb2_grpc()
    proc, lines = _start(["preset:tiny_dense", "--port", "0", "--slots", "2", "--max-len", "64",
                          "--tokenizer", "compact", *(["--kv-layout", layout] if layout else [])])
    try:
        m = re.search(r"listening on (\S+):(\d+) .*kv_layout=(\w+)", "".join(lines))
        assert m and m.group(1) == "127.0.0.1"
        assert m.group(3) == (layout or "paged")
        port = int(m.group(2))
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.OrchestratorStub(ch)
            req = pb.DecodeRequest(token_content=pb.DecodeRequest.TokenContent(token_ids=[72, 105, 33]),
                                   max_tokens=5)
            runs = [[t for r in stub.Decode(req, timeout=60) for s in r.stream_content.samples for t in s.token_ids]
                    for _ in range(2)]  # with the text request below, 3 requests on 2 slots: a slot re-used
            ids = runs[0]
            assert 1 <= len(ids) <= 5 and all(0 <= t < 384 for t in ids)
            assert runs[1] == ids  # greedy
            req = pb.DecodeRequest(text_content=pb.DecodeRequest.TextContent(text="Hi!"), max_tokens=3)
            texts = [s.text for r in stub.Decode(req, timeout=60) for s in r.stream_content.samples]
            assert texts  # streamed text pieces
            assert stub.HealthCheck(pb.HealthCheckRequest(), timeout=10).is_live
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, "".join(lines[-40:])
        assert any("stopped" in line for line in lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def _held_port():
    """A 127.0.0.1 port held by a plain listening socket (another program)."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    return s, s.getsockname()[1]


def test_grpc_server_refuses_a_port_another_grpc_server_holds():
    """Before the fix gRPC's default SO_REUSEPORT let a second server share the port and both
    reported success. Our server binds without it: the second bind fails naming the port. No
    JetStream Driver threads run here (a stand-in driver), so this is safe in-process."""
    import concurrent.futures

    import grpc

    from jax_rl.runtime.serve import JetStreamGrpcServer, PortInUseError

    first = grpc.server(concurrent.futures.ThreadPoolExecutor(1))  # gRPC defaults: SO_REUSEPORT on
    port = first.add_insecure_port("127.0.0.1:0")
    first.start()
    try:
        class _Driver:
            def stop(self):
                pass

        with pytest.raises(PortInUseError, match=f":{port}"):
            JetStreamGrpcServer(_Driver(), "127.0.0.1", port, threads=1)
    finally:
        first.stop(0)


def test_serve_cli_port_in_use_is_one_line_and_nonzero():
    """A port held by another program: one line naming it, exit 1, before any compile."""
    sock, port = _held_port()
    try:
        env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
        r = subprocess.run([sys.executable, "-m", "jax_rl.cli", "serve", "preset:tiny_dense", "--port", str(port),
                            "--tokenizer", "compact"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    finally:
        sock.close()
    assert r.returncode == 1, (r.stdout, r.stderr)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and f"port {port} is in use" in lines[0], r.stderr
    assert "listening" not in r.stdout


def test_serve_names_its_tokenizer(tmp_path):
    from jax_rl.runtime.serve import resolve_tokenizer

    tok, desc = resolve_tokenizer(str(tmp_path), None)  # an HF dir without tokenizer.json
    assert "compact demo tokenizer" in desc and f"no tokenizer.json in {tmp_path}" in desc
    assert tok.vocab_size > 0
    _, desc = resolve_tokenizer(str(tmp_path), "compact")
    assert "--tokenizer" in desc


def test_serve_help_documents_every_argument():
    from jax_rl.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command").choices["serve"]
    for a in sub._actions:
        if a.dest != "help":
            assert a.help, f"serve argument {a.dest} has no help"
    assert any(a.dest == "temperature" for a in sub._actions)
    kv = next(a for a in sub._actions if a.dest == "kv_layout")
    assert kv.default == "paged" and set(kv.choices) == {"paged", "contiguous"}
