"""Everything a run can be told wrong, checked before any work and before anything is written.

`check(cfg, world, run_dir)` collects every problem it finds into one ConfigError, one per line:
the batch split over the ranks, the model's config (built as its HF config class, not as
weights), the tokenizer against the model's vocabulary, the data files, W&B's package where the
config asks for W&B, the compiler a compile backend needs, and every directory the run will write
(the run directory, the checkpoint root, the data cache). The command line runs it before
launching any rank; `train.loop` runs it again on rank 0 for callers of the library.
What can only be found by reading the data in full (a malformed parquet file, a JSON line)
is found by `data.prepare`, which reads every input before it writes its first cache file.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from hyperparallel.errors import ConfigError, HyperparallelError
from hyperparallel.kernels import native
from hyperparallel.models import get_family
from hyperparallel.parallel import mesh as parallel_mesh
from hyperparallel.train import data, wandb_log
from hyperparallel.train.checkpointing import not_a_model_directory
from hyperparallel.train.config import TrainConfig
from hyperparallel.train.run_dir import checkpoint_root


def check(cfg: TrainConfig, world: int, run_dir: Path) -> None:
    problems = layout_problems(cfg, world) + data.input_problems(cfg.data) + data_problems(cfg) + compile_problems(cfg)
    problems += wandb_log.problems(cfg.logging.wandb)
    try:  # (a model.path that is a training checkpoint has no tokenizer to read: model_problems says what it is)
        vocab = None if _training_output(cfg) else data.tokenizer_vocab_size(cfg.data, cfg.model.path)
    except HyperparallelError as error:
        problems.append(str(error))
        vocab = None
    problems += model_problems(cfg, vocab) + write_problems(cfg, run_dir)
    if problems:
        raise ConfigError("\n".join(problems))


def document_mask(cfg: TrainConfig) -> tuple[bool, str | None]:
    """(whether packed rows get document masks, why not where they cannot): data.document_mask,
    or (null) on with packing wherever the layout and the model support it."""
    if not cfg.data.packing:
        return False, None
    reason = None
    if cfg.parallel.cp > 1:
        reason = (f"parallel.cp = {cfg.parallel.cp} splits each sequence over ranks whose ring and Ulysses attention "
                  f"is causal over the whole row")
    elif (family := _family(cfg)) is not None and family.document_mask is not None:
        reason = f"model.family {cfg.model.family}: {family.document_mask}"
    elif family is not None and (problem := _model_document_mask_problem(cfg)) is not None:
        reason = f"model {family.name!r}: {problem}"
    if cfg.data.document_mask is None:
        return reason is None, reason
    return cfg.data.document_mask and reason is None, reason


_document_mask_problems: dict[str, str | None] = {}


def _model_document_mask_problem(cfg: TrainConfig) -> str | None:
    """`models.document_mask_problem` of the model the config builds (on the meta device, once per
    model config); None where it cannot be built (model_problems says why)."""
    from hyperparallel.models import build_model, document_mask_problem

    key = json.dumps([cfg.model.family, cfg.model.path, cfg.model.config, cfg.model.attention()], sort_keys=True,
                     default=str)
    if key not in _document_mask_problems:
        try:
            meta = build_model(cfg.model.family, path=None if cfg.model.path is None else Path(cfg.model.path).expanduser(),
                               config=cfg.model.config, attn_implementation=cfg.model.attention(), materialize=False)
            _document_mask_problems[key] = document_mask_problem(meta)
        except HyperparallelError:
            return None
    return _document_mask_problems[key]


def compile_problems(cfg: TrainConfig, cuda: bool | None = None) -> list[str]:
    """DVM's kernels run on the CPU: on GPUs a run would fall back to ATen, op by op, unannounced."""
    if cuda is None:
        import torch  # (preflight imports no torch for the checks that need none)

        cuda = torch.cuda.is_available()
    if cfg.training.compile == "dvm" and cuda:
        return ["training.compile: dvm runs its fused kernels on the CPU, and this run trains on CUDA GPUs; "
                "use training.compile: inductor (the default) or none"]
    if cfg.training.compile == "dvm" and "hyperparallel._dvm_native" in native.not_built():
        return ["training.compile: dvm runs the DVM's native interpreter, which this install has no build of "
                "(no C compiler where it was installed); use training.compile: none (or inductor)"]
    if cfg.training.compile == "inductor" and not cuda and not _cpp_compiler():
        return ["training.compile: inductor compiles C++ for the CPU, and this machine has no C++ compiler "
                "($CXX, else g++); use training.compile: none"]
    return []


