"""Fixtures shared by the engine / generator tests: the tiny dense Qwen3 and a second set of weights."""

import pytest
from flax import nnx

from jax_rl.models import qwen3 as q


@pytest.fixture(scope="module")
def model():
    """The tiny dense preset, seed 0 (module-scoped: one build per test file)."""
    return q.Qwen3ForCausalLM(q.get_preset("tiny_dense"), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def params2(model):
    """Params of the same architecture at seed 1: the weights a swap publishes."""
    return nnx.state(q.Qwen3ForCausalLM(model.config, rngs=nnx.Rngs(1)), nnx.Param)
