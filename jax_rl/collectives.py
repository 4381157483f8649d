"""Host-side collectives over the ``jax.distributed`` key-value store (no device collective, so they never
wait on devices busy with rollouts and need no agreement on shapes): :func:`allgather_bytes` and
:func:`allgather_json`, which checkpoints, placement, the learner's state holder, the runtime and the group
exchange use. A leaf: it imports jax alone. One process: each returns ``[own]`` without the store.
"""

from __future__ import annotations

import itertools
import json
import time
from typing import Any

import jax
from jax._src import distributed

__all__ = ["PeerLostError", "allgather_bytes", "allgather_json"]


class PeerLostError(RuntimeError):
    """A peer process did not answer within ``runtime.peer_timeout_s`` (a lost host); the message names it.
    :class:`jax_rl.weight_sync.WeightSyncError` is one."""


_GATHER_SEQ = itertools.count()
_CHUNK = 1 << 20  # bytes per key-value entry (the coordination service's gRPC messages stay small)


def allgather_bytes(data: bytes, *, timeout_s: float = 100.0, what: str = "state") -> list:
    """Every process's ``data``, in process order (a collective: every process calls it at the same point;
    this process's own entry is ``data`` itself). Through the ``jax.distributed`` key-value store's bytes
    entries (``key_value_set_bytes``, 1 MiB chunks), not a device collective, so it never waits on devices
    busy with rollouts and needs no agreement on shapes; one process: ``[data]``.

    Raises:
        PeerLostError: a peer did not hand its ``what`` in within ``timeout_s`` (one line naming it).
    """
    if jax.process_count() == 1:
        return [data]
    client = distributed.global_state.client
    seq = next(_GATHER_SEQ)
    base = f"jax_rl/gather/{seq}"
    me = jax.process_index()
    view = memoryview(data).cast("B")
    n = max(1, -(-len(view) // _CHUNK))
    for i in range(n):
        client.key_value_set_bytes(f"{base}/{me}/{i}", bytes(view[i * _CHUNK:(i + 1) * _CHUNK]))
    client.key_value_set(f"{base}/{me}/n", str(n))
    deadline = time.monotonic() + float(timeout_s)
    out = []
    for q in range(jax.process_count()):
        if q == me:
            out.append(data)
            continue
        try:
            m = int(client.blocking_key_value_get(f"{base}/{q}/n", max(1, int(1000 * (deadline - time.monotonic())))))
            chunks = [client.blocking_key_value_get_bytes(f"{base}/{q}/{i}", 10_000) for i in range(m)]
        except Exception:  # noqa: BLE001 - a timeout or the coordination service gone
            raise PeerLostError(f"process {q} did not hand in its {what} within {float(timeout_s):g} s "
                                  "(runtime.peer_timeout_s): peer lost") from None
        out.append(chunks[0] if m == 1 else b"".join(chunks))
    if seq >= 2:  # read by everyone by now
        try:
            client.key_value_delete(f"jax_rl/gather/{seq - 2}/{me}")
        except Exception:  # noqa: BLE001 - housekeeping only
            pass
    return out


def allgather_json(obj: Any, *, timeout_s: float = 100.0, what: str = "state") -> list:
    """Every process's JSON-safe ``obj``, in process order (:func:`allgather_bytes` of its JSON text; one
    process: ``[obj]``). For small state (metrics, run-dir checks); trajectories cross as arrays
    (:func:`rollout.types.encode_groups`).

    Raises:
        PeerLostError: a peer did not hand its ``what`` in within ``timeout_s`` (one line naming it).
    """
    if jax.process_count() == 1:
        return [obj]
    text = json.dumps(obj).encode()
    return [obj if b is text else json.loads(b) for b in allgather_bytes(text, timeout_s=timeout_s, what=what)]
