"""MFU's yardstick: the FLOP/s that a run's model FLOP/s are divided by, and its name in the run
summary.

- `logging.peak_tflops`, when the config gives it;
- a known GPU: its datasheet's dense BF16 peak (`GPU_PEAK_BF16_TFLOPS`, which `device_model`'s GPU
  models are built from too);
- the CPU: the best torch.mm has reached here on a large product, kept in the user's cache
  directory (`cpu_peak_tflops.json` under `$XDG_CACHE_HOME/hyperparallel`, else
  `~/.cache/hyperparallel`), keyed by the CPU model, torch's thread count, torch's version and the
  dtype. Measured anew on every start it moved 0.08-0.21 TFLOP/s between identical runs of one
  shared 2-core machine, and MFU moved with it; measured once and kept, a first start on a busy
  machine kept 0.10 where the machine does 0.20 (MFU above 100%). Other work only ever slows a
  measurement down, so every start measures briefly and only a higher figure replaces the kept
  one: it rises to the machine's and then stays. Delete the file to measure again.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import NamedTuple

import torch

GPU_PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "B200": 2250.0}
CACHE_FILE = "cpu_peak_tflops.json"


class Peak(NamedTuple):
    tflops: float
    source: str  # what it is, for the run summary: "H200 dense bf16 peak (datasheet)", ...


def measured_cpu_peak_tflops(dtype: torch.dtype, seconds: float = 0.5) -> float:
    """What torch.mm reaches here on a large square product: the yardstick for a CPU's MFU.

    The best of the calls made within `seconds`: the first calls pay for warming the thread
    pool and the clock, and other work on the machine only ever slows a call down."""
    a = torch.randn(1024, 1024, dtype=dtype)
    best, start = float("inf"), time.perf_counter()
    while time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        torch.mm(a, a)
        best = min(best, time.perf_counter() - t0)
    return 2 * 1024**3 / best / 1e12


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hyperparallel"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_key(dtype: torch.dtype, threads: int) -> str:
    """What a CPU measurement holds for: this CPU model, this many torch threads, this torch."""
    return f"{_cpu_model()} | {threads} threads | torch {torch.__version__} | {str(dtype).replace('torch.', '')}"


def cpu_peak_tflops(dtype: torch.dtype) -> float:
    """torch.mm's TFLOP/s on this CPU at torch's current thread count: the best this machine has
    shown. A first start measures a second; later ones a fifth of one, which can only raise the
    cached figure (other work only ever slows a measurement, so one taken on a busy machine is
    corrected by the next quiet start, and the figure stops moving once one was quiet). A cache
    that cannot be read or written is measured past."""
    key = cpu_key(dtype, torch.get_num_threads())
    try:  # (no home directory: Path.home() raises RuntimeError; then there is no cache)
        path = cache_dir() / CACHE_FILE
        known = json.loads(path.read_text())
    except RuntimeError:
        path, known = None, {}
    except (OSError, ValueError):
        known = {}
    if not isinstance(known, dict):
        known = {}
    cached = known.get(key) if isinstance(known.get(key), (int, float)) and known[key] > 0 else None
    measured = measured_cpu_peak_tflops(dtype, seconds=1.0 if cached is None else 0.2)
    if cached is not None and cached >= measured:
        return float(cached)
    if path is None:
        return measured
    try:  # (ranks that measure together each write the whole file under a name of their own, then rename)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{CACHE_FILE}.{os.getpid()}")
        tmp.write_text(json.dumps({**known, key: measured}, indent=1) + "\n")
        tmp.replace(path)
    except OSError:
        pass
    return measured


def mfu_peak(device: torch.device, dtype: torch.dtype, configured: float | None) -> Peak:
    """The peak that MFU divides by, and what it is."""
    if configured:
        return Peak(configured, "logging.peak_tflops")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in GPU_PEAK_BF16_TFLOPS.items():
            if key in name:
                return Peak(value, f"{key} dense bf16 peak (datasheet)")
    threads = torch.get_num_threads()
    return Peak(cpu_peak_tflops(dtype), f"torch.mm {str(dtype).replace('torch.', '')} on {threads} thread"
                                        f"{'s' if threads != 1 else ''} here, the best measured")
