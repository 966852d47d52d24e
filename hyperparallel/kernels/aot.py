"""Every Triton kernel of the package compiled ahead of time to cubin, for GPUs this machine need
not have (CI runs it on CPUs):

    python -m hyperparallel.kernels.aot [--targets sm_90,sm_100] [--kernel NAME] [-q]

One line per kernel specialization and target (its cubin's size, or the error's first line),
then a summary; the exit status is 1 when any compile failed, 2 on a bad argument.

[Note: specializations from the launch sites] What is compiled is what the code launches, found
by running it: each driver (DRIVERS) calls one kernel module's own wrappers on small CPU tensors,
with every dtype, element format and flag they can pick, inside
``triton_support.recorded_launches()`` (see its [Note: recorded launches]), so no kernel runs.
Each recorded launch becomes a specialization: the signature Triton's JIT gives its arguments
(`triton.runtime.jit.mangle_type`: a tensor's dtype as a pointer type, an int as i32 or i64 by its
value, a float as fp32), its constexpr values and its launch options (num_warps, num_stages).
Identical ones are compiled once. Block sizes follow the shapes, and the drivers take shapes of
the models we train (hidden and expert sizes of 256 and more, more tokens than a tile), so the
tiles are those of training. Each cubin is the general one of its specialization: the JIT also
specializes a launch on 16-byte aligned pointers, ints divisible by 16 and ints equal to 1, which
follow the values of one call and are not compiled here.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import inspect
import itertools
import multiprocessing
import os
import re
import sys
import time
from collections.abc import Callable, Iterable, Sequence

import torch

from hyperparallel.errors import BackendError, ConfigError, HyperparallelError, error_lines
from hyperparallel.kernels import triton_support
from hyperparallel.kernels.triton_support import JitKernels, Launch

DEFAULT_TARGETS = ("sm_90", "sm_100")


# ------------------------------------------------------------------------------------ drivers
# One function per module of Triton kernels: its wrappers called with representative CPU inputs,
# every combination of dtypes and flags they launch (see [Note: specializations from the launch
# sites]). A new module adds its driver to DRIVERS.


def _mx() -> None:
    """hyperparallel.mx.backends.triton: quantize (each axis, both at once, grouped), dequantize."""
    from hyperparallel import mx  # (mx sits above kernels: imported only when the command runs)

    rows, cols = 256, 1024
    offsets = torch.tensor([0, 40, 40, 200, rows])  # groups of any size, an empty one among them
    for dtype, elem, mode in itertools.product((torch.float32, torch.bfloat16, torch.float16),
                                               (torch.float8_e4m3fn, torch.float8_e5m2), ("rceil", "floor")):
        x = torch.zeros(rows, cols, dtype=dtype)
        options = {"elem_dtype": elem, "scale_mode": mode, "backend": "triton"}
        quantized = [mx.quantize(x, -1, **options), mx.quantize(x, 0, **options),
                     mx.quantize_grouped(x, offsets, **options), *mx.quantize_dual(x, **options)]
        for q in quantized:
            for t in (q, q.t()):  # blocks along the last axis and across the rows, each layout
                t.dequantize(dtype, backend="triton")


def _mx_gemm() -> None:
    """hyperparallel.mx.backends.triton_mm: the MX GEMM that decodes in the tile, launched as
    `mx.mx_mm` launches it when forced (HYPERPARALLEL_MX_GEMM=triton): each output dtype and pair
    of element formats, and with a bias (which mx_mm rounds to the operand dtype) as MXLinear's
    forward has (E4M3 x E4M3), the tiles it launches with."""
    from hyperparallel import mx
    from hyperparallel.mx import gemm_path

    formats = (torch.float8_e4m3fn, torch.float8_e5m2)
    cases = [(out, ea, eb, False) for out, ea, eb in
             itertools.product((torch.bfloat16, torch.float16, torch.float32), formats, formats)]
    cases += [(out, formats[0], formats[0], True) for out in (torch.bfloat16, torch.float16, torch.float32)]
    with gemm_path.forcing("triton"):
        for out_dtype, elem_a, elem_b, bias in cases:
            a = mx.quantize(torch.zeros(256, 512), 1, elem_dtype=elem_a, backend="reference")
            b = mx.quantize(torch.zeros(512, 256), 0, elem_dtype=elem_b, backend="reference")
            mx.mx_mm(a, b, out_dtype, bias=torch.zeros(256) if bias else None)


# The routers of the families models registers, as MegaGate takes them: (score, experts, top_k,
# groups, top groups, correction bias, routed scaling factor, hash-routed).
_ROUTERS = {
    "qwen3_moe": ("softmax", 128, 8, 1, 1, False, 1.0, False),
    "deepseek_v3": ("sigmoid", 256, 8, 8, 4, True, 2.5, False),
    "kimi_k2": ("sigmoid", 384, 8, 1, 1, True, 2.827, False),
    "deepseek_v4": ("sqrtsoftplus", 256, 6, 1, 1, True, 1.5, False),
    "deepseek_v4_hash": ("sqrtsoftplus", 256, 6, 1, 1, False, 1.5, True),
}


def _mega_gate() -> None:
    """hyperparallel.kernels.mega_gate.triton: forward and backward of every family's router, with
    and without the aux loss's sums, with and without renormalized weights."""
    from hyperparallel.kernels.mega_gate.op import run_backend

    tokens = 256
    for (score, experts, top_k, groups, top_groups, bias, scale, hashed), aux, norm in itertools.product(
            _ROUTERS.values(), (False, True), (False, True)):
        logits = torch.zeros(tokens, experts, requires_grad=True)
        weights, _, _, prob_sum = run_backend(
            "triton", logits, torch.zeros(experts) if bias else None, score=score, top_k=top_k, num_groups=groups,
            top_groups=top_groups, norm_topk_prob=norm or hashed, routed_scaling_factor=scale,
            norm_eps=0.0 if score == "softmax" else 1e-20, aux_probs=aux,
            hash_indices=torch.zeros(tokens, top_k, dtype=torch.int64) if hashed else None)
        outputs = [weights] + ([prob_sum] if aux else [])
        torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])


