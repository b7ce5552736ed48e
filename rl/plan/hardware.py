"""What the planner knows of a device: memory, memory bandwidth, dense matmul peaks, links, and
the fraction of the peaks a step reaches (calibrated; see docs/planning.md). Presets for common
GPUs, each figure with its source; `cpu` measures this machine; a YAML file gives any other."""
from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field, fields

GIB = 2 ** 30


@dataclass(frozen=True)
class Hardware:
    name: str
    memory_bytes: float  # what one device (a GPU; a CPU node's RAM) offers a process
    bandwidth: float  # bytes/s its compute reads from that memory
    bf16_flops: float  # dense matmul peak, FLOP/s
    fp32_flops: float
    intra_link: float  # bytes/s between devices of one node (NVLink; CPU: memcpy)
    inter_link: float  # bytes/s between nodes, per device
    gpu: bool = True
    # fraction of the matmul peak a training step's forward and backward reach, and a decode
    # step of the bandwidth bound (calibrated per hardware, docs/planning.md)
    train_utilization: float = 0.5
    decode_utilization: float = 0.6
    prefill_utilization: float = 0.5
    # fraction of the link a weight sync reaches (a CPU's colocated sync passes over the bytes
    # several times: the copy, the byte check, re-packing the linears); GPUs: not yet measured
    sync_utilization: float = 1.0
    # fixed costs the bounds above miss: a decode step's scheduling and sampling; a decoder
    # layer's forward or backward in training (launches, ZeRO's hooks); a sync's own work
    # (barriers, the probe). On a GPU the launches overlap the kernels (a step takes the larger
    # of the two); on a CPU they add.
    decode_step_overhead: float = 0.003
    layer_pass_overhead: float = 0.0043
    sync_overhead: float = 0.05
    # what a decode step's fixed cost adds per sequence in it (sampling, bookkeeping), and a
    # layer pass's at ZeRO-3 (its gathers and reduce-scatters); GPUs: in the figures above
    decode_sequence_overhead: float = 0.0
    zero3_pass_overhead: float = 0.0
    sources: dict = field(default_factory=dict, compare=False)

    def flops(self, dtype: str) -> float:
        return self.bf16_flops if dtype == "bfloat16" else self.fp32_flops

    def to_dict(self) -> dict:
        return asdict(self)


# Datasheets: NVIDIA A100 (SXM4 80GB), H100 (SXM5 80GB), H200 (SXM 141GB); "dense" is without
# structured sparsity. Usable memory: what nvidia-smi reports as the card's total. Links: NVLink
# 3 (A100, 600 GB/s) and 4 (900 GB/s) per GPU, bidirectional, half each way; between nodes one
# InfiniBand HDR (200 Gb/s, A100 systems) or NDR (400 Gb/s) adapter per GPU, as in DGX systems.
PRESETS = {
    "a100-80g": Hardware(
        "a100-80g", memory_bytes=81920 * 2**20, bandwidth=2.039e12, bf16_flops=312e12,
        fp32_flops=19.5e12, intra_link=300e9, inter_link=25e9,
        sources={"memory": "nvidia-smi: 81920 MiB", "bandwidth": "A100 datasheet, SXM4 80GB",
                 "flops": "A100 datasheet: BF16 312 TFLOPS dense, FP32 19.5 TFLOPS",
                 "links": "NVLink 3 600 GB/s bidirectional; HDR 200 Gb/s per GPU (DGX A100)"}),
    "h100-80g": Hardware(
        "h100-80g", memory_bytes=81559 * 2**20, bandwidth=3.35e12, bf16_flops=989e12,
        fp32_flops=67e12, intra_link=450e9, inter_link=50e9,
        sources={"memory": "nvidia-smi: 81559 MiB", "bandwidth": "H100 SXM5 datasheet",
                 "flops": "H100 SXM5 datasheet: BF16 989 TFLOPS dense, FP32 67 TFLOPS",
                 "links": "NVLink 4 900 GB/s bidirectional; NDR 400 Gb/s per GPU (DGX H100)"}),
    "h200": Hardware(
        "h200", memory_bytes=143771 * 2**20, bandwidth=4.8e12, bf16_flops=989e12,
        fp32_flops=67e12, intra_link=450e9, inter_link=50e9,
        sources={"memory": "nvidia-smi: 143771 MiB", "bandwidth": "H200 SXM datasheet",
                 "flops": "H200 datasheet: BF16 989 TFLOPS dense, FP32 67 TFLOPS",
                 "links": "NVLink 4 900 GB/s bidirectional; NDR 400 Gb/s per GPU"}),
}
HARDWARE_NAMES = ("cpu", *PRESETS)


