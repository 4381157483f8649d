"""The accelerators jax-rl knows (one table for the TPU compile checks, the CLI and the benches) and
what JAX runs on here.

* :data:`CHIPS`: per-chip vendor peak figures of the TPU generations and the NVIDIA data-center GPUs
  (HBM bytes, dense bf16 FLOP/s, HBM bytes/s), for roofline estimates, not measurements. Sources: the
  vendor pages in each :attr:`ChipSpec.source` (quoted in the comments below, read 2026-12).
  :data:`jax_rl.compile.topology.CHIPS` is the TPU part of this table.
* :func:`chip_for`: a JAX device (its ``device_kind``) -> its :class:`ChipSpec`, or None.
* :func:`backend_report`: the versions (jax-rl, jax, jaxlib), the backend and its devices, as a dict
  (``jax-rl --version``, every bench record); an absent backend is an ``error`` string, never a raise.
* :func:`require_backend`: the backend ``JAX_PLATFORMS`` asks for is present, else
  :class:`BackendUnavailable` naming it (the CLI prints it in one line, exit 2).

Imports nothing heavy at module level (the CLI imports it before choosing the platform).
"""

from __future__ import annotations

import dataclasses
import os
import re
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Optional

__all__ = ["ChipSpec", "CHIPS", "TPU_CHIPS", "GPU_CHIPS", "chip_for", "backend_report", "format_report",
           "require_backend", "BackendUnavailable"]

GiB = 1 << 30
GB = 10 ** 9


@dataclasses.dataclass(frozen=True)
class ChipSpec:
    """One accelerator chip. ``hbm_bytes`` bytes of HBM, ``peak_bf16_flops`` FLOP/s (dense bf16
    matmul, no sparsity), ``hbm_bandwidth`` bytes/s, ``cores`` JAX devices per chip (TPU
    TensorCores in the default mode; 1 for a GPU), ``source`` the vendor page the figures come from,
    ``ici_bandwidth`` the page's *bidirectional* inter-chip interconnect (TPU ICI) bandwidth per chip
    in bytes/s (all of a chip's links, both directions: one direction is half of it; None where the
    page gives no per-chip figure, and for GPUs), ``dcn_bandwidth`` the page's data center network
    bandwidth per chip (bytes/s), ``kinds`` regexes of the JAX ``device_kind`` strings of this chip.
    Vendor peaks, for roofline estimates, not measurements."""

    name: str
    hbm_bytes: int
    peak_bf16_flops: float
    hbm_bandwidth: float
    cores: int
    source: str
    ici_bandwidth: Optional[float] = None
    dcn_bandwidth: Optional[float] = None
    kinds: tuple[str, ...] = ()


TPU_CHIPS: dict[str, ChipSpec] = {
    # Google Cloud "TPU v4" page, "System architecture": 32 GiB HBM2, 1200 GBps, 275 TFLOPs; the page
    # gives no per-chip ICI bandwidth (only per Pod), so none here
    "v4": ChipSpec("v4", 32 * GiB, 275e12, 1200 * GB, 2, "https://cloud.google.com/tpu/docs/v4",
                   kinds=(r"TPU v4$",)),
    # "TPU v5e" page, chip specifications: 16 GB HBM2, 819 GBps, 197 TFLOPs bf16; bidirectional ICI
    # bandwidth per chip 400 GBps
    "v5e": ChipSpec("v5e", 16 * GB, 197e12, 819 * GB, 1, "https://cloud.google.com/tpu/docs/v5e", 400 * GB,
                    kinds=(r"TPU v5 ?lite", r"TPU v5e")),
    # "TPU v5p" page, chip specifications: 95 GB HBM2e, 2765 GBps, 459 TFLOPs bf16; bidirectional ICI
    # bandwidth per chip 1200 GBps (4800 Gbps on the older page); DCN bandwidth per chip 50 Gbps
    "v5p": ChipSpec("v5p", 95 * GB, 459e12, 2765 * GB, 2, "https://cloud.google.com/tpu/docs/v5p", 1200 * GB,
                    50e9 / 8, kinds=(r"TPU v5p?$",)),
    # "TPU v6e" (Trillium) page: 32 GB HBM, 1640 GBps, 918 TFLOPs bf16; bidirectional ICI bandwidth per
    # chip 800 GBps
    "v6e": ChipSpec("v6e", 32 * GB, 918e12, 1640 * GB, 1, "https://cloud.google.com/tpu/docs/v6e", 800 * GB,
                    kinds=(r"TPU v6 ?lite", r"TPU v6e")),
}