def _cpp_compiler() -> str | None:
    """The C++ compiler Inductor's CPU code builds with, as its default config finds it on Linux:
    $CXX, else g++; or the g++ it installs itself (TORCH_INDUCTOR_INSTALL_GXX)."""
    import shutil

    if os.environ.get("TORCH_INDUCTOR_INSTALL_GXX"):
        return "g++ (Inductor installs it)"
    cxx = os.environ.get("CXX", "g++")
    return shutil.which(cxx) if cxx else None


def data_problems(cfg: TrainConfig) -> list[str]:
    on, reason = document_mask(cfg)
    if cfg.data.document_mask and reason is not None:
        return [f"data.document_mask: {reason}, so packed documents would see each other; set data.document_mask: "
                f"false (or null: masks wherever supported), or data.packing: false"]
    return []


def layout_problems(cfg: TrainConfig, world: int) -> list[str]:
    p = cfg.parallel
    ep, tp, cp = p.ep, p.tp, p.cp
    problems = parallel_mesh.layout_problems(p, world)  # (the layout alone; below, what it asks of the model and the data)
    seq = cfg.data.seq_len
    if p.sequence_parallel and seq % tp:
        problems.append(f"parallel.sequence_parallel: data.seq_len ({seq}) must divide by parallel.tp ({tp})")
    if cp > 1 and seq % (2 * cp):
        problems.append(f"parallel.cp = {cp}: data.seq_len ({seq}) must divide by 2 x cp = {2 * cp} (each rank holds "
                        f"two load-balanced chunks of every sequence)")
    if tp > 1 and not cfg.training.fused_loss:
        problems.append(f"parallel.tp = {tp} needs training.fused_loss: true (the vocab-parallel cross-entropy; the "
                        f"logits are never whole on any rank)")
    if tp > 1 and cfg.optimizer.name == "muon":
        problems.append(f"optimizer.name: muon with parallel.tp = {tp}: Muon orthogonalizes whole matrices, and TP "
                        f"splits them over ranks (not supported yet); use adamw, or tp: 1")
    family = _family(cfg)  # (None: model_problems names what is wrong with model.family)
    attention = cfg.model.attn_implementation
    if family is not None and attention != "auto" and attention not in family.attention_implementations:
        problems.append(f"model.attn_implementation: {attention}: transformers' {cfg.model.family} supports "
                        f"{', '.join(family.attention_implementations)} only; use auto")
    if cfg.moe.waves is not None and cfg.moe.implementation != "megamoe":
        problems.append(f"moe.waves = {cfg.moe.waves} sets MegaMoE's expert waves, and moe.implementation is "
                        f"{cfg.moe.implementation}; set moe.implementation: megamoe, or leave moe.waves null")
    if cfg.moe.implementation == "megamoe" and ep == 1:
        problems.append("moe.implementation: megamoe overlaps the all-to-alls of expert parallelism, and parallel.ep "
                        "is 1 (no all-to-alls); set parallel.ep > 1 or use moe.implementation: sequential")
    lp = cfg.low_precision
    problems += cfg.moe.dispatch_problems(ep, lp.enabled and "experts" in lp.modules)
    try:
        micro_batches = cfg.grad_accumulation(world)
    except HyperparallelError as error:
        problems.append(str(error))
    else:
        if p.pp > 1 and micro_batches < p.pp:
            problems.append(f"parallel.pp = {p.pp} runs {micro_batches} micro-batch(es) a step through {p.pp} stages "
                            f"(training.global_batch {cfg.training.global_batch} / micro_batch "
                            f"{cfg.training.micro_batch} / data-parallel ranks); a pipeline needs at least one a stage: "
                            f"raise global_batch or lower micro_batch")
    return problems


def _family(cfg: TrainConfig):
    """The model's family, or None where model.family names none (model_problems says why)."""
    try:
        return get_family(cfg.model.family)
    except HyperparallelError:
        return None


