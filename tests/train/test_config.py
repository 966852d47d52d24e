"""Config validation: valid files load, each kind of mistake names the key or the file."""

from __future__ import annotations

import pytest

from hyperparallel.errors import ConfigError
from hyperparallel.train import examples
from hyperparallel.train.config import DEFAULT_CONFIG, apply_overrides, config_path, load_config

MINIMAL = "model:\n  family: qwen3\n  config: {hidden_size: 64}\n"


def write(tmp_path, text: str):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_the_default_config_is_valid():
    cfg = load_config()
    assert cfg.model.family == "qwen3_moe" and cfg.data.source == "stdlib"
    assert cfg.grad_accumulation(1) == cfg.training.global_batch // cfg.training.micro_batch


def test_defaults_fill_every_section(tmp_path):
    cfg = load_config(write(tmp_path, MINIMAL))
    assert cfg.optimizer.name == "adamw" and cfg.parallel.recompute == "off" and cfg.checkpoint.resume == "none"


def test_overrides_parse_yaml_scalars_and_reach_nested_keys(tmp_path):
    cfg = load_config(write(tmp_path, MINIMAL), ["training.steps=7", "model.dtype=bfloat16",
                                                 "optimizer.betas=[0.8, 0.9]", "model.config.num_hidden_layers=3"])
    assert cfg.training.steps == 7 and cfg.model.dtype == "bfloat16" and cfg.optimizer.betas == (0.8, 0.9)
    assert cfg.model.config["num_hidden_layers"] == 3


def test_grad_accumulation_is_derived_and_checked(tmp_path):
    cfg = load_config(write(tmp_path, MINIMAL), ["training.global_batch=12", "training.micro_batch=3"])
    assert cfg.grad_accumulation(1) == 4 and cfg.grad_accumulation(2) == 2
    with pytest.raises(ConfigError, match=r"training.global_batch \(12\) must be a multiple .* \(3\) x ranks \(3\)"):
        cfg.grad_accumulation(3)


