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
default model's decoder layers), harvested by scripts/dvm_vf_harvest.py.

`HYPERPARALLEL_DVM_VF=0` turns VFs off (the per-op VM), for comparison and as an escape hatch. VFs
are used only when the native library was built from this table (its digest matches).
"""

from __future__ import annotations

import functools
import os

from hyperparallel.fusion import vf_spec
from hyperparallel.fusion.bytecode import BINARY, UNARY, WORDS, Kind, Op, Program
from hyperparallel.kernels.env_setting import env_set

ENV = "HYPERPARALLEL_DVM_VF"
BUDGET = 12  # values a VF keeps alive at once (see 2. above)
_VF_OPS = {Op[name] for name in vf_spec.ARITY}
COLLECT: set[str] | None = None  # when a set, every segment's line is added to it (scripts/dvm_vf_harvest.py)


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def lowering_with(on: bool):
    """Lowering writes VFs (on) or runs every op on its own (off) while inside: HYPERPARALLEL_DVM_VF
    set for the time, as a user would (for comparisons: benchmarks, tests)."""
    return env_set(ENV, "1" if on else "0")


@functools.cache
def specs() -> list[vf_spec.VF]:
    """The table's VFs, read once (a VF's index is its place here)."""
    return vf_spec.read()


@functools.cache
def table() -> dict[str, int]:
    """Each VF's canonical line -> its index."""
    return {vf.line: i for i, vf in enumerate(specs())}


@functools.cache
def library_has_table() -> bool:
    """Whether the native VM was built from this table (a stale build runs the per-op path)."""
    try:
        from hyperparallel.fusion import vm
    except ImportError:
        return False
    lib = vm.LIB
    return lib is not None and lib.hp_dvm_vf_digest().decode() == vf_spec.digest(specs())


def active() -> bool:
    """Whether lowering writes VF instructions now."""
    return COLLECT is not None or (enabled() and library_has_table())


# per opcode: how many of a, b, c it reads, and its part in a run ("side": moves to the run's
# start when its result is not FULL; "vf": a VF may run it; "ew": element-wise, per-op only)
_N_READS = {**dict.fromkeys((int(Op.LOAD), int(Op.CONST)), 0),
            **dict.fromkeys((int(o) for o in (*UNARY, Op.STORE, Op.RSUM, Op.RMAX, Op.RMIN, Op.ROT_HALF)), 1),
            **dict.fromkeys((int(o) for o in BINARY), 2), int(Op.WHERE): 3}
_ROLE = {**{int(o): "ew" for o in (*UNARY, *BINARY, Op.WHERE)}, **{int(o): "vf" for o in _VF_OPS},
         int(Op.LOAD): "side", int(Op.CONST): "side"}
_NAME = {int(o): o.name for o in Op}


def decode(program: Program) -> list[tuple[int, int, int, tuple[int, ...]]] | None:
    """Per instruction: (index, destination, opcode, registers read); None for a program the split
    leaves alone (already split, or a register written twice: not the lowering's SSA form)."""
    code = program.code
    out, written = [], set()
    for k in range(len(code) // WORDS):
        op, d, a, b, c = code[WORDS * k:WORDS * k + WORDS]
        n = _N_READS.get(op)
        if n is None:
            return None  # VF, ARG: already split
        if op != Op.STORE:
            if d in written:
                return None
            written.add(d)
        out.append((k, d, op, (a, b, c)[:n]))
    return out


def _segments(body: list[tuple], readers: dict[int, list[int]]) -> list[list[tuple]]:
    """The body's instructions cut into consecutive segments within the register budget."""
    if _peak_live(body, readers) <= BUDGET:
        return [body] if body else []  # (the usual case: one pass over the body)
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


def _escapes(d: int, seg: list[tuple], readers: dict[int, list[int]]) -> bool:
    """Whether the program reads d after the segment (instructions are in program order, and only
    the segment reads a FULL value between its first and last instruction)."""
    rs = readers.get(d)
    return bool(rs) and rs[-1] > seg[-1][0]


def _peak_live(seg: list[tuple], readers: dict[int, list[int]]) -> int:
    """The most values alive at once in a VF of `seg`: its inputs from the start (a VF loads them
    first) to their last use, each result from its op to its last use in the segment, or to the
    end when the program reads it after the segment."""
    if not seg:
        return 0
    born: dict[int, int] = {}
    last: dict[int, int] = {}
    for t, (_, d, _, reads) in enumerate(seg):
        for r in reads:
            born.setdefault(r, 0)
            last[r] = t
        born[d] = last[d] = t
    end = len(seg)
    for _, d, _, _ in seg:
        if _escapes(d, seg, readers):
            last[d] = end
    delta = [0] * (end + 2)
    for r, t in born.items():
        delta[t] += 1
        delta[last[r] + 1] -= 1
    peak = alive = 0
    for t in range(end):
        alive += delta[t]
        peak = max(peak, alive)
    return peak


def _line(seg: list[tuple], kinds: list[Kind], readers: dict[int, list[int]]) -> tuple[str, list[int], list[int]]:
    """The segment's canonical table line (vf_spec.VF.line), its output and its input registers."""
    number: dict[int, int] = {}
    inputs: list[int] = []
    defined = {instr[1] for instr in seg}
    for _, _, _, reads in seg:  # inputs numbered by first use
        for r in reads:
            if r not in number and r not in defined:
                number[r] = len(inputs)
                inputs.append(r)
    ops = []
    for m, (_, d, op, reads) in enumerate(seg):
        ops.append(" ".join((_NAME[op], *(str(number[r]) for r in reads))))
        number[d] = len(inputs) + m
    outputs = [d for _, d, _, _ in seg if _escapes(d, seg, readers)]
    head = "".join("F" if kinds[r] == Kind.FULL else "U" for r in inputs)
    return f"{head} : {' ; '.join(ops)} -> {' '.join(str(number[d]) for d in outputs)}", outputs, inputs


def apply(program: Program) -> Program:
    """`program` with its table-covered segments run as VFs (the same program if none is)."""
    ins = decode(program)
    if ins is None:
        return program
    code, kinds = program.code, program.register_kinds
    readers: dict[int, list[int]] = {}
    for k, _, _, reads in ins:
        for r in reads:
            readers.setdefault(r, []).append(k)
    roles = []
    for _, d, op, _ in ins:
        role = _ROLE.get(op, "stop")
        if role != "side" and role != "stop":
            role = "side" if kinds[d] != Kind.FULL else "body" if role == "vf" else "stop"
        roles.append(role)

    table_ = table()
    out: list[int] = []
    changed = False
    k = 0
    while k < len(ins):
        if roles[k] == "stop":
            out += code[WORDS * k:WORDS * k + WORDS]
            k += 1
            continue
        end = k
        while end < len(ins) and roles[end] != "stop":
            end += 1
        body = []
        for i in range(k, end):  # the run: what is not FULL first, then the body's segments
            if roles[i] == "side":
                out += code[WORDS * i:WORDS * i + WORDS]
            else:
                body.append(ins[i])
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