def _mega_mhc() -> None:
    """hyperparallel.kernels.mega_mhc.triton: DeepSeek-V4's hyper-connections (4 streams of 4096),
    pre, post and head, forward and backward, in each stream dtype."""
    from hyperparallel.kernels.mega_mhc.op import run_head, run_post, run_pre

    tokens, n, d = 64, 4, 4096
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        streams = torch.zeros(tokens, n, d, dtype=dtype, requires_grad=True)
        fn, base, scale = (torch.zeros(shape, requires_grad=True) for shape in ([(2 + n) * n, n * d], [(2 + n) * n], [3]))
        post, comb, collapsed = run_pre("triton", streams, fn, base, scale, sinkhorn_iters=20, hc_eps=1e-6,
                                        norm_eps=1e-6)
        mixed = run_post("triton", collapsed, streams, post, comb)  # (the block's output: any [T, D])
        hc_fn, hc_base, hc_scale = (torch.zeros(shape, requires_grad=True) for shape in ([n, n * d], [n], [1]))
        head = run_head("triton", mixed, hc_fn, hc_base, hc_scale, hc_eps=1e-6, norm_eps=1e-6)
        head.float().sum().backward()


DRIVERS: dict[str, Callable[[], None]] = {"mx": _mx, "mx_gemm": _mx_gemm, "mega_gate": _mega_gate,
                                          "mega_mhc": _mega_mhc}


# ------------------------------------------------------------------------------ specializations