BAD = [
    ("model: [unclosed", r"malformed YAML at line 1"),
    ("- a\n- b\n", r"top level must be a mapping"),
    (MINIMAL + "trainig: {steps: 3}\n", r"trainig: unknown key; did you mean training\?"),
    (MINIMAL + "training: {stepz: 3}\n", r"training.stepz: unknown key; did you mean training.steps\?"),
    (MINIMAL + "checkpoint: {asynk: true}\n", r"checkpoint.asynk: unknown key; did you mean checkpoint.async\?"),
    ("data: {}\n", r"model: missing"),
    ("model: {config: {hidden_size: 64}}\n", r"model.family is auto, and the inline model.config has no model_type"),
    ("model: {family: qwen3}\n", r"exactly one of model.path .* or model.config"),
    ("model: {family: qwen3, path: x, config: {}}\n", r"exactly one of model.path"),
    (MINIMAL + "training: {steps: many}\n", r"training.steps: .*got 'many'"),
    (MINIMAL + "training: {steps: 0}\n", r"training.steps: .*greater than or equal to 1"),
    (MINIMAL + "training: {mixed_precision: fp16}\n", r"training.mixed_precision: .*got 'fp16'"),
    (MINIMAL + "training: {compile: tvm}\n", r"training.compile: .*got 'tvm'"),
    (MINIMAL + "training: {fused_loss: maybe}\n", r"training.fused_loss"),
    (MINIMAL + "model2: 1\n", r"model2: unknown key"),
    (MINIMAL + "data: {validation: 0.9}\n", r"data.validation: a held-out fraction is a number in \(0, 0.5\], got 0.9"),
    (MINIMAL + "training: {eval_batches: 0}\n", r"training.eval_batches: .*greater than or equal to 1"),
    ("model: {family: qwen3, config: nowhere.yaml}\n", r"model.config: cannot read the model config file .*nowhere.yaml"),
    ("model: {path: /nonexistent-model}\n", r"model.path /nonexistent-model is not a directory; give a local Hugging Face"),
    (MINIMAL + "parallel: {cp_mode: striped}\n", r"parallel.cp_mode: .*got 'striped'"),
    (MINIMAL + "parallel: {tp: 0}\n", r"parallel.tp: .*greater than or equal to 1"),
    (MINIMAL + "parallel: {dp_shard: 0}\n", r"parallel.dp_shard: .*greater than or equal to 1"),
    (MINIMAL + "parallel: {dp_replicate: 0}\n", r"parallel.dp_replicate: .*greater than or equal to 1"),
    (MINIMAL + "parallel: {shard_geometry: even}\n", r"parallel.shard_geometry: .*got 'even'"),
    (MINIMAL + "parallel: {align: 0}\n", r"parallel.align: .*greater than or equal to 1"),
    (MINIMAL + "parallel: {recompute: some}\n", r"parallel.recompute: .*got 'some'"),
    (MINIMAL + "low_precision: {format: mxfp4}\n", r"low_precision.format: .*got 'mxfp4'"),
    (MINIMAL + "low_precision: {wgrad: fp8}\n", r"low_precision.wgrad"),
    (MINIMAL + "optimizer: {name: sgd}\n", r"optimizer.name: .*got 'sgd'"),
    (MINIMAL + "optimizer: {lr: -1}\n", r"optimizer: lr must be a finite number >= 0, got -1"),
    (MINIMAL + "optimizer: {name: muon, momentum: 1.5}\n", r"optimizer: momentum must be a number in \[0, 1\), got 1.5"),
    (MINIMAL + "optimizer: {ns_steps: 0, name: muon}\n", r"optimizer: ns_steps must be an integer in \[1, 99\]"),
    (MINIMAL + "scheduler: {min_lr_ratio: 2}\n", r"scheduler: min_lr_ratio must be a number in \[0, 1\]"),
    (MINIMAL + "training: {timeout_s: 0}\n", r"training.timeout_s: .*greater than 0"),
    (MINIMAL + "checkpoint: {async: maybe}\n", r"checkpoint.async: .*got 'maybe'"),
    (MINIMAL + "scheduler: {kind: step}\n", r"scheduler.kind"),
    (MINIMAL + "training: {steps: 5}\nscheduler: {warmup_steps: 9}\n", r"warmup_steps \(9\) exceeds training.steps"),
    (MINIMAL + "data: {source: files}\n", r"data.source is 'files' but data.files is empty"),
    (MINIMAL + "data: {seq_len: 2}\n", r"data.seq_len"),
    (MINIMAL + "logging: {run_dir: 'runs/{name}'}\n", r"only placeholder allowed is \{time\}"),
    (MINIMAL + "checkpoint: {keep_last: 0}\n", r"checkpoint.keep_last"),
    (MINIMAL + "moe: {load_balance: auxloss}\n", r"moe.load_balance: .*got 'auxloss'"),
    (MINIMAL + "moe: {aux_loss_coef: -1}\n", r"moe.aux_loss_coef: .*greater than or equal to 0"),
    (MINIMAL + "moe: {bias_rate: 0.1}\n", r"moe.bias_rate: unknown key; did you mean moe.bias_update_rate\?"),
    (MINIMAL + "parallel: {ep: 0}\n", r"parallel.ep: .*greater than or equal to 1"),
]


@pytest.mark.parametrize("text, message", BAD, ids=[m for _, m in BAD])
def test_each_mistake_is_named(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, text))


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"config file .*nope.yaml does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_a_directory_or_a_binary_file_is_named_as_such(tmp_path):
    with pytest.raises(ConfigError, match=r"config .* is a directory; give a YAML file"):
        load_config(tmp_path)
    binary = tmp_path / "c.yaml"
    binary.write_bytes(b"model: \xff\xfe\x00")
    with pytest.raises(ConfigError, match=r"c.yaml is not UTF-8 text \(byte 8\)"):
        load_config(binary)


