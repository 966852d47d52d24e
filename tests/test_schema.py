"""hyperparallel.schema: a component's config built in code names every mistake at once, as a
ConfigError; inside the trainer's config the same mistakes are listed under their full keys."""

from __future__ import annotations

import pytest

from hyperparallel.errors import ConfigError
from hyperparallel.optim import OptimizerConfig
from hyperparallel.train.config import from_mapping


def test_a_config_built_in_code_names_every_mistake_as_a_config_error():
    with pytest.raises(ConfigError) as error:
        OptimizerConfig(betaz=(0.9, 0.9), ns_steps="many")
    assert str(error.value).splitlines() == [
        "ns_steps: Input should be a valid integer, unable to parse string as an integer (got 'many')",
        "betaz: unknown key; did you mean betas?",
    ]
    with pytest.raises(ConfigError, match=r"^lr must be a finite number >= 0, got -1.0$"):
        OptimizerConfig(lr=-1)


def test_inside_the_trainers_config_the_same_mistakes_keep_their_full_keys():
    raw = {"model": {"family": "qwen3", "config": {}}, "optimizer": {"betaz": 1, "lr": "fast"}}
    with pytest.raises(ConfigError) as error:
        from_mapping(raw)
    assert str(error.value).splitlines() == [
        "optimizer.lr: Input should be a valid number, unable to parse string as a number (got 'fast')",
        "optimizer.betaz: unknown key; did you mean optimizer.betas?",
    ]
