"""Peak FLOP/s of GPUs, by the name ``torch.cuda.get_device_name()`` gives, and MFU.

MFU (model FLOPs utilisation, Chowdhery et al. 2022 "PaLM" §B; Korthikanti et al. 2022 §6) is
the model FLOPs a run achieves per second over the hardware's peak. The model FLOPs come from
the cost model (:func:`mpu_lab.perf.cost_model.model_flops_per_iteration`, Narayanan et al.
2021: ``6N + 12·L·h·s`` per token); the peak is the dense 16-bit tensor-core figure of the
vendor's datasheet — never the "with sparsity" number printed next to it (twice as large), and
for GPUs without bfloat16 (T4, V100) the float16 figure. A CPU has no such published peak:
there only the achieved FLOP/s mean anything.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Optional, Tuple


@dataclasses.dataclass(frozen=True)
class GpuPeak:
    """One GPU's dense 16-bit tensor-core peak."""
    name: str                 # how we call it
    pattern: str              # a regular expression that matches torch's device name
    tflops: float             # dense peak, TFLOP/s
    dtype: str                # "bf16" or "fp16": the precision of that peak
    source: str               # the vendor document it is from

    @property
    def flops(self) -> float:
        return self.tflops * 1e12


# Most specific first: "A100" must not be taken for "A10", an H100 PCIe for an H100 SXM.
PEAKS: Tuple[GpuPeak, ...] = (
    GpuPeak("H200", r"\bH200\b", 989.0, "bf16",
            "NVIDIA H200 Tensor Core GPU datasheet (SXM; 1,979 with sparsity)"),
    GpuPeak("H100 PCIe", r"\bH100\b.*\bPCIE\b", 756.0, "bf16",
            "NVIDIA H100 Tensor Core GPU datasheet (PCIe; 1,513 with sparsity)"),
    GpuPeak("H100 NVL", r"\bH100\b.*\bNVL\b", 835.0, "bf16",
            "NVIDIA H100 Tensor Core GPU datasheet (NVL; 1,671 with sparsity)"),
    GpuPeak("H100 SXM", r"\bH100\b", 989.0, "bf16",
            "NVIDIA H100 Tensor Core GPU datasheet (SXM; 1,979 with sparsity)"),
    GpuPeak("A100", r"\bA100\b", 312.0, "bf16",
            "NVIDIA A100 Tensor Core GPU datasheet (624 with sparsity)"),
    GpuPeak("L4", r"\bL4\b", 121.0, "bf16",
            "NVIDIA L4 Tensor Core GPU datasheet (242 with sparsity)"),
    GpuPeak("A10", r"\bA10\b", 125.0, "bf16",
            "NVIDIA A10 Tensor Core GPU datasheet (250 with sparsity)"),
    GpuPeak("T4", r"\bT4\b", 65.0, "fp16",
            "NVIDIA T4 Tensor Core GPU datasheet (mixed precision FP16/FP32; no bf16)"),
    GpuPeak("V100", r"\bV100\b", 125.0, "fp16",
            "NVIDIA V100 Tensor Core GPU datasheet (SXM2 tensor performance; no bf16)"),
)


def lookup(device_name: Optional[str]) -> Optional[GpuPeak]:
    """The peak of the GPU called ``device_name`` (``"NVIDIA H100 80GB HBM3"``), or ``None``
    for a CPU (``None``, ``"cpu"``) or a GPU not in :data:`PEAKS`."""
    if not device_name:
        return None
    for peak in PEAKS:
        if re.search(peak.pattern, device_name, flags=re.IGNORECASE):
            return peak
    return None


def mfu(model_flops_per_s: float, peak: GpuPeak, gpus: int = 1) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over ``gpus`` × the peak. Ranks that
    share one GPU share its peak, so ``gpus`` counts GPUs, not ranks."""
    if gpus < 1:
        raise ValueError(f"gpus must be >= 1, got {gpus}")
    return model_flops_per_s / (gpus * peak.flops)


def describe(peak: Optional[GpuPeak], device_name: Optional[str] = None) -> str:
    """One line: which peak MFU is measured against, and where the number is from."""
    if peak is None:
        what = device_name or "a CPU"
        return (f"{what}: no published peak here, so no MFU (MFU needs a GPU's datasheet "
                f"peak; see mpu_lab.perf.hardware.PEAKS)")
    return (f"peak {peak.tflops:g} TFLOP/s dense {peak.dtype} per GPU ({peak.name}; "
            f"{peak.source})")
