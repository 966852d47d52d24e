"""Every mistake a user can make in a run's inputs: one `error:` line naming the fault, exit
status 2, no traceback, and nothing written (no run directory, no cache, no checkpoint), from
one process and from the ranks of `--nproc 2` alike. The command runs in this process
(tests/conftest.py's `cli`) unless ranks start."""

from __future__ import annotations

import re
from functools import partial
from pathlib import Path

import pytest

from tests.train.test_cli_train import ROOT, run, tiny_config


def files_under(root: Path) -> set[Path]:
    return {p for p in root.rglob("*")}


def fails_cleanly(cli, tmp_path: Path, *args: str, message: str, lines: int = 1) -> list[str]:
    """`hyperparallel train ARGS` through `cli` (tests/conftest.py's, in this process, or `run`'s subprocess)."""
    before = files_under(tmp_path)
    result = cli("train", *args)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and len(errors) == lines, result.stderr[-2000:]
    assert re.search(message, "\n".join(errors)), errors
    assert files_under(tmp_path) == before, sorted(map(str, files_under(tmp_path) - before))  # nothing written
    return errors


@pytest.fixture
def config(tmp_path) -> Path:
    return tiny_config(tmp_path, tmp_path / "run")


def test_a_config_that_is_not_utf8_text(cli, tmp_path):
    path = tmp_path / "binary.yaml"
    path.write_bytes(b"model:\n  family: qwen3\n\xff\xfe")
    fails_cleanly(cli, tmp_path, str(path), message=r"error: .*binary.yaml is not UTF-8 text \(byte 24\)")


def test_a_config_path_that_is_a_directory(cli, tmp_path):
    (tmp_path / "configs").mkdir()
    fails_cleanly(cli, tmp_path, str(tmp_path / "configs"), message=r"error: config .*configs is a directory; give a YAML file")


def test_a_malformed_parquet_file(cli, tmp_path, config):
    (tmp_path / "corpus.parquet").write_bytes(b"PAR1 this is not parquet")
    fails_cleanly(cli, tmp_path, str(config), "--set", "data.source=files", "--set", f"data.files={tmp_path}/corpus.parquet",
                  message=r"error: data.files: .*corpus.parquet is not a readable parquet file")


def test_a_malformed_tokenizer_file(cli, tmp_path, config):
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    fails_cleanly(cli, tmp_path, str(config), "--set", f"data.tokenizer={tmp_path}/tokenizer.json",
                  message=r"error: data.tokenizer: .*tokenizer.json is not a tokenizers JSON file")


def test_a_run_dir_that_is_an_existing_file(cli, tmp_path, config):
    (tmp_path / "taken").write_text("a file")
    fails_cleanly(cli, tmp_path, str(config), "--set", f"logging.run_dir={tmp_path}/taken",
                  message=r"error: logging.run_dir: .*taken is an existing file, not a directory")


def test_run_and_checkpoint_dirs_that_cannot_be_written(cli, tmp_path, config):
    # /sys refuses new files even to root (who may write anywhere else)
    fails_cleanly(cli, tmp_path, str(config), "--set", "logging.run_dir=/sys/hyperparallel-run",
                  message=r"error: logging.run_dir: /sys/hyperparallel-run cannot be created: /sys is not writable")
    fails_cleanly(cli, tmp_path, str(config), "--set", "checkpoint.dir=/sys/hyperparallel-checkpoints",
                  message=r"error: checkpoint.dir: /sys/hyperparallel-checkpoints cannot be created")


def test_a_model_config_mistake_is_found_before_the_tokenizer_is_trained(cli, tmp_path, config):
    fails_cleanly(cli, tmp_path, str(config), "--set", "model.config.hidden_sise=64", "--set", "model.config.num_layerz=1",
                  lines=2, message=r"(?s)error: model.config: unknown key 'hidden_sise' .*did you mean 'hidden_size'.*"
                                   r"error: model.config: unknown key 'num_layerz'")
    assert not (tmp_path / "cache").exists()  # no tokenizer, no token cache


