"""Fused attention kernels for the Qwen3 model: Pallas TPU splash attention (``model.attention:
splash``, :func:`splash_attend`) and cuDNN flash attention on a GPU (``model.attention: cudnn``,
:func:`cudnn_attend`, at the end of this module).

Wraps ``jax.experimental.pallas.ops.tpu.splash_attention`` (the kernel MaxText uses for
``attention: flash`` on TPU, ``maxtext/layers/attention_op.py``) in the model's layout:

    q [B,T,N,H], k/v [B,T,K,H] (GQA: N % K == 0), segment_ids [B,T] int32 -> [B,T,N,H]

Causal mask and-ed with segment ids: a query attends to keys ``s <= t`` with the same segment
id. Right padding is segment 0 and valid tokens segment 1, so valid queries never see padding
(padded queries see only padding: their outputs are garbage that the caller masks; no row is
empty, so no NaN). T is padded up to a multiple of the kernel's block (128) with segment -1
(never attended to by real tokens).

Numerics differ from the XLA path (``qwen3.attend``, HF eager): q is scaled by ``H**-0.5``
before the dot and the softmax is online (flash) in fp32; on CPU with the Pallas interpreter
the difference is ~1e-6 in fp32 (tests/models/test_scan_attention.py).

Under a ``jax.set_mesh`` mesh the kernel runs inside ``jax.shard_map``: batch over the
``activation_batch`` mesh axes, heads over ``tensor`` when both N and K divide by it. A jit
over several devices WITHOUT an ambient mesh fails to lower ("Mosaic kernels cannot be
automatically partitioned"): set the mesh with ``jax.set_mesh`` (docs/design.md §5 Decisions).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as _sk
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as _sm
from jax.sharding import PartitionSpec as P

from jax_rl.sharding import logical_to_pspec

Array = jax.Array

__all__ = ["splash_attend", "SPLASH_BLOCK", "cudnn_attend"]

SPLASH_BLOCK = 128
"""Query/key block of the kernel (BlockSizes.get_default()); T is padded to a multiple."""

INTERPRET = False
"""Run the kernel with the Pallas interpreter (CPU tests). Never on a real TPU compile."""


def _block(Tp: int) -> int:
    for b in (512, 256, 128):
        if Tp % b == 0:
            return b
    return SPLASH_BLOCK


@functools.lru_cache(maxsize=64)
def _kernel(n_heads: int, Tp: int, interpret: bool):
    b = _block(Tp)
    sizes = _sk.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b,
                           block_kv_dkv=b, block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b)
    mask = _sm.MultiHeadMask([_sm.CausalMask((Tp, Tp)) for _ in range(n_heads)])
    return _sk.make_splash_mha(mask=mask, head_shards=1, q_seq_shards=1, block_sizes=sizes,
                               interpret=interpret)


def _local(qh: Array, kh: Array, vh: Array, seg: Array, interpret: bool) -> Array:
    """Per-shard body: qh [b,N,Tp,H], kh/vh [b,K,Tp,H], seg [b,Tp] -> [b,N,Tp,H]."""
    kernel = _kernel(qh.shape[1], qh.shape[2], interpret)

    def one(q, k, v, s):
        return kernel(q, k, v, segment_ids=_sk.SegmentIds(q=s, kv=s))

    return jax.vmap(one)(qh, kh, vh, seg)


def splash_attend(q: Array, k: Array, v: Array, segment_ids: Array, *,
                  interpret: bool | None = None) -> Array:
    """Causal GQA attention with the splash kernel.

    q [B,T,N,H], k/v [B,T,K,H] (same T: self-attention), segment_ids [B,T] int32 (1 = token,
    0 = padding) -> [B,T,N,H] in q.dtype. ``interpret`` defaults to the module's
    ``INTERPRET`` (False: compile the Mosaic TPU kernel, so only a TPU backend or a TPU
    topology AOT compile can run it). Raises ValueError for N % K != 0.
    """
    B, T, N, H = q.shape
    K = k.shape[2]
    if N % K:
        raise ValueError(f"num heads {N} is not a multiple of kv heads {K}")
    interpret = INTERPRET if interpret is None else interpret
    Tp = -(-T // SPLASH_BLOCK) * SPLASH_BLOCK
    pad = Tp - T
    qh = (q * jnp.asarray(H ** -0.5, q.dtype)).transpose(0, 2, 1, 3)  # [B,N,T,H]
    kh = k.astype(q.dtype).transpose(0, 2, 1, 3)
    vh = v.astype(q.dtype).transpose(0, 2, 1, 3)
    seg = jnp.asarray(segment_ids, jnp.int32)
    if pad:
        qh, kh, vh = (jnp.pad(a, ((0, 0), (0, 0), (0, pad), (0, 0))) for a in (qh, kh, vh))
        seg = jnp.pad(seg, ((0, 0), (0, pad)), constant_values=-1)
    body = functools.partial(_local, interpret=interpret)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is not None and not mesh.empty:
        bspec = logical_to_pspec(("activation_batch",), shape=(B,), mesh=mesh)[0]
        hspec = logical_to_pspec(("q_heads",), shape=(N,), mesh=mesh)[0]
        kspec = logical_to_pspec(("kv_heads",), shape=(K,), mesh=mesh)[0]
        if hspec != kspec:
            hspec = kspec = None
        qs, ks = P(bspec, hspec, None, None), P(bspec, kspec, None, None)
        body = jax.shard_map(body, mesh=mesh, in_specs=(qs, ks, ks, P(bspec, None)),
                             out_specs=qs, check_vma=False)
    if q.dtype == jnp.float32:
        o = body(qh, kh, vh, seg)
    else:  # Mosaic rejects an fp32-precision contraction of bf16 operands (e.g. under a
        # global jax_default_matmul_precision="highest")
        with jax.default_matmul_precision("default"):
            o = body(qh, kh, vh, seg)
    return o[:, :, :T].transpose(0, 2, 1, 3).astype(q.dtype)


# ---------------------------------------------------------------------------- cuDNN (GPU)

CUDNN_IMPLEMENTATION = "cudnn"
"""``implementation`` given to ``jax.nn.dot_product_attention`` by :func:`cudnn_attend`; tests on
the CPU set ``"xla"`` (the same function's reference implementation) to check the plumbing."""


def cudnn_attend(q: Array, k: Array, v: Array, valid: Array | None = None) -> Array:
    """Causal GQA attention through ``jax.nn.dot_product_attention`` (cuDNN flash attention on a
    GPU: no [T, S] score or probability array in memory, forward or backward).

    q [B,T,N,H], k/v [B,T,K,H] (N % K == 0), ``valid`` [B,T] bool or None -> [B,T,N,H] in q.dtype.
    Padding must be on the right (the learner's batches and the engine's prefill): a row's keys
    are its first ``sum(valid[b])`` positions (``key_value_seq_lengths``), at least 1, so a query
    always has a key and no row is empty (a fully padded row attends to position 0; its outputs
    are garbage the caller masks, as on the other paths). Scores are scaled by ``H**-0.5`` with
    an fp32 softmax (the same maths as ``qwen3.attend``, fused: ~1e-6 apart in fp32).

    cuDNN takes bf16 / fp16 only: fp32 inputs run the function's XLA implementation (the same
    values as ``attend``, with the [T, S] arrays). Raises ValueError for N % K != 0 and, from
    jax, for shapes cuDNN does not support.
    """
    B, T, N, H = q.shape
    K = k.shape[2]
    if N % K:
        raise ValueError(f"num heads {N} is not a multiple of kv heads {K}")
    impl = CUDNN_IMPLEMENTATION if q.dtype in (jnp.bfloat16, jnp.float16) else "xla"
    kv_len = None
    if valid is not None:
        kv_len = jnp.maximum(jnp.sum(jnp.asarray(valid, bool), axis=1, dtype=jnp.int32), 1)
    o = jax.nn.dot_product_attention(q, k.astype(q.dtype), v.astype(q.dtype), scale=H ** -0.5,
                                     is_causal=True, key_value_seq_lengths=kv_len, implementation=impl)
    return o.astype(q.dtype)
