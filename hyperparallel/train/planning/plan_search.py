"""`hyperparallel plan --search`: the layouts of a model over N ranks that fit in a device's memory,
ranked by predicted tokens/s, printed as `--set` lines to paste into `hyperparallel train`.

[Note: how the search is made]
Enumerated: tp (powers of two up to the ranks per machine, dividing the attention heads), cp (each
rank keeping at least CP_TOKENS of a sequence; not with tp, as the trainer refuses), pipeline
stages (pp: powers of two leaving whole machines to each stage and two decoder layers or more to
each), the
dp_replicate x dp_shard splits whose shard groups are whole machines (or every data-parallel
rank), ep (MoE models: powers of two dividing dp_shard x cp, up to the experts); for each, the
largest micro-batch (a power of two dividing each replica's rows) that fits with recompute off,
then selective, then full, stopping at the first that fits the largest micro-batch (more
recompute at the same micro-batch is only slower); a micro-batch that accumulates and does not
fit keeping its whole gradients is tried again with parallel.sync_every_micro_batch. A layout
fits when its plan's total is at most the device's memory less HEADROOM (the CUDA context, the
allocator's fragmentation, NCCL's buffers).

A pipeline's layout (`parallel.pp`, 1F1B) is screened as a first stage holding the leading dense
layers and a stage's share of the others, more than any of its stages holds, then planned whole
as the others are. Each is screened on plans of the model's first few layers (`plan(layers=...)` at two depths,
every figure extrapolated linearly to the whole depth), whose micro-batches are simulated once
per tp, micro-batch and recompute with every expert and shared by every ep and split (an
expert-parallel rank's gradients cut to its experts: `Timeline.with_gradients_of`; not cut, and
so overestimated, are the bf16 copies autocast makes of the experts' weights when they are
float32 and not gathered in bf16). The best CONFIRMED x top screened layouts are then planned whole, each as `hyperparallel
plan` plans its --set lines (its own simulation), and ranked on those plans. When the screen finds
none that fits, the layouts it puts least over the budget are planned whole instead, and each that
fits is tried whole with larger micro-batches: what does not grow by the layer extrapolates high
(the screen of a MoE runs every expert on one rank; DeepSeek-V3's over 256 H100s is over by more
than a micro-batch: docs/train.md, "Published predictions").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

from hyperparallel.errors import ConfigError
from hyperparallel.models.layers import config_values
from hyperparallel.moe import GroupedExperts
from hyperparallel.train.config import TrainConfig
from hyperparallel.train.planning.device_model import DeviceModel
from hyperparallel.train.planning.memory import runtime_bytes
from hyperparallel.train.planning.model import meta_model
from hyperparallel.train.planning.plan_time import StepTime
from hyperparallel.train.planning.planner import Plan, plan
from hyperparallel.train.preflight import layout_problems

HEADROOM = 0.1  # of the device's memory, kept free
CP_TOKENS = 4096  # the fewest tokens of a sequence a context-parallel rank is given
CONFIRMED = 2  # whole plans per printed layout: the best screened ones are planned whole


@dataclass(frozen=True)
class Candidate:
    settings: dict  # dotted config key -> value
    plan: Plan

    @property
    def tokens_per_s(self) -> float:
        return self.plan.time.tokens_per_s

    def set_lines(self) -> str:
        return " ".join(f"--set {key}={'null' if value is None else value}" for key, value in self.settings.items())

    def to_json(self) -> dict:
        return {"settings": self.settings, "set": self.set_lines(), "plan": self.plan.to_json()}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _powers_of_two(limit: int) -> list[int]:
    return [2**i for i in range(int(math.log2(max(limit, 1))) + 1)]


def layouts(cfg: TrainConfig, world: int, ranks_per_node: int, config, experts: int = 0, depth: int = 1) -> list[dict]:
    """The mesh shapes of `cfg`'s model (its HF `config`, `experts` routed experts per MoE layer,
    0: dense; `depth` decoder layers) over `world` ranks to try (as config settings), without
    recompute and micro-batch (`search` picks those): shard groups of whole machines, or of every
    data-parallel rank; pipeline stages (1F1B, the outermost dimension) of whole machines, at least
    two decoder layers each."""
    heads = config_values(config, "num_attention_heads")  # (per layer, where the config lets them vary)
    seq = cfg.data.seq_len
    out = []
    for pp in [q for q in _powers_of_two(world) if q == 1 or (world // q % ranks_per_node == 0 and 2 * q <= depth)]:
        stage = world // pp
        for tp in [t for t in _powers_of_two(min(ranks_per_node, stage))
                   if all(h % t == 0 for h in heads) and stage % t == 0]:
            for cp in [c for c in _powers_of_two(max(seq // CP_TOKENS, 1)) if (stage // tp) % c == 0]:
                if tp > 1 and cp > 1:
                    continue
                dp = stage // (tp * cp)
                for dp_shard in _divisors(dp):
                    group = dp_shard * cp * tp
                    if dp_shard != dp and group % ranks_per_node:
                        continue
                    eps = [e for e in _powers_of_two(dp_shard * cp) if e <= experts] if experts else [1]
                    # (a pipeline's: 1F1B over stages balanced by the search, whatever the config's)
                    staged = ({"parallel.pp_schedule": "1f1b", "parallel.pp_virtual_stages": 1,
                               "parallel.pp_layers": None} if pp > 1 else {})
                    for ep in eps:
                        out.append({"parallel.pp": pp, **staged, "parallel.tp": tp, "parallel.cp": cp,
                                    "parallel.dp_replicate": dp // dp_shard, "parallel.dp_shard": dp_shard,
                                    "parallel.ep": ep})
    return out


def configured(cfg: TrainConfig, settings: dict) -> TrainConfig:
    """`cfg` with the layout's settings."""
    parallel = {key.split(".", 1)[1]: value for key, value in settings.items() if key.startswith("parallel.")}
    parallel["sequence_parallel"] = cfg.parallel.sequence_parallel and settings["parallel.tp"] > 1
    training = {"micro_batch": settings["training.micro_batch"]}
    return cfg.model_copy(update={"parallel": cfg.parallel.model_copy(update=parallel),
                                  "training": cfg.training.model_copy(update=training)})


