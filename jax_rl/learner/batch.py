"""The learner batch: a typed pytree of [B, T] arrays, built by :func:`collate` and checked
by :func:`validate_batch` (docs/design.md §3.3 Learner batch, docs/interfaces.md "Learner batch");
:func:`learner_batch` turns the buffer's GRPO groups into one, with the ``algo.advantage``
estimator's advantages."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

import flax
import jax
import numpy as np

from jax_rl.errors import BatchError
from jax_rl.learner.advantages import compute_advantages
from jax_rl.models.qwen3 import route_dtype

if TYPE_CHECKING:  # annotations only
    from jax_rl.config import AlgoConfig, Config

__all__ = ["BATCH_FIELDS", "OPTIONAL_FIELDS", "INERT_FILL", "inert", "BatchError", "LearnerBatch", "abstract_batch", "bucket_len", "collate",
           "pad_len", "pad_rows", "seq_buckets", "validate_batch", "group_advantages",
           "sorted_groups", "learner_batch"]


@flax.struct.dataclass
class LearnerBatch:
    """One learner batch. On the host every field is [B, T]; inside the train step it is laid
    out [U, m, r, T] (minibatches, microbatches, rows) and a microbatch is [r, T].

    Fields:
        tokens: int32, prompt + all turns (right-padded with the pad id).
        attention_mask: bool, True on real tokens (a run of True then False per row).
        loss_mask: bool, True only on tokens the policy generated (never at t = 0).
        behav_logp: float32, log mu of each generated token (0 elsewhere).
        versions: int32, policy version that generated each token (-1 elsewhere).
        turn_ids: int32, assistant turn index per token (-1 elsewhere).
        advantages: float32, per token (broadcast per trajectory; 0 on padding).
        prox_logp: float32 or None, log pi_prox supplied by the correction's host step
            (``exact``: log pi_v per token).
        old_logp: float32 or None, exact log pi_v next to an approximate mode
            (``old_logits.measure_error``).
        routes: int8/int16 [B, T, n_moe_layers, k] or None (``moe.routing_replay``): the rollout
            engine's top-k expert ids per position and MoE layer (``Trajectory.routes``; -1 =
            none: the learner's router decides there). Inside the step [U, m, r, T, n_moe_layers, k].
    """

    tokens: Any
    attention_mask: Any
    loss_mask: Any
    behav_logp: Any
    versions: Any
    turn_ids: Any
    advantages: Any
    prox_logp: Any = None
    old_logp: Any = None
    routes: Any = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "LearnerBatch":
        return cls(**{k: d.get(k) for k in (*BATCH_FIELDS, *OPTIONAL_FIELDS)})

    def map(self, fn) -> "LearnerBatch":
        """Apply ``fn`` to every present field (None stays None)."""
        return LearnerBatch(**{k: None if v is None else fn(v) for k, v in self.__dict__.items()})


# name -> (kind, dtype); kind: "int" | "bool" | "float"
BATCH_FIELDS: dict[str, tuple[str, Any]] = {
    "tokens": ("int", np.int32),
    "attention_mask": ("bool", np.bool_),
    "loss_mask": ("bool", np.bool_),
    "behav_logp": ("float", np.float32),
    "versions": ("int", np.int32),
    "turn_ids": ("int", np.int32),
    "advantages": ("float", np.float32),
}
OPTIONAL_FIELDS: dict[str, tuple[str, Any]] = {
    "prox_logp": ("float", np.float32),
    "old_logp": ("float", np.float32),  # exact log pi_v (e.g. from another old-logit route)
    "routes": ("routes", np.int32),  # [B, T, n_moe_layers, k]; stored in jax_rl.models.qwen3.route_dtype
}


def abstract_batch(shape: tuple[int, ...], sharding: Any, *, prox: bool = False, old: bool = False,
                   routes: Optional[tuple[tuple[int, int], Any]] = None) -> LearnerBatch:
    """A :class:`LearnerBatch` of ``jax.ShapeDtypeStruct`` (``shape``, e.g. [U, m, r, T], with
    ``sharding``) for AOT ``lower().compile()``: every :data:`BATCH_FIELDS` field, plus float32
    ``prox_logp`` (``prox``: a host-supplied pi_prox, ``exact``) and ``old_logp`` (``old``: the
    exact log-probs beside an approximate mode); ``routes`` = ((n_moe_layers, k), dtype): the
    recorded expert ids [*shape, n_moe_layers, k] (``moe.routing_replay``)."""
    fields = {k: jax.ShapeDtypeStruct(tuple(shape), dt, sharding=sharding) for k, (_, dt) in BATCH_FIELDS.items()}
    for name, want in (("prox_logp", prox), ("old_logp", old)):
        if want:
            fields[name] = jax.ShapeDtypeStruct(tuple(shape), np.float32, sharding=sharding)
    if routes is not None:
        fields["routes"] = jax.ShapeDtypeStruct(tuple(shape) + tuple(routes[0]), routes[1], sharding=sharding)
    return LearnerBatch.from_dict(fields)


MIN_BUCKET = 16
"""The smallest default length bucket (:func:`seq_buckets`)."""


def seq_buckets(max_seq_len: int, buckets: Optional[Sequence[int]] = None) -> tuple[int, ...]:
    """The padded lengths T a learner batch may take (``optim.seq_len_buckets``), ascending.

    Args:
        max_seq_len: ``optim.max_seq_len``; always the last bucket, so every valid batch fits.
        buckets: the configured lengths (each in [1, max_seq_len]); None: the powers of two from
            :data:`MIN_BUCKET` and their 1.5x midpoints below ``max_seq_len``, then ``max_seq_len``
            (512 -> 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512: eleven shapes where 16-token
            multiples would be 32; a batch is padded by less than half its length, so at most a
            third of the padded learner tokens are padding).

    Raises:
        BatchError: a configured length outside [1, max_seq_len].
    """
    M = int(max_seq_len)
    if buckets is None:
        out, n = [], MIN_BUCKET
        while n < M:
            out.append(n)
            if n * 3 // 2 < M:
                out.append(n * 3 // 2)
            n *= 2
        return tuple(out) + (M,)
    bad = [int(b) for b in buckets if not 1 <= int(b) <= M]
    if bad:
        raise BatchError(f"optim.seq_len_buckets {bad} outside [1, optim.max_seq_len={M}]")
    return tuple(sorted({int(b) for b in buckets} | {M}))


def bucket_len(T: int, buckets: Sequence[int]) -> int:
    """The smallest of ``buckets`` (ascending, :func:`seq_buckets`) that holds ``T`` tokens: the one rule for
    the padded length of a batch, applied by :func:`collate`, the learner (a batch from elsewhere) and the
    old-logit scorers, so they compile the same shapes.

    Raises:
        BatchError: ``T`` above the largest bucket (``optim.max_seq_len``).
    """
    for b in buckets:
        if b >= T:
            return int(b)
    raise BatchError(f"batch has T={T} > optim.max_seq_len={buckets[-1]} (over-long sequences)")


INERT_FILL: dict[str, int] = {"versions": -1, "turn_ids": -1, "routes": -1}
"""The value a padded position of a batch field holds when it is not 0: ``versions`` / ``turn_ids`` -1 (not
generated, no turn), ``routes`` -1 (no recorded expert); ``tokens`` take the tokenizer's ``pad_id``
(:func:`inert`). Every other field pads with 0 / False (no attention, no loss, no advantage)."""


def inert(field: str, pad_id: int = 0) -> int:
    """The padding value of batch field ``field`` (:data:`INERT_FILL`; ``pad_id`` for ``tokens``; 0 else): what
    :func:`collate`, :func:`pad_len` and :func:`pad_rows` write where there is no token."""
    return pad_id if field == "tokens" else INERT_FILL.get(field, 0)


def pad_len(batch: dict[str, np.ndarray], T: int, pad_id: int = 0) -> dict[str, np.ndarray]:
    """Right-pad every [B, T0, ...] field of a (validated) batch to ``T`` >= T0 columns with inert
    values: ``tokens`` ``pad_id``, ``versions`` / ``turn_ids`` / ``routes`` -1, masks False, floats 0
    (no loss, no gradient, no metric token; attention never reaches a padded key). Returns ``batch``
    itself when T0 == T.

    Raises:
        BatchError: ``T`` < T0.
    """
    T0 = int(np.shape(batch["tokens"])[1])
    if T < T0:
        raise BatchError(f"pad_len: batch has T={T0} columns, more than the {T} asked for")
    if T == T0:
        return batch
    return {k: np.pad(v, ((0, 0), (0, T - T0)) + ((0, 0),) * (np.ndim(v) - 2), constant_values=inert(k, pad_id))
            for k, v in batch.items()}


def pad_rows(batch: dict[str, np.ndarray], rows: int, pad_id: int = 0) -> dict[str, np.ndarray]:
    """Append inert rows to a collated batch until it has ``rows`` rows.

    A group can reach the learner short of ``algo.group_size`` (its failed or over-long
    trajectories are removed and counted by the buffer), so a batch can hold fewer rows than
    ``optim.batch_size`` and then not split into ``optim.minibatches x optim.microbatches``. The
    learner gets the full ``[optim.batch_size, T]`` instead (one compiled shape, no
    :class:`BatchError`): each added row is one ``pad_id`` token with ``attention_mask`` True at
    position 0 only (no attention row is empty), ``loss_mask`` False everywhere (no loss, no
    gradient, no metric token), ``versions`` / ``turn_ids`` / ``routes`` -1, every other field 0.

    Args:
        batch: :func:`collate`'s dict of arrays with B rows on axis 0.
        rows: the wanted row count (>= B).
        pad_id: the token id of the added rows.

    Returns:
        A new dict with ``rows`` rows (``batch`` itself when B == rows).

    Raises:
        BatchError: ``rows`` < B.
    """
    B = int(np.asarray(batch["tokens"]).shape[0])
    if rows < B:
        raise BatchError(f"pad_rows: batch has B={B} rows, more than the {rows} asked for")
    if rows == B:
        return batch
    n = rows - B
    out = {}
    for k, a in batch.items():
        a = np.asarray(a)
        extra = np.full((n,) + a.shape[1:], inert(k, pad_id), a.dtype)
        if k == "attention_mask":
            extra[:, 0] = True
        out[k] = np.concatenate([a, extra])
    return out


def collate(
    trajectories: Sequence[Any],
    advantages_per_traj: Sequence[Any],
    max_seq_len: int,
    buckets: Optional[Sequence[int]] = None,
    pad_id: int = 0,
) -> dict[str, np.ndarray]:
    """Right-pad trajectories into a learner batch.

    Args:
        trajectories: objects with the attributes ``tokens`` int [T_i], ``loss_mask`` bool [T_i],
            ``behav_logp`` float [T_i], ``versions`` int [T_i], ``turn_ids`` int [T_i]
            (``rollout.types.Trajectory``).
        advantages_per_traj: one float per trajectory (broadcast over its tokens) or an
            array [T_i] per trajectory.
        max_seq_len: longest accepted trajectory (``optim.max_seq_len``).
        buckets: ``optim.seq_len_buckets``: T is the smallest of :func:`seq_buckets` that holds the longest
            trajectory (:func:`bucket_len`; few distinct shapes are compiled, the learner's own).
        pad_id: token id written in padding (masked out everywhere; :func:`inert`).

    Returns:
        dict of numpy arrays [B, T]: tokens int32, attention_mask bool, loss_mask bool,
        behav_logp float32, versions int32 (-1 pad), turn_ids int32 (-1 pad), advantages
        float32 (0 pad); and ``old_logp`` float32 (0 pad) when the trajectories carry it
        (``old_logits.route=dedicated``); ``routes`` [B, T, n_moe_layers, k] (their int dtype,
        -1 pad) when they carry routes (``moe.routing_replay``).

    Raises:
        BatchError: no trajectories, mismatched lengths, a trajectory longer than max_seq_len,
            ``old_logp`` or ``routes`` on some trajectories but not all, routes of different
            shapes.
    """
    lens = _lengths(trajectories, advantages_per_traj, max_seq_len)
    T = bucket_len(max(lens), seq_buckets(max_seq_len, buckets))
    B = len(trajectories)
    out = {k: np.full((B, T), inert(k, pad_id), dt) for k, dt in _COLLATED.items()}
    old_logp = _optional_field(trajectories, "old_logp", "; a batch's exact old log-probs must come from one route")
    if old_logp is not None:
        out["old_logp"] = _old_logp_rows(old_logp, lens, T)
    routes = _optional_field(trajectories, "routes",
                             " (moe.routing_replay records them for every trajectory of a run)")
    if routes is not None:
        out["routes"] = _route_rows(routes, lens, T)
    for b, (t, adv) in enumerate(zip(trajectories, advantages_per_traj)):
        _fill_row(out, b, t, adv, lens[b])
    return out


_COLLATED = {"tokens": np.int32, "attention_mask": bool, "loss_mask": bool, "behav_logp": np.float32,
             "versions": np.int32, "turn_ids": np.int32, "advantages": np.float32}
"""The fields :func:`collate` always writes, with their dtypes."""


def _lengths(trajectories: Sequence[Any], advantages_per_traj: Sequence[Any], max_seq_len: int) -> list[int]:
    """Each trajectory's token count, checked: some trajectories, one advantage each, none over ``max_seq_len``."""
    if len(trajectories) == 0:
        raise BatchError("collate got no trajectories")
    if len(advantages_per_traj) != len(trajectories):
        raise BatchError(f"collate got {len(trajectories)} trajectories but {len(advantages_per_traj)} advantages")
    bad = [i for i, t in enumerate(trajectories) if not hasattr(t, "tokens")]
    if bad:
        raise BatchError(f"collate takes trajectories (rollout.types.Trajectory: attributes tokens, loss_mask, ...); "
                         f"item {bad[0]} is a {type(trajectories[bad[0]]).__name__}")
    lens = [len(t.tokens) for t in trajectories]
    if max(lens) > max_seq_len:
        i = int(np.argmax(lens))
        raise BatchError(f"trajectory {i} has {lens[i]} tokens > optim.max_seq_len={max_seq_len}; "
                         "raise optim.max_seq_len or cap rollout.max_cache_len")
    return lens


def _optional_field(trajectories: Sequence[Any], k: str, why: str) -> Optional[list[Any]]:
    """Each trajectory's ``k`` (``old_logp`` / ``routes``) when they all carry one, None when none does.

    Raises:
        BatchError: some carry it and others not (the message ends with ``why``)."""
    vals = [getattr(t, k, None) for t in trajectories]
    if all(v is None for v in vals):
        return None
    missing = sum(v is None for v in vals)
    if missing:
        raise BatchError(f"{missing} of {len(vals)} trajectories carry no {k} while the others do{why}")
    return vals


def _old_logp_rows(olds: list[Any], lens: list[int], T: int) -> np.ndarray:
    out = np.full((len(olds), T), inert("old_logp"), np.float32)
    for b, o in enumerate(olds):
        a = np.asarray(o, np.float32)
        if a.shape != (lens[b],):
            raise BatchError(f"trajectory {b}: field old_logp has shape {a.shape}, tokens has ({lens[b]},)")
        out[b, :lens[b]] = a
    return out


def _route_rows(rts: list[Any], lens: list[int], T: int) -> np.ndarray:
    tails = {np.shape(r)[1:] for r in rts}
    if len(tails) != 1 or len(next(iter(tails))) != 2:
        raise BatchError(f"trajectory routes must all be [T_i, n_moe_layers, k] of one shape; got tails {sorted(tails)}")
    dt = np.result_type(*[np.asarray(r).dtype for r in rts])
    out = np.full((len(rts), T, *next(iter(tails))), inert("routes"), dt)
    for b, r in enumerate(rts):
        if np.shape(r)[0] != lens[b]:
            raise BatchError(f"trajectory {b}: routes has {np.shape(r)[0]} positions, tokens has {lens[b]}")
        out[b, :lens[b]] = r
    return out


def _fill_row(out: dict[str, np.ndarray], b: int, t: Any, adv: Any, n: int) -> None:
    """Row ``b`` of ``out``: trajectory ``t``'s ``n`` tokens and its advantage (a scalar broadcast, or one per token)."""
    for k in ("tokens", "loss_mask", "behav_logp", "versions", "turn_ids"):
        a = np.asarray(getattr(t, k))
        if a.shape != (n,):
            raise BatchError(f"trajectory {b}: field {k} has shape {a.shape}, tokens has ({n},)")
        out[k][b, :n] = a
    out["attention_mask"][b, :n] = True
    a = np.asarray(adv, np.float32)
    if a.ndim != 0 and a.shape != (n,):
        raise BatchError(f"trajectory {b}: advantages shape {a.shape}; expected a scalar or ({n},)")
    out["advantages"][b, :n] = a


def validate_batch(
    batch: Mapping[str, Any],
    *,
    max_seq_len: int,
    vocab_size: Optional[int] = None,
    row_divisor: int = 1,
    current_version: Optional[int] = None,
    require_versions: bool = False,
    num_experts: Optional[int] = None,
) -> dict[str, np.ndarray]:
    """Check a learner batch and return normalised numpy copies (int32 / bool / float32).

    Args:
        batch: dict with :data:`BATCH_FIELDS` (and optionally ``old_logp``), each [B, T].
        max_seq_len: T must be <= this.
        vocab_size: token ids under the attention mask must lie in [0, vocab_size).
        row_divisor: B must be a multiple of this (minibatches * microbatches).
        current_version: loss tokens may not carry a version above it (a future version).
        require_versions: every loss token must carry a version >= 0 (the snapshot store scores them).
        num_experts: ``routes`` ids must lie in [-1, num_experts) and are stored in
            ``jax_rl.models.qwen3.route_dtype(num_experts)`` (None: int32, ids >= -1).

    Returns:
        dict of numpy arrays with the dtypes of :data:`BATCH_FIELDS`.

    Raises:
        BatchError: with a message naming the field and the rule.
    """
    if not isinstance(batch, Mapping):
        raise BatchError(f"learner batch must be a dict of arrays, got {type(batch).__name__}")
    missing = [k for k in BATCH_FIELDS if k not in batch]
    if missing:
        raise BatchError(f"learner batch is missing field(s) {missing}; expected {list(BATCH_FIELDS)}")
    unknown = [k for k in batch if k not in BATCH_FIELDS and k not in OPTIONAL_FIELDS]
    if unknown:
        raise BatchError(f"learner batch has unknown field(s) {unknown}")
    tok = np.asarray(batch["tokens"])
    if tok.ndim != 2:
        raise BatchError(f"batch['tokens'] must be [B, T], got shape {tok.shape}")
    B, T = tok.shape
    if B == 0 or T == 0:
        raise BatchError(f"batch is empty: tokens shape {tok.shape}")
    if T > max_seq_len:
        raise BatchError(f"batch has T={T} > optim.max_seq_len={max_seq_len} (over-long sequences)")
    if B % row_divisor:
        raise BatchError(
            f"batch has B={B} rows, not a multiple of optim.minibatches*optim.microbatches={row_divisor}"
        )
    out: dict[str, np.ndarray] = {}
    spec = dict(BATCH_FIELDS)
    spec.update({k: v for k, v in OPTIONAL_FIELDS.items() if k in batch})
    for k, (kind, dt) in spec.items():
        if kind == "routes":
            out[k] = _routes_field(batch[k], (B, T), num_experts)
            continue
        out[k] = _field(k, kind, dt, batch[k], (B, T))
    am, lm = out["attention_mask"], out["loss_mask"]
    if np.any(lm & ~am):
        raise BatchError("batch['loss_mask'] is True where attention_mask is False")
    if np.any(lm[:, 0]):
        raise BatchError("batch['loss_mask'][:, 0] must be False: the first token has no context to score it")
    if np.any(am[:, 1:] & ~am[:, :-1]):
        raise BatchError("batch must be right-padded: attention_mask rows must be a run of True then False")
    if vocab_size is not None:
        t = out["tokens"][am]
        if t.size and (t.min() < 0 or t.max() >= vocab_size):
            raise BatchError(f"batch['tokens'] has ids outside [0, {vocab_size}) (min {t.min()}, max {t.max()})")
    if not np.all(np.isfinite(out["advantages"][lm])):
        raise BatchError("batch['advantages'] is not finite on some loss tokens")
    v = out["versions"][lm]
    if current_version is not None and v.size and v.max() > current_version:
        raise BatchError(
            f"batch has loss tokens of version {int(v.max())} > the learner's version {current_version} (future version)"
        )
    if require_versions and v.size and v.min() < 0:
        raise BatchError("exact old log-probs from the snapshot store need batch['versions'] >= 0 on every loss token")
    return out


def _routes_field(value: Any, shape: tuple[int, int], num_experts: Optional[int]) -> np.ndarray:
    """``batch['routes']`` checked: int [B, T, n_moe_layers, k], ids in [-1, num_experts)."""
    a = np.asarray(value)
    if a.ndim != 4 or a.shape[:2] != shape:
        raise BatchError(f"batch['routes'] has shape {a.shape}; expected {shape} + (n_moe_layers, k)")
    if not np.issubdtype(a.dtype, np.integer):
        raise BatchError(f"batch['routes'] has dtype {a.dtype}; expected an integer dtype")
    hi = num_experts if num_experts is not None else np.iinfo(np.int32).max
    if a.size and (a.min() < -1 or a.max() >= hi):
        raise BatchError(f"batch['routes'] has expert ids outside [-1, {hi}) (min {a.min()}, max {a.max()})")
    if num_experts is None:
        return np.ascontiguousarray(a, dtype=np.int32)

    return np.ascontiguousarray(a, dtype=route_dtype(num_experts))


def _field(k: str, kind: str, dt: Any, value: Any, shape: tuple[int, int]) -> np.ndarray:
    """One batch field checked for shape and dtype kind, as a contiguous ``dt`` array."""
    a = np.asarray(value)
    if a.shape != shape:
        raise BatchError(f"batch[{k!r}] has shape {a.shape}; expected {shape} like tokens")
    if kind == "int":
        if not np.issubdtype(a.dtype, np.integer):
            raise BatchError(f"batch[{k!r}] has dtype {a.dtype}; expected an integer dtype (int32)")
        if a.size and (a.min() < np.iinfo(np.int32).min or a.max() > np.iinfo(np.int32).max):
            raise BatchError(f"batch[{k!r}] has values outside int32")
    elif kind == "bool":
        if a.dtype != np.bool_:
            raise BatchError(f"batch[{k!r}] has dtype {a.dtype}; expected bool")
    elif not np.issubdtype(a.dtype, np.floating):
        raise BatchError(f"batch[{k!r}] has dtype {a.dtype}; expected a float dtype (float32)")
    return np.ascontiguousarray(a, dtype=dt)


def group_advantages(algo: AlgoConfig, groups: Sequence[Sequence[Any]]) -> list[np.ndarray]:
    """Per-trajectory advantages per group by the ``algo.advantage`` estimator
    (:func:`jax_rl.learner.advantages.compute_advantages`), as a list of float32 [G] arrays."""
    rewards = np.concatenate([np.asarray([t.reward for t in g], np.float32) for g in groups])
    gids = np.concatenate([np.full(len(g), i, np.int32) for i, g in enumerate(groups)])
    adv = np.asarray(compute_advantages(algo, rewards, gids), np.float32)
    out, i = [], 0
    for g in groups:
        out.append(adv[i: i + len(g)])
        i += len(g)
    return out


def sorted_groups(groups: Sequence[Sequence[Any]]) -> tuple[list, list]:
    """``(groups, trajectories)``: the groups by ``group_id`` (the batch's row order, so the fp32
    summation order does not depend on which rollout thread finished first) and their trajectories
    flattened in that order: the rows of :func:`learner_batch`."""
    groups = sorted(groups, key=lambda g: g[0].group_id)
    return groups, [t for g in groups for t in g]


def learner_batch(cfg: Config, groups: Sequence[Sequence[Any]], pad_id: int, *, rows: Optional[int] = None):
    """Turn GRPO groups from the buffer into a learner batch of at least ``rows`` rows (default
    ``optim.batch_size`` over ``jax.process_count()``: each process's equal share; the runtime passes
    :func:`jax_rl.runtime.engines.local_groups_per_step` x ``algo.group_size``, or the whole
    ``optim.batch_size`` for a disaggregated run's global batch).

    Groups are sorted by ``group_id`` so the row order (hence fp32 summation order) does not
    depend on which rollout thread finished first.

    Returns:
        ``(groups, trajectories, batch)``: the sorted groups, their trajectories flattened, and
        the padded ``[B, T]`` batch of :func:`collate` with per-trajectory
        advantages broadcast over each row. B is ``optim.batch_size`` (divided by the process count in a
        multi-process run: each process's share) whenever the groups hold
        fewer trajectories (a group short of failed / over-long members): inert rows
        (:func:`pad_rows`, no loss tokens) fill it, so the batch always splits into
        ``minibatches x microbatches`` and one shape is compiled; ``step_row`` logs them as
        ``padded_rows``.

    Raises:
        BatchError: a trajectory longer than ``optim.max_seq_len``.
    """
    groups, trajs = sorted_groups(groups)
    adv = group_advantages(cfg.algo, groups)
    batch = collate(trajs, np.concatenate(adv), cfg.optim.max_seq_len, cfg.optim.seq_len_buckets, pad_id=pad_id)
    if rows is None:  # multi-process: this process's share
        rows = cfg.optim.batch_size // cfg.algo.group_size // jax.process_count() * cfg.algo.group_size
    if len(trajs) < rows:
        batch = pad_rows(batch, rows, pad_id)
    return groups, trajs, batch
