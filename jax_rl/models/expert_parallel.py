"""Expert parallelism for the Qwen3-MoE block: tokens go to the expert shards and back.

Used by :class:`jax_rl.models.qwen3.MoE` when ``moe_dispatch="ragged"`` and the ambient
``jax.set_mesh`` mesh has an ``expert`` axis of size EP > 1. The experts' params [E, D, F] /
[E, F, D] are sharded over ``expert`` (logical name ``expert``, ``jax_rl.sharding``), so each
expert shard holds E/EP experts; without this path XLA would all-gather every expert's weights
onto every device.

Method (MaxText ``layers/moe.py`` ``RoutedMoE.sparse_matmul`` with expert parallelism, GShard
capacity dispatch, Lepikhin et al. 2020, arXiv:2006.16668, section 2.2), all inside one
``jax.shard_map`` over the whole mesh:

1. Routing (top-k, or ``forced_expert_ids``) is done by the caller outside the shard_map, so
   the router weights get their gradient through the combine weights ``w``.
2. Each device holds the tokens of its ``activation_batch`` shard (replicated over
   ``expert``, as the rules table has it) and takes its 1/EP chunk of them (flattened [B*T],
   padded with invalid tokens up to a multiple of EP). When the batch is already sharded over
   ``expert`` (``batch_axes`` containing it) the chunk is the whole local shard.
3. Each token copy (token, k-th choice) goes to expert shard ``id // (E/EP)``. A fixed
   ``capacity`` C of slots per (source device, destination shard) pair makes the exchange a
   plain ``jax.lax.all_to_all`` of a [EP, C, D] buffer. Slots are filled first-choice first
   (all top-1 copies, then all top-2 copies, ..., each in token order: GShard's priority), and
   a copy that finds its destination full is dropped (contributes 0; the token keeps its
   residual) and counted. ``capacity_factor=None`` (the default) is dropless: C = the chunk's
   number of copies, which no routing can exceed.
4. On the expert shard the received rows are sorted by local expert and run through the local
   experts' SwiGLU with ``jax.lax.ragged_dot`` (grouped matmul; the megablox ``gmm`` role).
   Empty slots sort last, outside every group, and come out as zeros.
5. The reverse ``all_to_all`` brings the outputs back into the same slots; the combine
   ``y[n] = sum_k w[n, k] * out[slot[n, k]]`` is a gather (no scatter), then a ``psum`` over
   the axes that shard F (``tensor``, Megatron-style expert TP) and an ``all_gather`` of the
   chunks over ``expert`` restore the caller's layout.

``jax.lax.ragged_all_to_all`` (MaxText's dropless EP exchange) would send only the rows
needed, but XLA:CPU does not implement it in jax 0.10.2 ("HLO opcode ``ragged-all-to-all`` is
not supported by XLA:CPU ThunkEmitter"), so the capacity all_to_all is the one path here: it
runs and is tested on the fake CPU devices and compiles for TPU. Cost of the dropless default:
the [EP*C, D] buffers per device hold EP times the rows a uniform routing needs (the grouped
matmuls run over the empty slots too); ``capacity_factor`` ~1.25-2 brings that down at the
price of dropped copies under load imbalance (which an RL learner should watch: a drop makes
the learner's forward differ from the rollout's).

TPU (libtpu AOT for v5p-8, mesh expert=4, compiler estimates): the block at Qwen3-30B-A3B
sizes (E=128, k=8, D=2048, F=768, bf16, 8192 tokens) compiles to ``all-to-all`` +
``ragged-dot``; fwd+bwd temp memory 1062 MiB dropless, 467 MiB at capacity factor 1.25 (the
single-shard ragged path on fsdp=4, experts gathered: 1544 MiB).

The grouped matmul (``matmul``, config ``model.moe_matmul``): ``ragged_dot`` is
``jax.lax.ragged_dot``; ``megablox`` is the Pallas TPU megablox kernels (``gmm`` forward and
input gradient, ``tgmm`` weight gradient: ``jax.experimental.pallas.ops.tpu.megablox``, what
MaxText's ``megablox: true`` runs) under our own VJP (:func:`grouped_matmul`). Why megablox on
TPU: the weight gradient of ``ragged_dot`` is a ragged-*contracting* ``ragged_dot_general``,
which libtpu (jax 0.10.2 / libtpu 0.0.42) lowers densely: each row is masked into a
``[G, M, D]`` copy per local expert and a batched matmul runs over all of them, G times the
FLOPs of the gradient (measured by the compiler's cost analysis on v5p: 16.0x at G=16, with
``[16, 327680, 2048]`` bf16 selects, 70 GiB each, in one Qwen3-30B-A3B layer's gradient);
``tgmm`` visits only the (row tile, group) pairs that exist (cost analysis: exactly 2 M K N
per matmul for dx + dw). The kernels run inside this module's ``shard_map`` with
``check_vma=False`` (their Pallas out_shape carries no varying-axes type, as for splash
attention); the single-shard path (``MoE._ragged``, no shard_map) keeps ``ragged_dot``
because XLA cannot partition a Mosaic kernel.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jax_rl.sharding import axis_names, logical_to_pspec

Array = jax.Array

__all__ = ["EXPERT_AXIS", "MOE_MATMULS", "expert_parallel_size", "ep_capacity", "EPOptions", "expert_parallel_moe",
           "grouped_matmul", "resolve_moe_matmul"]

MOE_MATMULS: tuple[str, ...] = ("auto", "ragged_dot", "megablox")
"""Names accepted by ``model.moe_matmul`` (``auto``: megablox on a TPU backend, else ragged_dot)."""

MEGABLOX_INTERPRET = False
"""Run the megablox kernels with the Pallas interpreter (CPU tests). Never on a real TPU compile."""

MEGABLOX_TILE = (512, 512, 512)
"""Megablox (rows, contracting, output) tile upper bounds; a dim smaller than its bound is one
full-dim tile. Rows are zero-padded to a multiple of the row tile (at least 128)."""

EXPERT_AXIS = "expert"
"""The mesh axis experts are sharded over (``jax_rl.sharding.MESH_AXES``)."""


def expert_parallel_size(mesh=None) -> int:
    """Size of the ``expert`` axis of ``mesh`` (default: the ambient ``jax.set_mesh`` abstract
    mesh); 1 when there is no mesh or no such axis."""
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    if mesh is None or mesh.empty or EXPERT_AXIS not in mesh.axis_names:
        return 1
    return int(dict(zip(mesh.axis_names, mesh.axis_sizes))[EXPERT_AXIS])


def ep_capacity(num_copies: int, ep: int, capacity_factor: float | None) -> int:
    """Slots per (source device, destination expert shard) pair.

    ``num_copies`` = tokens x k of one source chunk. ``None`` -> dropless: ``num_copies`` (all
    copies could go to one shard). Otherwise GShard's ``ceil(capacity_factor * num_copies /
    ep)`` (the uniform load times the factor), at least 1 and at most ``num_copies``.
    Raises ValueError for a factor <= 0.
    """
    if capacity_factor is None:
        return max(1, num_copies)
    if not capacity_factor > 0:
        raise ValueError(f"moe_capacity_factor must be > 0 or None (dropless), "
                         f"got {capacity_factor}")
    return max(1, min(num_copies, math.ceil(capacity_factor * num_copies / ep)))


def resolve_moe_matmul(kind: str) -> str:
    """``auto`` -> ``megablox`` on a TPU backend (``jax.default_backend()``), else
    ``ragged_dot``; the others unchanged. Raises ValueError for an unknown name."""
    if kind not in MOE_MATMULS:
        raise ValueError(f"moe_matmul must be one of {MOE_MATMULS}, got {kind!r}")
    if kind == "auto":
        return "megablox" if jax.default_backend() == "tpu" else "ragged_dot"
    return kind


def _row_tiles() -> tuple[int, ...]:
    """Megablox row tiles tried, largest first (``MEGABLOX_TILE[0]``, 256, 128)."""
    return (MEGABLOX_TILE[0], 256, 128)


def _row_tile(m: int) -> int:
    """The row tile ``m`` rows are padded to a multiple of: the largest not above m (128 minimum)."""
    return next((t for t in _row_tiles() if m >= t), 128)


def _precision(dtype):
    """Mosaic rejects an fp32-precision contraction of bf16 operands (e.g. under a global
    ``jax_default_matmul_precision="highest"``): the kernels of a bf16 matmul are traced at the
    default precision (as splash attention); fp32 ones keep the ambient setting. Part of the
    kernels' precision is read when the program is lowered, so lower a bf16 megablox program
    under ``jax.default_matmul_precision("default")`` too (``jax-rl compile`` does; it is JAX's
    default)."""
    import contextlib

    return contextlib.nullcontext() if dtype == jnp.float32 else jax.default_matmul_precision("default")


def _tiling(m: int, k: int, n: int) -> tuple[int, int, int]:
    """Megablox tiles for one call's (rows, contracting, output) dims (its ``LutFn``; the backward
    calls see the dims swapped): the largest row tile of (512, 256, 128) dividing m (rows are
    padded to one), and ``MEGABLOX_TILE`` bounds on k and n (a smaller dim is one full tile)."""
    tm = next((t for t in _row_tiles() if m % t == 0), m)
    return tm, min(MEGABLOX_TILE[1], k), min(MEGABLOX_TILE[2], n)


def _valid_rows(y: Array, group_sizes: Array) -> Array:
    """Zero the rows of a megablox output past the last group (the kernel never writes them)."""
    rows = jnp.arange(y.shape[0], dtype=jnp.int32)[:, None]
    return jnp.where(rows < jnp.sum(group_sizes), y, jnp.zeros((), y.dtype))


def _megablox_kernels():
    """The megablox kernel module (its package re-exports ``gmm`` as a function of that name)."""
    import importlib

    return importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _megablox(x, w, group_sizes, tiling, interpret):
    return _megablox_fwd(x, w, group_sizes, tiling, interpret)[0]


def _megablox_fwd(x, w, group_sizes, tiling, interpret):
    mb = _megablox_kernels()
    with _precision(x.dtype):
        y = mb.gmm(x, w, group_sizes, x.dtype, tiling, interpret=interpret)
    return _valid_rows(y, group_sizes), (x, w, group_sizes)


def _megablox_bwd(tiling, interpret, res, dy):
    mb = _megablox_kernels()
    x, w, group_sizes = res
    dy = dy.astype(x.dtype)
    with _precision(x.dtype):
        dx = mb.gmm(dy, w, group_sizes, x.dtype, tiling, transpose_rhs=True, interpret=interpret)
        dw = mb.tgmm(x.swapaxes(0, 1), dy, group_sizes, w.dtype, tiling, num_actual_groups=w.shape[0],
                     interpret=interpret)
    return _valid_rows(dx, group_sizes), dw, None


_megablox.defvjp(_megablox_fwd, _megablox_bwd)


def grouped_matmul(x: Array, w: Array, group_sizes: Array, matmul: str = "ragged_dot") -> Array:
    """Grouped matmul ``y[r] = x[r] @ w[g(r)]`` for rows sorted by group (``jax.lax.ragged_dot``
    semantics: rows past ``sum(group_sizes)`` belong to no group and come out 0).

    Args:
      x: [M, K] rows, grouped contiguously in group order (compute dtype).
      w: [G, K, N] per-group weights (same dtype as x).
      group_sizes: [G] int32, rows per group, ``sum <= M``.
      matmul: ``ragged_dot`` (``jax.lax.ragged_dot``) or ``megablox`` (Pallas TPU ``gmm`` /
        ``tgmm`` with a custom VJP: dx by ``gmm`` against w transposed, dw by ``tgmm``; rows
        zero-padded to a multiple of the row tile; runs only on a TPU or, with
        :data:`MEGABLOX_INTERPRET`, in the Pallas interpreter). See the module docstring for why.

    Returns:
      [M, N] in x.dtype (fp32 accumulation).

    Raises:
      ValueError: an unknown ``matmul`` (``auto`` must be resolved first:
      :func:`resolve_moe_matmul`).
    """
    if matmul == "ragged_dot":
        return jax.lax.ragged_dot(x, w, group_sizes)
    if matmul != "megablox":
        raise ValueError(f"grouped_matmul: matmul must be 'ragged_dot' or 'megablox', got {matmul!r}")
    M = x.shape[0]
    tm = _row_tile(M)
    Mp = -(-M // tm) * tm
    xp = jnp.pad(x, ((0, Mp - M), (0, 0))) if Mp != M else x
    y = _megablox(xp, w.astype(x.dtype), group_sizes.astype(jnp.int32), _tiling, bool(MEGABLOX_INTERPRET))
    return y[:M]


def _local_experts(x, w, ids, valid, wg, wu, wd, *, ep: int, capacity: int, matmul: str = "ragged_dot"):
    """One device's dispatch -> local experts -> return -> combine (inside the shard_map).

    x [N, D], w [N, k] (x.dtype), ids [N, k] int32 global expert ids, valid [N] bool (False =
    padding token), wg/wu [El, D, F'], wd [El, F', D] (this shard's El = E/EP experts, F' the
    local F slice). Returns (y [N, D] partial over the F slice, dropped copies int32 [],
    dropped copies per token int32 [N]).
    """
    N, D = x.shape
    k = ids.shape[-1]
    El = wg.shape[0]
    C = capacity
    dest = ids // El  # [N, k] destination expert shard
    local_id = ids % El  # [N, k] expert index on that shard
    # slot of each copy in its destination's C slots: first choices first, then token order
    dest_km = dest.T.reshape(-1)  # [k*N], k-major
    valid_km = jnp.broadcast_to(valid[None, :], (k, N)).reshape(-1)
    onehot = jax.nn.one_hot(dest_km, ep, dtype=jnp.int32) * valid_km[:, None].astype(jnp.int32)
    pos_km = jnp.take_along_axis(jnp.cumsum(onehot, axis=0), dest_km[:, None], axis=1)[:, 0] - 1
    pos = pos_km.reshape(k, N).T  # [N, k]
    keep = valid[:, None] & (pos < C)
    dropped_tok = jnp.sum(valid[:, None] & (pos >= C), axis=1, dtype=jnp.int32)  # [N]
    dropped = jnp.sum(dropped_tok, dtype=jnp.int32)
    slot = jnp.where(keep, dest * C + pos, ep * C)  # [N, k]; ep*C = "nowhere"
    flat_slot = slot.reshape(-1)
    token = jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32)[:, None], (N, k)).reshape(-1)
    slot_token = jnp.full((ep * C + 1,), N, jnp.int32).at[flat_slot].set(token)[:ep * C]
    slot_expert = jnp.full((ep * C + 1,), El, jnp.int32).at[flat_slot].set(
        local_id.reshape(-1))[:ep * C]
    # an empty slot (token N, past the end) reads zeros: a filling gather, not a padded copy of x
    send = jnp.take(x, slot_token, axis=0, mode="fill", fill_value=0).reshape(ep, C, D)
    recv = jax.lax.all_to_all(send, EXPERT_AXIS, 0, 0)  # [ep (source), C, D]
    recv_expert = jax.lax.all_to_all(slot_expert.reshape(ep, C), EXPERT_AXIS, 0, 0).reshape(-1)
    # local experts, grouped matmul over rows sorted by local expert (empty slots last)
    order = jnp.argsort(recv_expert, stable=True)
    inverse = jnp.argsort(order)
    group_sizes = jnp.bincount(recv_expert, length=El).astype(jnp.int32)  # El (empty) dropped
    xs = recv.reshape(ep * C, D)[order]
    g = grouped_matmul(xs, wg, group_sizes, matmul)
    u = grouped_matmul(xs, wu, group_sizes, matmul)
    ys = grouped_matmul(jax.nn.silu(g) * u, wd, group_sizes, matmul)[inverse]  # [ep*C, D]
    back = jax.lax.all_to_all(ys.reshape(ep, C, D), EXPERT_AXIS, 0, 0).reshape(ep * C, D)
    # a dropped copy (slot ep*C, past the end) reads zeros (no padded copy of the [ep*C, D] buffer)
    y = jnp.einsum("nkd,nk->nd", jnp.take(back, slot, axis=0, mode="fill", fill_value=0),
                   jnp.where(keep, w, jnp.zeros_like(w)))
    return y, dropped, dropped_tok


class _EPLayout(NamedTuple):
    """How :func:`expert_parallel_moe` lays a [B, T] batch over the mesh (static Python ints and axis names):
    ``ep`` expert shards; B sharded over ``batch_axes`` (``n_batch`` shards of ``n_local`` tokens each);
    ``split``: the tokens are replicated over ``expert``, so each expert device takes one of ``n_chunks``
    chunks of ``chunk`` tokens (else one chunk of all ``n_local``); ``capacity`` slots per (device, expert
    shard) pair; ``token_axes`` the chunks' mesh axes; ``f_axes`` the experts' F axes to sum partial outputs
    over."""
    ep: int
    batch_axes: tuple[str, ...]
    split: bool
    f_axes: tuple[str, ...]
    n_batch: int
    n_local: int
    chunk: int
    n_chunks: int
    capacity: int
    token_axes: tuple[str, ...]


def _ep_layout(mesh, x_shape: tuple, ids_shape: tuple, wg_shape: tuple, batch_axes, capacity_factor) -> _EPLayout:
    """:class:`_EPLayout` of tokens ``x_shape`` [B, T, D] routed to ``ids_shape[-1]`` experts each, experts of
    shape ``wg_shape`` on ``mesh``. Raises ValueError: no ``expert`` axis, E not divisible by EP, experts not sharded over
    ``expert`` alone, B not divisible by its shards, a bad capacity factor."""
    if mesh is None or mesh.empty or EXPERT_AXIS not in mesh.axis_names:
        raise ValueError("expert_parallel_moe needs a mesh with an 'expert' axis "
                         "(jax.set_mesh)")
    ep = expert_parallel_size(mesh)
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    B, T, _ = x_shape
    k = ids_shape[-1]
    E = wg_shape[0]
    if E % ep:
        raise ValueError(f"num_experts={E} is not divisible by mesh.expert={ep}")
    if batch_axes is None:
        batch_axes = logical_to_pspec(("activation_batch",), shape=(B,), mesh=mesh)[0]
    batch_axes = axis_names(batch_axes)
    split = EXPERT_AXIS not in batch_axes  # tokens replicated over expert: take a 1/EP chunk
    # the experts' own sharding by the rules: E over expert, F over (tensor); D is gathered
    e_spec, _, f_spec = logical_to_pspec(("expert", "embed", "mlp"), shape=wg_shape, mesh=mesh)
    if ep > 1 and axis_names(e_spec) != (EXPERT_AXIS,):
        raise ValueError(f"experts [E={E}, ...] are not sharded over {EXPERT_AXIS!r} alone "
                         f"(rules give {e_spec!r})")
    f_axes = tuple(a for a in axis_names(f_spec) if a not in batch_axes)
    n_batch = math.prod(sizes[a] for a in batch_axes)
    if B % n_batch:
        raise ValueError(f"batch {B} is not divisible by the {batch_axes} shards ({n_batch})")
    n_local = (B // n_batch) * T
    chunk = -(-n_local // ep) if split else n_local
    return _EPLayout(ep=ep, batch_axes=batch_axes, split=split, f_axes=f_axes, n_batch=n_batch, n_local=n_local,
                     chunk=chunk, n_chunks=ep if split else 1, capacity=ep_capacity(chunk * k, ep, capacity_factor),
                     token_axes=tuple(batch_axes) + ((EXPERT_AXIS,) if split else ()))


def _spec(axes):
    """A PartitionSpec entry for ``axes``: None, the one axis, or the tuple."""
    return None if not axes else (axes[0] if len(axes) == 1 else tuple(axes))


def _to_chunks(a: Array, lay: _EPLayout) -> Array:
    """[B, T, ...] -> [n_batch * n_chunks * chunk, ...]: B's shards are the leading blocks, each padded to
    ``n_chunks * chunk`` tokens, one chunk per (batch shard, expert) device; XLA slices the chunks out of the
    expert-replicated tokens and gathers them back."""
    pad = lay.n_chunks * lay.chunk - lay.n_local
    a = a.reshape(lay.n_batch, lay.n_local, *a.shape[2:])
    if pad:
        a = jnp.pad(a, ((0, 0), (0, pad)) + ((0, 0),) * (a.ndim - 2))
    return a.reshape(lay.n_batch * lay.n_chunks * lay.chunk, *a.shape[2:])


@dataclass(frozen=True)
class EPOptions:
    """The static options of :func:`expert_parallel_moe` (Python values, fixed at trace time):

    Attributes:
      capacity_factor: None = dropless (default); else slots per (device, expert shard) pair =
        ``ceil(capacity_factor * copies / EP)`` (:func:`ep_capacity`); copies over it are dropped.
      batch_axes: mesh axes B is sharded over (default: what ``activation_batch`` maps to for
        this B under ``jax_rl.sharding.LOGICAL_RULES``).
      mesh: default the ambient ``jax.set_mesh`` mesh (must have an ``expert`` axis).
      matmul: the local experts' grouped matmul, ``ragged_dot`` or ``megablox``
        (:func:`grouped_matmul`; ``auto`` is resolved by :func:`resolve_moe_matmul`).
      per_token: fill the third output, each token's dropped copies int32 [B, T] (laid out like x's
        tokens; the rollout engine's per-slot drop count). Default False: the program is unchanged
        and the third output None (no flag changes the arity).
    """

    capacity_factor: float | None = None
    batch_axes: Sequence[str] | str | None = None
    mesh: Any = None
    matmul: str = "ragged_dot"
    per_token: bool = False


def expert_parallel_moe(x: Array, w: Array, ids: Array, wg: Array, wu: Array, wd: Array, *,
                        valid: Array | None = None, options: EPOptions = EPOptions()
                        ) -> tuple[Array, Array, Array | None]:
    """Expert-parallel experts + combine of a MoE block (pure, jit-able; see the module doc):
    ``y[b,t] = sum_k w[b,t,k] * expert_{ids[b,t,k]}(x[b,t])``, the SwiGLU expert
    ``(silu(x @ wg[e]) * (x @ wu[e])) @ wd[e]``.

    Args:
      x: [B, T, D] tokens (compute dtype), sharded over ``batch_axes`` on B.
      w: [B, T, k] combine weights (cast to x.dtype; gradient flows to them, hence to the router).
      ids: [B, T, k] int global expert ids in [0, E).
      wg, wu: [E, D, F] gate / up projections; wd: [E, F, D] down projection (x.dtype).
      valid: [B, T] bool, False for a token that takes no slot (right padding: its output is 0
        and it is neither sent nor counted as dropped), so padding never pushes a real token's
        copy over the capacity. Default: every token valid.
      options: the static options (:class:`EPOptions`: capacity factor, batch axes, mesh, grouped
        matmul, per-token drops).

    Returns:
      (y [B, T, D] x.dtype, laid out like x; dropped int32 [] replicated: valid token copies
      dropped for capacity over the whole batch, 0 when dropless; per-token drops [B, T] int32 with
      ``options.per_token``, else None).

    Raises:
      ValueError: no mesh / no ``expert`` axis, E not divisible by EP, a bad capacity factor or
      an unknown ``matmul``.
    """
    matmul, per_token = resolve_moe_matmul(options.matmul), options.per_token
    mesh = jax.sharding.get_abstract_mesh() if options.mesh is None else options.mesh
    lay = _ep_layout(mesh, x.shape, ids.shape, wg.shape, options.batch_axes, options.capacity_factor)
    B, T, D = x.shape
    k = ids.shape[-1]
    ep, capacity, f_axes, token_axes = lay.ep, lay.capacity, lay.f_axes, lay.token_axes
    n_batch, n_chunks, chunk, n_local = lay.n_batch, lay.n_chunks, lay.chunk, lay.n_local
    valid = _to_chunks(jnp.ones((B, T), bool) if valid is None else jnp.asarray(valid, bool).reshape(B, T), lay)

    def body(x, w, ids, valid, wg, wu, wd):
        y, dropped, dropped_tok = _local_experts(x, w, ids, valid, wg, wu, wd, ep=ep, capacity=capacity,
                                                 matmul=matmul)
        if f_axes:  # each device holds an F slice of its experts: sum the partial outputs
            y = jax.lax.psum(y, f_axes)
        if per_token:
            return y, jax.lax.psum(dropped, token_axes), dropped_tok
        return y, jax.lax.psum(dropped, token_axes)

    tok = P(_spec(token_axes), None)
    f = _spec(f_axes)
    wspec, dspec = P(EXPERT_AXIS, None, f), P(EXPERT_AXIS, f, None)
    fn = jax.shard_map(body, mesh=mesh, out_specs=(tok, P(), P(_spec(token_axes))) if per_token else (tok, P()),
                       in_specs=(tok, tok, tok, P(_spec(token_axes)), wspec, wspec, dspec),
                       check_vma=matmul != "megablox")
    out = fn(_to_chunks(x.reshape(B, T, D), lay), _to_chunks(w.astype(x.dtype).reshape(B, T, k), lay),
             _to_chunks(ids.astype(jnp.int32).reshape(B, T, k), lay), valid, wg, wu, wd)
    y = out[0].reshape(n_batch, n_chunks * chunk, D)[:, :n_local].reshape(B, T, D)
    tok_drops = out[2].reshape(n_batch, n_chunks * chunk)[:, :n_local].reshape(B, T) if per_token else None
    return y, out[1], tok_drops
