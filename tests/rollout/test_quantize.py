"""Weight-only quantisation of the rollout engine (``rollout.quantize``, ``rollout/quantize.py``):
hand tables for a 2x2 weight in int8 / int4 / fp8, jit and eager, which params are quantised and
on which axes, the per-channel error bound as a hypothesis property, and the shardings of a
quantised tree."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from rollout.quantize import (
    QTYPES,
    contracted_axes,
    dequantize_params,
    dequantize_weight,
    is_qarray,
    quantize_params,
    quantize_weight,
    quantized_shardings,
)

HSET = settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])

# w [in=2, out=2]: channel 0 = (1.0, 0.3), channel 1 = (-1.0, 4.0); contracted axis 0
W = np.asarray([[1.0, -1.0], [0.3, 4.0]], np.float32)
# per channel: scale = absmax / B (B = 127.5 int8, 7.5 int4, 448 fp8), q = round-half-even(w / scale)
# saturated to the type (int8 [-128, 127], int4 [-8, 7]); fp8 = nearest e4m3fn (0.3 * 448 = 134.4 ->
# 128: spacing 16 in [128, 256))
TABLE = {
    "int8": dict(scale=[[1 / 127.5, 4 / 127.5]], q=[[127, -32], [38, 127]],
                 dq=[[127 / 127.5, -32 * 4 / 127.5], [38 / 127.5, 127 * 4 / 127.5]]),
    "int4": dict(scale=[[1 / 7.5, 4 / 7.5]], q=[[7, -2], [2, 7]],
                 dq=[[7 / 7.5, -2 * 4 / 7.5], [2 / 7.5, 7 * 4 / 7.5]]),
    "fp8": dict(scale=[[1 / 448, 4 / 448]], q=[[448, -112], [128, 448]],
                dq=[[1.0, -1.0], [128 / 448, 4.0]]),
}


class HandTableTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_tables(self):
        for mode, t in TABLE.items():
            q = self.variant(lambda w: quantize_weight(w, mode, (0,)))(jnp.asarray(W))
            assert q.qvalue.dtype == jnp.dtype(QTYPES[mode]) and q.scale.dtype == jnp.float32, mode
            chex.assert_trees_all_close(q.scale, jnp.asarray(t["scale"], jnp.float32), rtol=1e-6)
            chex.assert_trees_all_close(q.qvalue.astype(jnp.float32), jnp.asarray(t["q"], jnp.float32))
            dq = self.variant(lambda q: dequantize_weight(q, jnp.float32))(q)
            chex.assert_trees_all_close(dq, jnp.asarray(t["dq"], jnp.float32), rtol=1e-6, atol=1e-7)

    @chex.variants(with_jit=True, without_jit=True)
    def test_absmax_keeps_its_sign(self):
        # +absmax maps to +B = 127.5 and rounds (half to even) to 128: the conversion must saturate
        # to 127, never wrap to -128 (a sign flip of a channel's largest weight)
        w = jnp.asarray([[2.0, -2.0], [1.0, -1.0]], jnp.float32)
        dq = self.variant(lambda w: dequantize_weight(quantize_weight(w, "int8", (0,))))(w)
        np.testing.assert_array_equal(np.sign(np.asarray(dq)), np.sign(np.asarray(w)))
        assert float(jnp.max(jnp.abs(dq - w))) <= (2.0 / 127.5) / 2 + 1e-7

    @chex.variants(with_jit=True, without_jit=True)
    def test_zero_channel(self):
        w = jnp.asarray([[0.0, 1.0], [0.0, -0.5]], jnp.float32)
        dq = self.variant(lambda w: dequantize_weight(quantize_weight(w, "int8", (0,))))(w)
        assert bool(jnp.all(jnp.isfinite(dq)))
        chex.assert_trees_all_close(dq[:, 0], jnp.zeros(2))

    def test_bad_mode_and_axes(self):
        with pytest.raises(ValueError, match="mode must be one of"):
            quantize_weight(jnp.asarray(W), "int3", (0,))
        with pytest.raises(ValueError, match="contract must name"):
            quantize_weight(jnp.asarray(W), "int8", ())
        with pytest.raises(ValueError, match="rollout.quantize must be one of"):
            quantize_params({"q_proj": jnp.asarray(W)}, "int2", jnp.bfloat16)


def _bound(mode: str, w: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The per-element error bound of the module docstring, plus the fp32 rounding of w / scale
    and q * scale (a few ulps of |w|)."""
    ulps = 4 * np.finfo(np.float32).eps * np.abs(w)
    if mode == "fp8":
        return 2.0 ** -4 * np.abs(w) + 2.0 ** -10 * scale + ulps
    return scale / 2 + ulps


@HSET
@given(mode=st.sampled_from(["int8", "int4", "fp8"]),
       w=hnp.arrays(np.float32, hnp.array_shapes(min_dims=2, max_dims=3, min_side=1, max_side=6),
                    elements=st.floats(-50, 50, width=32)),
       axis=st.integers(0, 2))