GPU_CHIPS: dict[str, ChipSpec] = {
    # NVIDIA H100 datasheet (nvidia.com/en-us/data-center/h100), H100 SXM column: 80 GB HBM3, 3.35 TB/s,
    # BF16 Tensor Core 1,979 TFLOPS *with sparsity* -> 989.5e12 dense
    "h100-sxm": ChipSpec("h100-sxm", 80 * GB, 989.5e12, 3.35e12, 1, "https://www.nvidia.com/en-us/data-center/h100/",
                         kinds=(r"H100 80GB HBM3", r"H100 SXM")),
    # the same datasheet, H100 PCIe column (the NVL column is a different card): 80 GB HBM2e, 2 TB/s,
    # BF16 1,513 TFLOPS with sparsity -> 756.5e12 dense
    "h100-pcie": ChipSpec("h100-pcie", 80 * GB, 756.5e12, 2.0e12, 1,
                          "https://www.nvidia.com/en-us/data-center/h100/", kinds=(r"H100 PCIe",)),
    # NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200), H200 SXM: 141 GB HBM3e, 4.8 TB/s,
    # BF16 1,979 TFLOPS with sparsity -> 989.5e12 dense (the H100's compute)
    "h200": ChipSpec("h200", 141 * GB, 989.5e12, 4.8e12, 1, "https://www.nvidia.com/en-us/data-center/h200/",
                     kinds=(r"H200",)),
    # NVIDIA A100 datasheet (nvidia.com/en-us/data-center/a100), A100 80GB SXM: 80 GB HBM2e, 2,039 GB/s,
    # BF16 Tensor Core 312 TFLOPS dense (624 with sparsity)
    "a100-80gb": ChipSpec("a100-80gb", 80 * GB, 312e12, 2039 * GB, 1,
                          "https://www.nvidia.com/en-us/data-center/a100/", kinds=(r"A100.*80GB",)),
    # the same datasheet, A100 40GB (SXM): 40 GB HBM2, 1,555 GB/s, 312 TFLOPS BF16 dense
    "a100-40gb": ChipSpec("a100-40gb", 40 * GB, 312e12, 1555 * GB, 1,
                          "https://www.nvidia.com/en-us/data-center/a100/", kinds=(r"A100.*40GB",)),
}

CHIPS: dict[str, ChipSpec] = {**TPU_CHIPS, **GPU_CHIPS}
"""Every known chip by name (TPU generations and GPUs): one table, no copies elsewhere."""


def chip_for(device_or_kind: Any) -> Optional[ChipSpec]:
    """The :class:`ChipSpec` of a JAX device (or its ``device_kind`` string, e.g. ``"NVIDIA H200"``,
    ``"TPU v5 lite"``), or None for a CPU or an unknown chip (the caller then prints no roofline)."""
    kind = device_or_kind if isinstance(device_or_kind, str) else getattr(device_or_kind, "device_kind", "")
    for spec in CHIPS.values():
        if any(re.search(k, kind, re.IGNORECASE) for k in spec.kinds):
            return spec
    return None


class BackendUnavailable(RuntimeError):
    """The JAX backend asked for (``JAX_PLATFORMS``) is not present on this host."""


def _dist_version(dist: str) -> str:
    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"


def backend_report() -> dict[str, Any]:
    """``{"jax-rl", "jax", "jaxlib", "JAX_PLATFORMS", "backend", "devices": [{"id", "kind", "platform"}],
    "chip"}`` for this process, or with ``"error"`` (one line) in place of backend/devices when JAX
    cannot start the backend asked for. ``chip``: the :data:`CHIPS` name of device 0, or None. Starts
    JAX's backend (import jax) but never raises for a missing one."""
    rep: dict[str, Any] = {d: _dist_version(d) for d in ("jax-rl", "jax", "jaxlib")}
    rep["JAX_PLATFORMS"] = os.environ.get("JAX_PLATFORMS", "")
    try:
        import jax

        devs = jax.devices()
        rep["backend"] = jax.default_backend()
        rep["devices"] = [{"id": d.id, "kind": d.device_kind, "platform": d.platform} for d in devs]
        spec = chip_for(devs[0]) if devs else None
        rep["chip"] = spec.name if spec else None
    except Exception as e:  # noqa: BLE001 - RuntimeError from jax's backend init; AssertionError (cuda, no GPU)
        rep["error"] = _backend_error(e)
    return rep


def _backend_error(e: BaseException) -> str:
    asked = os.environ.get("JAX_PLATFORMS", "")
    text = " ".join(str(e).split())[:300] or type(e).__name__
    if asked and type(e) is AssertionError:  # jax skips a 'cuda' without a visible GPU, then asserts
        text = f"jax found no device for {asked!r} (no visible accelerator of that kind)"
    where = f"JAX_PLATFORMS={asked}: " if asked else ""
    return f"{where}backend not available on this host: {text}"


def format_report(rep: dict[str, Any]) -> str:
    """One line per field of :func:`backend_report` (``jax-rl --version``)."""
    lines = [f"jax-rl {rep['jax-rl']}", f"jax {rep['jax']}", f"jaxlib {rep['jaxlib']}"]
    if "error" in rep:
        lines.append(f"backend: error: {rep['error']}")
    else:
        kinds: dict[str, int] = {}
        for d in rep["devices"]:
            kinds[d["kind"]] = kinds.get(d["kind"], 0) + 1
        chip = f" (chip {rep['chip']})" if rep.get("chip") else ""
        lines.append(f"backend: {rep['backend']}{chip}")
        lines.append("devices: " + ", ".join(f"{n} x {k}" for k, n in kinds.items()))
    return "\n".join(lines)


def require_backend() -> dict[str, Any]:
    """:func:`backend_report` when the backend came up.

    Raises:
        BackendUnavailable: one line naming ``JAX_PLATFORMS`` and why JAX could not start it.
    """
    rep = backend_report()
    if "error" in rep:
        hint = " (unset JAX_PLATFORMS, or install the platform's extra: pip install 'jax-rl[gpu]' or 'jax-rl[tpu]')"
        raise BackendUnavailable(rep["error"] + hint)
    return rep
