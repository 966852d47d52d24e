"""Splitting a program into VF segments: the runs of element-wise work a precompiled vector function
(VF) covers become one VF instruction each, so the VM makes one pass over the tile for them
instead of one pass per op.

The split (`apply`), after lowering, in one walk over the bytecode:
1. **Runs**: maximal stretches of LOADs, CONSTs and element-wise instructions. A STORE, a row
   reduction or an op no VF runs (SIN, COS, POW) ends a run. Within a run, the instructions whose
   result is not FULL (loads, constants, per-row values such as RMSNorm's 1 / rms) read nothing
   the FULL ops compute, so they move to the run's start; the FULL ops are the run's *body*.
2. **Register budget**: the body is cut into segments whose values alive at once (inputs still to
   be read, results still to be used) stay within BUDGET: a VF keeps them all in vector
   registers (AVX2 has 16, and the math needs a few for its constants).
3. **Lookup**: a segment of two ops or more is written in the table's canonical form
   (vf_spec.py): its inputs numbered by first use, F (per element) or U (per row or scalar), its
   ops on those numbers, and the results read after it. Found in the table, it becomes
   `VF index` and its ARG words; not found, its ops stay as they were (the per-op path).

So compiling stays a table lookup (microseconds). The table holds the segments of the chains in
vf_chains.py (activations and their backward, norms, softmax, rotary, casts, the loss chunk, the
default model's decoder layers), harvested by vf_harvest.py.

`HYPERPARALLEL_DVM_VF=0` turns VFs off (the per-op VM), for comparison and as an escape hatch. VFs
are used only when the native library was built from this table (its digest matches).
"""

from __future__ import annotations

import functools
import os

from hyperparallel.fusion import vf_spec
from hyperparallel.fusion.bytecode import BINARY, UNARY, WORDS, Kind, Op, Program

ENV = "HYPERPARALLEL_DVM_VF"
BUDGET = 12  # values a VF keeps alive at once (see 2. above)
_VF_OPS = {Op[name] for name in vf_spec.ARITY}
COLLECT: set[str] | None = None  # when a set, every segment's line is added to it (vf_harvest.py)


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


@functools.cache
def table() -> dict[str, int]:
    """Each VF's canonical line -> its index."""
    return {vf.line: i for i, vf in enumerate(vf_spec.read())}


@functools.cache
def library_has_table() -> bool:
    """Whether the native VM was built from this table (a stale build runs the per-op path)."""
    try:
        from hyperparallel.fusion import vm
    except ImportError:
        return False
    lib = vm.LIB
    return lib is not None and lib.hp_dvm_vf_digest().decode() == vf_spec.digest(vf_spec.read())


def active() -> bool:
    """Whether lowering writes VF instructions now."""
    return COLLECT is not None or (enabled() and library_has_table())


def _reads(op: Op, a: int, b: int, c: int) -> tuple[int, ...]:
    """The registers an instruction reads."""
    if op in (Op.LOAD, Op.CONST):
        return ()
    if op in UNARY or op in (Op.STORE, Op.RSUM, Op.RMAX, Op.RMIN):
        return (a,)
    return (a, b) if op in BINARY else (a, b, c)


def _segments(body: list[tuple], readers: dict[int, list[int]]) -> list[list[tuple]]:
    """The body's instructions cut into consecutive segments within the register budget."""
    segments: list[list[tuple]] = []
    current: list[tuple] = []
    for instr in body:
        if current and _peak_live(current + [instr], readers) > BUDGET:
            segments.append(current)
            current = []
        current.append(instr)
    if current:
        segments.append(current)
    return segments


def _peak_live(seg: list[tuple], readers: dict[int, list[int]]) -> int:
    """The most values alive at once in a VF of `seg`: its inputs from the start (a VF loads them
    first) to their last use, each result from its op to its last use in the segment, or to the
    end when the program reads it after the segment."""
    positions = {instr[0] for instr in seg}
    born = {instr[1]: t for t, instr in enumerate(seg)}
    last = dict(born)
    for t, (_, _, op, a, b, c) in enumerate(seg):
        for r in _reads(op, a, b, c):
            born.setdefault(r, 0)
            last[r] = t
    for d in list(last):
        if d in {instr[1] for instr in seg} and any(k not in positions for k in readers.get(d, ())):
            last[d] = len(seg)
    return max(sum(1 for r in born if born[r] <= t <= last[r]) for t in range(len(seg)))


