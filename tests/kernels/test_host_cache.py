"""The native kernels' cache of large output buffers (csrc/mx_cache.c, kernels/host_cache.py), through
the MX CPU backend, its first user."""

from __future__ import annotations

import gc
import io
import threading

import pytest
import torch

from hyperparallel import mx
from hyperparallel.errors import ConfigError
from hyperparallel.kernels import host_cache
from hyperparallel.mx import reference

LARGE = (1024, 1024)  # 1 MiB of codes: large enough for the cache


@pytest.fixture
def fresh_cache():
    limit = host_cache._limit
    host_cache.set_limit(64 << 20)
    host_cache.empty_cache()
    yield
    host_cache.set_limit(limit)


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def test_a_freed_output_buffer_is_reused(fresh_cache):
    x = torch.randn(LARGE, dtype=torch.bfloat16)
    first = mx.quantize(x, axis=-1)
    address = first.data.data_ptr()
    del first
    gc.collect()
    assert host_cache.free_bytes() >= LARGE[0] * LARGE[1]
    second = mx.quantize(x, axis=-1)
    assert second.data.data_ptr() == address


def test_a_live_output_is_never_handed_out_again(fresh_cache):
    a = torch.randn(LARGE, dtype=torch.bfloat16)
    b = torch.randn(LARGE, dtype=torch.bfloat16) * 1000
    qa = mx.quantize(a, axis=0)
    kept = u8(qa.data).clone()
    qb = mx.quantize(b, axis=0)
    assert qb.data.data_ptr() != qa.data.data_ptr()
    assert torch.equal(u8(qa.data), kept)


@pytest.mark.parametrize("op", ["rows", "cols", "dual", "grouped", "dequantize"])
def test_cached_outputs_are_exact(fresh_cache, op):
    x = torch.randn(LARGE, dtype=torch.float32) * 3
    for _ in range(2):  # the second round runs in reused (dirty) buffers
        if op == "rows":
            got, want = [mx.quantize(x, axis=1)], [reference.quantize(x, 1, torch.float8_e4m3fn, "rceil")]
        elif op == "cols":
            got, want = [mx.quantize(x, axis=0)], [reference.quantize(x, 0, torch.float8_e4m3fn, "rceil")]
        elif op == "dual":
            got = list(mx.quantize_dual(x))
            want = [reference.quantize(x, 1, torch.float8_e4m3fn, "rceil"), reference.quantize(x, 0, torch.float8_e4m3fn, "rceil")]
        elif op == "grouped":
            offsets = torch.tensor([0, 100, 100, 700, 1024])
            got = [mx.quantize_grouped(x, offsets)]
            want = [reference.quantize_grouped(x, offsets, torch.float8_e4m3fn, "rceil")]
        else:
            q = mx.quantize(x, axis=1)
            assert torch.equal(q.dequantize(torch.float32), reference.dequantize(q.data, q.scale, 1, None, torch.float32))
            continue
        for g, (data, scale) in zip(got, want, strict=True):
            assert torch.equal(u8(g.data), u8(data)) and torch.equal(u8(g.scale), u8(scale))
        del got
        gc.collect()


def test_cached_outputs_are_ordinary_tensors(fresh_cache):
    q = mx.quantize(torch.randn(LARGE, dtype=torch.bfloat16), axis=-1)
    buffer = io.BytesIO()
    torch.save(q.data, buffer)
    buffer.seek(0)
    assert torch.equal(u8(torch.load(buffer)), u8(q.data))
    assert q.data.is_contiguous() and q.data.device.type == "cpu"


def test_a_tensor_freed_on_another_thread_returns_its_buffer(fresh_cache):
    holder = [mx.quantize(torch.randn(LARGE, dtype=torch.bfloat16), axis=-1)]
    thread = threading.Thread(target=holder.clear)
    thread.start()
    thread.join()
    gc.collect()
    assert host_cache.free_bytes() >= LARGE[0] * LARGE[1]


def test_limit_zero_keeps_nothing(fresh_cache):
    host_cache.set_limit(0)
    q = mx.quantize(torch.randn(LARGE, dtype=torch.bfloat16), axis=-1)
    del q
    gc.collect()
    assert host_cache.free_bytes() == 0


def test_the_limit_evicts_old_buffers(fresh_cache):
    host_cache.set_limit(3 << 20)
    outs = [mx.quantize(torch.randn(LARGE, dtype=torch.bfloat16), axis=-1) for _ in range(6)]
    del outs
    gc.collect()
    assert 0 < host_cache.free_bytes() <= 3 << 20


def test_a_bad_limit_is_refused(monkeypatch):
    with pytest.raises(ValueError, match=">= 0 bytes"):
        host_cache.set_limit(-1)
    monkeypatch.setenv("HYPERPARALLEL_MX_CACHE_MB", "lots")
    with pytest.raises(ConfigError, match="HYPERPARALLEL_MX_CACHE_MB"):
        host_cache._limit_from_env()
