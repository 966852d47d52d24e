"""The fused kernels a model can run with: MegaGate (every MoE router) and MegaMHC (DeepSeek-V4's
hyper-connections). Each computes what the modules it replaces compute, to fp32 rounding; off,
the model runs the routers op by op as transformers does and transformers' own hyper-connection
modules. A router that is not `fusable` (its top_k exceeds the experts its eligible groups reach:
moe's router.py) runs op by op with MegaGate on too; the report counts it apart and says so.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from hyperparallel.moe import TopKRouter
from hyperparallel.schema import Section

from .families import family_for_model_type


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
    op_by_op: int = 0  # routers that run op by op with MegaGate on (not `fusable`: top_k beyond their groups)

    def summary(self, *, mega_gate: bool, mega_mhc: bool) -> str:
        """The run summary's line: each kernel the model has modules for, on or off; one it has
        none for (MegaGate without routers, MegaMHC outside DeepSeek-V4) goes unnamed, and a model
        with neither gets no line (""). Routers MegaGate is on for but that run op by op are named
        after MegaGate's count."""
        apart = ""
        if self.op_by_op:
            one = self.op_by_op == 1
            apart = (f"; {self.op_by_op} whose top_k exceeds {'its' if one else 'their'} reachable experts "
                     f"run{'s' if one else ''} op by op, as transformers does")
        said = [f"{name} on ({count} {what}{note})" if wanted else f"{name} off"
                for name, wanted, count, has, what, note in (
                    ("MegaGate", mega_gate, self.mega_gate, self.routers, "routers", apart),
                    ("MegaMHC", mega_mhc, self.mega_mhc, self.hyper_connected, "hyper-connected layers", ""))
                if has]
        return f"kernels: {', '.join(said)}" if said else ""


def use_kernels(model: nn.Module, *, mega_gate: bool, mega_mhc: bool) -> KernelsReport:
    """Switch `model`'s routers to MegaGate (those `fusable`: the others keep running op by op)
    and its DeepSeek-V4 layers to MegaMHC (before FSDP, recompute and compilation, which wrap the
    modules this swaps)."""
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    for router in routers:
        router.fused = mega_gate
    fused = sum(router.fusable for router in routers) if mega_gate else 0
    layers, config = 0, getattr(model, "config", None)
    family = family_for_model_type(getattr(config, "model_type", None))
    hyper_connected = family is not None and family.hyper_connected  # (every decoder layer, then)
    if mega_mhc and hyper_connected:
        from .deepseek_v4 import use_mega_mhc  # (imports transformers' DeepSeek-V4 and the kernels)

        layers = use_mega_mhc(model)
    return KernelsReport(mega_gate=fused, mega_mhc=layers, routers=len(routers),
                         hyper_connected=config.num_hidden_layers if hyper_connected else 0,
                         op_by_op=len(routers) - fused if mega_gate else 0)