def _moe_problems(cfg: TrainConfig, meta) -> list[str]:
    """What the MoE options ask of the model's MoE layers (`meta`: the model on the meta device,
    its MoE layers on hyperparallel.moe's modules)."""
    from hyperparallel.models.families import computes_aux_loss, load_balance_rule
    from hyperparallel.moe import GroupedExperts, TopKRouter
    from hyperparallel.moe.balance import balanced_layers
    from hyperparallel.parallel.expert_parallel import shared_by_experts

    layers = balanced_layers(meta)
    experts = [m for m in meta.modules() if isinstance(m, GroupedExperts)]
    name = cfg.model.family
    problems = []
    if cfg.parallel.ep > 1 and not experts:
        problems.append(f"parallel.ep = {cfg.parallel.ep} splits the experts of MoE layers, and {name!r} has none")
    rule = cfg.moe.load_balance or load_balance_rule(get_family(name), meta)
    if rule == "bias" and any(layer.bias_owner is None and not getattr(layer.counter, "hash_routing", False)
                              for layer in layers):
        problems.append(f"moe.load_balance: bias moves a router's correction bias, and the routers of {name!r} have none; "
                        f"use aux_loss or none")
    ours = any(isinstance(layer.counter, TopKRouter) for layer in layers)
    if rule == "aux_loss" and layers and not ours and not computes_aux_loss(meta):
        problems.append(f"moe.load_balance: aux_loss: transformers' {type(meta).__name__} adds no auxiliary loss of "
                        f"its own (its config has no router_aux_loss_coef); use bias or none")
    shared = next(((m, names) for m in experts if (names := shared_by_experts(m))), None)
    if cfg.parallel.ep > 1 and shared is not None:
        problems.append(f"parallel.ep = {cfg.parallel.ep}: {type(shared[0]).__name__}'s {', '.join(shared[1])} are "
                        f"shared by all its experts, and expert parallelism would train a copy per rank on that "
                        f"rank's experts' tokens only; use ep: 1")
    odd = next((m for m in experts if not m.default_layout), None)
    if odd is not None and cfg.moe.implementation == "megamoe" and cfg.parallel.ep > 1:
        problems.append(f"moe.implementation: megamoe runs gate_up_proj [E, 2I, H] / down_proj [E, H, I] experts "
                        f"without biases or a post-expert norm, and {type(odd).__name__} is laid out otherwise "
                        f"({odd.layout_description()}); use moe.implementation: sequential")
    return problems


