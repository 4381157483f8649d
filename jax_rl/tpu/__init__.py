"""TPU facts and ahead-of-time compilation for a TPU topology from a CPU host.

Three parts (this package re-exports their public names):

* ``CHIPS``: the TPU part of :data:`jax_rl.chips.CHIPS` (per-chip HBM bytes, peak bf16 FLOP/s, HBM
  bandwidth, bidirectional ICI bandwidth, as published on Google Cloud's TPU pages; sources in
  ``ChipSpec.source``). Vendor peak figures, for roofline estimates, not measurements.
* ``resolve_topology`` (``topology.py``): a Cloud TPU type (``v5e-8``, ``v5litepod-8``, ``v5p-8``, ``v5p-64``,
  ``v6e-8``, ``v4-16``) or a raw topology name (``v5p:4x4x4``) -> the arguments of
  ``jax.experimental.topologies.get_topology_desc``. Cloud names count TensorCores for v4 and
  v5p (2 per chip: ``v5p-8`` is 4 chips) and chips for v5e and v6e (``v5e-8`` is 8 chips).
* ``compile_rollout`` (``rollout.py``; ``analysis.py`` reads one compiled program's figures): AOT-compiles the rollout engine's prefill and decode steps
  (``rollout.engine.Qwen3Engine``) for a topology with ``jax.jit(...).lower(ShapeDtypeStruct
  ...).compile()`` through libtpu's compiler (the ``tpu`` extra) and returns
  ``memory_analysis()`` (bytes per chip) and ``cost_analysis()`` figures. These are
  compile-time estimates: nothing runs on a TPU, and ``cost_analysis`` counts a loop (e.g. a
  scanned layer stack) body once.

``cpu_unless_tpu_present`` keeps a CPU host with libtpu installed from probing for a TPU
(JAX would print libtpu initialisation errors, then fall back to the CPU).
``no_persistent_cache`` turns JAX's persistent compilation cache off around a TPU compile.
"""

from jax_rl.tpu.analysis import HBM_SIDE_OPTIONS, program_analysis
from jax_rl.chips import GB, ChipSpec
from jax_rl.tpu.rollout import compile_rollout
from jax_rl.tpu.topology import (CHIPS, TopologySpec, cpu_unless_tpu_present, get_topology, libtpu_available, quiet_libtpu_env,
                                 no_persistent_cache, resolve_topology)

__all__ = ["ChipSpec", "CHIPS", "GB", "TopologySpec", "resolve_topology", "get_topology", "compile_rollout",
           "cpu_unless_tpu_present", "libtpu_available", "quiet_libtpu_env", "no_persistent_cache", "program_analysis",
           "HBM_SIDE_OPTIONS"]
