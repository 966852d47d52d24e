"""convert(): swap chosen modules for their MXFP8 versions, keeping every Parameter object.

Runs at build time, before parallel plans and sharding. Modules are chosen by kind
(`config.modules`: nn.Linear, MoE experts) and by name (`include` / `exclude` globs, matched on
the full module name). An nn.Linear becomes an MXLinear. Experts are recognized by their layout,
not their class: 3-D Parameters `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I], an `act_fn`
and a `recipe` for their products (hyperparallel.moe.GroupedExperts); they stay the same module
and get the MXFP8 recipe. transformers' own experts modules (no recipe) are skipped with the
reason: swap them for GroupedExperts first (`hyperparallel.models.swap_moe_blocks`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatchcase

import torch
from torch import nn

from hyperparallel.lowp.config import LowPrecisionConfig
from hyperparallel.lowp.grouped import MXExpertsRecipe
from hyperparallel.lowp.linear import MXLinear

MX_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class ConversionReport:
    replaced: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (module name, why)

    def summary(self) -> str:
        lines = [f"MXFP8: {len(self.replaced)} modules converted, {len(self.skipped)} skipped"]
        lines += [f"  skipped {name}: {why}" for name, why in self.skipped]
        return "\n".join(lines)


def is_experts(module: nn.Module) -> bool:
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and gate_up.dim() == 3
            and down.dim() == 3 and hasattr(module, "act_fn"))


def is_mx_experts(module: nn.Module) -> bool:
    return isinstance(getattr(module, "recipe", None), MXExpertsRecipe)


def _linear_problem(linear: nn.Linear) -> str | None:
    if linear.weight.dtype not in MX_INPUT_DTYPES:
        return f"weight dtype {linear.weight.dtype} is not one the MX kernels take (float32, bfloat16, float16)"
    return None


def _experts_problem(experts: nn.Module) -> str | None:
    if not hasattr(experts, "recipe"):
        return (f"{type(experts).__name__} has no recipe for its products; swap it for "
                f"hyperparallel.moe.GroupedExperts first (hyperparallel.models.swap_moe_blocks)")
    if not getattr(experts, "default_layout", True):
        return (f"the MXFP8 recipe runs gate_up_proj [E, 2I, H] and down_proj [E, H, I] without biases or a "
                f"post-expert norm, and {type(experts).__name__} is laid out otherwise")
    if experts.gate_up_proj.dtype not in MX_INPUT_DTYPES:
        return f"weight dtype {experts.gate_up_proj.dtype} is not one the MX kernels take"
    return None


def _selected(name: str, config: LowPrecisionConfig) -> bool:
    return any(fnmatchcase(name, g) for g in config.include) and not any(fnmatchcase(name, g) for g in config.exclude)


def convert(model: nn.Module, config: LowPrecisionConfig) -> ConversionReport:
    """Swap the chosen modules of `model` in place; returns what was replaced and what was not."""
    report = ConversionReport()
    if not config.enabled:
        return report
    for name, module in list(model.named_modules()):
        if not name or not _selected(name, config):
            continue
        if "linear" in config.modules and type(module) is nn.Linear:
            problem = _linear_problem(module)
            replacement = None if problem else MXLinear.from_linear(module, config)
        elif "experts" in config.modules and is_experts(module) and not is_mx_experts(module):
            problem = _experts_problem(module)
            if problem is None:
                module.recipe = MXExpertsRecipe(config)  # the same module: nothing else changes
                report.replaced.append(name)
                continue
        else:
            continue
        if problem:
            report.skipped.append((name, problem))
            continue
        before = {id(p) for p in module.parameters()}
        model.set_submodule(name, replacement)
        assert {id(p) for p in replacement.parameters()} == before, f"{name}: conversion changed its Parameters"
        report.replaced.append(name)
    return report