def test_a_model_vocabulary_smaller_than_the_builtin_tokenizer(cli, tmp_path):
    fails_cleanly(cli, tmp_path, str(ROOT / "configs" / "qwen3.yaml"), "--set", "data.vocab_size=4096",
                  message=r"error: model.config.vocab_size \(512\) is smaller than the builtin tokenizer's "
                          r"data.vocab_size \(4096\); set data.vocab_size: 512")


def test_three_mistakes_are_named_together(cli, tmp_path, config):
    fails_cleanly(cli, tmp_path, str(config), "--set", "training.stepz=3", "--set", "optimizer.lr=fast",
                  "--set", "data.seq_len=2", lines=3,
                  message=r"(?s)data.seq_len: .*greater than or equal to 8.*training.stepz: unknown key; did you mean "
                          r"training.steps\?.*optimizer.lr: .*got 'fast'")


@pytest.mark.parametrize("case", ["malformed parquet", "unwritable checkpoint.dir", "three mistakes"])
def test_under_two_ranks_a_mistake_is_reported_once(cli, tmp_path, config, case):
    """Found by the launcher before any rank starts (a directory, the config; in this process) or
    inside the ranks (the data, read in full there): one line either way."""
    (tmp_path / "corpus.parquet").write_bytes(b"PAR1 this is not parquet")
    args, message, lines = {
        "malformed parquet": (["--set", "data.source=files", "--set", f"data.files={tmp_path}/corpus.parquet"],
                              r"corpus.parquet is not a readable parquet file", 1),
        "unwritable checkpoint.dir": (["--set", "checkpoint.dir=/sys/hyperparallel-checkpoints"],
                                      r"checkpoint.dir: /sys/hyperparallel-checkpoints cannot be created", 1),
        "three mistakes": (["--set", "training.stepz=3", "--set", "optimizer.lr=fast", "--set", "data.seq_len=2"],
                           r"(?s)data.seq_len.*training.stepz.*optimizer.lr", 3),
    }[case]
    if case == "malformed parquet":  # the ranks start: processes of their own, from `python -m hyperparallel`
        cli = partial(run, tmp_path=tmp_path)
    fails_cleanly(cli, tmp_path, str(config), *args, "--nproc", "2", message=message, lines=lines)


def _config(family: str, **sections):
    import yaml

    from hyperparallel.models.tiny import tiny_config_values
    from hyperparallel.train.config import from_mapping

    path = ROOT / f"configs/models/{family}_tiny.yaml"
    inline = yaml.safe_load(path.read_text()) if path.is_file() else tiny_config_values(family)
    model = {"family": family, "config": inline, **sections.pop("model", {})}
    return from_mapping({"model": model, "training": {"global_batch": 64, "micro_batch": 1}, **sections})


@pytest.mark.parametrize("family, sections, world, message", [
    ("qwen3_moe", {"parallel": {"ep": 2}}, 2,
     r"parallel.ep = 2 borrows its ranks from parallel.dp_shard = 1 x parallel.cp = 1: that product must be a "
     r"multiple of ep .* with 2 rank\(s\): dp_shard: 2 and ep one of \[2\]"),
    ("qwen3_moe", {"parallel": {"ep": 3, "dp_shard": 8}}, 8, r"parallel.dp_shard = 8 x .* ep one of \[2, 4, 8\]"),
    ("qwen3_moe", {"moe": {"implementation": "megamoe"}, "parallel": {"dp_shard": 2}}, 2,
     r"moe.implementation: megamoe overlaps the all-to-alls of expert parallelism, and parallel.ep is 1"),
    ("deepseek_v4", {"model": {"attn_implementation": "sdpa"}}, 1,
     r"model.attn_implementation: sdpa: transformers' deepseek_v4 supports eager only; use auto"),
    ("qwen3_moe", {"parallel": {"ep": 4, "dp_shard": 2, "dp_replicate": 2}}, 4,
     r"parallel.ep = 4 borrows its ranks from parallel.dp_shard = 2 x parallel.cp = 1 within each of "
     r"parallel.dp_replicate = 2 replicas: .* with 4 rank\(s\): ep one of \[2\]$"),
    ("qwen3_moe", {"moe": {"waves": 2}, "parallel": {"dp_shard": 2, "ep": 2}}, 2,
     r"moe.waves = 2 sets MegaMoE's expert waves, and moe.implementation is sequential; set moe.implementation: "
     r"megamoe, or leave moe.waves null"),
])
def test_expert_layout_mistakes_are_named(family, sections, world, message):
    from hyperparallel.train.preflight import layout_problems

    problems = layout_problems(_config(family, **sections), world)
    assert len(problems) == 1 and re.search(message, problems[0]), problems


