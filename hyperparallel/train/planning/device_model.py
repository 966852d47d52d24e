"""What one accelerator can do, for predicting a step's time before a cluster is booked
(`hyperparallel plan --device`): peak matmul FLOP/s per operand type, memory bandwidth, the links
between ranks, and the fraction of each peak a real kernel reaches.

The GPU models are datasheet figures (dense, no sparsity) times stated efficiencies; the CPU model
is measured on the spot (`measure_cpu`), so that a prediction can be checked here against a real
run: rates, the host's time per operator, view and module call, the fraction small products
reach, and gloo among the run's ranks, shared out as the run's ranks share the cores. Every field
can be overridden (`plan --set device_model.FIELD=VALUE`, or `device_model:` in
the config): a user who has measured their cluster should say so.

Sources (NVIDIA datasheets, dense Tensor Core figures):
- H100 SXM5: 989 TFLOP/s BF16, 1979 FP8, 495 TF32; HBM3 80 GB at 3.35 TB/s; NVLink 4 900 GB/s
  (both directions together, 450 each way); one 400 Gb/s ConnectX-7 NIC per GPU (50 GB/s).
- H200 SXM: H100's Tensor Cores; HBM3e 141 GB at 4.8 TB/s; the same links.
- B200 (HGX B200, per GPU): 2.25 PFLOP/s BF16, 4.5 FP8 and MXFP8, 1.1 TF32; HBM3e 180 GB at
  7.7 TB/s; NVLink 5 1.8 TB/s (900 GB/s each way); one 400 Gb/s NIC per GPU.
Hopper has no MX units: an MXFP8 product there runs as bf16 (`hyperparallel.mx.gemm_path`:
`dequantize`), so its MX rate is its BF16 rate.

Efficiencies (assumptions, not measurements: override them with your own):
- matmul 0.7 of peak: large cuBLAS BF16 GEMMs on H100 are commonly measured at 650-800 TFLOP/s;
- attention 0.5 of the BF16 peak: FlashAttention-2's published H100 forward is about 35% of it,
  FlashAttention-3's and cuDNN's 60-75%;
- memory 0.8 of the HBM figure (a copy kernel's typical share);
- links 0.8 of the per-direction figure (NCCL's ring bus bandwidth on 8 NVLink GPUs is commonly
  reported at 350-400 GB/s of 450); per ring step 3 us within a node, 8 us across nodes;
- every kernel at least 4 us (launch to end, for a small one).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, fields, replace

import torch

from hyperparallel.errors import ConfigError
from hyperparallel.train.peak_flops import GPU_PEAK_BF16_TFLOPS, cpu_peak_tflops
from hyperparallel.train.planning import cpu_gloo


@dataclass(frozen=True)
class DeviceModel:
    name: str
    # achieved FLOP/s of a large product, by operand dtype: float32 | bfloat16 | float8 | mx; and of
    # attention's fused kernels (flash attention), whatever their dtype: attention
    matmul_flops: dict[str, float]
    memory_bytes_per_s: float  # achieved bandwidth of memory-bound kernels
    memory_bytes: int  # what one rank may hold (a GPU's memory; the CPU's shared out over its ranks)
    intra_node_bytes_per_s: float  # achieved per-direction bandwidth of one rank's link within a machine
    intra_node_latency_s: float  # per ring step
    inter_node_bytes_per_s: float  # per rank, across machines
    inter_node_latency_s: float
    ranks_per_node: int  # GPUs per machine (the link model: a group spanning machines uses the slower link)
    op_floor_s: float  # the least time one operator takes (a kernel launch, or the CPU's dispatch)
    overlap: bool  # whether communication runs beside compute (GPUs: yes; CPU ranks share their cores)
    peak_bf16_flops: float  # the datasheet's dense BF16 peak (the CPU's: its measured matmul): MFU's yardstick
    source: str = ""
    # the host's time beyond the operators' own, where nothing hides it (the CPU: its ranks run
    # their own Python; a GPU's host runs ahead of its kernels, 0): per recorded operator that
    # launches no kernel (a view, an alias) and per module call
    dispatch_s: float = 0.0
    module_s: float = 0.0
    # the CPU's: what a collective call takes among the run's ranks on their shared cores, by the
    # size of its group, measured in a step's rhythm (cpu_gloo.py); empty: the link model (a GPU's)
    collective_calls: tuple[cpu_gloo.GroupCalls, ...] = ()
    # the CPU's: the fraction of matmul_flops a product reaches by its smallest dimension, and of
    # attention's rate by one head's FLOPs ((size, fraction) pairs, measured; log-linear between
    # them, the ends beyond); empty: 1 (a GPU's datasheet rates, its small kernels at op_floor_s)
    matmul_ladder: tuple[tuple[float, float], ...] = ()
    attention_ladder: tuple[tuple[float, float], ...] = ()

    def efficiency(self, size: float, attention: bool = False) -> float:
        """The fraction of its rate a product of this size reaches (`matmul_ladder`, plan_time.op_cost's size)."""
        ladder = self.attention_ladder if attention else self.matmul_ladder
        if not ladder:
            return 1.0
        if size <= ladder[0][0]:
            return ladder[0][1]
        for (s0, e0), (s1, e1) in zip(ladder, ladder[1:], strict=False):
            if size <= s1:
                return e0 + (e1 - e0) * (math.log(size) - math.log(s0)) / (math.log(s1) - math.log(s0))
        return ladder[-1][1]

    def flops_for(self, dtype: torch.dtype | str) -> float:
        key = str(dtype).replace("torch.", "")
        if key in ("bfloat16", "float16"):
            return self.matmul_flops["bfloat16"]
        return self.matmul_flops.get(key, self.matmul_flops["float32"])

    def call(self, ranks: int, sent: float, compute_s: float = 0.0) -> float:
        """Seconds of a collective call over `ranks` ranks sending `sent` bytes per rank after
        `compute_s` of compute (`collective_calls`: the group size measured, or the nearest above,
        else the largest)."""
        above = [c for c in self.collective_calls if c.ranks >= ranks]
        calls = min(above, key=lambda c: c.ranks) if above else max(self.collective_calls, key=lambda c: c.ranks)
        return calls.seconds(sent, compute_s)

    def link(self, spans_nodes: bool) -> tuple[float, float]:
        """(bytes/s, latency per ring step) of a group's links."""
        if spans_nodes:
            return self.inter_node_bytes_per_s, self.inter_node_latency_s
        return self.intra_node_bytes_per_s, self.intra_node_latency_s

    def with_overrides(self, overrides: dict | None) -> DeviceModel:
        """This model with `overrides` (field -> value; matmul_flops by operand type: matmul_flops.bfloat16
        or {matmul_flops: {bfloat16: ...}})."""
        if not overrides:
            return self
        names = {f.name for f in fields(self)} - {"name", "source", "peak_bf16_flops", "matmul_ladder",
                                                   "attention_ladder", "collective_calls"}
        flops = dict(self.matmul_flops)
        changes: dict = {}
        flat = {}
        for key, value in overrides.items():  # (YAML or --set nest matmul_flops.bfloat16 as a mapping)
            if key == "matmul_flops" and not isinstance(value, dict):
                raise ConfigError(f"device_model.matmul_flops: give it per operand type, e.g. "
                                  f"matmul_flops.bfloat16={value}; one of {', '.join(flops)}")
            flat.update({f"{key}.{k}": v for k, v in value.items()} if isinstance(value, dict) else {key: value})
        for key, value in flat.items():
            if key != "overlap" and (isinstance(value, dict) or not value > 0):
                raise ConfigError(f"device_model.{key}: must be a number above 0, got {value!r}")
            if key.startswith("matmul_flops."):
                dtype = key.split(".", 1)[1]
                if dtype not in flops:
                    raise ConfigError(f"device_model.{key}: no such operand type; one of {', '.join(flops)}")
                flops[dtype] = float(value)
            elif key in names:
                kind = type(getattr(self, key))
                changes[key] = kind(value) if kind is not dict else value
            else:
                raise ConfigError(f"device_model.{key}: no such field; one of "
                                  f"{', '.join(sorted(names - {'matmul_flops'}))}, matmul_flops.<dtype>")
        if any(key.startswith(("intra_node_", "inter_node_")) for key in changes):
            changes["collective_calls"] = ()  # (the CPU's measured calls give way to the link given)
        return replace(self, matmul_flops=flops, **changes, source=self.source + " (with overrides)")


MATMUL_EFFICIENCY, ATTENTION_EFFICIENCY, MEMORY_EFFICIENCY, LINK_EFFICIENCY = 0.7, 0.5, 0.8, 0.8
_NIC = 400e9 / 8  # one 400 Gb/s ConnectX-7 per GPU


def _gpu(name: str, bf16: float, fp8: float, tf32: float, mx: float, hbm: float, memory_gib: float,
         nvlink_each_way: float) -> DeviceModel:
    return DeviceModel(
        name=name,
        matmul_flops={"float32": tf32 * MATMUL_EFFICIENCY, "bfloat16": bf16 * MATMUL_EFFICIENCY,
                      "float8": fp8 * MATMUL_EFFICIENCY, "mx": mx * MATMUL_EFFICIENCY,
                      "attention": bf16 * ATTENTION_EFFICIENCY},
        memory_bytes_per_s=hbm * MEMORY_EFFICIENCY, memory_bytes=int(memory_gib * 2**30),
        intra_node_bytes_per_s=nvlink_each_way * LINK_EFFICIENCY, intra_node_latency_s=3e-6,
        inter_node_bytes_per_s=_NIC * LINK_EFFICIENCY, inter_node_latency_s=8e-6, ranks_per_node=8,
        op_floor_s=4e-6, overlap=True, peak_bf16_flops=bf16,
        source="datasheet peaks x stated efficiencies (hyperparallel/train/planning/device_model.py)",
    )


# memory: what torch reports as the device's total (H100 80 GB: 79.2 GiB; H200 141 GB: 139.8 GiB;
# B200 180 GB: taken as 178 GiB, not measured here)
_BF16 = {name.lower(): tflops * 1e12 for name, tflops in GPU_PEAK_BF16_TFLOPS.items()}
GPUS = {
    "h100": _gpu("h100", bf16=_BF16["h100"], fp8=1979e12, tf32=495e12, mx=_BF16["h100"], hbm=3.35e12,
                 memory_gib=79.2, nvlink_each_way=450e9),
    "h200": _gpu("h200", bf16=_BF16["h200"], fp8=1979e12, tf32=495e12, mx=_BF16["h200"], hbm=4.8e12,
                 memory_gib=139.8, nvlink_each_way=450e9),
    "b200": _gpu("b200", bf16=_BF16["b200"], fp8=4500e12, tf32=1100e12, mx=4500e12, hbm=7.7e12, memory_gib=178,
                 nvlink_each_way=900e9),
}
DEVICES = ("cpu", *GPUS)


def device_model(name: str, ranks_per_node: int | None = None, overrides: dict | None = None) -> DeviceModel:
    """The named device's model (`cpu`: measured now, for `ranks_per_node` ranks sharing this machine)."""
    if name == "cpu":
        model = measure_cpu(ranks_per_node or 1)
    elif name in GPUS:
        model = GPUS[name] if ranks_per_node is None else replace(GPUS[name], ranks_per_node=ranks_per_node)
    else:
        raise ConfigError(f"--device {name}: no such device model; one of {', '.join(DEVICES)}")
    return model.with_overrides(overrides)


# ------------------------------------------------------------------------- measured on the CPU


def _best_seconds(fn, repeats: int, clock=time.thread_time) -> float:
    """The best of `repeats` calls of `fn`, by this thread's CPU time: what the machine can do, not
    what it did while other processes took the cores (the ranks' own sharing is modelled apart)."""
    fn()  # warm
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        fn()
        best = min(best, clock() - start)
    return best


def _attention_flops(tokens: int = 512) -> float:
    """Causal flash attention's FLOP/s, forward and backward, at a middling shape (512 tokens, 8
    heads of 64; the CPU's fused kernel is a third to a half of the matmul rate)."""
    import torch.nn.functional as F

    q = torch.randn(1, 8, tokens, 64, requires_grad=True)

    def step():
        F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()

    forward = 2 * 8 * tokens * tokens * (64 + 64) // 2  # (causal: half the pairs)
    return forward * 7 / 2 / _best_seconds(step, 5)  # (backward: 2.5 x the forward, plan_time.op_cost)


def _ladders() -> tuple[tuple[tuple[float, float], ...], tuple[tuple[float, float], ...]]:
    """What fraction of the large shapes' rate smaller products reach on one thread (a small
    model's products, thin in one dimension, are far from a 1024^3 product's rate: the packing,
    the memory traffic per FLOP, the call): a Linear of width k to 3k over 1024 rows, forward and
    backward (its three products, each k wide in one dimension), for k of 16..512, against a
    1024^3 product, as (k, fraction); attention per head at 64..512 tokens, as (one head's FLOPs,
    fraction of 512 tokens' rate)."""
    import torch.nn.functional as F

    big = torch.randn(1024, 1024)
    peak = 2 * 1024**3 / _best_seconds(lambda: torch.mm(big, big), 5)
    matmul = []
    for k in (16, 32, 64, 128, 256, 512):
        x, w = torch.randn(1024, k, requires_grad=True), torch.randn(3 * k, k, requires_grad=True)
        grad = torch.ones(1024, 3 * k)
        repeats = max(1, 2**26 // (18 * 1024 * k * k))  # (about 0.06 GFLOP a timing)

        def linear(x=x, w=w, grad=grad, repeats=repeats):
            for _ in range(repeats):
                F.linear(x, w).backward(grad)

        matmul.append((float(k), 18 * 1024 * k * k * repeats / _best_seconds(linear, 5) / peak))
    matmul = tuple(matmul)
    tokens = (64, 128, 256, 512)
    attention_rates = [_attention_flops(t) for t in tokens]
    per_head = [2 * t * t * 128 // 2 * 7 / 2 for t in tokens]  # (one head's FLOPs, forward and backward)
    attention = tuple((float(f), r / attention_rates[-1]) for f, r in zip(per_head, attention_rates, strict=True))
    return matmul, attention


def _memory_bytes_per_s(nbytes: int = 16 * 2**20) -> float:
    """Bytes read and written per second by the element-wise mix of a transformer layer: a copy, a
    multiply, an exp and a SiLU (the harmonic mean of their rates; the CPU computes exp and SiLU
    slower than it moves their bytes)."""
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    kernels = (lambda: dst.copy_(src), lambda: torch.mul(src, 1.5, out=dst), lambda: torch.exp(src, out=dst),
               lambda: torch.nn.functional.silu(src, inplace=False))
    seconds = sum(_best_seconds(kernel, 5) for kernel in kernels)
    return len(kernels) * 2 * nbytes / seconds


def _op_floor_s(count: int = 500) -> float:
    """One operator's time beside its work in a training step: a chain of small multiplies under
    autograd and its backward (each forward operator makes one backward operator)."""
    x = torch.ones(8, requires_grad=True)

    def ops():
        y = x
        for _ in range(count):
            y = y * 1.0001
        y.sum().backward()

    return _best_seconds(ops, 3) / (2 * count)


def _dispatch_s(count: int = 500) -> float:
    """One operator that launches no kernel (a view), under autograd, forward and backward: what a
    recorded view, alias or detach costs the CPU's dispatcher and autograd."""
    x = torch.ones(8, requires_grad=True)

    def views():
        y = x
        for _ in range(count):
            y = y.view(8)
        y.sum().backward()

    return _best_seconds(views, 3) / (2 * count)


class _Step(torch.nn.Module):
    def forward(self, x):
        return x * 1.0001


def _module_s(count: int = 300) -> float:
    """One module call beyond its operators' time (nn.Module.__call__: the hook checks, the
    forward's frame): a chain of one-multiply modules against the same multiplies inline."""
    x = torch.ones(8, requires_grad=True)
    modules = [_Step() for _ in range(count)]

    def called():
        y = x
        for m in modules:
            y = m(y)
        y.sum().backward()

    def inline():
        y = x
        for _ in modules:
            y = y * 1.0001
        y.sum().backward()

    return max(_best_seconds(called, 5) - _best_seconds(inline, 5), 0.0) / count


_measured: dict[int, DeviceModel] = {}


def measure_cpu(ranks: int) -> DeviceModel:
    """This machine measured now (a few seconds, once per process), shared out as `hyperparallel
    train --nproc ranks` shares it: one thread's matmul FLOP/s and element-wise bandwidth times the
    cores' worth each rank gets (cores / ranks threads, at least 1, the ranks' threads sharing the
    cores); the host's time per operator, per view and per module call, on one thread, over the
    share of a core each rank's interpreter gets (all of one, or cores / ranks when the ranks
    outnumber the cores); gloo's calls among `ranks` processes on these cores, for each group size
    a layout can have (cpu_gloo.py).
    Single-thread figures are thread CPU time (and the matmul the best this machine has shown:
    peak_flops' cache), so other processes' load does not lower them: the plan is of the run alone."""
    if ranks in _measured:
        return _measured[ranks]
    cores = cpu_gloo.usable_cores()
    threads_per_rank = max(1, cores // ranks)
    share = min(threads_per_rank, cores / ranks)  # cores' worth of compute each rank gets
    host = min(1.0, cores / ranks)  # a core's worth of the interpreter each rank gets
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        # (the trainer's own CPU yardstick for MFU, on one thread)
        flops = {dtype: cpu_peak_tflops(getattr(torch, dtype)) * 1e12 * share for dtype in ("float32", "bfloat16")}
        flops["mx"] = flops["bfloat16"]  # (the CPU's MX products dequantize to the compute dtype)
        flops["attention"] = _attention_flops() * share
        memory = _memory_bytes_per_s() * share
        floor, dispatch, module = _op_floor_s() / host, _dispatch_s() / host, _module_s() / host
        matmul_ladder, attention_ladder = _ladders()
    finally:
        torch.set_num_threads(saved)
    calls = cpu_gloo.measure(ranks)
    # (the largest group's: the link a plan uses where its calls are not, one link figure given by hand)
    rate, latency = calls[-1].link()
    link = {"bytes_per_s": rate, "latency_s": latency}
    total_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    _measured[ranks] = DeviceModel(
        name="cpu", matmul_flops=flops, memory_bytes_per_s=memory, memory_bytes=total_memory // ranks,
        intra_node_bytes_per_s=link["bytes_per_s"], intra_node_latency_s=link["latency_s"],
        inter_node_bytes_per_s=link["bytes_per_s"], inter_node_latency_s=link["latency_s"], ranks_per_node=ranks,
        op_floor_s=floor, overlap=False, peak_bf16_flops=flops["bfloat16"], dispatch_s=dispatch, module_s=module,
        collective_calls=calls,
        matmul_ladder=matmul_ladder, attention_ladder=attention_ladder,
        source=f"measured now on this machine ({cores} cores shared by {ranks} rank(s), gloo among {max(ranks, 2)} processes)",
    )
    return _measured[ranks]
