"""Data shared by the rollout side: :class:`Trajectory` (docs/design.md §3.2 Trajectory) and :class:`Completion`.

No jax here: everything is numpy on the host, per-token fields as arrays under one name each
(``behav_logp``, ``versions``, ``loss_mask``, ``routes``) from the generator to the learner batch.
Processes exchange the arrays themselves, as one record (:meth:`Trajectory.to_record`: JSON-safe
metadata and the named numpy arrays): Ray's object store pickles a Trajectory through it (protocol 5,
the arrays out of band) and the ``jax.distributed`` key-value store carries it as bytes
(:func:`encode_groups` / :func:`decode_groups`: a JSON header of dtypes, shapes and offsets, then the raw
array bytes; no pickle). :meth:`Trajectory.to_dict` / :meth:`Trajectory.from_dict` (arrays as JSON
lists) are for disk (the buffer's checkpointed state); nothing is pickled to disk.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence, runtime_checkable

import numpy as np

__all__ = ["Trajectory", "Completion", "json_safe", "ROUTE_MISSING", "ARRAY_FIELDS", "encode_groups", "decode_groups",
           "TokenGenerator", "SessionGenerator", "OrderedGenerator", "PartialTokens", "DecodeEngine"]

ROUTE_MISSING = -1
"""Expert id of a position with no recorded route (``jax_rl.models.qwen3.ROUTE_MISSING``): the
learner's MoE block routes it by its own router."""


def json_safe(x: Any, default: Optional[Callable[[Any], Any]] = None) -> Any:
    """Recursively turn numpy / jax scalars and arrays, tuples and sets into JSON-serialisable values
    (dict keys as ``str``). The one conversion: ``Trajectory.info`` (strict), run summaries and
    checkpoint metadata (``default=str``).

    Args:
        default: what a value with no JSON form becomes (e.g. ``str``); None raises.

    Raises:
        TypeError: (``default`` None) a value that has no JSON form (e.g. an arbitrary object).
    """
    if isinstance(x, dict):
        return {str(k): json_safe(v, default) for k, v in x.items()}
    if isinstance(x, (list, tuple, set, frozenset)):
        return [json_safe(v, default) for v in x]
    if isinstance(x, (np.ndarray, np.generic)) or (hasattr(x, "__array__") and not isinstance(x, (str, bytes))):
        a = np.asarray(x)
        return a.item() if a.ndim == 0 else a.tolist()
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if default is not None:
        return default(x)
    raise TypeError(f"value of type {type(x).__name__} is not JSON-serialisable: {x!r}")


def _int_dtype(name: str) -> np.dtype:
    """An integer numpy dtype by name (from a trajectory dict); ValueError for anything else."""
    if name not in ("int8", "int16", "int32", "int64", "uint8", "uint16"):
        raise ValueError(f"Trajectory routes_dtype must be an integer dtype name, got {name!r}")
    return np.dtype(name)


@dataclass
class Completion:
    """One finished generation request (Generator -> agent), see docs/interfaces.md.

    The per-token values the learner uses are numpy arrays under the names the :class:`Trajectory`
    and the learner batch use (lists given to the constructor are converted once; arrays of the
    right dtype are kept as they are); ``tokens`` stays a list of ints, the generator's prompt type
    (the agent submits it back as context).

    Attributes:
        request_id: the generator's id of the request.
        tokens: list of n ints, generated token ids (the stop token included when it was sampled).
        behav_logp: float32 [n], behaviour log-prob (log mu) of each generated token under the
            distribution it was sampled from (temperature, then any top-k / top-p truncation
            renormalised): the engine's ``StepOutput.behav_logp``, the Trajectory's ``behav_logp``.
        versions: int32 [n], policy version that produced each token.
        finish_reason: ``"stop"`` (a stop id was sampled), ``"length"`` (max_new_tokens reached) or
            ``"aborted"`` (the generator gave up on the request).
        info: extra data, e.g. number of reissues, prefill tokens (:mod:`rollout.generator`).
        routes: None, or the expert ids the engine's MoE layers chose at every position of
            prompt + ``tokens`` ([len(prompt) + n, n_moe_layers, k], a compact int
            dtype, ``ROUTE_MISSING`` where none: the last token); ``moe.routing_replay``.

    Raises (on construction):
        ValueError: ``tokens`` / ``behav_logp`` / ``versions`` of different lengths, or an unknown
            ``finish_reason``.
    """

    request_id: int
    tokens: list[int]
    behav_logp: np.ndarray
    versions: np.ndarray
    finish_reason: str = "stop"
    info: dict = field(default_factory=dict)
    routes: Optional[np.ndarray] = None

    def __post_init__(self) -> None:
        self.tokens = [int(t) for t in self.tokens]
        self.behav_logp = np.asarray(self.behav_logp, dtype=np.float32).reshape(-1)
        self.versions = np.asarray(self.versions, dtype=np.int32).reshape(-1)
        if not (len(self.tokens) == self.behav_logp.shape[0] == self.versions.shape[0]):
            raise ValueError(
                f"Completion {self.request_id}: tokens/behav_logp/versions lengths differ "
                f"({len(self.tokens)}, {len(self.behav_logp)}, {len(self.versions)})"
            )
        if self.finish_reason not in ("stop", "length", "aborted"):
            raise ValueError(f"Completion.finish_reason must be stop|length|aborted, got {self.finish_reason!r}")