def test_error_bound_per_channel(mode, w, axis):
    axis = axis % w.ndim
    q = quantize_weight(jnp.asarray(w), mode, (axis,))
    dq = np.asarray(dequantize_weight(q))
    scale = np.broadcast_to(np.asarray(q.scale), w.shape)
    assert q.scale.shape[axis] == 1 and all(q.scale.shape[a] == w.shape[a] for a in range(w.ndim) if a != axis)
    err = np.abs(w - dq)
    assert np.all(err <= _bound(mode, w, scale)), (mode, float(np.max(err - _bound(mode, w, scale))))


def _tree():
    """A params tree shaped like a tiny scanned MoE layer stack (the paths the engine sees)."""
    k = iter(jax.random.split(jax.random.PRNGKey(0), 16))
    n = lambda *s: jax.random.normal(next(k), s, jnp.float32)  # noqa: E731
    return {
        "embed_tokens": n(16, 8),
        "lm_head": n(8, 16),
        "norm": {"weight": n(8)},
        "layers": {
            "attn": {"q_proj": n(2, 8, 2, 4), "k_proj": n(2, 8, 1, 4), "v_proj": n(2, 8, 1, 4),
                     "o_proj": n(2, 2, 4, 8), "q_norm": {"weight": n(2, 4)}},
            "mlp": {"router": n(2, 8, 4), "gate_proj": n(2, 4, 8, 6), "up_proj": n(2, 4, 8, 6),
                    "down_proj": n(2, 4, 6, 8)},
        },
        "steps": jnp.arange(3, dtype=jnp.int32),
    }


def test_which_params_and_axes():
    qp = quantize_params(_tree(), "int8", jnp.bfloat16)
    want = {"q_proj": (1, 2, 1, 4), "k_proj": (2, 1, 1, 4), "v_proj": (2, 1, 1, 4), "o_proj": (2, 1, 1, 8),
            "gate_proj": (2, 4, 1, 6), "up_proj": (2, 4, 1, 6), "down_proj": (2, 4, 1, 8)}
    want["q_proj"] = (2, 1, 2, 4)  # [L, D, N, H]: D contracted, a scale per (layer, head, head_dim)
    for sec in ("attn", "mlp"):
        for name, x in qp["layers"][sec].items():
            if name in want:
                assert is_qarray(x) and x.scale.shape == want[name], (name, x.scale.shape)
                assert x.qvalue.dtype == jnp.int8
    # kept in the rollout dtype: embedding, LM head, router, norms; integer leaves untouched
    for x in (qp["embed_tokens"], qp["lm_head"], qp["layers"]["mlp"]["router"], qp["norm"]["weight"],
              qp["layers"]["attn"]["q_norm"]["weight"]):
        assert not is_qarray(x) and x.dtype == jnp.bfloat16
    assert qp["steps"].dtype == jnp.int32
    assert contracted_axes((jax.tree_util.DictKey("o_proj"),), 3) == (0, 1)
    assert contracted_axes((jax.tree_util.DictKey("router"),), 2) is None


class ParamsTreeTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_roundtrip_tree(self):
        tree = _tree()
        for mode in ("int8", "int4", "fp8"):
            dq = self.variant(lambda t: dequantize_params(quantize_params(t, mode, jnp.bfloat16), jnp.bfloat16))(tree)
            assert jax.tree.structure(dq) == jax.tree.structure(tree)
            for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(dq)[0], jax.tree.leaves(tree)):
                if jnp.issubdtype(b.dtype, jnp.floating):
                    assert a.dtype == jnp.bfloat16, path
                    q = contracted_axes(path, b.ndim)
                    if q is None:  # only cast
                        chex.assert_trees_all_close(a, b.astype(jnp.bfloat16))
                    else:  # within the quantisation error + the bf16 rounding of the result
                        tol = {"int8": 0.02, "int4": 0.4, "fp8": 0.2}[mode]
                        assert float(jnp.max(jnp.abs(a.astype(jnp.float32) - b))) < tol * float(jnp.max(jnp.abs(b)))
                else:
                    chex.assert_trees_all_equal(a, b)

    @chex.variants(with_jit=True, without_jit=True)
    def test_none_only_casts(self):
        tree = _tree()
        got = self.variant(lambda t: quantize_params(t, "none", jnp.bfloat16))(tree)
        want = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)
        chex.assert_trees_all_equal(got, want)


def test_quantized_shardings(devices):
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.asarray(devices).reshape(2, 4), ("fsdp", "tensor"))
    w = jnp.zeros((8, 4, 4), jnp.float32)  # q_proj [D, N, H]: D over fsdp, N over tensor
    tree = {"q_proj": w, "norm": jnp.zeros((4,), jnp.float32)}
    sh = {"q_proj": NamedSharding(mesh, P("fsdp", "tensor", None)), "norm": NamedSharding(mesh, P())}
    abstract = jax.eval_shape(lambda t: quantize_params(t, "int8", jnp.bfloat16), tree)
    qs = quantized_shardings(abstract, sh)
    assert qs["q_proj"].qvalue.spec == P("fsdp", "tensor", None)
    assert qs["q_proj"].scale.spec == P(None, "tensor", None)  # the contracted axis is size 1: replicated
    assert qs["norm"] == sh["norm"]
    placed = jax.device_put(quantize_params(tree, "int8", jnp.bfloat16), qs)
    assert placed["q_proj"].qvalue.sharding.spec == P("fsdp", "tensor", None)