def _depths(config) -> tuple[int, int]:
    """Two depths to extrapolate from, past the leading dense layers of a MoE model: the second adds
    one layer like most of the model's. Not 1 and 2: FSDP's buffers at the peak hold a layer and its
    neighbours' prefetch, which one layer does not have (measured: linear from 2 on)."""
    first = getattr(config, "first_k_dense_replace", 0) or 0
    return first + 2, first + 3


def _extrapolated(a: Plan, b: Plan, da: int, db: int, depth: int) -> Plan:
    """Plan `b` with every size and time carried on linearly from depth `da` and `db` to `depth`."""
    scale = (depth - db) / (db - da)

    def line(x, y):
        if isinstance(x, dict):
            return {k: line(x.get(k, 0), y.get(k, 0)) for k in y}
        value = y + (y - x) * scale
        return type(y)(max(value, 0))

    sizes = {f.name: line(getattr(a, f.name), getattr(b, f.name)) for f in fields(Plan)
             if f.name in ("params", "grads", "optimizer", "activations", "buffers", "tensors", "build",
                           "comm_bytes_per_step", "comm", "comm_by_dimension", "comm_by_dimension_and_kind")}
    time: StepTime = b.time
    step = line(a.time.predicted_step_s, time.predicted_step_s)
    moved = replace(time, predicted_step_s=step, compute_s=line(a.time.compute_s, time.compute_s),
                    exposed_comm_s=line(a.time.exposed_comm_s, time.exposed_comm_s),
                    optimizer_s=line(a.time.optimizer_s, time.optimizer_s), comm_s=line(a.time.comm_s, time.comm_s),
                    tokens_per_s=time.tokens_per_s * time.predicted_step_s / step,
                    mfu=time.mfu * time.predicted_step_s / step)
    return replace(b, **sizes, time=moved)


