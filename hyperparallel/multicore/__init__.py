"""Multicore: a task graph of communication, matrix and vector work, scheduled by data dependency.

`TaskGraph` infers the order of its tasks from the buffer regions they read and write;
`scheduler.run` executes it (CUDA: a stream per lane; CPU: asynchronous gloo communication beside
compute on the calling thread); `trace` (hyperparallel.multicore.timeline) records runs as Chrome trace JSON; `simulate` predicts a
graph's makespan from per-task costs. MegaMoE (`hyperparallel.moe.megamoe`) is built on it.
"""

from hyperparallel.multicore.graph import KINDS, Buffer, Region, Task, TaskGraph
from hyperparallel.multicore.scheduler import RunStats, run
from hyperparallel.multicore.simulate import (
    COST_MODELS,
    EXECUTORS,
    LANE_PER_KIND,
    SHARED_COMPUTE,
    CostModel,
    Prediction,
    costs_from_trace,
    simulate,
)
from hyperparallel.multicore.timeline import trace

__all__ = [
    "COST_MODELS",
    "SHARED_COMPUTE",
    "LANE_PER_KIND",
    "KINDS",
    "EXECUTORS",
    "Buffer",
    "CostModel",
    "Prediction",
    "Region",
    "RunStats",
    "Task",
    "TaskGraph",
    "costs_from_trace",
    "run",
    "simulate",
    "trace",
]