def load_hardware(name: str) -> Hardware:
    """A preset by name, `cpu` (this machine, measured), or a YAML file with Hardware's fields."""
    if name == "cpu":
        return measure_cpu()
    if name in PRESETS:
        return PRESETS[name]
    if name.endswith((".yaml", ".yml")) and os.path.isfile(name):
        import yaml

        given = yaml.safe_load(open(name)) or {}
        known = {f.name for f in fields(Hardware)}
        unknown = sorted(set(given) - known)
        if unknown:
            raise ValueError(f"hardware file {name}: unknown key {unknown[0]!r}; known: "
                             f"{', '.join(sorted(known))}")
        return Hardware(**{"name": os.path.basename(name), **given})
    raise ValueError(f"hardware {name!r} is not known; use one of {', '.join(HARDWARE_NAMES)} or "
                     f"a YAML file with the fields of rl.plan.hardware.Hardware")


def meminfo(key: str) -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return float(line.split()[1]) * 1024
    raise ValueError(f"/proc/meminfo has no {key}")


# a bf16 matmul's rate, timed by torch in a process of its own (the planner imports no torch):
# oneDNN runs it on AMX, AVX-512 bf16 or, on AVX2, converted to float32 (~100x slower here)
BF16_RATE = """
import sys, time, torch
torch.set_num_threads(int(sys.argv[2]))
a, b = torch.randn(512, 512, dtype=torch.bfloat16), torch.randn(512, 2048, dtype=torch.bfloat16)
a @ b
n, start = 0, time.perf_counter()
while n == 0 or time.perf_counter() - start < float(sys.argv[1]):
    a @ b
    n += 1
print(n * 2 * 512 * 512 * 2048 / (time.perf_counter() - start))
"""


def bf16_matmul_rate(seconds: float) -> float | None:
    """FLOP/s of a bf16 matmul on every core, or None where torch cannot say (not installed,
    failed): bf16 is then taken as float32."""
    import subprocess
    import sys

    try:
        out = subprocess.run([sys.executable, "-c", BF16_RATE, str(seconds),
                              str(os.cpu_count() or 1)], capture_output=True, text=True,
                             timeout=60 + 10 * seconds)
        return float(out.stdout.split()[-1]) if out.returncode == 0 else None
    except (subprocess.TimeoutExpired, ValueError, IndexError, OSError):
        return None


def measure_cpu(seconds: float = 3.0) -> Hardware:
    """This machine: its RAM, a memcpy's bandwidth, and matmul rates on every core (float32:
    numpy's BLAS; bf16: torch's in a subprocess, bf16_matmul_rate), each measured for about a
    second. The utilizations are those calibrated on 2-core machines (docs/planning.md)."""
    import numpy as np

    budget = seconds / 3
    src = np.ones(64 * 2**20 // 4, dtype=np.float32)  # 64 MiB: past the caches
    dst = np.empty_like(src)
    copies, start = 0, time.perf_counter()
    while time.perf_counter() - start < budget:
        np.copyto(dst, src)
        copies += 1
    copy_s = (time.perf_counter() - start) / copies
    bandwidth = 2 * src.nbytes / copy_s  # a copy reads and writes each byte
    a = np.random.default_rng(0).standard_normal((1024, 1024), dtype=np.float32)
    a @ a  # warm the BLAS threads
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < budget:
        a @ a
        n += 1
    fp32 = n * 2 * 1024 ** 3 / (time.perf_counter() - start)
    bf16 = bf16_matmul_rate(budget)
    return Hardware(
        "cpu", memory_bytes=meminfo("MemTotal"), bandwidth=bandwidth, bf16_flops=bf16 or fp32,
        fp32_flops=fp32, intra_link=src.nbytes / copy_s, inter_link=1.25e9, gpu=False,
        **cpu_calibration(),
        sources={"memory": "/proc/meminfo MemTotal", "bandwidth": "a 64 MiB numpy copy",
                 "flops": "a 1024^3 float32 numpy matmul on every core; bf16: a 512 x 512 x "
                          "2048 torch matmul " + ("on every core" if bf16 else
                                                  "(torch failed: taken as fp32)"),
                 "links": "memcpy between processes; 10 Gb/s Ethernet between nodes (assumed)"})


# Fractions of the measured peaks that rl-train's steps reach on a CPU, and the fixed costs the
# bounds miss: fitted by `benchmarks/plan_check.py --split` on three calibration runs (a tiny
# model on 1 and on 2 workers at ZeRO-3, bench-100m) on a 2-core AMD EPYC (AVX-512, no AMX), and
# checked on two others, the quickstart's and the smollm2 preset's (docs/planning.md)
CPU_UTILIZATION = {"train": 0.56, "decode": 0.61, "prefill": 0.61, "sync": 0.12}
CPU_OVERHEADS = {"decode_step_overhead": 0.0011, "decode_sequence_overhead": 0.000068,
                 "layer_pass_overhead": 0.0044, "zero3_pass_overhead": 0.0028,
                 "sync_overhead": 0.017}


def cpu_calibration() -> dict:
    """Hardware's utilization and fixed-cost fields for a CPU."""
    return {"train_utilization": CPU_UTILIZATION["train"],
            "decode_utilization": CPU_UTILIZATION["decode"],
            "prefill_utilization": CPU_UTILIZATION["prefill"],
            "sync_utilization": CPU_UTILIZATION["sync"], **CPU_OVERHEADS}
