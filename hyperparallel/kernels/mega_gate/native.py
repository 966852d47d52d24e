"""The C of csrc/mega_gate.c, the router's forward and backward on CPU tensors: its functions'
signatures for kernels' loader, and ``LIB``, the loaded ``hyperparallel._mega_gate_native`` (None
where it is not built or is stale: MegaGate then runs its reference).
"""

from __future__ import annotations

from hyperparallel.kernels.native import F32, I64, INT, PTR, load

MODULE = "hyperparallel._mega_gate_native"
_SIGNATURES = {
    # logits, T, E, bias, hash, score, k, groups, top_groups, norm, scale, eps,
    # weights, indices, counts, prob_sum, threads
    "hp_mega_gate_forward": ([PTR, I64, I64, PTR, PTR, INT, INT, INT, INT, INT, F32, F32,
                              PTR, PTR, PTR, PTR, INT], INT),
    # logits, T, E, indices, grad_weights, grad_prob_sum, score, k, norm, scale, eps, grad_logits, threads
    "hp_mega_gate_backward": ([PTR, I64, I64, PTR, PTR, PTR, INT, INT, INT, F32, F32, PTR, INT], INT),
}

# The kernels' status codes (csrc/mega_gate.c)
OK, BAD_HASH_INDEX, NO_MEMORY = 0, -1, -2

LIB = load(MODULE, _SIGNATURES, isa="hp_mega_gate")