def search(cfg: TrainConfig, world: int, device: DeviceModel, top: int = 5) -> list[Candidate]:
    """The `top` fastest layouts that fit, by predicted tokens/s (the module's note says how)."""
    budget = device.memory_bytes * (1 - HEADROOM)
    # the CPU's runtime term measured once, before any plan fills this process
    runtime = 0 if device.name != "cpu" else runtime_bytes(cfg.training.compile)
    config = meta_model(cfg, layers=1).config  # (the HF config, its defaults filled in)
    depth, (da, db) = _depth(cfg), _depths(config)
    meta = meta_model(cfg, layers=min(da, depth))  # (past the leading dense layers: a MoE layer, if any)
    experts = max((m.routed_experts for m in meta.modules() if isinstance(m, GroupedExperts)), default=0)
    simulations: dict = {}
    refusals: list[str] = []  # (what the model refused of the layouts tried: said when none is left)

    def screen(settings: dict) -> Plan | None:
        candidate = configured(cfg, settings)
        if layout_problems(candidate, world):
            return None
        try:
            candidate.grad_accumulation(world)
        except ConfigError:
            return None
        options = {"device_model": device, "runtime": runtime, "device": "cpu", "simulations": simulations}
        # (a pipeline's screen: a first stage holding the leading dense layers and a stage's share of
        # the others, more than any stage holds)
        first_dense = da - 2  # (_depths: the leading dense layers, then two)
        held = depth if candidate.parallel.pp == 1 else min(depth, first_dense + -(-depth // candidate.parallel.pp))
        try:
            if held <= db:  # (a pipeline's: its first stage of `held` layers alone)
                return plan(candidate, world, layers=None if held == depth else held, **options)
            return _extrapolated(*(plan(candidate, world, layers=n, **options) for n in (da, db)), da, db, held)
        except ConfigError as error:  # what this layout asks of the model it cannot do (no TP plan, no CP, ...)
            refusals.append(str(error).splitlines()[0])
            return None

    screened: list[Candidate] = []
    over: list[Candidate] = []  # (the first of each mesh and recompute mode the screen puts over the budget)
    for mesh in layouts(cfg, world, device.ranks_per_node, config, experts, depth):
        rows = _rows(cfg, world, mesh)  # (each data-parallel rank reads its share of a batch)
        micros = [m for m in _powers_of_two(rows) if rows % m == 0]
        for recompute in ("off", "selective", "full"):
            best = None  # the largest micro-batch that fits (fewer FSDP gathers per step)
            for micro in micros:
                settings = {**mesh, "parallel.recompute": recompute, "training.micro_batch": micro}
                planned = screen(settings)
                if (planned is not None and planned.total > budget and planned.accumulation > 1
                        and not cfg.parallel.sync_every_micro_batch):  # whole gradients kept: reduce each instead
                    settings["parallel.sync_every_micro_batch"] = True
                    planned = screen(settings)
                if planned is not None and planned.total > budget:
                    over.append(Candidate(dict(settings), planned))
                if planned is None or planned.total > budget:
                    break
                best = Candidate(settings, planned)
            if best is not None:
                screened.append(best)
                if best.settings["training.micro_batch"] == micros[-1]:
                    break  # (more recompute at the same micro-batch is only slower)
    if not screened and refusals and not over:
        raise ConfigError("\n".join(dict.fromkeys(refusals)))
    least_over = not screened
    if least_over:  # (none fits by the screen, which overestimates at the edge: the least over, planned whole)
        screened = sorted(over, key=lambda c: c.plan.total)[:top * CONFIRMED]
    screened.sort(key=lambda c: -c.tokens_per_s)

    def whole(settings: dict) -> Candidate | None:  # (planned as `hyperparallel plan` plans its --set lines)
        planned = plan(configured(cfg, settings), world, device_model=device, runtime=runtime, device="cpu")
        return Candidate(settings, planned) if planned.total <= budget else None

    confirmed = [c for c in map(whole, (c.settings for c in screened[:top * CONFIRMED])) if c is not None]
    if least_over:  # (each was its mesh's first micro-batch over by the screen: a larger one may fit whole too)
        for c in list(confirmed):
            micro, rows = c.settings["training.micro_batch"], _rows(cfg, world, c.settings)
            while 2 * micro <= rows and rows % (2 * micro) == 0 and (larger := whole({**c.settings, "training.micro_batch": 2 * micro})):
                confirmed.append(larger)
                micro *= 2
    confirmed.sort(key=lambda c: -c.tokens_per_s)
    return confirmed[:top]


def _rows(cfg: TrainConfig, world: int, settings: dict) -> int:
    """The sequences each data-parallel rank reads a step (0 where the batch does not divide)."""
    data_ranks = world // (settings["parallel.pp"] * settings["parallel.tp"] * settings["parallel.cp"])
    return cfg.training.global_batch // data_ranks if cfg.training.global_batch % data_ranks == 0 else 0


def _depth(cfg: TrainConfig) -> int:
    from hyperparallel.train.data import tokenizer_vocab_size
    from hyperparallel.train.planning.model import layer_count_key, whole_model_config

    whole = whole_model_config(cfg, tokenizer_vocab_size(cfg.data, cfg.model.path))
    return whole[layer_count_key(cfg.model.family, whole)]


def format_search(found: list[Candidate], cfg: TrainConfig, world: int, device: DeviceModel) -> str:
    if not found:
        return (f"no layout of {cfg.model.family} over {world} ranks fits in {device.name}'s "
                f"{device.memory_bytes / 2**30:.0f} GiB (less {HEADROOM:.0%} headroom); more ranks, a larger "
                f"device, or a smaller global batch / sequence")
    lines = [f"layouts of {cfg.model.family} ({found[0].plan.n_params / 1e9:.2f}B parameters) over {world} ranks on "
             f"{device.name} ({device.ranks_per_node} per machine), fastest first (predictions, not measurements):"]
    for i, c in enumerate(found, 1):
        t = c.plan.time
        exposed = ", ".join(f"{dim} {s * 1e3:.0f} ms" for dim, s in t.exposed_comm_s.items() if s > 5e-4) or "none"
        lines.append(f"{i}. {t.tokens_per_s:,.0f} tokens/s, step {t.predicted_step_s:.2f} s, MFU {100 * t.mfu:.1f}%, "
                     f"{c.plan.total / 2**30:.1f} GiB per rank (compute {t.compute_s:.2f} s, exposed {exposed})")
        lines.append(f"   {c.set_lines()}")
    return "\n".join(lines)

