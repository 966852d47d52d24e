"""MegaGate and MegaMHC against transformers' modules, side by side in one run.

    python benchmarks/fused_kernels.py                       # 4096 tokens, hidden 1024, 256 experts top-6
    python benchmarks/fused_kernels.py --tokens 2048 --repeat 5 --json kernels.json

1. The router, forward + backward, fp32: transformers' DeepseekV4TopKRouter (sqrt-softplus scores,
   correction bias, top-6 of 256), DeepseekV3TopkRouter (sigmoid, 8 groups of which 4,
   top-8) and Qwen3MoeTopKRouter (softmax, top-8 of 128) against our TopKRouter with MegaGate on
   the same weights. Twice: the whole router (its projection to logits included, the same matmul
   for both) and the gate alone (everything after the logits).
2. A hyper-connection and the mix after its block, forward + backward (DeepSeek-V4's hc_mult 4,
   20 Sinkhorn iterations): transformers' DeepseekV4HyperConnection and the decoder layer's
   expand-and-mix against MegaMHC's mhc_pre + mhc_post, fp32 and bf16 streams; the block between
   them is a per-channel gain (the least a block can be, so the hyper-connection's time shows).
   Under two memory regimes, side by side:
   - "allocator matched" (the fair figure): freed memory is reused on both sides. MegaMHC's large
     outputs come from its host buffer cache, and glibc is told to keep freed memory for the next
     tensor (mallopt: no mmap below 1 GiB, no trimming below 1 GiB; benchmarks/mx_ops.py's
     `cached`), so transformers' tensors cost no fresh pages either;
   - "favourable": glibc as it comes, so every large tensor of transformers' is a fresh mmap (a
     page fault per 4 KiB) while MegaMHC's still come from its cache.
   glibc's setting cannot be taken back, so the matched runs come last (after the training step).
3. The whole training step (forward, backward, AdamW) of a small DeepSeek-V4 with both kernels on
   against both off.

Times are medians over --repeat runs with the contenders alternated; "saved" is the bytes
autograd keeps for backward beyond the inputs and parameters (distinct storages, counted by
saved-tensor hooks). Ratios are transformers' / ours.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import DeepseekV4Config, Qwen3MoeConfig
from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection, DeepseekV4TopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from hyperparallel.kernels.mega_mhc import MegaHyperConnection, mhc_post
from hyperparallel.models import build_model
from hyperparallel.models.families import router_from_hf
from hyperparallel.models.kernels import use_kernels

ROOT = Path(__file__).resolve().parent.parent


def alternated(contenders: dict[str, Callable[[], None]], repeat: int) -> dict[str, float]:
    """Median ms of each contender, the contenders run in turn `repeat` times."""
    for fn in contenders.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(repeat):
        for name, fn in contenders.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def saved_bytes(fn: Callable[[], torch.Tensor], inputs: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages autograd saves while `fn` runs, other than the inputs'."""
    skip = {t.untyped_storage().data_ptr() for t in inputs}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


# ----------------------------------------------------------------------------------------- routers


def hf_routers(hidden: int) -> dict[str, tuple[torch.nn.Module, Callable]]:
    """name -> (transformers' router, a function hidden_states -> (weights, indices) through it)."""
    v4 = DeepseekV4TopKRouter(DeepseekV4Config(hidden_size=hidden, n_routed_experts=256, num_experts_per_tok=6))
    v3 = DeepseekV3TopkRouter(DeepseekV3Config(hidden_size=hidden, n_routed_experts=256, num_experts_per_tok=8,
                                               n_group=8, topk_group=4))
    qwen = Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=hidden, num_experts=128, num_experts_per_tok=8))
    g = torch.Generator().manual_seed(0)
    for router in (v4, v3, qwen):
        with torch.no_grad():
            router.weight.copy_(0.02 * torch.randn(router.weight.shape, generator=g))
            bias = getattr(router, "e_score_correction_bias", None)
            if bias is not None:
                bias.copy_(0.01 * torch.randn(bias.shape, generator=g))
    return {
        "DeepSeek-V4 sqrt-softplus, 256 experts top-6": (v4, lambda x: v4(x)[1:]),
        "DeepSeek-V3 sigmoid, 8 groups of which 4, 256 top-8": (v3, lambda x: v3(x)[1:]),
        "Qwen3-MoE softmax, 128 top-8": (qwen, lambda x: qwen(x)[1:]),
    }