@dataclasses.dataclass(frozen=True)
class Specialization:
    """One kernel compiled one way: its signature (parameter -> Triton type, "constexpr" for the
    constexprs), constexpr values and launch options, each as sorted-or-ordered pairs."""

    kernels: JitKernels
    name: str
    signature: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[str, object], ...]
    options: tuple[tuple[str, object], ...]

    @property
    def kernel(self) -> str:
        """The kernel's name with its module's, e.g. mx.backends.triton._quant_rows_kernel."""
        return f"{self.kernels.module.removeprefix('hyperparallel.')}.{self.name}"


def specialization(launch: Launch) -> Specialization:
    """What Triton's JIT would compile for this launch (see [Note: specializations from the launch sites])."""
    from triton.runtime.jit import mangle_type

    fn = launch.kernels.jitted(launch.name)
    params = [p.name for p in fn.params]
    options = {k: v for k, v in launch.kwargs.items() if k not in params}
    bound = fn.signature.bind(*launch.args, **{k: v for k, v in launch.kwargs.items() if k in params})
    bound.apply_defaults()
    constexpr = {p.name for p in fn.params if p.is_constexpr}
    signature = tuple((name, "constexpr" if name in constexpr else mangle_type(value))
                      for name, value in bound.arguments.items())
    constexprs = tuple((name, value) for name, value in bound.arguments.items() if name in constexpr)
    return Specialization(launch.kernels, launch.name, signature, constexprs, tuple(sorted(options.items())))


def record(drivers: Iterable[Callable[[], None]]) -> list[Specialization]:
    """The distinct specializations the drivers launch, in the order first launched."""
    with triton_support.recorded_launches() as launches:
        for drive in drivers:
            drive()
    return list(dict.fromkeys(specialization(launch) for launch in launches))


def describe(spec: Specialization, among: Sequence[Specialization]) -> str:
    """The specialization in short: the pointer types and constexprs that set it apart from the
    others of its kernel (all of them for a kernel launched one way), and the options."""
    siblings = [s for s in among if s.kernels is spec.kernels and s.name == spec.name]
    fields = [(k, v) for k, v in spec.signature if v.startswith("*")] + list(spec.constexprs)
    fields += [(k, v) for k, v in spec.options]
    if len(siblings) > 1:
        others = [dict(s.signature) | dict(s.constexprs) | dict(s.options) for s in siblings]
        fields = [(k, v) for k, v in fields if len({repr(o.get(k)) for o in others}) > 1]
    return " ".join(f"{k}={v}" for k, v in fields) or "-"


# ------------------------------------------------------------------------------------ compile


def parse_targets(text: str):
    """"sm_90,sm_100" -> Triton's GPUTarget of each (a ConfigError naming a bad one)."""
    from triton.backends.compiler import GPUTarget

    targets = []
    for name in (part.strip() for part in text.split(",")):
        match = re.fullmatch(r"sm_(\d{2,3})a?", name)
        if match is None:
            raise ConfigError(f"--targets: {name!r} is not a CUDA target such as sm_90 or sm_100")
        targets.append((name, GPUTarget("cuda", int(match.group(1)), 32)))
    return targets


def compile_cubin(spec: Specialization, target) -> bytes:
    """The cubin of one specialization for one GPUTarget (what triton.compile raises, if it fails)."""
    triton = triton_support.triton
    source = triton.compiler.ASTSource(spec.kernels.jitted(spec.name), signature=dict(spec.signature),
                                       constexprs=dict(spec.constexprs))
    return triton.compile(source, target=target, options=dict(spec.options)).asm["cubin"]


def first_line(error: BaseException) -> str:
    """The error in one line. Triton's CompilationError opens with its place ("at 3:27:") and ends
    with the cause; an error inside a jit function the kernel calls is chained below the kernel's
    (whose own message ends at the call): the innermost one, named by its function, is the cause."""
    while error.__cause__ is not None and type(error.__cause__).__name__ == type(error).__name__:
        error = error.__cause__
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if len(lines) > 1 and re.fullmatch(r"at \d+:\d+:", lines[0]):
        function = re.search(r"def (\w+)", getattr(error, "src", None) or "")
        where = f" in {function.group(1)}" if function else ""
        return f"{type(error).__name__}{where} {lines[0]} {lines[-1]}"
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


