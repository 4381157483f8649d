"""The untruncated sampler's Pallas TPU kernel (``rollout.engine.sampler_kernel``, issue 46 item 4) in
Pallas interpret mode on the CPU against the XLA path of ``sample_tokens``: the same random stream (the
same token for the same key wherever the draw is not within rounding of a CDF boundary), ``behav_logp``
to 1e-5, greedy rows, ``-inf`` logits, batches that are not a multiple of the kernel's 8-row tile, and
vocabularies of 1 to 40 vregs (one partial group, whole groups, whole groups and a partial one). The
kernel's TPU lowering is compiled in ``tests/test_tpu.py``."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollout.engine import sample_tokens
from rollout.engine.sampler_kernel import sample_untruncated

BOUNDARY = 1e-5  # a draw this close to a CDF boundary may land on either neighbour (fp32 running sums)


def _case(B: int, V: int, seed: int):
    """Logits [B, V] (normal x 3), temperatures in [0.3, 2] with two greedy rows, and ``-inf`` spans:
    row 2 a whole leading run of vregs and the tail (the draw's clamp to the last entry with mass),
    row 3 every other entry, row 4 a single finite entry; row 0 (greedy) a tie for its max."""
    rng = np.random.default_rng(seed)
    lg = (rng.normal(size=(B, V)) * 3).astype(np.float32)
    lg[2, : V // 2] = -np.inf
    lg[2, V - 7:] = -np.inf
    lg[3, ::2] = -np.inf
    lg[4, :] = -np.inf
    lg[4, rng.integers(V)] = 1.5
    if V >= 384:  # a greedy row's tied max: the first index (vreg 1, lane 100), not the lowest lane (vreg 2, lane 3)
        lg[0, [259, 228]] = 50.0
    if V >= 2176:  # and in the next group of 16 vregs, same lane as the first (vreg 16, lane 100)
        lg[0, 2148] = 50.0
    temp = rng.uniform(0.3, 2.0, size=B).astype(np.float32)
    temp[[0, B - 1]] = 0.0
    keys = jax.vmap(jax.random.PRNGKey)(jnp.arange(B) + 1000 * seed)
    return lg, temp, keys


def _float64_truth(lg, temp, u):
    """Per row: the float64 tempered log-softmax and the distance of ``u`` to the nearest CDF boundary."""
    t = np.where(temp > 0, temp, 1.0).astype(np.float64)[:, None]
    z = lg.astype(np.float64) / t
    m = z.max(axis=1, keepdims=True)
    lp = z - m - np.log(np.exp(z - m).sum(axis=1, keepdims=True))
    cdf = np.cumsum(np.exp(lp), axis=1)
    near = np.abs(cdf - np.asarray(u, np.float64)[:, None]).min(axis=1)
    return lp, near


@pytest.mark.parametrize("B,V", [(5, 128), (11, 384), (8, 1024), (16, 2176), (19, 5120)])
def test_kernel_draws_the_xla_token_and_log_prob(B, V):
    """Interpret mode against ``sample_tokens(impl="xla")``: tokens equal on every row whose uniform is
    not within 1e-5 of a CDF boundary (at least 3 in 4 rows are so checked),
    greedy rows equal and the first argmax; ``behav_logp`` within 1e-5 of the XLA path's and of the
    float64 log-softmax at the kernel's token; no draw of a ``-inf`` entry."""
    lg, temp, keys = _case(B, V, seed=V + B)
    tok_x, lp_x, _ = jax.jit(functools.partial(sample_tokens, impl="xla"))(jnp.asarray(lg), keys, jnp.asarray(temp))
    u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys)
    greedy = jnp.asarray(temp) <= 0
    inv_t = 1.0 / jnp.where(greedy, 1.0, jnp.asarray(temp))
    tok_k, lp_k = (np.asarray(a) for a in sample_untruncated(jnp.asarray(lg), u, inv_t, greedy, interpret=True))
    tok_x, lp_x = np.asarray(tok_x), np.asarray(lp_x)
    truth, near = _float64_truth(lg, temp, np.asarray(u))
    sampled = temp > 0
    checked = ~sampled | (near > BOUNDARY)
    assert checked.sum() >= 0.75 * B, near  # the comparison below covers the batch, not a few rows
    np.testing.assert_array_equal(tok_k[checked], tok_x[checked])
    np.testing.assert_array_equal(tok_k[~sampled], np.argmax(lg[~sampled], axis=1))
    assert V < 384 or tok_k[0] == 228
    assert np.all(np.isfinite(lg[np.arange(B), tok_k]))
    same = tok_k == tok_x
    np.testing.assert_allclose(lp_k[same], lp_x[same], atol=1e-5, rtol=0)
    np.testing.assert_allclose(lp_k, truth[np.arange(B), tok_k], atol=1e-5, rtol=0)