@pytest.mark.parametrize("sections, world, message", [
    ({"parallel": {"tp": 2, "dp_shard": 2}}, 2,
     r"parallel.dp_replicate \(1\) x parallel.dp_shard \(2\) x parallel.cp \(1\) x parallel.tp \(2\) = 4 ranks, but "
     r"this run has 2; make their product 2, or launch hyperparallel train --nproc 4"),
    ({"parallel": {"dp_replicate": 2, "dp_shard": 2}}, 8,
     r"parallel.dp_replicate \(2\) x parallel.dp_shard \(2\) x parallel.cp \(1\) x parallel.tp \(1\) = 4 ranks, but "
     r"this run has 8; make their product 8, or launch hyperparallel train --nproc 4"),
    ({"parallel": {"dp_shard": 2}}, 4,
     r"parallel.dp_shard = 2 shards the model over that many ranks, but this run has 4; launch it with "
     r"hyperparallel train --nproc 2, or parallel.dp_replicate: 2 to replicate that sharding over the 4 ranks \(HSDP\)"),
    ({"parallel": {"tp": 2, "cp": 2}}, 4, r"parallel.tp = 2 with parallel.cp = 2: .* not supported yet"),
    ({"parallel": {"sequence_parallel": True}}, 1, r"parallel.sequence_parallel .* parallel.tp is 1"),
    ({"parallel": {"cp": 3}, "data": {"seq_len": 256}}, 3,
     r"parallel.cp = 3: data.seq_len \(256\) must divide by 2 x cp = 6"),
    ({"parallel": {"tp": 2}, "training": {"global_batch": 64, "micro_batch": 1, "fused_loss": False}}, 2,
     r"parallel.tp = 2 needs training.fused_loss: true"),
    ({"parallel": {"tp": 2}, "optimizer": {"name": "muon"}}, 2, r"optimizer.name: muon with parallel.tp = 2"),
    ({"parallel": {"tp": 2}, "training": {"global_batch": 3, "micro_batch": 1}}, 4,
     r"global_batch \(3\) must be a multiple of training.micro_batch \(1\) x data-parallel ranks \(4 ranks / tp "
     r"x cp 2 = 2\) = 2"),
])
def test_parallel_layout_mistakes_are_named(sections, world, message):
    from hyperparallel.train.preflight import layout_problems

    problems = layout_problems(_config("qwen3", **sections), world)
    assert any(re.search(message, p) for p in problems), problems


@pytest.mark.parametrize("parallel, world", [
    ({"dp_replicate": 2, "dp_shard": 2}, 4),
    ({"dp_replicate": 4}, 4),  # pure replication: shard groups of one rank, gradients all-reduced
    ({"dp_replicate": 2, "tp": 2}, 4),
    ({"dp_replicate": 2, "dp_shard": 2, "ep": 2}, 4),
    ({"dp_replicate": 2, "cp": 2, "ep": 2}, 4),  # ep borrows from dp_shard x cp = 2 within each replica
])
def test_hsdp_layouts_whose_product_is_the_world_pass(parallel, world):
    from hyperparallel.train.preflight import layout_problems

    assert layout_problems(_config("qwen3_moe", parallel=parallel), world) == []


