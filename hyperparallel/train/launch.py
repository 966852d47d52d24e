"""`hyperparallel train --nproc N`: N ranks on this machine through torch.distributed.run.

For several machines run torchrun yourself, the same command on each (see the README):
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m hyperparallel train CONFIG
"""

from __future__ import annotations

import subprocess
import sys

from hyperparallel.errors import ConfigError


def launch(config: str | None, overrides: list[str], nproc: int) -> int:
    if nproc < 1:
        raise ConfigError(f"--nproc must be at least 1, got {nproc}")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "hyperparallel", "train"]
    if config is not None:
        command.append(config)
    for item in overrides:
        command += ["--set", item]
    return subprocess.call(command)
