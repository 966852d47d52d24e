"""MFU's yardstick: the CPU's torch.mm measured once per machine (CPU model, threads, torch) and
cached, so it no longer moves between identical runs; named in the run summary. (No timing is
tested: the measurement is replaced by a counter.)"""

from __future__ import annotations

import json

import torch

from hyperparallel.train import peak_flops


def test_the_cpu_peak_is_measured_once_per_machine_and_named(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    measured = []

    def measure(dtype, seconds=0.5):
        measured.append(dtype)
        return 0.125 * len(measured)

    monkeypatch.setattr(peak_flops, "measured_cpu_peak_tflops", measure)
    first = peak_flops.mfu_peak(torch.device("cpu"), torch.float32, None)
    assert peak_flops.mfu_peak(torch.device("cpu"), torch.float32, None) == first  # the cached one
    assert first.tflops == 0.125 and len(measured) == 1
    threads = torch.get_num_threads()
    assert first.source == f"torch.mm float32 on {threads} thread{'s' if threads != 1 else ''} here, measured once"
    cached = json.loads((tmp_path / "hyperparallel" / peak_flops.CACHE_FILE).read_text())
    assert cached == {peak_flops.cpu_key(torch.float32, threads): 0.125}
    # another dtype (or thread count, CPU, torch) is another measurement
    assert peak_flops.mfu_peak(torch.device("cpu"), torch.bfloat16, None).tflops == 0.25 and len(measured) == 2
    assert peak_flops.mfu_peak(torch.device("cpu"), torch.float32, 7.5) == (7.5, "logging.peak_tflops")
