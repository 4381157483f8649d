"""``model.attention: cudnn`` (``jax.nn.dot_product_attention``, cuDNN flash attention on a GPU).

No GPU here: the tests run the same call with ``implementation="xla"`` (jax's reference
implementation of that function), which checks our plumbing (layout, GQA, causal mask, right
padding as key lengths, scale) against the model's own attention in fp32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_rl.models import attention as A
from jax_rl.models.qwen3 import Qwen3ForCausalLM, get_preset
from jax_rl.models.xla_attention import attend_causal


@pytest.fixture(autouse=True)
def _xla_reference(monkeypatch):
    monkeypatch.setattr(A, "CUDNN_IMPLEMENTATION", "xla")


def _qkv(B=3, T=12, N=4, K=2, H=8, seed=0):
    r = np.random.default_rng(seed)
    return tuple(jnp.asarray(r.normal(size=s), jnp.float32) for s in ((B, T, N, H), (B, T, K, H), (B, T, K, H)))


@pytest.mark.parametrize("jit", [False, True])
def test_cudnn_attend_matches_the_xla_core_on_valid_queries(jit):
    q, k, v = _qkv()
    B, T = q.shape[:2]
    lengths = np.array([T, 7, 1])
    valid = jnp.asarray(np.arange(T)[None] < lengths[:, None])
    mask = jnp.tril(jnp.ones((T, T), bool))[None] & valid[:, None, :]
    f = jax.jit(A.cudnn_attend) if jit else A.cudnn_attend
    got = np.asarray(f(q, k, v, valid))
    want = np.asarray(attend_causal(q, k, v, mask))
    for b, n in enumerate(lengths):  # padded queries are garbage on every path; the caller masks them
        np.testing.assert_allclose(got[b, :n], want[b, :n], atol=2e-6, rtol=0)
    assert np.all(np.isfinite(got))


def test_cudnn_attend_fully_padded_row_is_finite_and_no_mask_is_causal():
    q, k, v = _qkv(B=2, T=6)
    valid = jnp.asarray([[True] * 6, [False] * 6])
    assert np.all(np.isfinite(np.asarray(A.cudnn_attend(q, k, v, valid))))
    T = q.shape[1]
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool))[None], (2, T, T))
    np.testing.assert_allclose(np.asarray(A.cudnn_attend(q, k, v)), np.asarray(attend_causal(q, k, v, mask)),
                               atol=2e-6, rtol=0)


def test_cudnn_attend_rejects_bad_gqa():
    q, k, v = _qkv(N=3, K=2)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        A.cudnn_attend(q, k, v)


def test_model_with_cudnn_attention_matches_xla_logits_and_grads():
    cfg = get_preset("tiny_dense")
    m_x = Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0), attention="xla")
    m_c = Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0), attention="cudnn")
    assert m_c.attention == "cudnn"
    B, T = 2, 10
    ids = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (B, T)), jnp.int32)
    am = jnp.asarray(np.arange(T)[None] < np.array([[T], [6]]))

    def loss(m):
        lg = m(ids, attention_mask=am)
        return jnp.sum(jnp.where(am[..., None], jax.nn.log_softmax(lg), 0.0)), lg

    vg = nnx.jit(nnx.value_and_grad(loss, has_aux=True))
    (lx, gx_logits), gx = vg(m_x)
    (lc, gc_logits), gc = vg(m_c)
    keep = np.asarray(am)
    np.testing.assert_allclose(np.asarray(gc_logits)[keep], np.asarray(gx_logits)[keep], atol=1e-5, rtol=0)
    np.testing.assert_allclose(float(lc), float(lx), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(nnx.state(gc, nnx.Param)), jax.tree.leaves(nnx.state(gx, nnx.Param))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-4)