def test_every_mistake_is_listed_at_once_one_per_line(tmp_path):
    text = MINIMAL + "training: {stepz: 3, global_batch: 0}\noptimizer: {lr: fast}\n"
    with pytest.raises(ConfigError) as error:
        load_config(write(tmp_path, text))
    assert str(error.value).splitlines() == [
        "training.global_batch: Input should be greater than or equal to 1 (got 0)",
        "training.stepz: unknown key; did you mean training.steps?",
        "optimizer.lr: Input should be a valid number, unable to parse string as a number (got 'fast')",
    ]


def test_the_built_in_defaults_are_those_of_the_default_config():
    """A config that leaves a section out gets what configs/default.yaml says: the demo's values."""
    from hyperparallel.train.config import TrainConfig

    shipped = load_config()
    built_in = TrainConfig(model=shipped.model)
    assert shipped.model_dump() == built_in.model_dump()


def test_the_components_configs_are_the_sections_and_hold_the_defaults_docs_train_md_names():
    """The optimizer, scheduler, MoE, kernels and low-precision sections are the components' own
    configs (each default written once, where it is read), and every default the YAML reference
    in docs/train.md writes out (`key` (value...)) is the schema's."""
    import re
    from pathlib import Path

    import yaml

    from hyperparallel.lowp.config import LowPrecisionConfig
    from hyperparallel.models.kernels import KernelsConfig
    from hyperparallel.moe.config import MoEConfig
    from hyperparallel.optim import OptimizerConfig, SchedulerConfig
    from hyperparallel.train.config import TrainConfig

    fields = TrainConfig.model_fields
    assert (fields["optimizer"].annotation, fields["scheduler"].annotation, fields["moe"].annotation,
            fields["kernels"].annotation, fields["low_precision"].annotation) == (
        OptimizerConfig, SchedulerConfig, MoEConfig, KernelsConfig, LowPrecisionConfig)
    doc = (Path(__file__).resolve().parents[2] / "docs" / "train.md").read_text()
    table = doc.split("| section | keys |", 1)[1].split("\n\n", 1)[0]
    checked = []
    for line in table.splitlines()[2:]:
        name, keys = line.strip().strip("|").split(" | ", 1)
        section = fields[name.strip().strip("`")].annotation
        defaults = {field.alias or key: field.default for key, field in section.model_fields.items()}
        for key, value in re.findall(r"`(\w+)` \((true|false|null|-?\d[\d.e+-]*)[);:]", keys):
            assert defaults[key] == yaml.safe_load(value), f"docs/train.md: {name.strip()} {key} ({value})"
            checked.append(key)
    assert {"bias_update_rate", "mega_gate", "warmup_steps", "eval_every"} <= set(checked)


def test_model_config_may_name_a_mapping_file_beside_the_config(tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "tiny.yaml").write_text("hidden_size: 64\nnum_hidden_layers: 1\n")
    cfg = load_config(write(tmp_path, "model: {family: qwen3, config: models/tiny.yaml}\n"))
    assert cfg.model.config == {"hidden_size": 64, "num_hidden_layers": 1}


def test_data_files_not_found_where_the_command_runs_are_looked_for_beside_the_config(tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.jsonl").write_text('{"text": "x"}\n')
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "data").mkdir(parents=True)
    (elsewhere / "data" / "mine.jsonl").write_text('{"text": "y"}\n')
    monkeypatch.chdir(elsewhere)
    config = write(tmp_path, MINIMAL + "data: {source: files, files: data/a.jsonl, validation: [data/*.jsonl]}\n")
    cfg = load_config(config)
    # validation's glob matches where the command runs (data/mine.jsonl): as written
    assert cfg.data.files == [str(tmp_path / "data/a.jsonl")] and cfg.data.validation == ["data/*.jsonl"]
    # the command line's value is never moved
    assert load_config(config, ["data.files=data/a.jsonl"]).data.files == ["data/a.jsonl"]
    # found nowhere: as written (the data check names it)
    assert load_config(write(tmp_path, MINIMAL + "data: {source: files, files: other.txt}\n")).data.files == ["other.txt"]


