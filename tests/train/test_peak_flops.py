"""MFU's yardstick: the best torch.mm rate this machine has shown (CPU model, threads, torch),
cached, so it does not move between identical runs except upwards; named in the run summary.
(No timing is tested: the measurement is replaced by a list of figures.)"""

from __future__ import annotations

import json

import torch

from hyperparallel.train import peak_flops


def test_the_cpu_peak_is_the_best_measured_on_this_machine_and_named(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    figures = [0.125, 0.1, 0.2, 0.3]  # a busy first start, a busier one, then quieter ones
    measured = []

    def measure(dtype, seconds=0.5):
        measured.append((dtype, seconds))
        return figures[len(measured) - 1]

    monkeypatch.setattr(peak_flops, "measured_cpu_peak_tflops", measure)
    cache = tmp_path / "hyperparallel" / peak_flops.CACHE_FILE
    threads = torch.get_num_threads()
    key = peak_flops.cpu_key(torch.float32, threads)
    first = peak_flops.mfu_peak(torch.device("cpu"), torch.float32, None)
    assert first.tflops == 0.125 and measured == [(torch.float32, 1.0)]  # a second the first time
    assert first.source == f"torch.mm float32 on {threads} thread{'s' if threads != 1 else ''} here, the best measured"
    assert peak_flops.mfu_peak(torch.device("cpu"), torch.float32, None) == first  # a lower figure keeps the cached
    assert json.loads(cache.read_text()) == {key: 0.125} and measured[1] == (torch.float32, 0.2)
    assert peak_flops.mfu_peak(torch.device("cpu"), torch.float32, None).tflops == 0.2  # a higher one replaces it
    assert json.loads(cache.read_text()) == {key: 0.2}
    # another dtype (or thread count, CPU, torch) is another figure
    assert peak_flops.mfu_peak(torch.device("cpu"), torch.bfloat16, None).tflops == 0.3
    assert json.loads(cache.read_text()) == {key: 0.2, peak_flops.cpu_key(torch.bfloat16, threads): 0.3}
    assert peak_flops.mfu_peak(torch.device("cpu"), torch.float32, 7.5) == (7.5, "logging.peak_tflops")