@dataclass
class Trajectory:
    """One episode (possibly many turns), numpy on the host. docs/design.md §3.2 Trajectory.

    Attributes:
        tokens: int32 [T], prompt + all turns in Qwen3 chat format; exactly the context the
            generator saw, followed by what it generated.
        loss_mask: bool [T], True only on tokens the policy generated (incl. its ``<|im_end|>``).
        behav_logp: float32 [T], log mu of each generated token (0 elsewhere). The log-prob of
            token t is stored at index t.
        versions: int32 [T], policy version that generated each token; -1 where not generated.
        turn_ids: int32 [T], assistant turn index (0, 1, ...) per generated token; -1 elsewhere.
        reward: episode reward in [0, 1].
        group_id: GRPO group id (all samples of one task share it).
        env: environment name.
        seed: environment (task) seed.
        info: JSON-serialisable dict: truncation flags, tool errors, timings, failure reason.
        old_logp: float32 [T] or None: exact log pi_v of each generated token under its own
            behaviour version v with the learner's training numerics (0 elsewhere; aligned like
            ``behav_logp``), filled before the trajectory enters the buffer by
            ``old_logits.route=dedicated`` (:class:`jax_rl.learner.correction.old_logits.OldLogitScorer`); None = not
            scored.
        routes: None, or int [T, n_moe_layers, k] (int8/int16: ``jax_rl.models.qwen3.route_dtype``):
            the top-k expert ids each MoE layer of the rollout engine chose at position t (prompt
            and tool tokens: their prefill's; generated tokens: their decode step's; a position
            run again (a later turn's prefill, a ``recompute_kv`` re-prefill) holds its most recent
            route: the one the later tokens' K/V came from), ``ROUTE_MISSING`` (-1) where the engine never ran
            the token (the last one, a final tool turn). Recorded under ``moe.routing_replay``
            r2/r3; r3 forces them in every learner forward.

    Raises (on construction):
        ValueError: arrays of different lengths, or a reward outside [0, 1].
    """

    tokens: np.ndarray
    loss_mask: np.ndarray
    behav_logp: np.ndarray
    versions: np.ndarray
    turn_ids: np.ndarray
    reward: float = 0.0
    group_id: int = 0
    env: str = ""
    seed: int = 0
    info: dict = field(default_factory=dict)
    old_logp: Optional[np.ndarray] = None
    routes: Optional[np.ndarray] = None

    def __post_init__(self) -> None:
        self.tokens = np.asarray(self.tokens, dtype=np.int32).reshape(-1)
        self.loss_mask = np.asarray(self.loss_mask, dtype=bool).reshape(-1)
        self.behav_logp = np.asarray(self.behav_logp, dtype=np.float32).reshape(-1)
        self.versions = np.asarray(self.versions, dtype=np.int32).reshape(-1)
        self.turn_ids = np.asarray(self.turn_ids, dtype=np.int32).reshape(-1)
        if self.old_logp is not None:
            self.old_logp = np.asarray(self.old_logp, dtype=np.float32).reshape(-1)
        n = self.tokens.shape[0]
        for name in ("loss_mask", "behav_logp", "versions", "turn_ids") + (("old_logp",) if self.old_logp is not None
                                                                           else ()):
            if getattr(self, name).shape[0] != n:
                raise ValueError(f"Trajectory.{name} has length {getattr(self, name).shape[0]}, tokens has {n}")
        if self.routes is not None:
            self.routes = np.asarray(self.routes)
            if self.routes.ndim != 3 or self.routes.shape[0] != n or not np.issubdtype(self.routes.dtype, np.integer):
                raise ValueError(f"Trajectory.routes must be an int array [T={n}, n_moe_layers, k], got "
                                 f"{self.routes.dtype} {self.routes.shape}")
        self.reward = float(self.reward)
        if not (0.0 <= self.reward <= 1.0) or self.reward != self.reward:
            raise ValueError(f"Trajectory.reward must be in [0, 1], got {self.reward}")
        self.group_id = int(self.group_id)
        self.seed = int(self.seed)

    # ------------------------------------------------------------------ derived
    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_generated(self) -> int:
        """Number of policy-generated tokens (``loss_mask.sum()``)."""
        return int(self.loss_mask.sum())

    @property
    def failed(self) -> bool:
        """True when the episode failed (env exception, aborted generation); never trained."""
        return bool(self.info.get("failed", False))

    @property
    def overlong(self) -> bool:
        """True when the prompt alone left no room to generate (``info["overlong"]``); never trained."""
        return bool(self.info.get("overlong", False))

    def min_version(self) -> Optional[int]:
        """Smallest policy version among generated tokens, or None if nothing was generated."""
        v = self.versions[self.loss_mask & (self.versions >= 0)]
        return int(v.min()) if v.size else None

    def max_version(self) -> Optional[int]:
        """Largest policy version among generated tokens, or None if nothing was generated."""
        v = self.versions[self.loss_mask & (self.versions >= 0)]
        return int(v.max()) if v.size else None

    def staleness(self, current_version: int) -> int:
        """``current_version - min_version()`` (0 when nothing was generated)."""
        mv = self.min_version()
        return 0 if mv is None else int(current_version) - mv

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict:
        """JSON-safe dict (arrays -> lists; ``old_logp`` only when scored). Inverse of :meth:`from_dict`."""
        d = {
            "tokens": self.tokens.tolist(),
            "loss_mask": self.loss_mask.tolist(),
            "behav_logp": self.behav_logp.tolist(),
            "versions": self.versions.tolist(),
            "turn_ids": self.turn_ids.tolist(),
            "reward": self.reward,
            "group_id": self.group_id,
            "env": self.env,
            "seed": self.seed,
            "info": json_safe(self.info),
        }
        if self.old_logp is not None:  # float32 -> Python float -> float32 is exact; -inf -> JSON -Infinity
            d["old_logp"] = self.old_logp.tolist()
        if self.routes is not None:  # ints: exact; the dtype name travels with them
            d["routes"] = self.routes.tolist()
            d["routes_dtype"] = self.routes.dtype.name
            d["routes_shape"] = list(self.routes.shape)
        return d

    def to_record(self) -> tuple[dict, dict[str, np.ndarray]]:
        """The record processes exchange: ``(meta, arrays)``. ``meta``: ``reward``, ``group_id``, ``env``,
        ``seed``, ``info`` (as they are); ``arrays``: the :data:`ARRAY_FIELDS` that are set, the
        trajectory's own arrays (no copy). Inverse of :meth:`from_record`; Ray pickles a Trajectory
        through it, :func:`encode_groups` writes it as bytes."""
        meta = {"reward": self.reward, "group_id": self.group_id, "env": self.env, "seed": self.seed,
                "info": self.info}
        return meta, {k: getattr(self, k) for k in ARRAY_FIELDS if getattr(self, k) is not None}

    @classmethod
    def from_record(cls, meta: dict, arrays: dict) -> "Trajectory":
        """Rebuild from :meth:`to_record`; arrays of the field's dtype are kept as they are (views)."""
        return cls(**{k: arrays.get(k) for k in ARRAY_FIELDS}, reward=meta["reward"], group_id=meta["group_id"],
                   env=meta["env"], seed=meta["seed"], info=dict(meta.get("info") or {}))

    def __reduce__(self):
        """Pickle (Ray's object store only) as the record: the arrays travel out of band."""
        return _from_record, self.to_record()

    @classmethod
    def from_dict(cls, d: dict) -> "Trajectory":
        """Rebuild from :meth:`to_dict` output (float32 log-probs round-trip exactly)."""
        return cls(
            tokens=np.asarray(d["tokens"], dtype=np.int32),
            loss_mask=np.asarray(d["loss_mask"], dtype=bool),
            behav_logp=np.asarray(d["behav_logp"], dtype=np.float32),
            versions=np.asarray(d["versions"], dtype=np.int32),
            turn_ids=np.asarray(d["turn_ids"], dtype=np.int32),
            reward=d["reward"],
            group_id=d["group_id"],
            env=d["env"],
            seed=d["seed"],
            info=dict(d.get("info") or {}),
            old_logp=None if d.get("old_logp") is None else np.asarray(d["old_logp"], dtype=np.float32),
            routes=None if d.get("routes") is None else
            np.asarray(d["routes"], dtype=_int_dtype(d.get("routes_dtype", "int32"))).reshape(
                d.get("routes_shape") or (len(d["tokens"]), *np.shape(d["routes"])[1:])),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, s: str) -> "Trajectory":
        return cls.from_dict(json.loads(s))


