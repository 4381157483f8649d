"""What moving a step's GRPO groups between processes costs, old transport vs new, on this host.

Usage::

    .venv/bin/python bench/group_transport.py [--samples 8] [--tokens 2048] [--moe-layers 48] [--k 8]
        [--reps 5] [--parts kv,ray] [--json FILE]

**Embedded multi-process** (:func:`jax_rl.runtime.engines.exchange_groups`): one realistic group (``--samples``
trajectories of ``--tokens`` tokens, 3/4 of them generated: float32 ``behav_logp``, int32 versions, and int8
``routes`` ``[T, --moe-layers, --k]`` as ``moe.routing_replay`` records them for Qwen3-30B-A3B's 48 MoE layers
x top-8; ``--moe-layers 0``: none) crosses the ``jax.distributed`` key-value store (a one-process
coordinator on 127.0.0.1, the gRPC service a multi-process run uses; this process writes the chunks and
reads them back) once as JSON lists (``Trajectory.to_dict``, main's path before issue 48) and once as the
array payload (:func:`rollout.types.encode_groups`, 1 MiB chunks through the bytes entries). Prints the bytes
put into the store per group and the median [min-max] seconds of encode, put + get, decode and their sum over
``--reps`` rounds, and whether every array came back bit for bit.

**Ray** (``runtime=ray``): the object-store copies a group's arrays make from the rollout worker's result to
the learner step, counted from the store itself (``Plasma memory usage``: objects and MiB while the learner
side holds the batch) on a local Ray (one CPU, loopback). ``before``: main's hops replayed with the same Ray
calls (the buffer actor returns the trajectories by value, the driver collates and sends the batch);
``after``: this tree's real buffer actor (the batch as the worker's references,
:func:`jax_rl.runtime.ray_producer.group_source`) and the learner side reading them in place and collating
(:func:`jax_rl.runtime.ray_producer.read_groups`, :func:`jax_rl.learner.batch.learner_batch`: what
``LearnerActor.train_groups`` runs). Host copies of one log-prob from the engine to the learner = the engine
side's 2 (request buffer, Trajectory: docs/design.md section 3.2) + the object-store copies + 1 (the batch).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
from _record import ROOT, append_record  # noqa: E402  (the bench preamble: the repository first on sys.path)

import numpy as np  # noqa: E402

_CHUNK = 1 << 20


def make_group(samples: int, tokens: int, moe_layers: int, k: int, seed: int = 0) -> list:
    """``samples`` trajectories of ``tokens`` tokens: a shared prompt (1/4), then generated tokens with
    float32 log-probs, versions, turn ids and (``moe_layers`` > 0) int8 routes."""
    from rollout.types import Trajectory

    rng = np.random.default_rng(seed)
    prompt = tokens // 4
    lm = np.arange(tokens) >= prompt
    out = []
    for i in range(samples):
        behav = np.where(lm, np.log(rng.uniform(1e-6, 1.0, tokens)), 0).astype(np.float32)
        routes = rng.integers(0, 128, (tokens, moe_layers, k), dtype=np.int8) if moe_layers else None
        out.append(Trajectory(tokens=rng.integers(0, 151_000, tokens), loss_mask=lm, behav_logp=behav,
                              versions=np.where(lm, 7, -1), turn_ids=np.where(lm, 0, -1), reward=float(i % 2),
                              group_id=3, env="tau2_mock", seed=1003,
                              info={"sample_idx": i, "prefill_tokens": prompt, "turns": 1}, routes=routes))
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _same(a: list, b: list) -> bool:
    from rollout.types import ARRAY_FIELDS

    return all(all((getattr(x, f) is None and getattr(y, f) is None) or
                   (getattr(x, f).dtype == getattr(y, f).dtype and getattr(x, f).tobytes() == getattr(y, f).tobytes())
                   for f in ARRAY_FIELDS) for x, y in zip(a, b))


def kv_paths(group: list, reps: int) -> dict:
    """Each transport's bytes, timings and exactness through a one-process coordination service."""
    import jax
    from jax._src import distributed

    from rollout.types import Trajectory, decode_groups, encode_groups

    jax.distributed.initialize(f"127.0.0.1:{_free_port()}", num_processes=1, process_id=0)
    client = distributed.global_state.client

    def json_enc():
        text = json.dumps([[t.to_dict() for t in group]])
        return [text[i:i + _CHUNK] for i in range(0, len(text), _CHUNK)], len(text.encode())

    def json_move(chunks, key):
        for i, c in enumerate(chunks):
            client.key_value_set(f"{key}/{i}", c)
        return [client.blocking_key_value_get(f"{key}/{i}", 10_000) for i in range(len(chunks))]

    def json_dec(got):
        return [Trajectory.from_dict(d) for d in json.loads("".join(got))[0]]

    def arr_enc():
        data = encode_groups([group])
        return [data[i:i + _CHUNK] for i in range(0, len(data), _CHUNK)], len(data)

    def arr_move(chunks, key):
        for i, c in enumerate(chunks):
            client.key_value_set_bytes(f"{key}/{i}", c)
        return [client.blocking_key_value_get_bytes(f"{key}/{i}", 10_000) for i in range(len(chunks))]

    def arr_dec(got):
        return decode_groups(b"".join(got))[0]

    out = {}
    for name, enc, move, dec in (("json", json_enc, json_move, json_dec), ("arrays", arr_enc, arr_move, arr_dec)):
        ts = {"encode_s": [], "store_s": [], "decode_s": [], "total_s": []}
        for r in range(reps + 1):  # the first round warms up, not counted
            t0 = time.perf_counter()
            chunks, nbytes = enc()
            t1 = time.perf_counter()
            got = move(chunks, f"bench/{name}/{r}")
            t2 = time.perf_counter()
            back = dec(got)
            t3 = time.perf_counter()
            for i in range(len(chunks)):
                client.key_value_delete(f"bench/{name}/{r}/{i}")
            if r:
                for k, v in zip(ts, (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
                    ts[k].append(v)
        out[name] = {"bytes": nbytes, "chunks": len(chunks), "exact": _same(group, back),
                     **{k: [statistics.median(v), min(v), max(v)] for k, v in ts.items()}}
    jax.distributed.shutdown()
    return out


def _plasma(summary: str) -> tuple[int, float]:
    m = re.search(r"Plasma memory usage (\d+) MiB, (\d+) objects", summary)
    return (int(m.group(2)), float(m.group(1))) if m else (-1, float("nan"))


def ray_copies(group: list, tmp: str) -> dict:
    """Object-store objects / MiB a group makes from the worker to the learner step, before and after."""
    from jax_rl.config import CONFIG_DIR, load_config
    from jax_rl.runtime.ray_actors import actor_classes
    from jax_rl.runtime.ray_cluster import init_ray

    ray = init_ray(tmp, num_cpus=1)
    from ray._private.internal_api import memory_summary

    n, T = len(group), len(group[0])
    cfg = load_config(CONFIG_DIR / "tiny_cpu.yaml", [f"optim.batch_size={n}", f"algo.group_size={n}",
                                                      f"optim.max_seq_len={T}", "optim.minibatches=1",
                                                      "optim.microbatches=1"])

    @ray.remote(num_cpus=0)
    class Worker:  # a rollout worker: its run_group result is the group's one object-store copy
        def run_group(self, g):
            return g

    @ray.remote(num_cpus=0)
    class OldBuffer:  # main's buffer actor: get_batch returned the trajectories by value
        def put_group(self, g):
            self.g = g
            return len(g)

        def get_batch(self):
            return [self.g]

    @ray.remote(num_cpus=0)
    class Learner:  # the learner side: holds the batch during the step; reads the store's usage then
        def old(self, batch):
            return _plasma(memory_summary(stats_only=True)), float(batch["behav_logp"].sum())

        def new(self, sources, rows):
            from jax_rl.learner.batch import learner_batch
            from jax_rl.runtime.ray_producer import read_groups

            _, _, batch = learner_batch(cfg, read_groups(ray, sources), 0, rows=rows)
            return _plasma(memory_summary(stats_only=True)), float(batch["behav_logp"].sum())

    from jax_rl.learner.batch import learner_batch
    from jax_rl.runtime.ray_producer import read_groups

    _, BufferActor, _ = actor_classes()
    worker, learner = Worker.remote(), Learner.remote()
    group_ref = ray.put(group)  # the rollout side's own group (made in this process: not counted)
    out = {"group_mib": sum(a.nbytes for t in group for a in t.to_record()[1].values()) / 2**20}
    for path in ("before", "after"):
        time.sleep(2.0)  # the previous path's objects are freed
        base = _plasma(memory_summary(stats_only=True))
        ref = worker.run_group.remote(group_ref)
        ray.wait([ref])
        if path == "before":
            buf = OldBuffer.remote()
            ray.get(buf.put_group.remote(ref))
            groups = ray.get(buf.get_batch.remote())
            _, _, batch = learner_batch(cfg, groups, 0, rows=n)  # on the driver
            (objs, mib), s = ray.get(learner.old.remote(batch))
            del groups, batch
        else:
            buf = BufferActor.remote(n, 1, 1, None, T)
            assert ray.get(buf.admit.remote(0))
            ray.get(buf.put_group.remote([ref]))
            sources = ray.get(buf.get_batch.remote(1, 7))
            read_groups(ray, sources)  # the driver reads the groups for its metrics row, in place
            (objs, mib), s = ray.get(learner.new.remote(sources, n))
            del sources
        out[path] = {"objects": objs - base[0], "mib": mib - base[1]}
        del ref, buf
    ray.shutdown()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--moe-layers", type=int, default=48)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--parts", default="kv,ray", help="what to measure: kv (the key-value store transports), "
                    "ray (the object-store copies), or both")
    ap.add_argument("--json", help="append the record to this JSON file")
    a = ap.parse_args()
    group = make_group(a.samples, a.tokens, a.moe_layers, a.k)
    raw = sum(x.nbytes for t in group for x in t.to_record()[1].values())
    print("load average (1, 5, 15 min): {:.1f} {:.1f} {:.1f}".format(*os.getloadavg()))
    routes = f"routes [T, {a.moe_layers}, {a.k}] int8" if a.moe_layers else "no routes"
    print(f"group: {a.samples} x {a.tokens} tokens, {routes}; arrays {raw / 2**20:.2f} MiB", flush=True)
    rec: dict = {"samples": a.samples, "tokens": a.tokens, "moe_layers": a.moe_layers, "k": a.k, "array_bytes": raw}
    parts = set(a.parts.split(","))
    for name, r in (kv_paths(group, a.reps) if "kv" in parts else {}).items():
        rec.setdefault("kv", {})[name] = r
        ms = {k: "{:.1f} [{:.1f}-{:.1f}]".format(*(1e3 * x for x in r[k])) for k in
              ("encode_s", "store_s", "decode_s", "total_s")}
        print(f"kv {name:6s}: {r['bytes'] / 2**20:7.2f} MiB in {r['chunks']} chunks; ms per group: encode "
              f"{ms['encode_s']}, put+get {ms['store_s']}, decode {ms['decode_s']}, total {ms['total_s']}; "
              f"bit-exact {r['exact']}", flush=True)
    if "kv" in rec:
        j, b = rec["kv"]["json"], rec["kv"]["arrays"]
        print(f"kv arrays/json: bytes {b['bytes'] / j['bytes']:.3f}x, time {b['total_s'][0] / j['total_s'][0]:.3f}x")
    if "ray" in parts:
        with tempfile.TemporaryDirectory(prefix="group_transport_") as tmp:
            rec["ray"] = ray_copies(group, tmp)
        r = rec["ray"]
        for path in ("before", "after"):
            c = r[path]["objects"]
            print(f"ray {path:6s}: object-store copies of the group {c} ({r[path]['mib']:.0f} MiB for a "
                  f"{r['group_mib']:.1f} MiB group); host copies of a log-prob engine -> learner: 2 + {c} + 1 = "
                  f"{3 + c}", flush=True)
    print("load average (1, 5, 15 min): {:.1f} {:.1f} {:.1f}".format(*os.getloadavg()))
    if a.json:
        append_record(a.json, rec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
