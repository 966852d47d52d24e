"""MoEConfig: how MoE layers balance their experts' load (`LoadBalancer.from_config`) and, under
expert parallelism, how their all-to-alls run (dispatch's sequential layer or MegaMoE). It is the
trainer's `moe:` section."""

from __future__ import annotations

from pydantic import Field

from hyperparallel.moe import MOE_IMPLEMENTATIONS
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

    def rule(self, family_rule: str) -> str:
        """The load-balancing rule: load_balance, or (null) `family_rule`, the model family's own
        (the caller's to look up: moe does not know the families)."""
        return self.load_balance or family_rule