def test_an_example_config_is_taken_by_its_name_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("qwen3_moe", "qwen3_moe.yaml"):
        assert config_path(name) == examples.DIRECTORY / "qwen3_moe.yaml"
    chat = load_config("chat")  # its model shape and its data beside it, inside the package
    assert chat.model.config["hidden_size"] > 0 and chat.data.files == [str(examples.DIRECTORY / "data" / "same_answer_chats.jsonl")]
    assert {"default", "qwen3_moe", "deepseek_v4", "chat"} <= set(examples.names())
    # a file of that name where the command runs is the user's: it comes first
    (tmp_path / "qwen3_moe.yaml").write_text(MINIMAL)
    assert config_path("qwen3_moe.yaml").resolve() == tmp_path / "qwen3_moe.yaml"
    with pytest.raises(ConfigError, match=r"^config file qwen4 does not exist, and no example config has that name "
                                          r"\(the examples: chat, .*qwen3_moe\)$"):
        config_path("qwen4")


def test_the_family_is_read_from_model_path_or_the_inline_model_type(tmp_path):
    """model.family: auto (the default) is the model_type of model.path's config.json or of the
    inline config: any transformers type, checked (with the rest of the model) by preflight."""
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text('{"model_type": "deepseek_v3"}')
    assert load_config(write(tmp_path, f"model: {{path: {tmp_path / 'hf'}}}\n")).model.family == "deepseek_v3"
    (tmp_path / "hf" / "config.json").write_text('{"model_type": "llama"}')
    assert load_config(write(tmp_path, f"model: {{path: {tmp_path / 'hf'}}}\n")).model.family == "llama"
    assert load_config(write(tmp_path, "model: {config: {model_type: mixtral}}\n")).model.family == "mixtral"
    (tmp_path / "hf" / "config.json").write_text('{"hidden_size": 8}')
    with pytest.raises(ConfigError, match=r"config.json names no model_type to infer it from; give model.family"):
        load_config(write(tmp_path, f"model: {{path: {tmp_path / 'hf'}}}\n"))


def _hf_directory(path, model_type="qwen3_moe", tokenizer=True):
    path.mkdir()
    (path / "config.json").write_text(f'{{"model_type": "{model_type}"}}')
    if tokenizer:
        (path / "tokenizer.json").write_text("{}")
    return path


def test_model_path_on_the_command_line_replaces_an_example_configs_model_and_builtin_tokenizer(tmp_path):
    """configs/qwen3.yaml has model.family, model.config and data.tokenizer: builtin; --set
    model.path=DIR fine-tunes DIR's model (its family from config.json) with DIR's tokenizer, and
    says so in one line. Keys the command line sets itself stay as it sets them."""
    hf = _hf_directory(tmp_path / "hf")
    example = DEFAULT_CONFIG.parent / "qwen3.yaml"
    notes = []
    cfg = load_config(example, [f"model.path={hf}"], notes)
    assert (cfg.model.path, cfg.model.config, cfg.model.family, cfg.data.tokenizer) == (str(hf), None, "qwen3_moe", None)
    assert notes == [f"model.path {hf} from the command line replaces the config's model.config, model.family, "
                     f"data.tokenizer: builtin (its own tokenizer instead)"]
    notes = []
    cfg = load_config(example, [f"model.path={hf}", "data.tokenizer=builtin", "model.family=qwen3_moe"], notes)
    assert (cfg.data.tokenizer, notes) == ("builtin", [f"model.path {hf} from the command line replaces the "
                                                       f"config's model.config"])
    bare = _hf_directory(tmp_path / "bare", tokenizer=False)  # no tokenizer of its own: the builtin one stays
    assert load_config(example, [f"model.path={bare}"]).data.tokenizer == "builtin"
    notes = []
    load_config(DEFAULT_CONFIG, ["training.steps=3"], notes)
    assert notes == []


def test_data_files_and_validation_take_one_path_or_a_list(tmp_path):
    cfg = load_config(write(tmp_path, MINIMAL + "data: {source: files, files: a.txt, validation: b.txt}\n"))
    assert cfg.data.files == ["a.txt"] and cfg.data.validation == ["b.txt"]
    assert load_config(write(tmp_path, MINIMAL + "data: {validation: null}\n")).data.validation is None


