"""Collect the segments DVM's VF table should hold: `python scripts/dvm_vf_harvest.py [--write]`.

Lowers, with dvm and the split in collecting mode (vf.COLLECT), every chain of vf_chains.py
(forward without gradients; forward and backward with them; float32 and bfloat16), the fused
loss's chunk, and the default config's decoder layers for a training step in float32 and under
bf16 autocast. Prints the segments the table lacks; `--write` rewrites vf_table.txt with exactly
them (sorted, so a change shows as a small diff). Then `make setup` (or setup.py build_ext)
regenerates and compiles the C. (A script, not part of the package: it drives the models and the
trainer's config, which `fusion` may not import.)
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import torch

from hyperparallel.fusion import compile as dvm_compile
from hyperparallel.fusion import vf, vf_spec
from hyperparallel.fusion.vf_chains import CHAINS


@contextlib.contextmanager
def collecting():
    """Lowering collects every segment's line (and writes no VFs); yields the set."""
    previous, vf.COLLECT = vf.COLLECT, set()
    dvm_compile._CACHE.clear()
    try:
        yield vf.COLLECT
    finally:
        vf.COLLECT = previous
        dvm_compile._CACHE.clear()


def _run_chains(rows: int = 64, cols: int = 128) -> None:
    g = torch.Generator().manual_seed(0)
    for chain in CHAINS:
        for dtype in (torch.float32, torch.bfloat16):
            xs = chain.make(rows, cols, dtype, g)
            torch._dynamo.reset()
            with torch.no_grad():
                torch.compile(chain.fn, backend="dvm", dynamic=False)(*xs)
            torch._dynamo.reset()
            leaves = [x.detach().requires_grad_() for x in xs]
            torch.compile(chain.fn, backend="dvm", dynamic=False)(*leaves).float().square().sum().backward()


def _run_loss_chunk() -> None:
    from hyperparallel.models.loss import _chunk_loss_and_grad

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        torch._dynamo.reset()
        logits = torch.randn(64, 512, generator=g).to(dtype)
        targets = torch.randint(0, 512, (64,), generator=g)
        targets[::7] = -100
        torch.compile(_chunk_loss_and_grad, backend="dvm", dynamic=False)(logits, targets, torch.tensor(1 / 64), dtype)


def _run_default_layers() -> None:
    """One training step of configs/default.yaml's model (two layers, short sequences), its decoder
    layers and loss compiled with dvm, in float32 and under bf16 autocast."""
    from hyperparallel.models import build_model, compile_layers, install_fused_loss
    from hyperparallel.models.kernels import use_kernels
    from hyperparallel.models.loss import _compiled, fused_loss
    from hyperparallel.train.build import inline_model_config
    from hyperparallel.train.config import load_config

    cfg = load_config(None)
    cfg.model.config["num_hidden_layers"] = 2
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    for autocast in (False, True):
        torch._dynamo.reset()
        _compiled.clear()
        model = build_model(cfg.model.family, config=inline_model_config(cfg, 512), dtype=torch.float32,
                            attn_implementation=cfg.model.attention(), seed=0)
        use_kernels(model, mega_gate=cfg.kernels.mega_gate, mega_mhc=cfg.kernels.mega_mhc)
        install_fused_loss(model, "dvm")
        compile_layers(model, "dvm")
        context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
        with fused_loss(model), context:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    torch._dynamo.reset()
    _compiled.clear()


def harvest() -> set[str]:
    """Every segment's canonical line, over the chains, the loss chunk and the default layers."""
    with collecting() as lines:
        _run_chains()
        _run_loss_chunk()
        _run_default_layers()
    return set(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite vf_table.txt with every segment found")
    args = parser.parse_args(argv)
    lines = harvest()
    have = {vf.line for vf in vf_spec.read()}
    missing = sorted(lines - have)
    print(f"{len(lines)} segments found, {len(missing)} not in {vf_spec.TABLE.name}")
    for line in missing:
        print("  " + line)
    if args.write:
        header = [line for line in vf_spec.TABLE.read_text().splitlines() if line.startswith("#")]
        vf_spec.TABLE.write_text("\n".join(header + sorted(lines)) + "\n")
        print(f"wrote {vf_spec.TABLE} ({len(lines)} VFs); rebuild the native library (make setup)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
