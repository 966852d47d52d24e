"""The fused kernels a model can run with: MegaGate (every MoE router) and MegaMHC (DeepSeek-V4's
hyper-connections). Each computes what the modules it replaces compute, to fp32 rounding; off,
the model runs the routers op by op as transformers does and transformers' own hyper-connection
modules.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from hyperparallel.moe import TopKRouter
from hyperparallel.schema import Section


class KernelsConfig(Section):
    """Which fused kernels a model runs with: `use_kernels`' switches, the trainer's `kernels:`
    section."""

    mega_gate: bool = True  # every MoE router as one fused operation
    mega_mhc: bool = True  # DeepSeek-V4's hyper-connections as fused operations


@dataclass(frozen=True)
class KernelsReport:
    mega_gate: int  # routers that run as MegaGate
    mega_mhc: int  # decoder layers whose hyper-connections run as MegaMHC
    routers: int = 0  # the model's routers, MegaGate's or not
    hyper_connected: int = 0  # the model's hyper-connected decoder layers (DeepSeek-V4's), MegaMHC's or not

    def summary(self, *, mega_gate: bool, mega_mhc: bool) -> str:
        """The run summary's line: each kernel the model has modules for, on or off; one it has
        none for (MegaGate without routers, MegaMHC outside DeepSeek-V4) goes unnamed, and a model
        with neither gets no line ("")."""
        said = [f"{name} on ({count} {what})" if wanted else f"{name} off"
                for name, wanted, count, has, what in (
                    ("MegaGate", mega_gate, self.mega_gate, self.routers, "routers"),
                    ("MegaMHC", mega_mhc, self.mega_mhc, self.hyper_connected, "hyper-connected layers"))
                if has]
        return f"kernels: {', '.join(said)}" if said else ""


def use_kernels(model: nn.Module, *, mega_gate: bool, mega_mhc: bool) -> KernelsReport:
    """Switch `model`'s routers to MegaGate and its DeepSeek-V4 layers to MegaMHC (before FSDP,
    recompute and compilation, which wrap the modules this swaps)."""
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    for router in routers:
        router.fused = mega_gate
    layers, config = 0, getattr(model, "config", None)
    deepseek_v4 = getattr(config, "model_type", None) == "deepseek_v4"  # (every decoder layer hyper-connected)
    if mega_mhc and deepseek_v4:
        from .deepseek_v4 import use_mega_mhc  # (imports transformers' DeepSeek-V4 and the kernels)

        layers = use_mega_mhc(model)
    return KernelsReport(len(routers) if mega_gate else 0, layers, routers=len(routers),
                         hyper_connected=config.num_hidden_layers if deepseek_v4 else 0)