def test_kernel_follows_the_stream_over_many_keys():
    """One row of 384 logits under 256 keys (B = 256: 32 tiles): the kernel's tokens are the XLA path's
    except where the draw is within 1e-5 of a boundary, so the kernel samples the same distribution
    with the same key (the fixed-numbers fixtures' stream), not merely a distribution of the same law."""
    B, V = 256, 384
    row = (np.random.default_rng(7).normal(size=V) * 2).astype(np.float32)
    lg = np.broadcast_to(row, (B, V)).copy()
    temp = np.full((B,), 0.8, np.float32)
    keys = jax.vmap(jax.random.PRNGKey)(jnp.arange(B))
    tok_x, _, _ = jax.jit(functools.partial(sample_tokens, impl="xla"))(jnp.asarray(lg), keys, jnp.asarray(temp))
    tok_k, _, _ = jax.jit(functools.partial(sample_tokens, impl="kernel_interpret"))(
        jnp.asarray(lg), keys, jnp.asarray(temp))
    u = np.asarray(jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys))
    _, near = _float64_truth(lg, temp, u)
    checked = near > BOUNDARY
    assert checked.sum() >= B - 2
    np.testing.assert_array_equal(np.asarray(tok_k)[checked], np.asarray(tok_x)[checked])
    assert len(np.unique(np.asarray(tok_k))) > 50  # a real spread of draws, not one token


def test_impl_choice_keeps_the_cpu_path_and_rejects_unknown_names():
    """On the CPU ``impl="auto"`` is the XLA path bit for bit; truncated settings ignore the kernel;
    an unknown ``impl`` or a kernel for a vocabulary off the 128-lane grid is a one-line error."""
    lg, temp, keys = _case(9, 384, seed=3)
    args = (jnp.asarray(lg), keys, jnp.asarray(temp))
    auto = jax.jit(sample_tokens)(*args)
    xla = jax.jit(functools.partial(sample_tokens, impl="xla"))(*args)
    for a, b in zip(auto, xla):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    trunc = functools.partial(sample_tokens, top_k=20)
    for a, b in zip(jax.jit(functools.partial(trunc, impl="kernel_interpret"))(*args), jax.jit(trunc)(*args)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="impl='pallas'"):
        sample_tokens(*args, impl="pallas")
    with pytest.raises(ValueError, match="vocabulary 300"):
        sample_tokens(jnp.zeros((2, 300)), keys[:2], jnp.ones((2,)), impl="kernel_interpret")


def test_auto_takes_the_kernel_only_for_a_one_device_tpu_target():
    """``impl="auto"``: the kernel for a TPU target (``target_backend("tpu")``, as an AOT compile from a
    CPU host sets it) on one device and a vocabulary of whole lanes whose 8-row tile fits VMEM; XLA on
    the CPU, for V = 300 or 262,144, and
    under an ambient mesh of several devices (a Mosaic call is not partitioned)."""
    from jax.sharding import Mesh

    from jax_rl.models.backend_target import target_backend
    from rollout.engine.sampler import _kernel_path

    assert not _kernel_path("auto", 384)
    with target_backend("tpu"):
        assert _kernel_path("auto", 384) and _kernel_path("auto", 151936)
        assert not _kernel_path("auto", 300) and not _kernel_path("auto", 262144)  # off the lanes; past v4's VMEM
        with jax.set_mesh(Mesh(np.array(jax.devices()[:1]), ("data",))):
            assert _kernel_path("auto", 384)
        if len(jax.devices()) > 1:
            with jax.set_mesh(Mesh(np.array(jax.devices()[:2]), ("data",))):
                assert not _kernel_path("auto", 384)


def test_rollout_sampler_reaches_the_engines_step_programs(monkeypatch):
    """``rollout.sampler`` goes from the config to the engine to ``sample_tokens``' ``impl`` in the decode step
    (contiguous and paged programs); an unknown name is refused by the engine and by the config."""
    from jax_rl.config import load_config
    from jax_rl.config import ConfigError
    from jax_rl.models.qwen3 import Qwen3Config
    from jax_rl.runtime.engines import build_engine
    from rollout.engine import Qwen3Engine
    import rollout.engine.programs as programs_mod  # the one decode step, both layouts

    seen = []
    real = programs_mod.sample_tokens

    def spy(*a, **k):
        seen.append(k.get("impl"))
        return real(*a, **k)

    monkeypatch.setattr(programs_mod, "sample_tokens", spy)
    mc = Qwen3Config(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    for layout in ("contiguous", "paged"):
        eng = Qwen3Engine(mc, None, slots=2, max_cache_len=32, max_prefill_length=16, dtype="float32",
                          kv_layout=layout, sampler="xla")
        params = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), eng.abstract_params)
        jax.eval_shape(eng.programs["decode"], params, jax.eval_shape(eng.programs["init_state"], params))
    assert seen and set(seen) == {"xla"}, seen
    with pytest.raises(ValueError, match="rollout.sampler"):
        Qwen3Engine(mc, None, slots=2, max_cache_len=32, sampler="pallas", kv_layout="contiguous")
    with pytest.raises(ConfigError, match="rollout.sampler"):
        load_config("configs/tiny_cpu.yaml", ["rollout.sampler=pallas"])
    cfg = load_config("configs/tiny_cpu.yaml", ["rollout.sampler=xla"])
    assert build_engine(cfg, mc).sampler == "xla"
