"""One JSON conversion (``rollout.types.json_safe``): strict for trajectories, ``default=str`` for summaries
and checkpoint metadata; numpy and jax values become numbers either way."""

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from rollout.types import json_safe


def test_numbers_arrays_and_keys():
    out = json_safe({1: np.float32(0.5), "a": (np.int64(3), {np.bool_(True)}), "j": jnp.float32(2.0),
                     "arr": np.arange(3), "jarr": jnp.ones((2,), jnp.int32), "n": None})
    assert out == {"1": 0.5, "a": [3, [True]], "j": 2.0, "arr": [0, 1, 2], "jarr": [1, 1], "n": None}
    assert type(out["j"]) is float and type(out["a"][0]) is int


def test_strict_raises_and_default_str_keeps_the_rest():
    with pytest.raises(TypeError, match="PosixPath"):
        json_safe({"p": Path("/tmp/x")})
    assert json_safe({"p": Path("/tmp/x"), "x": np.float64(1.5)}, default=str) == {"p": "/tmp/x", "x": 1.5}
