"""A checkpoint written before a TrainState leaf was retired (``rng``) still restores, the leaf
read and dropped; a checkpoint without it restores the same way (``RETIRED_STATE_LEAVES``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_rl import checkpoint as C
from jax_rl.checkpoint.trees import RETIRED_STATE_LEAVES, saved_state_keys


def _state():
    return {"params": {"w": jnp.arange(6, dtype=jnp.float32).reshape(2, 3)}, "version": jnp.int32(3),
            "step": jnp.int32(5)}


@pytest.mark.parametrize("with_rng", [True, False])
def test_a_checkpoint_with_the_retired_rng_leaf_restores(tmp_path, with_rng):
    assert "rng" in RETIRED_STATE_LEAVES and "rng" not in C.STATE_KEYS
    saved = dict(_state(), **({"rng": jax.random.PRNGKey(7)} if with_rng else {}))
    with C.Checkpointer(tmp_path / "ck", async_save=False) as ck:
        ck.save(5, state=saved, metadata={"rl_step": 5})
    assert ("rng" in saved_state_keys(tmp_path / "ck", 5)) == with_rng
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), _state())
    with C.Checkpointer(tmp_path / "ck", async_save=False) as ck:
        out = ck.restore(5, state=target)
    assert set(out["state"]) == {"params", "version", "step"}
    np.testing.assert_array_equal(out["state"]["params"]["w"], np.arange(6, dtype=np.float32).reshape(2, 3))
    assert int(out["state"]["step"]) == 5 and out["metadata"]["rl_step"] == 5
