"""The Cloud TPU chip table: per-chip figures of each TPU generation (HBM bytes, peak bf16 FLOP/s, HBM
bandwidth, bidirectional ICI bandwidth), as published on Google Cloud's TPU pages (sources in
``ChipSpec.source``). They are the vendor's peak figures, for roofline estimates, not measurements."""

from __future__ import annotations

import dataclasses
from typing import Optional

__all__ = ["GB", "GiB", "ChipSpec", "CHIPS", "ALIASES", "TORUS_3D"]

GiB = 1 << 30
GB = 10 ** 9


@dataclasses.dataclass(frozen=True)
class ChipSpec:
    """One TPU chip. ``hbm_bytes`` bytes of HBM, ``peak_bf16_flops`` FLOP/s (dense bf16
    matmul), ``hbm_bandwidth`` bytes/s, ``cores`` TensorCores per chip (JAX devices per chip
    in the default mode), ``source`` the Cloud TPU page the figures come from, ``ici_bandwidth``
    the page's *bidirectional* inter-chip interconnect (ICI) bandwidth per chip in bytes/s (all of
    a chip's links, both directions: one direction is half of it; None where the page gives no
    per-chip figure). Vendor peaks, for roofline estimates, not measurements."""

    name: str
    hbm_bytes: int
    peak_bf16_flops: float
    hbm_bandwidth: float
    cores: int
    source: str
    ici_bandwidth: Optional[float] = None
    dcn_bandwidth: Optional[float] = None  # the page's data center network (DCN) bandwidth per chip, bytes/s


CHIPS: dict[str, ChipSpec] = {
    # Google Cloud "TPU v4" page, "System architecture": 32 GiB HBM2, 1200 GBps, 275 TFLOPs; the page
    # gives no per-chip ICI bandwidth (only per Pod), so none here
    "v4": ChipSpec("v4", 32 * GiB, 275e12, 1200 * GB, 2, "https://cloud.google.com/tpu/docs/v4"),
    # "TPU v5e" page, chip specifications: 16 GB HBM2, 819 GBps, 197 TFLOPs bf16; bidirectional ICI
    # bandwidth per chip 400 GBps
    "v5e": ChipSpec("v5e", 16 * GB, 197e12, 819 * GB, 1, "https://cloud.google.com/tpu/docs/v5e", 400 * GB),
    # "TPU v5p" page, chip specifications: 95 GB HBM2e, 2765 GBps, 459 TFLOPs bf16; bidirectional ICI
    # bandwidth per chip 1200 GBps (4800 Gbps on the older page); DCN bandwidth per chip 50 Gbps
    "v5p": ChipSpec("v5p", 95 * GB, 459e12, 2765 * GB, 2, "https://cloud.google.com/tpu/docs/v5p", 1200 * GB,
                    50e9 / 8),
    # "TPU v6e" (Trillium) page: 32 GB HBM, 1640 GBps, 918 TFLOPs bf16; bidirectional ICI bandwidth per
    # chip 800 GBps
    "v6e": ChipSpec("v6e", 32 * GB, 918e12, 1640 * GB, 1, "https://cloud.google.com/tpu/docs/v6e", 800 * GB),
}

ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "v6": "v6e", "v5": "v5p"}
TORUS_3D = ("v4", "v5p")  # 3-D torus generations (topology AxBxC)