# What the worker processes compile: set before they fork, read by index (a JitKernels holds a
# module's namespace, which does not pickle).
_WORK: list[tuple[Specialization, object]] = []


def _compile_one(index: int) -> tuple[float | None, str | None]:
    """(cubin KiB, None) or (None, the error's first line) of _WORK[index]."""
    spec, target = _WORK[index]
    try:
        return len(compile_cubin(spec, target)) / 1024, None
    except Exception as error:  # a kernel that does not compile: named, and the others go on
        return None, first_line(error)


def _compiled(count: int, jobs: int):
    """_compile_one of every index, in order; `jobs` forked processes (Triton's compiler is
    single-threaded: ~1.3 s a compile here), or this one."""
    if jobs <= 1 or count <= 1 or sys.platform != "linux":
        yield from map(_compile_one, range(count))
        return
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
        yield from pool.map(_compile_one, range(count))


def default_jobs() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def run(targets: str = ",".join(DEFAULT_TARGETS), kernel: str | None = None, quiet: bool = False,
        drivers: Iterable[Callable[[], None]] | None = None, out=sys.stdout, jobs: int = 1) -> int:
    """Compile every specialization the drivers launch (default: DRIVERS) whose kernel name holds
    `kernel`, for each target; print a line each (only failures when `quiet`) and a summary.
    The number of failed compiles."""
    if triton_support.triton is None:
        raise BackendError(triton_support.unavailable_reason(torch.device("cuda")))
    if triton_support.interpret():
        raise ConfigError("the Triton interpreter is on (its environment variable is 1): it compiles nothing; unset it")
    if "constexprs" not in inspect.signature(triton_support.triton.compiler.ASTSource).parameters:
        raise BackendError(f"triton {triton_support.triton.__version__} is too old to compile ahead of time: "
                           "install triton>=3.3")
    compile_targets = parse_targets(targets)
    start = time.perf_counter()
    specs = record(DRIVERS.values() if drivers is None else drivers)
    chosen = [s for s in specs if kernel is None or kernel in s.kernel]
    if not chosen:
        raise ConfigError(f"--kernel {kernel!r} names no kernel; they are {', '.join(sorted({s.kernel for s in specs}))}")
    failures = 0
    work = list(itertools.product(chosen, compile_targets))
    _WORK[:] = [(spec, target) for spec, (_, target) in work]
    try:
        for (spec, (name, _)), (kib, error) in zip(work, _compiled(len(work), jobs), strict=True):
            if error is not None:
                failures += 1
                result = f"FAILED {error}"
            elif quiet:
                continue
            else:
                result = f"ok     {kib:7.1f} KiB"
            print(f"{spec.kernel} [{describe(spec, chosen)}] {name}: {result}", file=out, flush=True)
    finally:
        _WORK.clear()
    kernels = len({s.kernel for s in chosen})
    compiles = len(chosen) * len(compile_targets)
    print(f"{compiles - failures} of {compiles} compiles ok ({kernels} kernels, {len(chosen)} specializations, "
          f"{', '.join(name for name, _ in compile_targets)}) in {time.perf_counter() - start:.1f} s", file=out)
    return failures


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hyperparallel.kernels.aot", description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default=",".join(DEFAULT_TARGETS),
                        help="CUDA targets, comma-separated (default: %(default)s)")
    parser.add_argument("--kernel", help="only the kernels whose name (module.kernel) contains this")
    parser.add_argument("-q", "--quiet", action="store_true", help="print only failures and the summary")
    parser.add_argument("-j", "--jobs", type=int, default=default_jobs(),
                        help="compiles at once, each in a process of its own (default: the cores, %(default)s)")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        print("error: --jobs must be 1 or more", file=sys.stderr)
        return 2
    try:
        return 1 if run(args.targets, args.kernel, args.quiet, jobs=args.jobs) else 0
    except HyperparallelError as error:
        print(error_lines(str(error)), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
