"""The learner's MoE capacity-drop metrics (``moe_dropped_copies``, ``moe_copies``,
``moe_dropped_frac``): the expert-parallel dispatch's drops in the gradient forward, counted over
the valid (attention-mask) tokens, on the tiny MoE (4 experts, top-2) with ``mesh.expert=4``."""

from __future__ import annotations

import numpy as np
import pytest

from jax_rl.learner.learner import Learner
from tests.learner._util import make_batch, make_cfg

EP_MESH = {"data": 1, "fsdp": -1, "tensor": 1, "expert": 4}


def _learner(capacity_factor, microbatches=1, **optim) -> Learner:
    cfg = make_cfg("decoupled", "tiny_moe", mesh=EP_MESH,
                   model={"moe_dispatch": "ragged", "moe_capacity_factor": capacity_factor, "remat": True},
                   optim={"microbatches": microbatches, **optim})
    return Learner(cfg)


def test_dropless_counts_every_valid_copy_and_drops_none(devices):
    L = _learner(None, microbatches=2)  # (the tight-capacity test takes the one-microbatch path)
    mc = L.model_config
    b = make_batch(0, vocab=mc.vocab_size)
    m = L.train_step(b)
    want = int(b["attention_mask"].sum()) * mc.num_experts_per_tok * len(mc.moe_layers)
    assert m["moe_copies"] == want  # padding is not routed
    assert m["moe_dropped_copies"] == 0 and m["moe_dropped_frac"] == 0.0


@pytest.mark.slow  # the pooled test below checks the same counts on the tight capacity (make test)
def test_tight_capacity_drops_are_counted(devices):
    L = _learner(0.25)
    b = make_batch(1, vocab=L.model_config.vocab_size)
    m = L.train_step(b)
    assert np.isfinite(m["loss"])
    assert m["moe_dropped_copies"] > 0
    assert m["moe_dropped_frac"] == pytest.approx(m["moe_dropped_copies"] / m["moe_copies"])
    assert 0.0 < m["moe_dropped_frac"] < 1.0


def test_drops_pooled_over_minibatches_and_epochs(devices):
    """Two minibatches x two epochs (four updates): the counts are per update, the fraction is the
    pooled dropped / copies, and each update routes the same valid copies (the batch splits)."""
    L = _learner(0.25, minibatches=2, ppo_epochs=2)
    mc = L.model_config
    b = make_batch(1, vocab=mc.vocab_size)
    m = L.train_step(b)
    per_update = int(b["attention_mask"].sum()) * mc.num_experts_per_tok * len(mc.moe_layers) / 2
    assert m["moe_copies"] == pytest.approx(per_update)  # the mean of the two halves' counts
    assert np.isfinite(m["loss"]) and m["moe_dropped_copies"] > 0
    assert m["moe_dropped_frac"] == pytest.approx(m["moe_dropped_copies"] / m["moe_copies"])
    assert 0.0 < m["moe_dropped_frac"] < 1.0


def test_copy_count_does_not_overflow_int32():
    """The routed-copy count of a big microbatch passes 2**31 (here 4096 x 16384 tokens x 48 MoE
    layers x k = 2: 6.4e9); an int32 count would wrap negative."""
    import jax.numpy as jnp

    from jax_rl.models.qwen3 import count_moe_drops, get_preset

    k = get_preset("tiny_moe").num_experts_per_tok
    out = count_moe_drops(jnp.ones((48,), jnp.int32), None, (4096, 16384), k)
    assert float(out.copies) == 4096 * 16384 * 48 * k > 2**31
    assert float(out.dropped) == 48