def _line(seg: list[tuple], kinds: list[Kind], readers: dict[int, list[int]]) -> tuple[str, list[int], list[int]]:
    """The segment's canonical table line, its output registers and its input registers."""
    positions = {ins[0] for ins in seg}
    number: dict[int, int] = {}
    inputs: list[int] = []
    defined = {instr[1] for instr in seg}
    for _, _d, op, a, b, c in seg:  # inputs numbered by first use
        for r in _reads(op, a, b, c):
            if r not in number and r not in defined:
                number[r] = len(inputs)
                inputs.append(r)
    ops = []
    for m, (_, d, op, a, b, c) in enumerate(seg):
        ops.append((op.name, tuple(number[r] for r in _reads(op, a, b, c))))
        number[d] = len(inputs) + m
    outputs = [d for _, d, *_ in seg if any(k not in positions for k in readers.get(d, ()))]
    vf = vf_spec.VF("".join("F" if kinds[r] == Kind.FULL else "U" for r in inputs), tuple(ops),
                    tuple(number[d] for d in outputs))
    return vf.line, outputs, inputs


def apply(program: Program) -> Program:
    """`program` with its table-covered segments run as VFs (the same program if none is)."""
    code, kinds = program.code, program.register_kinds
    ins = [(k, *code[WORDS * k:WORDS * k + WORDS]) for k in range(len(code) // WORDS)]
    ins = [(k, d, Op(op), a, b, c) for k, op, d, a, b, c in ins]
    written: set[int] = set()
    readers: dict[int, list[int]] = {}
    for k, d, op, a, b, c in ins:
        if op in (Op.VF, Op.ARG):
            return program  # already split
        for r in _reads(op, a, b, c):
            readers.setdefault(r, []).append(k)
        if op != Op.STORE:
            if d in written:
                return program  # a register written twice: not the lowering's SSA form, leave it
            written.add(d)

    def role(instr) -> str:
        _, d, op, *_ = instr
        if op in (Op.LOAD, Op.CONST):
            return "side"
        if op in UNARY or op in BINARY or op == Op.WHERE:
            if kinds[d] != Kind.FULL:
                return "side"
            return "body" if op in _VF_OPS else "stop"
        return "stop"

    table_ = table()
    out: list[int] = []
    changed = False
    k = 0
    while k < len(ins):
        if role(ins[k]) == "stop":
            out += code[WORDS * k:WORDS * k + WORDS]
            k += 1
            continue
        end = k
        while end < len(ins) and role(ins[end]) != "stop":
            end += 1
        run = ins[k:end]
        side = [i for i in run if role(i) == "side"]
        body = [i for i in run if role(i) == "body"]
        for i in side:
            out += code[WORDS * i[0]:WORDS * i[0] + WORDS]
        for seg in _segments(body, readers):
            index = None
            if len(seg) >= 2:
                line, outputs, inputs = _line(seg, kinds, readers)
                if COLLECT is not None:
                    COLLECT.add(line)
                index = table_.get(line)
                if index is not None and not (1 <= len(outputs) <= vf_spec.MAX_OUTPUTS
                                              and len(inputs) <= vf_spec.MAX_INPUTS):
                    index = None
            if index is None:
                for i in seg:
                    out += code[WORDS * i[0]:WORDS * i[0] + WORDS]
                continue
            args = outputs + inputs
            out += [int(Op.VF), index, len(args), 0, 0]
            for q in range(0, len(args), 4):
                words = args[q:q + 4]
                out += [int(Op.ARG), *words, *(0,) * (4 - len(words))]
            changed = True
        k = end
    if not changed:
        return program
    return Program(code=out, immediates=list(program.immediates), register_kinds=list(kinds),
                   input_dtypes=list(program.input_dtypes), output_dtypes=list(program.output_dtypes))
