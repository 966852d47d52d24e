"""DVM's VFs (hyperparallel/fusion/vf.py, vf_spec.py, csrc's generated table): the table covers the
chains it is made for, the split writes VF instructions for them, and a program run with VFs gives
bit for bit what the per-op path gives (each op of a VF is the per-op loop's own formula; the
build has no FP contraction), on every chain, forward and backward, fp32 and bf16, odd shapes,
every instruction set; the reference interpreter runs VF instructions; the VM refuses a VF that
does not fit its table."""

from __future__ import annotations

import pytest
import torch

from hyperparallel.fusion import compile as dvm_compile
from hyperparallel.fusion import reference, vf, vf_spec, vm
from hyperparallel.fusion.bytecode import WORDS, DType, Kind, Op, Program
from hyperparallel.fusion.vf_chains import CHAINS
from tests import instruction_sets

pytestmark = pytest.mark.skipif(vm.LIB is None, reason="hyperparallel._dvm_native is not built")
isa = instruction_sets.isa
F32, BF16 = torch.float32, torch.bfloat16


def vf_count(programs) -> int:
    return sum(p.code[i] == Op.VF for p in programs for i in range(0, len(p.code), WORDS))


def run_both(fn, xs, grad: bool):
    """fn's outputs (and input gradients) with VFs on and off, and the programs each built."""
    results, programs = {}, {}
    for use_vfs in (True, False):
        torch._dynamo.reset()
        dvm_compile._CACHE.clear()
        f = torch.compile(lambda *a: fn(*a), backend="dvm", dynamic=False)
        with vf.lowering_with(use_vfs):
            leaves = [x.detach().clone().requires_grad_(grad) for x in xs]
            with torch.set_grad_enabled(grad):
                out = f(*leaves)
                if grad:
                    out.float().square().sum().backward()
            programs[use_vfs] = [prog for prog, *_ in dvm_compile._CACHE.values()]
        results[use_vfs] = [out.detach()] + ([x.grad for x in leaves] if grad else [])
    return results, programs


def test_the_library_was_built_from_this_table():
    vfs = vf_spec.read()
    assert vf.library_has_table()
    assert vm.LIB.hp_dvm_vf_count() == len(vfs)
    assert vm.LIB.hp_dvm_vf_digest().decode() == vf_spec.digest(vfs)


def test_table_lines_parse_back_to_themselves():
    for v in vf_spec.read():
        assert vf_spec.parse_line(v.line) == v
    for bad in ("F : MUL 0 1 -> 2",  # value 1 is not defined before the op
                "F : SIN 0 ; MUL 1 0 -> 2",  # SIN runs per-op only
                "F : EXP 0 -> 0",  # an input is not an output
                "F :  EXP 0  -> 1 2",  # value 2 does not exist
                "X : EXP 0 -> 1"):
        with pytest.raises(ValueError):
            vf_spec.parse_line(bad)


