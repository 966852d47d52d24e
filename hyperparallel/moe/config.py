"""MoEConfig: how MoE layers balance their experts' load (`LoadBalancer.from_config`) and, under
expert parallelism, how their all-to-alls run (dispatch's sequential layer or MegaMoE) and in what
format the rows travel to the experts. It is the trainer's `moe:` section."""

from __future__ import annotations

from pydantic import Field

from hyperparallel.moe import MOE_DISPATCHES, MOE_IMPLEMENTATIONS
from hyperparallel.moe.router import LOAD_BALANCE
from hyperparallel.schema import Section, choice


class MoEConfig(Section):
    # aux_loss | bias | none; null: the family's rule (qwen3_moe: aux_loss, deepseek_v3: bias)
    load_balance: choice(LOAD_BALANCE) | None = None
    aux_loss_coef: float | None = Field(None, ge=0)  # null: the model config's router_aux_loss_coef
    bias_update_rate: float = Field(0.001, ge=0)  # DeepSeek-V3's bias update speed
    # sequential: all rows out, all experts, all rows back; megamoe: expert waves whose
    # all-to-alls overlap the experts' products (needs parallel.ep > 1)
    implementation: choice(MOE_IMPLEMENTATIONS) = "sequential"
    waves: int | None = Field(None, ge=1)  # MegaMoE's expert waves; null: what the cost model predicts fastest
    # the rows' format on the way to their experts (expert parallelism): compute (the products'
    # dtype, bf16 under bf16 autocast), or mx (MXFP8 experts: quantized along the hidden dimension
    # before the all-to-all, 0.52x bf16's bytes; the forward bit for bit compute's, the first
    # projection's weight gradient quantized from the rows' MX values; docs/moe.md "MX dispatch");
    # auto: mx for MXFP8 experts with an MXFP8 weight gradient, else compute. Rows return in the
    # compute dtype either way.
    dispatch: choice(MOE_DISPATCHES) = "auto"

    def dispatch_problems(self, ep: int, mx_experts: bool) -> list[str]:
        """What `dispatch` asks of a run with `ep`-way expert parallelism whose experts train in
        MXFP8 or not (`mx_experts`; the build checks each layer's own experts again)."""
        if self.dispatch != "mx":
            return []
        if ep == 1:
            return ["moe.dispatch: mx sends expert parallelism's rows as MX data, and parallel.ep is 1 (no "
                    "all-to-alls); set parallel.ep > 1 or use moe.dispatch: auto"]
        if not mx_experts:
            return ["moe.dispatch: mx sends the experts their rows as MXFP8 data, and the experts do not train in "
                    "MXFP8; set low_precision.enabled (with experts in low_precision.modules) or use moe.dispatch: auto"]
        return []

    def rule(self, family_rule: str) -> str:
        """The load-balancing rule: load_balance, or (null) `family_rule`, the model family's own
        (the caller's to look up: moe does not know the families)."""
        return self.load_balance or family_rule