@pytest.mark.parametrize("family, parallel, message", [
    ("qwen3", {"tp": 8, "dp_shard": 1}, r"parallel.tp \(8\) must divide the attention heads \(num_attention_heads = 4\)"),
    ("qwen3", {"tp": 2, "cp": 1, "dp_shard": 1}, None),  # 4 heads, 2 kv heads, vocab 512: fits
    ("qwen3", {"cp": 8, "cp_mode": "ulysses"}, r"parallel.cp_mode: ulysses .* parallel.cp \(8\) must divide the "
                                                 r"attention heads \(4\); use cp_mode: ring"),
    ("kimi_k2", {"tp": 2, "dp_shard": 2, "ep": 2}, None),
    ("deepseek_v3", {"tp": 2, "dp_shard": 2, "ep": 2}, None),
    ("qwen3", {"ep": 2, "dp_shard": 2}, r"parallel.ep = 2 splits the experts of MoE layers, and 'qwen3' has none"),
    ("deepseek_v4", {"tp": 2}, r"parallel.tp = 2: 'deepseek_v4': its compressed sparse attention and "
                               r"hyper-connections have no tensor-parallel plan"),
    ("deepseek_v4", {"cp": 2}, r"parallel.cp = 2: 'deepseek_v4': its compressed sparse attention with sinks is "
                               r"transformers' eager code alone; use FSDP \(dp_shard\) and EP"),
    ("gpt2", {"tp": 2}, r"parallel.tp = 2: 'gpt2': transformers declares no tensor-parallel plan for it"),
    ("gemma2", {"tp": 2}, r"parallel.tp = 2: 'gemma2': the vocab-parallel cross-entropy needs the fused loss head, and "
                          r"its forward rewrites the head's logits \(scales or soft-caps them\) first"),
    ("mamba", {"cp": 2}, r"parallel.cp = 2: 'mamba': decoder layer 0 mixes tokens with MambaMixer too, which runs "
                         r"over the whole sequence"),
    ("llama", {"tp": 8}, r"parallel.tp \(8\) must divide the attention heads"),
    ("mixtral", {"tp": 2, "dp_shard": 2, "ep": 2}, None),
    ("qwen3_next", {"tp": 2, "sequence_parallel": True},
     r"parallel.sequence_parallel: model.layers.0.linear_attn \(Qwen3NextGatedDeltaNet\) mixes tokens outside the "
     r"blocks the tensor-parallel plan splits"),
    ("mistral", {"cp": 2}, r"parallel.cp = 2: 'mistral': MistralAttention \(decoder layer 0\) attends in a sliding "
                           r"window \(sliding_window = 16\) shorter than the sequence \(data.seq_len = 256\)"),
    ("gpt2", {"cp": 2}, None),  # (its attention has no num_key_value_groups: found by the interface it calls)
    ("doge", {"cp": 2}, r"parallel.cp = 2: 'doge': DogeAttention \(decoder layer 0\) hands the attention a mask of its "
                        r"own \(attn_mask\)"),
    ("blt", {"cp": 2}, r"parallel.cp = 2: 'blt': BltCrossAttention \(model.local_encoder.cross_attn_layers.0\) is not "
                       r"causal"),
])
def test_parallel_model_mistakes_are_named(family, parallel, message):
    from hyperparallel.train.preflight import model_problems

    problems = model_problems(_config(family, parallel=parallel), None)
    if message is None:
        assert problems == []
    else:
        assert len(problems) == 1 and re.search(message, problems[0]), problems


@pytest.mark.parametrize("family, config, message", [
    ("falcon", {"hidden_size": 64, "num_attention_heads": 5, "num_hidden_layers": 2},
     r"^model.config: transformers' FalconForCausalLM cannot be built from this config \(model_type 'falcon'\): "
     r"`hidden_size` must be divisible by num_heads"),
    ("xlnet", {}, r"^model type 'xlnet' is a model whose forward does not compute transformers' causal-LM loss "
              r"\(XLNetLMHeadModel.forward"),
    ("llama", {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 3},
     r"^model.config: invalid inline config for family 'llama': num_attention_heads \(4\) must be a positive multiple "
     r"of num_key_value_heads \(3\)$"),
    ("gpt2", {"n_embd": 64, "n_head": 0},
     r"^model.config: transformers' GPT2LMHeadModel cannot be built from this config \(model_type 'gpt2'\): "
     r"ZeroDivisionError"),
])
def test_models_transformers_refuses_or_the_trainer_cannot_train_are_named(family, config, message):
    from hyperparallel.train.config import from_mapping
    from hyperparallel.train.preflight import model_problems

    cfg = from_mapping({"model": {"family": family, "config": config}, "training": {"global_batch": 64,
                                                                                    "micro_batch": 1}})
    problems = model_problems(cfg, None)
    assert len(problems) == 1 and re.search(message, problems[0]) and "\n" not in problems[0], problems


