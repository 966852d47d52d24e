"""The DVM virtual machine: runs a bytecode Program (bytecode.py) with the native interpreter.

The interpreter is plain C (csrc/dvm_*.c, the library ``hyperparallel._dvm_native``) loaded by
kernels' loader; ``LIB`` is None when it is not built (or is a stale build), and its instruction
set follows ``hyperparallel.kernels.use_isa``. ``run`` does little per call: the program's
code, immediates, register kinds and dtypes become ctypes arrays once, kept on the Program
(``Program._native``); a call only packs the data pointers.

What the VM does with a call (csrc/dvm_vm.c): it checks the program against the tensors (an
error raises VMError and writes nothing), runs it tile by tile (a tile's FULL registers hold
512 to 4096 floats, what keeps the tile in L1; with a row reduction a tile spans whole rows, so
``cols`` may be at most ``MAX_REDUCE_COLS``), parallel over tiles with OpenMP. Results do not
depend on the number of threads. The caller guarantees that every (row, col) addressed through
a tensor's strides lies inside that tensor, and that outputs overlap inputs only element for
element (the same strides; a STORE before a LOAD of the same memory in one program would read
the stored value).
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Sequence
from itertools import chain

import torch

from hyperparallel.errors import BackendError, HyperparallelError
from hyperparallel.fusion.bytecode import INPUT_DTYPES, WORDS, Op, Program, nested_strides
from hyperparallel.kernels.native import load, unavailable_reason

_INT = ctypes.c_int
_I64 = ctypes.c_int64
_data_ptr = torch.Tensor.data_ptr
# hp_dvm_run has no argtypes: ctypes' conversion of 19 declared arguments costs more than the
# call itself, so run() passes objects of the exact C types (ctypes arrays, or bytes, for pointers;
# c_int64 for rows and cols; Python ints only where the C type is int).
_SIGNATURES = {
    "hp_dvm_run": (None, _INT),
    "hp_dvm_strerror": ([_INT], ctypes.c_char_p),
    "hp_dvm_error_instr": ([], _INT),
    "hp_dvm_tile_elems": ([_I64], _I64),
    "hp_dvm_max_reduce_cols": ([], _I64),
    "hp_dvm_tune": ([_INT], _INT),
    "hp_dvm_vf_count": ([], _INT),
    "hp_dvm_vf_digest": ([], ctypes.c_char_p),
}


MODULE = "hyperparallel._dvm_native"
LIB = load(MODULE, _SIGNATURES, isa="hp_dvm")
MAX_REDUCE_COLS = LIB.hp_dvm_max_reduce_cols() if LIB is not None else 0


class VMError(HyperparallelError, RuntimeError):
    """The VM refused a program or its tensors; nothing was written. ``code`` is the C error
    code, ``instruction`` the index of the offending instruction (-1: not about one)."""

    def __init__(self, message: str, code: int, instruction: int):
        super().__init__(message)
        self.code = code
        self.instruction = instruction


class _Native:
    """A Program as the C function takes it, built once per Program."""

    __slots__ = ("key", "code", "n_instr", "imms", "n_imms", "kinds", "n_regs", "in_dtypes", "out_dtypes",
                 "in_torch", "out_torch", "pack_in", "pack_out", "in_strides", "out_strides")

    def __init__(self, program: Program):
        self.key = _key(program)
        code, imms, kinds = program.code, program.immediates, program.register_kinds
        n_in, n_out = len(program.input_dtypes), len(program.output_dtypes)
        self.code = (ctypes.c_int32 * max(len(code), 1))(*code)
        self.n_instr = len(code) // WORDS
        self.imms = (ctypes.c_double * max(len(imms), 1))(*imms)
        self.n_imms = len(imms)
        self.kinds = (ctypes.c_int32 * max(len(kinds), 1))(*(int(k) for k in kinds))
        self.n_regs = len(kinds)
        self.in_dtypes = (ctypes.c_int32 * max(n_in, 1))(*(int(d) for d in program.input_dtypes))
        self.out_dtypes = (ctypes.c_int32 * max(n_out, 1))(*(int(d) for d in program.output_dtypes))
        by_code = {int(code): dtype for dtype, code in INPUT_DTYPES.items()}
        self.in_torch = tuple(by_code[int(d)] for d in program.input_dtypes)
        self.out_torch = tuple(by_code[int(d)] for d in program.output_dtypes)
        # a call's pointer arrays: bytes, which ctypes passes as pointers to their contents (packed
        # with struct, they cost a third of a ctypes array's time and are no objects for the GC)
        self.pack_in, self.pack_out = struct.Struct(f"{n_in}P").pack, struct.Struct(f"{n_out}P").pack
        self.in_strides, self.out_strides = _I64 * max(4 * n_in, 1), _I64 * max(4 * n_out, 1)


def _key(program: Program) -> tuple[int, int, int, int, int]:
    # a program that grew after its first run gets new arrays
    return (len(program.code), len(program.immediates), len(program.register_kinds), len(program.input_dtypes),
            len(program.output_dtypes))


def _native(program: Program) -> _Native:
    native = getattr(program, "_native", None)
    if native is None or native.key != _key(program):
        native = _Native(program)
        program._native = native
    return native


def _check(kind: str, tensors: Sequence[torch.Tensor], dtypes: tuple[torch.dtype, ...]) -> None:
    if len(tensors) != len(dtypes):
        raise ValueError(f"the program has {len(dtypes)} {kind}s, got {len(tensors)} tensors")
    for i, (t, dtype) in enumerate(zip(tensors, dtypes, strict=True)):
        if t.dtype is not dtype or not t.is_cpu:
            raise ValueError(f"{kind} {i} of the program is a cpu {dtype} tensor, got {t.device.type} {t.dtype}")


def run(program: Program, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], rows: int, cols: int,
        input_strides: Sequence[Sequence[int]], output_strides: Sequence[Sequence[int]], n_threads: int = 0,
        row_dims: tuple[int, int] = (1, 1)) -> None:
    """Runs `program` over a `rows` x `cols` space, writing into `outputs`.

    Tensor i is seen as [rows, cols] through ``input_strides[i] = (row_stride, col_stride)``
    (elements, 0 broadcasts), starting at its data pointer (its storage offset included). Rows
    may nest up to three deep: with ``row_dims = (n_mid, n_inner)`` the rows are
    [rows / (n_mid * n_inner), n_mid, n_inner] and a tensor's strides are
    ``(outer, middle, inner row stride, col_stride)`` (a 2-tuple then means rows at one stride).
    `n_threads` <= 0: OpenMP's default. Raises VMError when the VM refuses the program.
    """
    _require_library()
    native = _native(program)
    _check("input", inputs, native.in_torch)
    _check("output", outputs, native.out_torch)
    Call(program, rows, cols, row_dims, input_strides, output_strides, n_threads)(inputs, outputs)


class Call:
    """`program` bound to one layout (rows, cols, row levels, strides; dtypes as the program says):
    every ctypes argument of the VM call built once, so a call passes only the data pointers.
    Called with the input and output tensors; the caller guarantees their shapes, strides and
    dtypes are the ones the Call was made for (FusedOp keys its plans by them)."""

    __slots__ = ("head", "pack_in", "in_dtypes", "in_strides", "n_in", "pack_out", "out_dtypes", "out_strides",
                 "n_out", "tail", "program")

    def __init__(self, program: Program, rows: int, cols: int, row_dims: tuple[int, int],
                 input_strides: Sequence[Sequence[int]], output_strides: Sequence[Sequence[int]], n_threads: int = 0):
        _require_library()
        native = _native(program)
        n_mid, n_inner = row_dims
        self.program = program
        self.head = (native.code, native.n_instr, native.imms, native.n_imms, native.kinds, native.n_regs)
        self.n_in, self.n_out = len(input_strides), len(output_strides)
        self.pack_in, self.pack_out = native.pack_in, native.pack_out
        self.in_dtypes, self.out_dtypes = native.in_dtypes, native.out_dtypes
        self.in_strides = native.in_strides(*chain.from_iterable(nested_strides(s, row_dims) for s in input_strides))
        self.out_strides = native.out_strides(*chain.from_iterable(nested_strides(s, row_dims) for s in output_strides))
        self.tail = (_I64(rows), _I64(cols), _I64(n_mid), _I64(n_inner), int(n_threads))

    def __call__(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> None:
        rc = LIB.hp_dvm_run(*self.head, self.n_in, self.pack_in(*map(_data_ptr, inputs)), self.in_dtypes,
                            self.in_strides, self.n_out, self.pack_out(*map(_data_ptr, outputs)), self.out_dtypes,
                            self.out_strides, *self.tail)
        if rc:
            raise _error(self.program, rc)


def _require_library() -> None:
    if LIB is None:
        raise BackendError(f"the DVM cannot run: {unavailable_reason(MODULE)}")


def _error(program: Program, rc: int) -> VMError:
    message = LIB.hp_dvm_strerror(rc).decode()
    k = LIB.hp_dvm_error_instr()
    if k >= 0:
        words = program.code[WORDS * k: WORDS * k + WORDS]
        try:
            name = Op(words[0]).name
        except ValueError:
            name = f"opcode {words[0]}"
        message = f"DVM instruction {k} ({name} {', '.join(map(str, words[1:]))}): {message}"
    else:
        message = f"DVM: {message}"
    return VMError(message, rc, k)


def tile_elems(elems: int = 0) -> int:
    """Floats per FULL register of a tile: `elems` > 0 fixes it, < 0 restores the default (sized
    for L1 from each program's buffers), 0 leaves it. Returns the setting (0: the default)."""
    return LIB.hp_dvm_tile_elems(elems)
