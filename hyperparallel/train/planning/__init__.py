"""`hyperparallel plan`: what one rank of a run holds and sends per step, and how long a step takes,
from its config alone ([Note: how the plan is made], planner.py).

- `model`: the trainer's model on the meta device, and with fake tensors, one rank's part.
- `timeline`: one micro-batch recorded on it: storages made and freed, marks, operators' costs.
- `memory`: the bytes held, part by part, and their largest sum over the timeline; the runtime term.
- `communication`: the collectives of a step, their bytes by collective and mesh dimension.
- `planner`: `plan`, the pieces assembled into a `Plan`; `report`: the plan as printed.
- `plan_time`, `device_model`: the step time predicted on a device's figures (`cpu_gloo`: the
  CPU's collectives, measured among processes); `plan_search`: the layouts that fit, fastest
  first (`--search`).

The package imports none of its modules until a name is used (`lazy_exports`). It never imports
the trainer's loop (tests/test_import_layers.py).
"""

from hyperparallel.lazy_exports import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "communication": ("COMM_FORMULA",),
    "device_model": ("DEVICES", "GPUS", "DeviceModel"),
    "memory": ("RUN_MODULES", "resident_bytes", "runtime_bytes"),
    "model": ("fake_model", "first_layers_config", "layer_count_key", "meta_model", "whole_model_config"),
    "plan_search": ("Candidate", "format_search", "search"),
    "plan_time": ("Collective", "StepTime"),
    "planner": ("Plan", "describe_shape", "plan", "plan_total_bytes"),
    "report": ("format_plan", "format_time", "memory_summary"),
    "timeline": ("Timeline", "simulate"),
})
