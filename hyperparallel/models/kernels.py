"""The fused kernels a model can run with: MegaGate (every MoE router) and MegaMHC (DeepSeek-V4's
hyper-connections). Each computes what the modules it replaces compute, to fp32 rounding; off,
the model runs the routers op by op as transformers does and transformers' own hyper-connection
modules.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from hyperparallel.moe import TopKRouter


@dataclass(frozen=True)
class KernelsReport:
    mega_gate: int  # routers that run as MegaGate
    mega_mhc: int  # decoder layers whose hyper-connections run as MegaMHC

    def summary(self, *, mega_gate: bool, mega_mhc: bool) -> str:
        def one(name: str, wanted: bool, count: int, what: str) -> str:
            if not wanted:
                return f"{name} off"
            return f"{name} on ({count} {what})" if count else f"{name} (the model has no {what})"
        return (f"kernels: {one('MegaGate', mega_gate, self.mega_gate, 'routers')}, "
                f"{one('MegaMHC', mega_mhc, self.mega_mhc, 'hyper-connected layers')}")


def use_kernels(model: nn.Module, *, mega_gate: bool, mega_mhc: bool) -> KernelsReport:
    """Switch `model`'s routers to MegaGate and its DeepSeek-V4 layers to MegaMHC (before FSDP,
    recompute and compilation, which wrap the modules this swaps)."""
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    for router in routers:
        router.fused = mega_gate
    layers = 0
    if mega_mhc and getattr(getattr(model, "config", None), "model_type", None) == "deepseek_v4":
        from .deepseek_v4 import use_mega_mhc  # (imports transformers' DeepSeek-V4 and the kernels)

        layers = use_mega_mhc(model)
    return KernelsReport(len(routers) if mega_gate else 0, layers)
