"""The Hopper MX GEMM's main loop in SASS, counted without a GPU: what its FP8 decode costs
against the tensor-core work it feeds, beside a plain bf16 Triton GEMM of the same tile.

    python benchmarks/mx_sass.py               # sm_90 (Hopper), the tiles below, both operand layouts

Each kernel is compiled as Triton's JIT compiles a real launch (pointers 16-byte aligned, sizes
and strides multiples of 16, unit strides constant), disassembled with the cuobjdump Triton
ships, and its K loop (the longest backward branch) counted: instructions, tensor-core
instructions (HGMMA / QGMMA / HMMA), registers, spilled bytes. "issue" is the loop's
instructions x warps / 4 (an SM issues one instruction per scheduler per clock, 4 schedulers),
"mma" the clocks the bf16 tensor cores need for the loop's BLOCK_M x BLOCK_N x BLOCK_K
products (2048 dense bf16 multiply-adds a clock per SM on H100 / H200). issue / mma above 1 means
the loop cannot keep the tensor cores busy however well it overlaps: the kernel runs at most at
mma / issue of the tensor cores' speed; below 1 it can be tensor-core bound.

Layouts: "forward" is MXLinear's forward (a [M, K] row-major, b the weight's copy [N, K] seen as
[K, N]: K contiguous in both); "grads" its input- and weight-grad products (b's N contiguous).
These are static counts, not times: scripts/gpu_check.sh times the kernel on an H200.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

from hyperparallel.mx.backends import triton_mm

TILES = [(128, 128, 64, 8, 3), (128, 256, 32, 8, 4), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3),
         (128, 128, 128, 8, 3), (64, 256, 64, 4, 3)]  # BLOCK_M, BLOCK_N, BLOCK_K, warps, stages
UNIT_STRIDES = {"forward": ("s_ak", "s_bk", "s_ask", "s_bsk", "s_cn"), "grads": ("s_ak", "s_bn", "s_ask", "s_bsn", "s_cn")}
BF16_MACS_PER_CLOCK = 2048  # dense bf16 multiply-adds per SM per clock (H100 / H200)


@triton.jit
def bf16_gemm(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, bias_ptr, M, N, K, s_am, s_ak, s_asm, s_ask, s_bk, s_bn, s_bsk,
              s_bsn, s_cm, s_cn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """A bf16 GEMM with the MX kernel's loop and masks, minus the decode (its parameters too, so
    both compile from one signature; the scale and bias pointers are unused)."""
    pid = tl.program_id(0)
    tiles_n = (N + BLOCK_N - 1) // BLOCK_N
    rm = (pid // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = (pid % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_m, in_n = rm < M, rn < N
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        in_k = rk < K
        a = tl.load(a_ptr + rm[:, None] * s_am + rk[None, :] * s_ak, mask=in_m[:, None] & in_k[None, :], other=0)
        b = tl.load(b_ptr + rk[:, None] * s_bk + rn[None, :] * s_bn, mask=in_k[:, None] & in_n[None, :], other=0)
        acc = tl.dot(a, b, acc)
    tl.store(c_ptr + rm[:, None] * s_cm + rn[None, :] * s_cn, acc.to(tl.bfloat16), mask=in_m[:, None] & in_n[None, :])


def cuobjdump() -> str:
    knobs = getattr(triton, "knobs", None)
    if knobs is not None and hasattr(knobs.nvidia, "cuobjdump"):
        return knobs.nvidia.cuobjdump.path
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")


def compile_kernel(fn, operand: str, tile, layout: str, target):
    """The kernel's cubin for one tile and layout, specialized as a real launch would be."""
    block_m, block_n, block_k, warps, stages = tile
    names = [p.name for p in fn.params]
    signature = {name: "i32" for name in names}
    signature.update(a_ptr=operand, b_ptr=operand, as_ptr="*u8", bs_ptr="*u8", c_ptr="*bf16", bias_ptr="*bf16")
    constexprs = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k}
    if fn is not bf16_gemm:
        constexprs.update(ELEM_A=0, ELEM_B=0, HAS_BIAS=False, OUT=1, BF16=True, INTERPRETED=False)
    constexprs.update({name: 1 for name in UNIT_STRIDES[layout]})
    for name in constexprs:
        signature[name] = "constexpr"
    aligned = {(names.index(n),): [["tt.divisibility", 16]] for n in names if signature[n] != "constexpr"}
    source = triton.compiler.ASTSource(fn, signature=signature, constexprs=constexprs, attrs=aligned)
    return triton.compile(source, target=target, options={"num_warps": warps, "num_stages": stages}).asm["cubin"]


def loop_counts(cubin: bytes, tool: str, tmp: Path) -> dict:
    path = tmp / "kernel.cubin"
    path.write_bytes(cubin)
    sass = subprocess.run([tool, "-sass", str(path)], capture_output=True, text=True, check=True).stdout
    usage = subprocess.run([tool, "-res-usage", str(path)], capture_output=True, text=True, check=True).stdout
    instructions = []  # (offset, opcode)
    for line in sass.splitlines():
        match = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*)", line)
        if match:
            instructions.append((int(match.group(1), 16), match.group(2), match.group(3)))
    loops = []
    for offset, op, rest in instructions:
        target = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
        if target and int(target.group(1), 16) < offset:
            loops.append((int(target.group(1), 16), offset))
    start, end = max(loops, key=lambda span: span[1] - span[0])
    body = collections.Counter(op.split(".")[0] for offset, op, _ in instructions if start <= offset <= end)
    return {"instructions": sum(body.values()), "mma": sum(body[op] for op in ("HGMMA", "QGMMA", "HMMA")),
            "registers": int(re.search(r"REG:(\d+)", usage).group(1)),
            "spilled": int(re.search(r"STACK:(\d+)", usage).group(1)), "top": body.most_common(4)}


def main(argv=None) -> int:
    # (sm_90 only: Blackwell's tensor-core instructions and rates differ, and it takes scaled_mm)
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    target = GPUTarget("cuda", 90, 32)
    triton_mm._KERNELS.build()
    kernels = {"mx": (triton_mm._KERNELS.jitted("_mx_mm_kernel"), "*u8"), "bf16": (bf16_gemm, "*bf16")}
    tool = cuobjdump()
    tmp = Path(__import__("tempfile").mkdtemp())
    print(f"sm_90, triton {triton.__version__}; the MX kernel's tile now: {triton_mm.TILE}")
    print("| tile M x N x K, warps, stages | layout | kernel | loop instr. | MMA instr. | regs | spilled B | issue clk "
          "| mma clk | issue / mma | mx / bf16 instr. | most frequent |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for tile in TILES:
        for layout in UNIT_STRIDES:
            counts = {name: loop_counts(compile_kernel(fn, operand, tile, layout, target), tool, tmp)
                      for name, (fn, operand) in kernels.items()}
            block_m, block_n, block_k, warps, stages = tile
            mma = block_m * block_n * block_k / BF16_MACS_PER_CLOCK
            for name, c in counts.items():
                issue = c["instructions"] * warps / 4
                ratio = counts["mx"]["instructions"] / counts["bf16"]["instructions"] if name == "mx" else 1.0
                print(f"| {block_m}x{block_n}x{block_k}, {warps}, {stages} | {layout} | {name} | {c['instructions']} | "
                      f"{c['mma']} | {c['registers']} | {c['spilled']} | {issue:.0f} | {mma:.0f} | {issue / mma:.2f} | "
                      f"{ratio:.2f}x | {', '.join(f'{op} {n}' for op, n in c['top'])} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
