"""Communication in the step's precision (parallel/mixed_precision.py, fsdp/gather.py,
lowp/gather.py): bf16 FSDP traffic against PyTorch FSDP2 with the same MixedPrecisionPolicy,
MXLinear weights gathered as MX data bitwise equal to gathering the values and quantizing after,
and the bytes the traffic counter sees for each."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hyperparallel import traffic

STEPS = 5


def tiny_qwen3() -> nn.Module:
    """A Qwen3 whose rows divide by neither 2 nor 4 ranks evenly (uneven and, at 4 ranks, short shards)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=99, hidden_size=60, intermediate_size=78, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config)


def batches(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, 99, (2, 24), generator=g)


def train(model: nn.Module, rank: int, world: int, no_sync=None) -> tuple[list[float], traffic.Traffic]:
    """Five AdamW steps under bf16 autocast; the mean loss over ranks per step, and the first step's
    traffic. `no_sync(model, bool)`: each step two micro-batches, the first without gradient sync."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, counted = [], None
    for step in range(STEPS):
        ids = batches(rank, step)
        with traffic.counting() as now, torch.autocast("cpu", dtype=torch.bfloat16):
            if no_sync is not None:  # (the first half of the batch, its gradients kept whole)
                no_sync(model, False)
                model(input_ids=ids[:1], labels=ids[:1]).loss.backward()
                no_sync(model, True)
                ids = ids[1:]
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
        counted = counted or now
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return losses, counted


def ours(rank: int, world: int, param_dtype: torch.dtype | None, reduce_dtype: torch.dtype = torch.float32,
         accumulate: bool = False) -> tuple[list[float], traffic.Traffic]:
    from hyperparallel.fsdp import MixedPrecision
    from hyperparallel.parallel.fsdp_plan import shard_model
    from hyperparallel.parallel.mixed_precision import keep_float32_outside_products, round_embedding_outputs

    model = tiny_qwen3()
    if param_dtype is not None:
        keep_float32_outside_products(model)
        round_embedding_outputs(model, param_dtype)
    shard_model(model, mp_policy=MixedPrecision(param_dtype, reduce_dtype))
    from hyperparallel.fsdp import set_requires_gradient_sync

    return train(model, rank, world, set_requires_gradient_sync if accumulate else None)


def fsdp2(rank: int, world: int, accumulate: bool = False) -> list[float]:
    """PyTorch FSDP2 with MixedPrecisionPolicy(bf16, fp32) on every layer and the root, and the
    norms (the parameters outside products) wrapped with a float32 policy of their own; the model
    as the trainer sets it up (the embedding's rows rounded to bf16, the residual stream left in
    the model's dtype: no policy casts the modules' inputs)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from hyperparallel.parallel.mixed_precision import round_embedding_outputs

    model = tiny_qwen3()
    round_embedding_outputs(model, torch.bfloat16)
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False)
    for layer in model.model.layers:
        for name, module in layer.named_modules():
            if name.endswith("norm"):
                fully_shard(module, mp_policy=fp32)
        fully_shard(layer, mp_policy=bf16)
    fully_shard(model.model.norm, mp_policy=fp32)
    fully_shard(model, mp_policy=bf16)
    no_sync = (lambda m, sync: m.set_requires_gradient_sync(sync)) if accumulate else None
    return train(model, rank, world, no_sync)[0]


class MXLayers(nn.Module):
    """Two MXFP8 Linears of 256 and 128 rows (shards of whole 32-row blocks) and 5 MXFP8 experts
    (uneven shards of whole experts, at 4 ranks an empty one), each a group freed after forward,
    as a decoder layer is, under a root with a norm."""

    def __init__(self):
        super().__init__()
        from hyperparallel.moe import GroupedExperts

        torch.manual_seed(1)
        self.norm, self.up, self.down = nn.LayerNorm(64), nn.Linear(64, 256), nn.Linear(256, 128, bias=False)
        self.experts = GroupedExperts(5, 128, 64, nn.SiLU())
        with torch.no_grad():
            for w in (self.experts.gate_up_proj, self.experts.down_proj):
                w.normal_(0, 0.1)
        self.route = torch.arange(16 * 2).remainder(5).view(16, 2)  # every expert some rows

    def forward(self, x):
        h = self.down(torch.nn.functional.gelu(self.up(self.norm(x))))
        return self.experts(h, self.route, torch.full((16, 2), 0.5))