ARRAY_FIELDS = ("tokens", "loss_mask", "behav_logp", "versions", "turn_ids", "old_logp", "routes")
"""The per-token arrays of :meth:`Trajectory.to_record` (``old_logp`` / ``routes`` only when set)."""

WIRE_MAGIC = b"JRLTRJ01"
"""First 8 bytes of :func:`encode_groups`' payload (then the header's length, uint64 little-endian)."""
_WIRE_DTYPES = frozenset({"|b1", "|i1", "<i2", "<i4", "<i8", "|u1", "<u2", "<f4"})
_ALIGN = 8


def _from_record(meta: dict, arrays: dict) -> Trajectory:
    return Trajectory.from_record(meta, arrays)


def encode_groups(groups) -> bytes:
    """GRPO groups (lists of :class:`Trajectory`) as one bytes payload: ``WIRE_MAGIC``, the header's
    length (uint64 LE), a UTF-8 JSON header ``{"groups": [[{"meta", "arrays": {name: [dtype, shape,
    offset]}}]], "nbytes"}`` and the arrays' raw little-endian bytes, each at an 8-byte aligned offset of
    the body. Every value arrives bit for bit (NaN payloads included); no pickle. Inverse of
    :func:`decode_groups`.

    Raises:
        TypeError: an array of a dtype outside the wire's (bool, int8-64, uint8/16, float32), or an
            ``info`` value with no JSON form (naming it).
    """
    parts: list = []
    off = 0
    header = []
    for g in groups:
        hg = []
        for t in g:
            meta, arrays = t.to_record()
            spec = {}
            for k, a in arrays.items():
                a = np.ascontiguousarray(a)
                dt = a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype
                if dt.str not in _WIRE_DTYPES:
                    raise TypeError(f"Trajectory.{k} of dtype {a.dtype} cannot cross processes "
                                    f"(wire dtypes: {sorted(_WIRE_DTYPES)})")
                a = a.astype(dt, copy=False)
                pad = -off % _ALIGN
                if pad:
                    parts.append(bytes(pad))
                    off += pad
                spec[k] = [dt.str, list(a.shape), off]
                parts.append(memoryview(a).cast("B") if a.size else b"")
                off += a.nbytes
            hg.append({"meta": {**meta, "info": json_safe(meta["info"])}, "arrays": spec})
        header.append(hg)
    head = json.dumps({"groups": header, "nbytes": off}).encode()
    return b"".join([WIRE_MAGIC, struct.pack("<Q", len(head)), head, *parts])