def test_document_masks_on_a_model_whose_documents_would_see_each_other_are_refused():
    from hyperparallel.train.config import from_mapping
    from hyperparallel.train.preflight import data_problems, document_mask

    def config(family: str, mask: bool | None):
        return from_mapping({"model": {"family": family, "config": {"hidden_size": 64, "num_hidden_layers": 2}},
                             "data": {"document_mask": mask}})

    assert document_mask(config("llama", None)) == (True, None)
    on, reason = document_mask(config("mamba", None))  # (null: off, and why)
    assert not on and reason == ("model 'mamba': decoder layer 0's MambaMixer carries its state along the whole row, "
                                 "whatever the positions say")
    assert data_problems(config("mamba", True)) == [
        f"data.document_mask: {reason}, so packed documents would see each other; set data.document_mask: false (or "
        f"null: masks wherever supported), or data.packing: false"]


def test_balancing_a_router_without_a_correction_bias_by_bias_is_named():
    from hyperparallel.train.preflight import model_problems

    for family in ("qwen3_moe", "mixtral"):
        cfg = _config(family, moe={"load_balance": "bias"})
        assert model_problems(cfg, None) == [f"moe.load_balance: bias moves a router's correction bias, and "
                                             f"the routers of {family!r} have none; use aux_loss or none"]
    cfg = _config("glm4_moe", moe={"load_balance": "aux_loss"})  # (DeepSeek-V3's routers; no aux loss of its own)
    assert model_problems(cfg, None) == ["moe.load_balance: aux_loss: transformers' Glm4MoeForCausalLM adds no "
                                         "auxiliary loss of its own (its config has no router_aux_loss_coef); use "
                                         "bias or none"]


def test_megamoe_with_tensor_parallel_shared_experts_is_named():
    from hyperparallel.train.preflight import model_problems

    cfg = _config("kimi_k2", parallel={"tp": 2, "dp_shard": 2, "ep": 2}, moe={"implementation": "megamoe"})
    assert any("moe.implementation: megamoe with parallel.tp = 2" in p for p in model_problems(cfg, None))


def test_more_expert_ranks_than_experts_is_named():
    from hyperparallel.train.preflight import model_problems

    cfg = _config("qwen3_moe", parallel={"ep": 32, "dp_shard": 32})  # the tiny model has 16 experts
    assert model_problems(cfg, None) == ["parallel.ep = 32 needs at least one expert per rank, and the model has 16 "
                                         "experts per MoE layer; use ep <= 16"]


def test_more_megamoe_waves_than_a_rank_has_experts_is_named():
    from hyperparallel.train.preflight import model_problems

    cfg = _config("qwen3_moe", parallel={"ep": 4, "dp_shard": 4}, moe={"implementation": "megamoe", "waves": 5})
    assert model_problems(cfg, None) == ["moe.waves = 5: a wave is a group of one rank's experts, and with 16 experts "
                                         "over parallel.ep = 4 ranks a rank holds at most 4; use moe.waves <= 4 (or null)"]


def test_expert_parallelism_of_a_dense_family_without_sharding(cli, tmp_path, config):
    fails_cleanly(cli, tmp_path, str(config), "--set", "parallel.ep=2", "--nproc", "2", lines=2,
                  message=r"parallel.ep = 2 borrows its ranks from parallel.dp_shard = 1(.|\n)*'qwen3' has none")


