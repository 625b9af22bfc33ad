"""What the hardware promises: peak memory bandwidth per GPU, from the spec sheets."""

from __future__ import annotations

#: Peak HBM bandwidth in GB/s, matched against ``torch.cuda.get_device_name()`` in order
#: (first substring that occurs wins, so the more specific names come first).
PEAK_BANDWIDTH_GBS: list[tuple[str, float]] = [
    ("H200", 4800.0),
    ("H100 NVL", 3900.0),
    ("H100 PCIe", 2000.0),
    ("H100", 3350.0),  # H100 SXM ("NVIDIA H100 80GB HBM3")
    ("H800", 3350.0),
    ("A100 80GB PCIe", 1935.0),
    ("A100-SXM4-80GB", 2039.0),
    ("A100", 1555.0),  # 40 GB
    ("L40S", 864.0),
    ("L40", 864.0),
    ("L4", 300.0),
    ("A10G", 600.0),
    ("RTX 4090", 1008.0),
    ("RTX 3090", 936.0),
    ("V100", 900.0),
    ("T4", 320.0),
]


def peak_bandwidth_gbs(device_name: str) -> float | None:
    """The device's peak memory bandwidth in GB/s, or None if it is not in the table."""
    for key, gbs in PEAK_BANDWIDTH_GBS:
        if key in device_name:
            return gbs
    return None