@pytest.mark.parametrize("item, message", [
    ("training.steps", r"expected KEY=VALUE"),
    ("=3", r"expected KEY=VALUE"),
    ("a..b=1", r"expected KEY=VALUE"),
    ("training.steps.x=1", r"'steps' is not a section"),
    ("training.steps=[1", r"not valid YAML"),
])
def test_bad_overrides_are_named(item, message):
    with pytest.raises(ConfigError, match=message):
        apply_overrides({"training": {"steps": 3}}, [item])


def test_the_embedded_default_is_the_shipped_file():
    assert DEFAULT_CONFIG.name == "default.yaml" and DEFAULT_CONFIG.is_file()


def test_a_bare_yaml_off_means_off(tmp_path):
    assert load_config(write(tmp_path, MINIMAL + "parallel: {recompute: off}\n")).parallel.recompute == "off"


def test_the_choices_are_those_of_the_registries_that_implement_them():
    from typing import get_args

    from hyperparallel.checkpoint.model_card import DTYPES
    from hyperparallel.fsdp import GEOMETRIES
    from hyperparallel.lowp.config import LowPrecisionConfig
    from hyperparallel.models.compile import BACKENDS
    from hyperparallel.moe.config import MoEConfig
    from hyperparallel.mx.format import SCALE_MODES
    from hyperparallel.optim import OPTIMIZER_NAMES, SCHEDULE_KINDS, OptimizerConfig, SchedulerConfig
    from hyperparallel.parallel import RECOMPUTE_MODES
    from hyperparallel.train import config

    def choices(section, key):
        return set(get_args(section.model_fields[key].annotation))

    assert choices(config.ModelSection, "dtype") == set(DTYPES)
    assert choices(config.TrainingSection, "compile") == set(BACKENDS)
    assert choices(config.ParallelSection, "shard_geometry") == set(GEOMETRIES)
    assert choices(config.ParallelSection, "recompute") == set(RECOMPUTE_MODES)
    assert choices(OptimizerConfig, "name") == set(OPTIMIZER_NAMES)
    assert choices(SchedulerConfig, "kind") == set(SCHEDULE_KINDS)
    assert choices(LowPrecisionConfig, "scale_mode") == set(SCALE_MODES)
    from hyperparallel.moe import LOAD_BALANCE

    rule = MoEConfig.model_fields["load_balance"].annotation  # Literal[...] | None (the family's)
    assert {v for arg in get_args(rule) for v in get_args(arg)} == set(LOAD_BALANCE)


def test_the_fingerprint_ignores_how_a_run_is_laid_out_computed_and_waited_for(tmp_path):
    """What a resumed run may change without its checkpoint being refused, and what it may not."""
    base = load_config(write(tmp_path, MINIMAL)).fingerprint()
    for item in ("logging.run_dir=elsewhere", "checkpoint.every=5", "training.timeout_s=1200", "training.compile=none",
                 "training.fused_loss=false", "training.steps=500", "training.micro_batch=1", "checkpoint.async=true",
                 "parallel.dp_shard=2", "logging.every=1", "training.eval_every=7", "training.eval_batches=2"):
        assert load_config(write(tmp_path, MINIMAL), [item]).fingerprint() == base, item
    for item in ("optimizer.lr=0.5", "training.seed=3", "data.seq_len=64", "model.dtype=bfloat16",
                 "data.validation=0.1", "scheduler.warmup_steps=3"):
        assert load_config(write(tmp_path, MINIMAL), [item]).fingerprint() != base, item


def test_the_differences_of_two_configs_name_their_keys(tmp_path):
    from hyperparallel.train.checkpointing import differences

    before = load_config(write(tmp_path, MINIMAL)).fingerprinted()
    after = load_config(write(tmp_path, MINIMAL), ["optimizer.lr=0.5", "model.config.num_hidden_layers=3"]).fingerprinted()
    assert differences(before, after) == ["model.config: num_hidden_layers '(absent)' -> 3", "optimizer.lr: 0.003 -> 0.5"]