def test_model_path_files_that_do_not_fit_the_model_are_named_before_any_rank_starts(cli, tmp_path, config):
    """The safetensors' headers against the model its config.json describes, in the preflight:
    each missing and each mis-shaped tensor a line, before anything is built or read."""
    import torch
    from safetensors.torch import load_file, save_file

    from hyperparallel.models import build_model

    hf = tmp_path / "hf"
    build_model("qwen3", config=yaml_config("qwen3")).save_pretrained(hf)
    tensors = load_file(hf / "model.safetensors")
    del tensors["model.norm.weight"]
    tensors["model.layers.1.self_attn.q_proj.weight"] = torch.zeros(64, 32)
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    fails_cleanly(cli, tmp_path, str(config), "--set", "model.config=null", "--set", f"model.path={hf}",
                  "--set", "data.tokenizer=builtin", lines=2,  # (hf has no tokenizer.json: its own error otherwise)
                  message=rf"(?s)error: model.path: checkpoint {hf}: model.layers.1.self_attn.q_proj.weight is "
                          rf"\(64, 64\) in the model but \(64, 32\) in the files.*"
                          rf"error: model.path: checkpoint {hf}: model.norm.weight is missing from the files")


@pytest.mark.parametrize("what", ["checkpoint", "run directory"])
def test_a_training_checkpoint_or_run_as_model_path_names_export_and_resume(cli, tmp_path, what):
    """model.path is a Hugging Face directory; a trainer's checkpoint or run directory there gets
    one line naming `hyperparallel export` (to fine-tune from it) and checkpoint.resume."""
    run_dir = tmp_path / "old_run"
    step = run_dir / "checkpoints" / "step_00000004"
    step.mkdir(parents=True)
    (step / "checkpoint.json").write_text("{}")
    (run_dir / "config.yaml").write_text("model: {family: qwen3}\n")
    given = step if what == "checkpoint" else run_dir
    fails_cleanly(cli, tmp_path, str(ROOT / "configs" / "qwen3.yaml"), "--set", f"model.path={given}",
                  message=rf"^error: model.path {given} is a training {what}, not a Hugging Face model directory: "
                          rf"`hyperparallel export {step} OUT_DIR` writes .*to fine-tune from \(model.path: OUT_DIR\), "
                          rf"and checkpoint.resume: {step} continues")


def yaml_config(family: str) -> dict:
    import yaml

    return yaml.safe_load((ROOT / f"configs/models/{family}_tiny.yaml").read_text())


def test_dvm_on_cuda_gpus_is_refused_before_any_work():
    from hyperparallel.train.preflight import compile_problems

    dvm = _config("qwen3", training={"compile": "dvm"})
    assert compile_problems(dvm, cuda=False) == []
    (problem,) = compile_problems(dvm, cuda=True)
    assert problem.startswith("training.compile: dvm runs its fused kernels on the CPU") and "inductor" in problem
    assert compile_problems(_config("qwen3", training={"compile": "inductor"}), cuda=True) == []


def test_a_compiler_this_install_or_machine_lacks_is_refused_before_any_work(monkeypatch):
    """No DVM build (a source install without a C compiler), or no C++ compiler for Inductor's CPU
    code: each named, with the setting that runs instead."""
    from hyperparallel.kernels import native
    from hyperparallel.train.preflight import compile_problems

    dvm, inductor = (_config("qwen3", training={"compile": c}) for c in ("dvm", "inductor"))
    assert compile_problems(dvm, cuda=False) == compile_problems(inductor, cuda=False) == []  # (this machine: both)
    monkeypatch.setattr(native, "not_built", lambda: ["hyperparallel._dvm_native"])
    (problem,) = compile_problems(dvm, cuda=False)
    assert problem.startswith("training.compile: dvm runs the DVM's native interpreter, which this install has no "
                              "build of") and problem.endswith("use training.compile: none (or inductor)")
    monkeypatch.delenv("TORCH_INDUCTOR_INSTALL_GXX", raising=False)
    monkeypatch.setenv("CXX", "no-such-compiler")
    (problem,) = compile_problems(inductor, cuda=False)
    assert problem == ("training.compile: inductor compiles C++ for the CPU, and this machine has no C++ compiler "
                       "($CXX, else g++); use training.compile: none")
    assert compile_problems(inductor, cuda=True) == []  # (on GPUs it compiles Triton)