def test_the_table_holds_every_segment_of_the_chains_and_the_default_layers():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[2] / "scripts" / "dvm_vf_harvest.py"
    spec = importlib.util.spec_from_file_location("dvm_vf_harvest", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    missing = script.harvest() - {v.line for v in vf_spec.read()}
    assert not missing, f"run python scripts/dvm_vf_harvest.py --write: {sorted(missing)}"


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("chain", CHAINS, ids=lambda c: c.name)
def test_vfs_equal_the_per_op_path_bitwise_forward_and_backward(chain, dtype):
    # 37 x 77: rows and tiles whose lengths are no multiple of a vector (the VFs' tails)
    xs = chain.make(37 * 4 if chain.name == "rotary" else 37, 77 if chain.name != "rotary" else 78, dtype,
                    torch.Generator().manual_seed(0))
    results, programs = run_both(chain.fn, xs, grad=True)
    for a, b in zip(results[True], results[False], strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert vf_count(programs[False]) == 0
    if chain.name != "sigmoid":  # one op: nothing to fuse
        assert vf_count(programs[True]) > 0
    leaves = [x.detach().clone().requires_grad_() for x in xs]
    want = chain.fn(*leaves)
    want.float().square().sum().backward()
    scale = want.float().abs().max().item()
    tol = 2e-5 * max(1.0, scale) if dtype == F32 else 2e-2 * max(1.0, scale)
    assert (results[True][0].float() - want.float()).abs().max().item() <= tol


@pytest.mark.parametrize("chain", CHAINS, ids=lambda c: c.name)
def test_vfs_equal_the_per_op_path_without_gradients_at_every_instruction_set(chain, isa):
    xs = chain.make(64, 96, F32, torch.Generator().manual_seed(1))
    results, _ = run_both(chain.fn, xs, grad=False)
    assert torch.equal(results[True][0], results[False][0])


def _vf_program(index: int, kinds: str) -> tuple[Program, list[int]]:
    """LOADs for the VF's inputs (U as ROW), the VF, a STORE per output."""
    spec = vf_spec.read()[index]
    p = Program(input_dtypes=[DType.FLOAT32] * len(kinds), output_dtypes=[DType.FLOAT32] * len(spec.outputs))
    ins = []
    for i, k in enumerate(kinds):
        r = p.register(Kind.FULL if k == "F" else Kind.ROW)
        p.emit(Op.LOAD, r, i)
        ins.append(r)
    outs = [p.register(Kind.FULL) for _ in spec.outputs]
    args = outs + ins
    p.emit(Op.VF, index, len(args))
    for q in range(0, len(args), 4):
        p.emit(Op.ARG, *(args[q:q + 4] + [0] * (4 - len(args[q:q + 4]))))
    for j, r in enumerate(outs):
        p.emit(Op.STORE, 0, r, j)
    return p, outs


def test_the_reference_interpreter_and_the_vm_agree_on_every_vf(isa):
    g = torch.Generator().manual_seed(2)
    rows, cols = 5, 37
    for index, spec in enumerate(vf_spec.read()):
        p, outs = _vf_program(index, spec.kinds)
        ins = [torch.randn(rows, cols if k == "F" else 1, generator=g) for k in spec.kinds]
        st = [(t.stride(0), 0 if t.shape[1] == 1 else 1) for t in ins]
        got = [torch.empty(rows, cols) for _ in outs]
        want = [torch.empty(rows, cols) for _ in outs]
        vm.run(p, ins, got, rows, cols, st, [(cols, 1)] * len(outs))
        reference.run(p, ins, want, rows, cols, st, [(cols, 1)] * len(outs))
        for a, b in zip(got, want, strict=True):  # eager's transcendental functions: a few ulps apart
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, equal_nan=True, msg=spec.line)


def _copy(p: Program) -> Program:
    return Program(code=list(p.code), immediates=list(p.immediates), register_kinds=list(p.register_kinds),
                   input_dtypes=list(p.input_dtypes), output_dtypes=list(p.output_dtypes))


def test_the_vm_refuses_a_vf_that_does_not_fit_its_table():
    specs = vf_spec.read()
    x = torch.randn(4, 8)

    def run(p):
        vm.run(p, [x] * len(p.input_dtypes), [torch.empty(4, 8) for _ in p.output_dtypes], 4, 8,
               [(8, 1)] * len(p.input_dtypes), [(8, 1)] * len(p.output_dtypes))

    def refused(p, instruction, what):
        with pytest.raises(vm.VMError, match="VF") as e:
            run(p)
        assert e.value.code == 11 and e.value.instruction == instruction, what

    one = next(i for i, s in enumerate(specs) if s.kinds == "FF" and len(s.outputs) == 1)  # 3 argument words
    good, _ = _vf_program(one, "FF")
    run(good)
    k = next(i for i in range(0, len(good.code), WORDS) if good.code[i] == Op.VF)
    arg = k + WORDS  # its ARG instruction
    edits = {"an index past the table": (k + 1, 10 ** 6), "a negative index": (k + 1, -1),
             "one argument too many": (k + 2, 4), "ARG words past the program's end": (k + 2, 4 * len(good.code)),
             "no ARG after it": (arg, int(Op.LOAD)), "padding that is not 0": (arg + 4, 1)}
    for what, (word, value) in edits.items():
        bad = _copy(good)
        bad.code[word] = value
        refused(bad, k // WORDS, what)
    bad = _copy(good)
    bad.register_kinds.append(Kind.ROW)  # an F input given a ROW register
    row = len(bad.register_kinds) - 1
    bad.code[arg + 2] = row
    bad.code[k:k] = [int(Op.LOAD), row, 0, 0, 0]  # (a ROW load of a broadcast column: fine itself)
    bad.input_dtypes.append(bad.input_dtypes[0])
    bad.code[1 + k] = row
    bad.code[2 + k] = len(bad.input_dtypes) - 1
    with pytest.raises(vm.VMError, match="VF"):
        vm.run(bad, [x, x, x[:, :1]], [torch.empty(4, 8)], 4, 8, [(8, 1), (8, 1), (8, 0)], [(8, 1)])

    two = next(i for i, s in enumerate(specs) if len(s.outputs) >= 2)
    good, _ = _vf_program(two, specs[two].kinds)
    k = next(i for i in range(0, len(good.code), WORDS) if good.code[i] == Op.VF)
    bad = _copy(good)
    bad.code[k + WORDS + 2] = bad.code[k + WORDS + 1]  # the same register as two outputs
    with pytest.raises(vm.VMError, match="VF"):
        vm.run(bad, [x if c == "F" else x[:, :1] for c in specs[two].kinds],
               [torch.empty(4, 8) for _ in bad.output_dtypes], 4, 8,
               [(8, 1) if c == "F" else (8, 0) for c in specs[two].kinds], [(8, 1)] * len(bad.output_dtypes))


def test_hyperparallel_dvm_vf_0_turns_vfs_off():
    xs = CHAINS[1].make(8, 32, F32, torch.Generator().manual_seed(0))
    _, programs = run_both(CHAINS[1].fn, xs, grad=False)
    assert vf_count(programs[True]) > 0 and vf_count(programs[False]) == 0


def test_a_segment_is_cut_within_the_register_budget():
    # a product of 24 inputs: a VF loads its inputs first, so each is alive until its use, and a
    # segment must end before more than BUDGET values are alive at once
    p = Program(input_dtypes=[DType.FLOAT32] * 24, output_dtypes=[DType.FLOAT32])
    regs = []
    for i in range(24):
        r = p.register(Kind.FULL)
        p.emit(Op.LOAD, r, i)
        regs.append(r)
    acc = regs[0]
    for r in regs[1:]:
        m = p.register(Kind.FULL)
        p.emit(Op.MUL, m, acc, r)
        acc = m
    p.emit(Op.STORE, 0, acc, 0)
    ins = vf.decode(p)
    readers: dict[int, list[int]] = {}
    for k, _, _, reads in ins:
        for r in reads:
            readers.setdefault(r, []).append(k)
    body = [i for i in ins if i[2] == Op.MUL]
    segments = vf._segments(body, readers)
    assert len(segments) > 1 and sum(map(len, segments)) == len(body)
    assert all(vf._peak_live(s, readers) <= vf.BUDGET for s in segments)


def test_vfs_walk_strided_rows_where_they_lie(isa):
    # inputs and outputs that are column slices of wider tensors (an MoE's gate and up halves,
    # the halves of a packed cat): a VF reads and writes them at their own row stride; the same
    # values as through tile buffers (hp_dvm_tune 64 turns that off)
    index = next(i for i, s in enumerate(vf_spec.read()) if s.kinds == "FF")
    p, outs = _vf_program(index, "FF")
    rows, cols = 37, 77
    g = torch.Generator().manual_seed(4)
    wide = torch.randn(rows, 2 * cols, generator=g)
    ins = [wide[:, :cols], wide[:, cols:]]
    weight = torch.randn(cols, generator=g)  # a row broadcast (row stride 0), read in place too
    p_w, outs_w = _vf_program(index, "FF")
    got_w = [torch.empty(rows, cols) for _ in outs_w]
    old = vm.LIB.hp_dvm_tune(8)
    try:
        vm.run(p_w, [ins[0], weight], got_w, rows, cols, [(2 * cols, 1), (0, 1)], [(cols, 1)] * len(outs_w))
    finally:
        vm.LIB.hp_dvm_tune(old)
    want_w = [torch.empty(rows, cols) for _ in outs_w]
    reference.run(p_w, [ins[0].contiguous(), weight], want_w, rows, cols, [(cols, 1), (0, 1)], [(cols, 1)] * len(outs_w))
    for a, w in zip(got_w, want_w, strict=True):
        torch.testing.assert_close(a, w, rtol=1e-5, atol=1e-6)
    results = []
    for flags in (0, 64, 8):  # 8: weights not kept (a broadcast input is never walked at a pitch)
        old = vm.LIB.hp_dvm_tune(flags)
        try:
            packed = torch.zeros(rows, (len(outs) + 1) * cols)
            got = [packed[:, j * cols:(j + 1) * cols] for j in range(len(outs))]
            vm.run(p, ins, got, rows, cols, [(2 * cols, 1)] * 2, [(packed.stride(0), 1)] * len(outs))
            assert torch.equal(packed[:, len(outs) * cols:], torch.zeros(rows, cols))  # nothing written past them
            results.append([t.clone() for t in got])
        finally:
            vm.LIB.hp_dvm_tune(old)
    want = [torch.empty(rows, cols) for _ in outs]
    reference.run(p, [t.contiguous() for t in ins], want, rows, cols, [(cols, 1)] * 2, [(cols, 1)] * len(outs))
    for a, b, w in zip(results[0], results[1], want, strict=True):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, w, rtol=1e-5, atol=1e-6)