def _expert_problems(cfg: TrainConfig, meta) -> list[str]:
    from hyperparallel.moe import GroupedExperts

    counts = [m.routed_experts for m in meta.modules() if isinstance(m, GroupedExperts)]
    experts = min(counts) if counts else None
    ep = cfg.parallel.ep
    if ep > 1 and experts is not None and experts < ep:
        return [f"parallel.ep = {ep} needs at least one expert per rank, and the model has {experts} "
                f"experts per MoE layer; use ep <= {experts}"]
    waves = cfg.moe.waves
    if cfg.moe.implementation == "megamoe" and ep > 1 and experts is not None and waves is not None:
        most = -(-experts // ep)
        if waves > most:
            return [f"moe.waves = {waves}: a wave is a group of one rank's experts, and with {experts} experts over "
                    f"parallel.ep = {ep} ranks a rank holds at most {most}; use moe.waves <= {most} (or null)"]
    return []


def _training_output(cfg: TrainConfig) -> str | None:
    """What to do instead when model.path is a training checkpoint or run directory (None: it is not)."""
    return None if cfg.model.path is None else not_a_model_directory(Path(cfg.model.path).expanduser())


def model_problems(cfg: TrainConfig, tokenizer_vocab: int | None) -> list[str]:
    """The model's HF config, built and checked by its family (the inline keys, the heads, the
    experts); its vocabulary against the tokenizer's (`data.tokenizer_vocab_size`; None: unknown)."""
    from hyperparallel.models import build_model, make_config, pretrained_config

    try:
        if cfg.model.config is not None:
            hf_config = make_config(cfg.model.family, cfg.model.config)
            inline = cfg.model.config
            given = inline.get("vocab_size", (inline.get("text_config") or {}).get("vocab_size"))  # (absent: it
            # follows the tokenizer)
        else:
            instead = _training_output(cfg)
            if instead is not None:
                return [instead]
            hf_config = pretrained_config(cfg.model.family, Path(cfg.model.path).expanduser())
            given = hf_config.get_text_config(decoder=True).vocab_size
    except HyperparallelError as error:
        where = "model.config" if cfg.model.config is not None else "model.path"
        return [line if line.startswith("model") else f"{where}: {line}" for line in str(error).splitlines()]
    where = "model.config" if cfg.model.config is not None else "model.path"
    try:  # (the model on the meta device, its MoE layers swapped: what the layout and options ask of it)
        meta = build_model(cfg.model.family, path=None if cfg.model.path is None else Path(cfg.model.path).expanduser(),
                           config=cfg.model.config, attn_implementation=cfg.model.attention(), materialize=False)
    except HyperparallelError as error:
        return [f"{where}: {line}" for line in str(error).splitlines()]
    experts = _expert_problems(cfg, meta) + _moe_problems(cfg, meta)
    experts += _parallel_problems(cfg, meta, given or tokenizer_vocab) + _pipeline_problems(cfg, meta)
    if cfg.model.path is not None and not experts:
        experts += _weight_file_problems(cfg, meta)
    if given is None or tokenizer_vocab is None or given >= tokenizer_vocab:
        return experts
    source = data.tokenizer_source(cfg.data, cfg.model.path)
    if source is not None:
        where = "model.config.vocab_size" if cfg.model.config is not None else f"model.path {cfg.model.path}"
        return experts + [f"{where} ({given}) is smaller than the vocabulary of the tokenizer {source} "
                f"({tokenizer_vocab}); give the model's own tokenizer or a larger vocab_size"]
    if cfg.model.config is not None:
        return experts + [f"model.config.vocab_size ({given}) is smaller than the builtin tokenizer's data.vocab_size "
                          f"({cfg.data.vocab_size}); set data.vocab_size: {given} or leave vocab_size out of the model "
                          f"config (it then follows the tokenizer)"]
    own = (Path(cfg.model.path).expanduser() / data.TOKENIZER_FILE).is_file()
    return experts + [f"model.path {cfg.model.path}: vocab_size ({given}) is smaller than the builtin tokenizer's "
                      f"data.vocab_size ({cfg.data.vocab_size}); " + (
                          "give data.tokenizer: null to tokenize with model.path's own tokenizer (its ids are the "
                          "model's)" if own else f"set data.vocab_size: {given}")]


def _pipeline_problems(cfg: TrainConfig, meta) -> list[str]:
    """What pipeline stages need of the model (`meta`: on the meta device): enough decoder layers,
    and no auxiliary loss that transformers' model sums over every
    stage's routers (ours balance by stage: moe/balance.py)."""
    p = cfg.parallel
    if p.pp == 1:
        return []
    from hyperparallel.models.families import load_balance_rule
    from hyperparallel.models.layers import layer_list
    from hyperparallel.moe.balance import aux_loss_coefficient, balanced_layers, routers

    problems = []
    layers, stages = len(layer_list(meta)), p.pp * p.pp_virtual_stages
    if p.pp_layers is not None and sum(p.pp_layers) != layers:
        problems.append(f"parallel.pp_layers {p.pp_layers} adds up to {sum(p.pp_layers)} decoder layers, and the "
                        f"model has {layers}")
    elif layers < stages:
        problems.append(f"parallel.pp = {p.pp} x pp_virtual_stages = {p.pp_virtual_stages} makes {stages} pipeline "
                        f"stages, and the model has {layers} decoder layers; every stage needs at least one")
    if balanced_layers(meta) and not routers(meta):  # (transformers' own routers: its model adds their loss)
        rule = cfg.moe.rule(load_balance_rule(get_family(cfg.model.family), meta))
        if rule == "aux_loss" and aux_loss_coefficient(cfg.moe, meta):
            problems.append(f"parallel.pp = {p.pp} with moe.load_balance: aux_loss: {type(meta).__name__} keeps "
                            f"transformers' routers, whose auxiliary loss its model adds over every layer at the "
                            f"last stage (not supported under pp); use moe.load_balance: none, or moe.aux_loss_coef: 0")
    return problems


def _weight_file_problems(cfg: TrainConfig, meta) -> list[str]:
    """model.path's safetensors against the model its config.json describes (`meta`, on the meta
    device), from the files' headers alone: every missing, unexpected or mis-shaped tensor, before
    any rank allocates."""
    from hyperparallel.checkpoint.hf_files import plan_hf_read

    try:
        plan_hf_read(Path(cfg.model.path).expanduser(), meta)
    except HyperparallelError as error:
        return [f"model.path: {line}" for line in str(error).splitlines()]
    return []


def _parallel_problems(cfg: TrainConfig, meta, vocab: int | None) -> list[str]:
    """What tensor and context parallelism need of the model (`meta`: on the meta device): a
    tensor-parallel plan this can run (transformers' own, with the family's additions) and the
    fused loss it computes the vocab-parallel cross-entropy with; attention context parallelism
    can run."""
    from hyperparallel.models import fused_loss_problem
    from hyperparallel.models.families import tensor_parallel_plan
    from hyperparallel.models.layers import config_values
    from hyperparallel.moe.block import MoEBlock
    from hyperparallel.parallel.context_parallel import context_parallel_problem
    from hyperparallel.parallel.tensor_parallel import plan_problem

    problems = []
    tp, cp = cfg.parallel.tp, cfg.parallel.cp
    family, name = get_family(cfg.model.family), cfg.model.family
    config = meta.config.get_text_config(decoder=True)
    heads = config_values(config, "num_attention_heads")  # (per layer, where the config lets them vary)
    if tp > 1:
        plan = tensor_parallel_plan(family, meta)
        problem = plan if isinstance(plan, str) else plan_problem(meta, plan, tp,
                                                                  sequence_parallel=cfg.parallel.sequence_parallel)
        if problem is not None:  # (one that names parallel.tp itself says what to change)
            problems.append(problem if problem.startswith("parallel.") else f"parallel.tp = {tp}: {name!r}: {problem}")
        elif (loss_problem := fused_loss_problem(meta)) is not None:
            problems.append(f"parallel.tp = {tp}: {name!r}: the vocab-parallel cross-entropy needs the fused loss "
                            f"head, and {loss_problem}")
    if tp > 1 and vocab is not None and vocab % tp:
        problems.append(f"parallel.tp ({tp}) must divide the vocabulary ({vocab}) of the vocab-parallel embedding and "
                        f"head; set the model's vocab_size to a multiple of {tp}")
    if tp > 1 and cfg.moe.implementation == "megamoe" and any(
            isinstance(m, MoEBlock) and m.shared_experts is not None for m in meta.modules()):
        problems.append(f"moe.implementation: megamoe with parallel.tp = {tp}: MegaMoE runs the shared experts inside "
                        f"its task graph, where tensor parallelism's collectives cannot run; use "
                        f"moe.implementation: sequential")
    if cp > 1:
        problem = family.context_parallel or context_parallel_problem(meta, cfg.data.seq_len)
        if problem is not None:
            problems.append(f"parallel.cp = {cp}: {name!r}: {problem}; use FSDP (dp_shard) and EP")
    if cp > 1 and cfg.parallel.cp_mode == "ulysses" and any(h % cp for h in heads):
        problems.append(f"parallel.cp_mode: ulysses exchanges heads for sequence: parallel.cp ({cp}) must divide the "
                        f"attention heads ({', '.join(map(str, sorted(heads)))}); use cp_mode: ring")
    return problems


def write_problems(cfg: TrainConfig, run_dir: Path) -> list[str]:
    places = [("logging.run_dir", run_dir), ("checkpoint.dir", checkpoint_root(run_dir, cfg.checkpoint.dir)),
              ("data.cache_dir", data.cache_root(cfg.data, cfg.logging.run_dir))]
    problems = []
    for what, path in places:
        if what == "checkpoint.dir" and cfg.checkpoint.dir is None and problems:
            continue  # (RUN_DIR/checkpoints: the run directory's problem is the one to fix)
        problem = unwritable(path)
        if problem:
            problems.append(f"{what}: {problem}")
    return problems


def unwritable(path: Path) -> str | None:
    """Why `path` cannot be a directory this process writes in, or None. Nothing is left behind:
    the nearest existing directory is tried with a temporary file that is gone on close."""
    path = Path(path).expanduser().absolute()
    try:
        if path.exists() and not path.is_dir():
            return f"{path} is an existing file, not a directory"
        existing = path
        while not existing.exists():
            existing = existing.parent
        if not existing.is_dir():
            return f"{path} cannot be created: {existing} is a file"
    except OSError as error:  # (a parent that cannot be searched)
        return f"{path} cannot be looked at ({error.strerror})"
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        verb = "is not writable" if existing == path else f"cannot be created: {existing} is not writable"
        return f"{path} {verb} ({os.strerror(error.errno) if error.errno else error})"
    return None