def decode_groups(payload) -> list[list[Trajectory]]:
    """The groups of an :func:`encode_groups` payload. Each array is a read-only view of ``payload``
    (bytes-like; no copy), with the dtype and shape it was sent with.

    Raises:
        ValueError: (one line) not such a payload (wrong magic, a truncated body, a dtype outside the wire's).
    """
    buf = memoryview(payload).cast("B")
    if len(buf) < 16 or bytes(buf[:8]) != WIRE_MAGIC:
        raise ValueError(f"not a trajectory payload (first bytes {bytes(buf[:8])!r}, expected {WIRE_MAGIC!r})")
    (n,) = struct.unpack("<Q", buf[8:16])
    header = json.loads(bytes(buf[16:16 + n]))
    body = buf[16 + n:]
    if len(body) != header["nbytes"]:
        raise ValueError(f"trajectory payload truncated: body of {len(body)} bytes, header says {header['nbytes']}")
    out = []
    for hg in header["groups"]:
        g = []
        for ht in hg:
            arrays = {}
            for k, (dt, shape, off) in ht["arrays"].items():
                if k not in ARRAY_FIELDS or dt not in _WIRE_DTYPES:
                    raise ValueError(f"trajectory payload: field {k!r} of dtype {dt!r} is not a wire field")
                count = int(np.prod(shape, dtype=np.int64))
                arrays[k] = np.frombuffer(body, dtype=np.dtype(dt), count=count, offset=off).reshape(shape)
            g.append(Trajectory.from_record(ht["meta"], arrays))
        out.append(g)
    return out


