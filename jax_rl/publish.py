"""Publishing: the learner's params of a version -> the rollout engines, the one path of both runtimes.

:class:`Publisher` (``RunContext.publisher``) takes the params a publish hands over
(:meth:`~Publisher.params`) and gives them to this process's generators (:meth:`~Publisher.publish`):

- embedded runtime, one process: a device copy of the params; the route's scorer gets them first
  when the ``old_logits.route`` scores on the rollout side
  (:meth:`jax_rl.learner.correction.old_logits.routes.Route.publish`), then every generator casts and reshards them
  (``Generator.update_params``);
- embedded runtime, several processes (``jax.distributed``): one
  :class:`jax_rl.weight_sync.ShardedWeightSync` push, each engine receiving its own shards;
- Ray runtime: the learner actor hands :meth:`~Publisher.params` (``host=True``: numpy, one
  object-store copy per version) to the rollout workers, whose generators cast and reshard them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_rl.dtypes import cast_floating
from jax_rl.learner.holder import copy_params

if TYPE_CHECKING:
    from jax_rl.learner.correction.old_logits.routes import Route
    from jax_rl.weight_sync import ShardedWeightSync

__all__ = ["Publisher", "hand_over"]


class Publisher:
    """The publish stage of one learner, built from the learner's pieces (it holds no learner).

    Args:
        params: the learner's params getter: ``params()`` -> the live params (an ``nnx.State`` on ``mesh``;
            donated by the next train step, so a publish copies them, :func:`jax_rl.learner.holder.copy_params`).
        mesh: the learner's mesh (the multi-process gather runs on it).
        rollout_dtype: the engines' dtype (``rollout.dtype``; the multi-process gather casts to it).
    """

    def __init__(self, params: Callable[[], Any], mesh: jax.sharding.Mesh, rollout_dtype: Any):
        self._params, self.mesh, self.rollout_dtype = params, mesh, jnp.dtype(rollout_dtype)
        self._gather_jit = None  # multi-process params(): the cast + all-gather program, built once

    def params(self, host: bool = False) -> Any:
        """The params a publish hands the rollout side (an ``nnx.State`` like the learner's params).

        Single process: a copy of the learner's params (:func:`jax_rl.learner.holder.copy_params`):
        device arrays on the learner's mesh (each engine casts and reshards them,
        ``Qwen3Engine.load_params``), or with ``host`` numpy arrays (the Ray object store's copy).
        Multi-process (``jax.distributed``): the learner's shards live on every host, and jax 0.10.2
        moves a non-addressable array to another device set only as a backend-specific cross-host
        transfer (none on CPU; ``jax.experimental.transfer`` over DCN on TPU), so ONE jitted program on
        the learner's mesh casts to ``rollout.dtype`` and all-gathers the params to every learner device
        (the mesh's collectives: ICI/DCN on a pod, gloo on CPU), and this process keeps the copy on its
        first addressable learner device (single-device arrays, which its engines then ``device_put``
        onto their own local meshes). Every process must call it at the same point (a collective).
        Cost: a transient full rollout-dtype copy per learner device.

        Raises:
            ValueError: ``host`` in a multi-process run.
        """
        if jax.process_count() == 1:
            return copy_params(self._params(), host=host)
        if host:
            raise ValueError("Publisher.params(host=True) needs a single process; use device arrays")
        if self._gather_jit is None:
            dt = self.rollout_dtype
            replicated = jax.tree.map(lambda _: NamedSharding(self.mesh, P()), self._params())
            self._gather_jit = jax.jit(lambda p: cast_floating(p, dt), out_shardings=replicated)
        with jax.set_mesh(self.mesh):
            full = self._gather_jit(self._params())
        return jax.tree.map(lambda x: x.addressable_shards[0].data, full)

    def publish(self, version: int, generators: Sequence[Any], *, sync: Optional["ShardedWeightSync"] = None,
                sync_keys: Sequence[Any] = (), route: Optional["Route"] = None, scorer: Any = None,
                retirer: Any = None) -> tuple[float, Optional[float]]:
        """Hand the learner's params of ``version`` to ``generators`` (this process's; cast and reshard in
        this thread, ``Generator.update_params``).

        Args:
            sync: multi-process: the weight sync the generators were built with
                (:func:`jax_rl.runtime.engines.synced_generators`); ``sync_keys`` their targets in its
                push (one per generator). A collective: every process calls it at the same point.
            route: ``loss.correction=exact``'s route when it scores on the rollout side: its
                ``publish`` hands the params to ``scorer`` / ``retirer`` first, then the generators.

        Returns:
            ``(cast_s, moved_bytes)``: the generators' cast/reshard seconds, and the bytes the weight
            sync sent and received (multi-process; None in one process, where the engines' own
            params are what moved).
        """
        if sync is not None:  # multi-process: each engine receives its own shards (jax_rl.weight_sync)
            placed = sync.push(self._params(), int(version))
            cast_s = sum(g.update_params(placed[k], version) for g, k in zip(generators, sync_keys))
            last = sync.last
            return float(cast_s), last.get("weight_sync_sent_bytes", 0.0) + last.get("weight_sync_recv_bytes", 0.0)
        params = jax.block_until_ready(self.params())  # blocked: the copy is timed with the publish
        return hand_over(params, version, generators, route=route, scorer=scorer, retirer=retirer), None


def hand_over(params: Any, version: int, generators: Sequence[Any], *, route: Optional["Route"] = None,
              scorer: Any = None, retirer: Any = None) -> float:
    """The last leg of every publish, in the process that holds the generators: ``route``'s publish
    (its scorer / retirer first, then the generators) when the exact route scores on the rollout side,
    else each generator casts and reshards ``params`` (``Generator.update_params``). Called by
    :meth:`Publisher.publish` (embedded runtime, one process) and by the Ray rollout workers'
    ``set_params`` (the params arriving from the object store, numpy).

    Args:
        params: an ``nnx.State`` like the learner's params (device or numpy arrays, any float dtype).
        version: the policy version the params are.

    Returns:
        The generators' cast/reshard seconds (float).
    """
    if route is not None:
        return float(route.publish(int(version), params, list(generators), scorer=scorer, retirer=retirer))
    return float(sum(g.update_params(params, version) for g in generators))