def mx_run(rank: int, world: int, codec: bool, recompute: bool = False) -> dict:
    """Two steps of MXLayers under FSDP, bf16 autocast: outputs, shard gradients, traffic. (No
    `align`: the codec aligns the MX weights' shards to 32-row blocks; the rest split evenly.)"""
    from hyperparallel.fsdp import fully_shard, shard_info
    from hyperparallel.lowp import LowPrecisionConfig, convert
    from hyperparallel.parallel.mixed_precision import attach_mx_gather

    model = MXLayers()
    convert(model, LowPrecisionConfig(enabled=True))
    if codec:
        assert attach_mx_gather(model) == 4  # two Linears' weights, the experts' two
    for module in (model.up, model.down, model.experts):
        if recompute:  # as the trainer recomputes a decoder layer: its inner forward again in backward
            import functools

            from hyperparallel.parallel.recompute import _checkpointed

            module.forward = functools.partial(_checkpointed, module.forward, "full")
        fully_shard(module, replays_forward=recompute)
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    outputs, grads, counted = [], [], None
    for step in range(2):
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(10 * step + rank))
        with traffic.counting() as now, torch.autocast("cpu", dtype=torch.bfloat16):
            y = model(x)
            y.float().square().mean().backward()
        counted = counted or now
        outputs.append(y.detach())
        grads.append({name: (shard_info(p), p.grad.clone()) for name, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
    return {"outputs": outputs, "grads": grads, "traffic": counted.sent}


def on_ranks(rank: int, world: int, out_dir: str) -> dict:
    fp32_losses, fp32_traffic = ours(rank, world, None)
    bf16_losses, bf16_traffic = ours(rank, world, torch.bfloat16)
    bf16_reduce_losses, bf16_reduce_traffic = ours(rank, world, torch.bfloat16, torch.bfloat16)
    return {"ours": bf16_losses, "fsdp2": fsdp2(rank, world), "fp32": fp32_losses, "bf16_reduce": bf16_reduce_losses,
            "ours_accumulated": ours(rank, world, torch.bfloat16, accumulate=True)[0],
            "fsdp2_accumulated": fsdp2(rank, world, accumulate=True),
            "traffic": {"fp32": fp32_traffic.sent, "bf16": bf16_traffic.sent, "bf16_reduce": bf16_reduce_traffic.sent},
            "mx": mx_run(rank, world, codec=True), "values": mx_run(rank, world, codec=False),
            "mx_recompute": mx_run(rank, world, codec=True, recompute=True),
            "values_recompute": mx_run(rank, world, codec=False, recompute=True)}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"{w}ranks")
def spawned(request) -> list[dict]:
    return request.getfixturevalue(f"spawn_{request.param}")["mixed_precision"]


def bf16_units() -> bool:
    """Whether this CPU runs bf16 products on bf16 units of its own (AVX-512 BF16, AMX: oneDNN's
    kernels) rather than widening them to float32 (AVX2)."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # (private: absent, taken as no)
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


def test_bf16_training_equals_pytorch_fsdp2_with_the_same_policy(spawned):
    ours_, theirs = torch.tensor(spawned[0]["ours"]), torch.tensor(spawned[0]["fsdp2"])
    # The same bf16 products and float32 reductions of the same bf16 gradients: equal to the bit at
    # 2 and 4 ranks on a CPU that widens bf16 products to float32 (an AMD EPYC, AVX2; there FSDP2
    # under two reduce orders of its own, the batches given to the ranks in reverse, or 2 ranks
    # each adding two of the 4 ranks' batches, moves its own losses by 1.0e-7). On a Sapphire
    # Rapids (AMX) at 4 ranks, rank 3's first batch (seed 1003) makes FSDP2's layer-0 attention
    # gradients (v_proj rows 22 and 26, o_proj row 58, the input norm; the embedding's row 18
    # below them) differ from a plain model's under the same autocast by one bf16 ulp, in one
    # process as on 4 ranks, with equal forwards: FSDP2's own backward, where ours equals the plain
    # model's (but the embedding's gradient, which ours, as FSDP2, computes in bf16). Not the
    # shards or the reduction order: FSDP2 laid out with columns for rows gives its own losses to
    # the bit. The losses then drift to 6e-6, 8e-6 and 2.9e-5 relative at steps 3-5: bounded at
    # 1e-4 there (3x), 1e-5 elsewhere.
    bound = 1e-4 if len(spawned) == 4 and bf16_units() else 1e-5
    torch.testing.assert_close(ours_, theirs, rtol=bound, atol=0)


def test_bf16_accumulation_without_sync_equals_pytorch_fsdp2(spawned):
    """Gradients kept whole between micro-batches add up in float32 (the reduce dtype), as FSDP2's do.
    (Measured: equal to the bit for the first 2-3 steps, then 6e-5 and 5e-5 relative at most, at 2
    and 4 ranks; where the last bits part is not found.)"""
    ours_, theirs = torch.tensor(spawned[0]["ours_accumulated"]), torch.tensor(spawned[0]["fsdp2_accumulated"])
    torch.testing.assert_close(ours_, theirs, rtol=3e-4, atol=0)


def test_bf16_gathers_half_the_bytes_of_float32(spawned):
    counted = spawned[0]["traffic"]
    fp32, bf16 = counted["fp32"][("dp_shard", "all_gather")], counted["bf16"][("dp_shard", "all_gather")]
    # every product's weight in bf16; the norms (kept float32) are 0.6% of this tiny model
    assert 0.5 <= bf16 / fp32 < 0.505
    # gradients still reduce in float32
    assert counted["bf16"][("dp_shard", "reduce_scatter")] == counted["fp32"][("dp_shard", "reduce_scatter")]


def test_gradients_reduce_in_bf16_when_asked(spawned):
    counted = spawned[0]["traffic"]
    fp32_reduce = counted["bf16"][("dp_shard", "reduce_scatter")]
    assert counted["bf16_reduce"][("dp_shard", "reduce_scatter")] == fp32_reduce // 2
    # the same training up to the gradients' rounding to bf16 in the sum (measured 1e-4 to 3e-4 over 5 steps)
    torch.testing.assert_close(torch.tensor(spawned[0]["bf16_reduce"]), torch.tensor(spawned[0]["ours"]),
                               rtol=1e-3, atol=0)


def whole(per_rank: list[dict], step: int, name: str) -> torch.Tensor:
    """A parameter's gradient from every rank's shard of it (the two runs shard it differently:
    the MX weights' shards are aligned to 32-row blocks)."""
    info = per_rank[0][step][name][0]
    out = torch.zeros(info.global_shape).reshape(info.rows, -1)
    for grads in per_rank:
        part, grad = grads[step][name]
        out[part.offset: part.offset + part.length] = grad.reshape(part.length, out.shape[1])
    return out


@pytest.mark.parametrize("recompute", [False, True], ids=["", "recompute"])
def test_mx_gather_is_bitwise_equal_to_gathering_values_and_quantizing_after(spawned, recompute):
    """(With recompute, the backward gather brings the forward's MX copy for the replay too.)"""
    key = "_recompute" if recompute else ""
    for results in spawned:
        for got, want in zip(results["mx" + key]["outputs"], results["values" + key]["outputs"], strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    mx, values = [r["mx" + key]["grads"] for r in spawned], [r["values" + key]["grads"] for r in spawned]
    for step in range(2):
        for name in values[0][step]:
            torch.testing.assert_close(whole(mx, step, name), whole(values, step, name), rtol=0, atol=0, msg=name)


def test_mx_gather_moves_about_a_quarter_of_float32s_bytes(spawned):
    mx, values = spawned[0]["mx"]["traffic"], spawned[0]["values"]["traffic"]
    ratio = mx[("dp_shard", "all_gather")] / values[("dp_shard", "all_gather")]
    # the weights as FP8 + E8M0 (1.03 bytes per element, forward and backward gathering one copy
    # each) against float32 (4 + 4); the bias and the norm (float32 values) are 0.4% of the elements
    assert ratio < 0.27