def router_rows(tokens: int, hidden: int, repeat: int) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    return [router_row(name, hf, hf_route, tokens, hidden, repeat, g)
            for name, (hf, hf_route) in hf_routers(hidden).items()]


def router_row(name: str, hf, hf_route, tokens: int, hidden: int, repeat: int, g: torch.Generator) -> dict:
    ours = router_from_hf(hf)
    ours.fused = True
    x = torch.randn(tokens, hidden, generator=g, requires_grad=True)
    logits = (x.detach() @ hf.weight.detach().t()).requires_grad_()
    cotangent = torch.randn(tokens, ours.top_k, generator=g)

    def whole(route):
        def run():
            route(x)[0].backward(cotangent)
        return run

    def from_logits(fused: bool):
        router = router_from_hf(hf)
        router.fused = fused

        def run():
            router.route_logits(logits)[0].backward(cotangent)
        return run

    both = alternated({"hf": whole(hf_route), "ours": whole(lambda t: ours(t)[1:])}, repeat)
    gate = alternated({"hf": from_logits(False), "ours": from_logits(True)}, repeat)
    saved = {"hf": saved_bytes(lambda: hf_route(x)[0], [x, hf.weight]),
             "ours": saved_bytes(lambda: ours(x)[1], [x, hf.weight])}
    return {"router": name, "whole_hf_ms": both["hf"], "whole_ours_ms": both["ours"],
            "gate_hf_ms": gate["hf"], "gate_ours_ms": gate["ours"],
            "saved_hf": saved["hf"], "saved_ours": saved["ours"]}


# -------------------------------------------------------------------------------- hyper-connections


def hyper_rows(tokens: int, hidden: int, repeat: int) -> list[dict]:
    config = DeepseekV4Config(hidden_size=hidden, hc_mult=4, hc_sinkhorn_iters=20)
    hf = DeepseekV4HyperConnection(config)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        hf.fn.copy_(0.02 * torch.randn(hf.fn.shape, generator=g))
        hf.base.copy_(0.1 * torch.randn(hf.base.shape, generator=g))
        hf.scale.copy_(1 + 0.1 * torch.randn(3, generator=g))
    return [hyper_row(hf, dtype, tokens, hidden, repeat, g) for dtype in (torch.float32, torch.bfloat16)]


def hyper_row(hf, dtype: torch.dtype, tokens: int, hidden: int, repeat: int, g: torch.Generator) -> dict:
    ours = MegaHyperConnection.from_hf(hf)
    params = [hf.fn, hf.base, hf.scale]
    streams = torch.randn(1, tokens, 4, hidden, generator=g).to(dtype).requires_grad_()
    gain = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)  # the block, as cheap as it gets
    cotangent = torch.randn(1, tokens, 4, hidden, generator=g).to(dtype)

    def hf_forward():  # DeepseekV4DecoderLayer.forward around one block
        post, comb, collapsed = hf(streams)
        out = collapsed * gain
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2),
                                                                               streams)

    def ours_forward():
        post, comb, collapsed = ours(streams)
        out = collapsed * gain
        T = tokens
        return mhc_post(out.reshape(T, hidden), streams.reshape(T, 4, hidden), post.reshape(T, 4),
                        comb.reshape(T, 4, 4)).view(1, T, 4, hidden)

    def backward_of(forward):
        def run():
            forward().backward(cotangent)
        return run

    times = alternated({"hf": backward_of(hf_forward), "ours": backward_of(ours_forward)}, repeat)
    saved = {"hf": saved_bytes(hf_forward, [streams, gain, *params]),
             "ours": saved_bytes(ours_forward, [streams, gain, *params])}
    return {"streams": str(dtype).removeprefix("torch."), "hf_ms": times["hf"], "ours_ms": times["ours"],
            "saved_hf": saved["hf"], "saved_ours": saved["ours"]}


def keep_freed_memory() -> None:
    """glibc keeps freed blocks for the next allocation, as mx_ops.py's `cached` setting: blocks up to
    1 GiB from the heap instead of fresh mmaps, and up to 1 GiB of freed heap kept mapped."""
    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_threshold = -1, -3
    if not (libc.mallopt(m_mmap_threshold, 1 << 30) and libc.mallopt(m_trim_threshold, 1 << 30)):
        raise SystemExit("mallopt refused the settings")


# -------------------------------------------------------------------------------------- whole step


