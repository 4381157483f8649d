"""The engine's weights: :meth:`EngineWeights.load_params` (the weight sync of a publish: cast to the
rollout dtype, re-lay the layers, optionally quantise, place on the engine's devices) and the abstract
params and shardings its programs are compiled for. A base class of :class:`rollout.engine.Qwen3Engine`.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_rl.models import qwen3 as _q
from jax_rl.dtypes import DTYPES, cast_floating, resolve_dtype
from rollout.quantize import quantize_params

__all__ = ["EngineWeights", "resolve_dtype", "DTYPES"]  # the dtype names: jax_rl.dtypes


class EngineWeights:
    """The weight methods of :class:`rollout.engine.Qwen3Engine` (a base class; the engine holds the
    state they read: ``dtype``, ``quantize``, ``params``, ``_sharded``, ``_sharding``,
    ``_abstract_params``, ``_engine_abstract``, ``_engine_shardings``, ``_param_shardings``,
    ``_unstack_layers``)."""

    def load_params(self, params: Any = None, *args: Any, **kwargs: Any) -> Any:
        """Cast float leaves of ``params`` to the compute dtype and place them on the device(s).

        ``params``: an ``nnx.State`` (or matching pytree, e.g. the pure dict of numpy leaves the Ray
        runtime ships) of the model's ``nnx.Param``s, in the engine's or the learner's layer layout
        (stacked ``[L, ...]`` layers are unstacked for a ``kv_per_layer`` engine); with no argument,
        returns the engine's current params.

        The weight sync of a publish (``Generator.update_params`` -> here; ``weight_sync_cast_s``):

        * colocated engine (no ``mesh``): an eager cast, then ``jax.device_put`` to
          ``jax.devices()[0]`` (unchanged).
        * sharded engine (``mesh``), device params (``jax.Array`` leaves, e.g. the learner's on its
          mesh): ONE jitted program, built once and reused every publish (jit caches it by the
          input's tree and shardings), casts to ``dtype`` and re-lays the layers where the params
          ARE (the learner's devices: the learner's mesh does the cast, each device its own shard,
          so the bytes that travel are already ``rollout.dtype``); then ``jax.device_put`` to the
          engine's param shardings (:attr:`param_shardings`) moves each shard to the engine's
          devices. Two steps because a ``jit`` runs on one device set: its out_shardings cannot
          name the engine's devices when they are not the learner's (XLA would refuse the
          mismatched device assignment); ``device_put`` between device sets is a device-to-device
          copy (ICI on a TPU slice), and on the same devices a reshard.
        * sharded engine, host params (numpy leaves): cast on the host, then ``device_put``.

        Multi-host (what runs where): every process runs its own engines on its own devices
        (``Roles.local_engines``), and this method runs in the process that owns the engine. With
        a learner mesh that spans processes its params are not fully addressable: the jitted cast
        is an SPMD program every process must run (they do: each publishes after the same train
        step), but in jax 0.10.2 ``device_put`` of a non-addressable array onto another device set
        is only supported as a "cross-host transfer" (``jax._src.dispatch``:
        same HLO sharding on both sides, a backend with ``supports_cross_host_transfers`` or the
        ``jax_cross_host_transfer_socket_address`` DCN flags), and ``jax.experimental.transfer``
        (a ``TransferServer`` that ``pull``s a pytree by id over DCN) is the general tool. The
        multi-process runtime therefore does the cross-process part before this method:
        :mod:`jax_rl.weight_sync` reshards and casts on the learner's devices into this engine's layout and
        ``device_put``s each shard across processes, and a tree that arrives already in this engine's
        tree, dtypes and shardings is taken as is (no copy). Other non-addressable params raise
        ValueError; host params (``Learner.get_params(host=True)``, the Ray path) work on every host.

        Raises:
            ValueError: a tree or leaf-shape mismatch; a sharded engine given device params that this
                process cannot address in full.
        """
        if params is None:
            if self.params is None:
                raise ValueError("Qwen3Engine has no params; pass them to load_params(params)")
            return self.params
        if isinstance(params, nnx.Module):
            params = nnx.state(params, nnx.Param)
        if self._already_placed(params):  # laid out, cast and placed by the sender (jax_rl.weight_sync)
            return params
        dt = self.dtype
        if self.quantize != "none":  # one jitted re-layout + quantisation where the params are
            out = self._cast_jit(params)
            return self._place(out) if self._sharded else jax.device_put(out, self._sharding)
        if not self._sharded:
            return jax.device_put(self._layout(cast_floating(jax.tree.map(jnp.asarray, params), dt)), self._sharding)
        leaves = jax.tree.leaves(params)
        if leaves and all(isinstance(x, jax.Array) for x in leaves):
            far = [x for x in leaves if not x.is_fully_addressable]
            if far:
                raise ValueError(
                    f"params live on devices of other processes ({far[0].sharding}); a sharded rollout engine "
                    "takes device params this process addresses in full, or host params (a multi-host publish goes "
                    "through jax_rl.weight_sync, which brings each engine's shards to its own process first)")
            out = self._cast_jit(params)
        else:
            out = self._layout(cast_floating(jax.tree.map(np.asarray, params), dt))
        return self._place(out)

    def _already_placed(self, params: Any) -> bool:
        """True when ``params`` already are this engine's tree, leaf for leaf with its shapes, dtypes and
        shardings (a multi-process publish, :mod:`jax_rl.weight_sync`, sends them so): taken as is."""
        want = self._engine_abstract
        if jax.tree.structure(params) != jax.tree.structure(want):
            return False
        sh = (jax.tree.leaves(self._engine_shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
              if self._sharded else None)
        for i, (x, a) in enumerate(zip(jax.tree.leaves(params), jax.tree.leaves(want))):
            if not isinstance(x, jax.Array) or x.shape != a.shape or x.dtype != a.dtype:
                return False
            if not (x.sharding == sh[i] if sh is not None else x.sharding.device_set == self._sharding.device_set):
                return False
        return True

    def _place(self, tree: Any) -> Any:
        """``device_put`` of a tree shaped like the engine's params to :attr:`param_shardings`."""
        placed = jax.device_put(jax.tree.leaves(tree), jax.tree.leaves(self._engine_shardings))
        return jax.tree.unflatten(jax.tree.structure(self._engine_abstract), placed)

    @property
    def param_shardings(self) -> Any:
        """The engine's param shardings (an ``nnx.State`` of NamedShardings like its params);
        ``None`` for the colocated engine (one device)."""
        return self._param_shardings

    @property
    def abstract_params(self) -> Any:
        """The params its programs read, as ``jax.ShapeDtypeStruct`` (nothing allocated): the
        model's param tree, with quantised leaves under ``quantize``. For AOT lowering
        (:func:`jax_rl.tpu.compile_rollout`, tests)."""
        return self._engine_abstract

    @functools.cached_property
    def _cast_jit(self) -> Any:
        """The sharded engine's compiled cast + layer re-layout (built once, reused every publish);
        for a quantising engine (either kind) the re-layout then the quantisation
        (:func:`rollout.quantize.quantize_params` of the values as given)."""
        dt = self.dtype
        if self.quantize != "none":
            mode = self.quantize
            return jax.jit(lambda params: quantize_params(self._layout(params), mode, dt))

        return jax.jit(lambda params: self._layout(cast_floating(params, dt)))

    def _layout(self, out: Any) -> Any:
        """(Already cast) params ``out`` in the engine's tree: stacked layers unstacked when it runs
        unrolled ones, State-vs-dict containers matched. Raises ValueError on a tree or shape
        mismatch. Traceable (the sharded engine jits it with the cast)."""
        want = jax.tree.structure(self._abstract_params)
        if self._unstack_layers and jax.tree.structure(out) != want:
            out = self._unstacked(out)
        if jax.tree.structure(out) != want:
            try:  # tolerate State-vs-pure-dict containers with the same leaves
                out = jax.tree.unflatten(want, jax.tree.leaves(out))
            except Exception as e:  # noqa: BLE001
                raise ValueError(f"params do not match the model's structure: {e}") from e
        for got, exp in zip(jax.tree.leaves(out), jax.tree.leaves(self._abstract_params)):
            if got.shape != exp.shape:
                raise ValueError(f"param shape {got.shape} != model's {exp.shape}")
        return out

    def _unstacked(self, params: Any) -> Any:
        """Stacked ``[L, ...]`` layer params (scan_layers layout) -> the engine's unrolled State."""
        pure = params.to_pure_dict() if isinstance(params, nnx.State) else params
        if not isinstance(pure, dict) or "layers" not in pure:
            return params  # not the stacked layout: the structure check below reports it
        target = jax.tree.map(lambda a: a, self._abstract_params)
        target.replace_by_pure_dict(_q.unstack_layer_params(pure, self._unstack_layers))
        return target