# ------------------------------------------------------------------------------------------ interfaces
# What the agent asks of a generator, and the generator of an engine (typing.Protocol: declared, checked where
# a capability is optional with isinstance on a runtime_checkable protocol, never probed with getattr).


@runtime_checkable
class TokenGenerator(Protocol):
    """What :class:`rollout.agent.AgentLoop` asks of any generator (:class:`rollout.generator.Generator`, a
    test's scripted one): ``submit`` a turn's request, get a future of its :class:`Completion`."""

    def submit(self, prompt_ids: Sequence[int], *, max_new_tokens: int, seed: int, stop_ids: Any,
               **kw: Any) -> Any:
        """A ``concurrent.futures.Future`` of the :class:`Completion` (keywords: ``session``, ``prefix_len``,
        ``order``, ``gang`` where the generator declares them below)."""


@runtime_checkable
class SessionGenerator(Protocol):
    """A generator that holds an episode's slot (its K/V) between turns, keyed by ``submit(session=)``: the
    agent releases the session when the episode ends."""

    def release_session(self, session: Any) -> None:
        """The episode ended: its held slot (if any) is given back."""


@runtime_checkable
class OrderedGenerator(Protocol):
    """A generator that admits by ``submit(order=, gang=)`` (:mod:`rollout.admission`): a group's samples
    admitted together; a group member that ends before its first request is withdrawn from its gang."""

    def withdraw(self, gang: tuple) -> None:
        """One member of ``gang`` (key, n) will never submit: the others do not wait for it."""


@runtime_checkable
class PartialTokens(Protocol):
    """A generator that reports the tokens a live request generated so far (the agent's partial rollouts)."""

    def partial_tokens(self, request_id: int) -> Optional[tuple]:
        """``(tokens, versions, routes or None)`` of request ``request_id`` so far; None when it is not live."""


class DecodeEngine(Protocol):
    """What :class:`rollout.generator.Generator` asks of its engine (:class:`rollout.engine.Qwen3Engine`):
    slots, prefill, decode and weights, and the K/V layout object ``kv``
    (:class:`rollout.engine.layout.KVLayout`: admission budget, preemption, stats)."""

    kv: Any
    max_cache_len: int
    max_prefill_length: int
    counts_moe_drops: bool
    moe_copies_per_token: int
    route_shape: Optional[tuple]
    params: Any

    def init_decode_state(self) -> dict: ...

    def load_params(self, params: Any = None) -> Any: ...

    def prefill_slots(self, params: Any, decode_state: dict, rows: Sequence[Any]) -> tuple[dict, list]: ...

    def copy_slot(self, decode_state: dict, src: int, dst: int, *, token: int, seed: int,
                  temperature: Optional[float] = None) -> dict: ...

    def free_slots(self, decode_state: dict, slots: Sequence[int]) -> dict: ...

    def decode(self, params: Any, decode_state: dict, *, version: int = 0) -> tuple[dict, Any]: ...

    def decode_steps(self, params: Any, decode_state: dict, n: int, *, version: int = 0) -> tuple[dict, Any]: ...