def step_rows(seq: int, batch: int, repeat: int) -> list[dict]:
    import yaml

    config = yaml.safe_load((ROOT / "configs/models/deepseek_v4_tiny.yaml").read_text())
    config.update(hidden_size=256, moe_intermediate_size=128, n_routed_experts=32, num_experts_per_tok=4,
                  num_attention_heads=8, head_dim=64, q_lora_rank=128, o_lora_rank=64, sliding_window=128,
                  compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 32},
                  index_topk=32, vocab_size=4096)
    ids = torch.randint(0, config["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(3))
    runs = {}
    for name, on in (("off", False), ("on", True)):
        model = build_model("deepseek_v4", config=config, seed=0)
        use_kernels(model, mega_gate=on, mega_mhc=on)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(model=model, optimizer=optimizer):
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        runs[name] = step
    times = alternated(runs, repeat)
    return [{"model": f"DeepSeek-V4 hidden 256, 4 layers, 32 experts top-4, {batch} x {seq} tokens",
             "off_ms": times["off"], "on_ms": times["on"]}]


# -------------------------------------------------------------------------------------------- main


def mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=1024, help="DeepSeek-V4's 4096 scaled to this machine")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--step-seq", type=int, default=512)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    torch.manual_seed(0)

    print(f"{args.tokens} tokens, hidden {args.hidden}; {torch.get_num_threads()} threads; torch {torch.__version__}; "
          f"forward + backward, median of {args.repeat}")
    routers = router_rows(args.tokens, args.hidden, args.repeat)
    print("\n| router | whole: transformers ms | MegaGate ms | ratio | gate alone: transformers ms | MegaGate ms "
          "| ratio | saved MiB: transformers | MegaGate | ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in routers:
        print(f"| {r['router']} | {r['whole_hf_ms']:.2f} | {r['whole_ours_ms']:.2f} | "
              f"{r['whole_hf_ms'] / r['whole_ours_ms']:.2f}x | {r['gate_hf_ms']:.2f} | {r['gate_ours_ms']:.2f} | "
              f"{r['gate_hf_ms'] / r['gate_ours_ms']:.2f}x | {mib(r['saved_hf'])} | {mib(r['saved_ours'])} | "
              f"{r['saved_ours'] / max(r['saved_hf'], 1):.2f}x |")
    favourable = hyper_rows(args.tokens, args.hidden, args.repeat)
    steps = step_rows(args.step_seq, 2, max(args.repeat // 2, 3))
    keep_freed_memory()  # for good: what follows runs with freed memory reused on both sides
    matched = hyper_rows(args.tokens, args.hidden, args.repeat)
    hyper = [{"streams": m["streams"], "matched_hf_ms": m["hf_ms"], "matched_ours_ms": m["ours_ms"],
              "favourable_hf_ms": f["hf_ms"], "favourable_ours_ms": f["ours_ms"], "saved_hf": f["saved_hf"],
              "saved_ours": f["saved_ours"]} for m, f in zip(matched, favourable, strict=True)]
    print("\nallocator matched: MegaMHC's outputs from its host buffer cache, transformers' tensors from glibc "
          "keeping freed memory (mallopt); favourable: glibc as it comes, transformers' large tensors fresh pages")
    print("\n| hyper-connection + mix, 4 streams | allocator matched: transformers ms | MegaMHC ms | ratio "
          "| favourable: transformers ms | MegaMHC ms | ratio | saved MiB: transformers | MegaMHC | ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in hyper:
        print(f"| {r['streams']} streams | {r['matched_hf_ms']:.2f} | {r['matched_ours_ms']:.2f} | "
              f"{r['matched_hf_ms'] / r['matched_ours_ms']:.2f}x | {r['favourable_hf_ms']:.2f} | "
              f"{r['favourable_ours_ms']:.2f} | {r['favourable_hf_ms'] / r['favourable_ours_ms']:.2f}x | "
              f"{mib(r['saved_hf'])} | {mib(r['saved_ours'])} | {r['saved_ours'] / r['saved_hf']:.2f}x |")
    print("\n| whole training step | kernels off ms | kernels on ms | ratio |")
    print("|---|---|---|---|")
    for r in steps:
        print(f"| {r['model']} | {r['off_ms']:.1f} | {r['on_ms']:.1f} | {r['off_ms'] / r['on_ms']:.2f}x |")
    if args.json:
        args.json.write_text(json.dumps({"routers": routers, "hyper_connections": hyper, "steps": steps}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
