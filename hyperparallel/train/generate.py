"""Sample text from a trained model: a training checkpoint or an exported Hugging Face directory.

A checkpoint (RUN_DIR/checkpoints/step_N, saved by any number of ranks in any layout) is rebuilt
from its model card and loaded whole into this process, as `hyperparallel export` does, with the
run's tokenizer.json; a Hugging Face directory (what export writes) is loaded with
`from_pretrained`, with the tokenizer.json beside it. The prompt is encoded as training encoded
text (the `tokenizers` library, no special tokens added); generation stops at the end-of-text
token the trainer put after every document, at `max_new_tokens`, or at the model's last position.

[Note: our own loop, not `model.generate`] transformers' `generate` fills every setting we leave
unset from the model's `generation_config` (a downloaded Qwen3 sets top_k 20, top_p 0.95,
temperature 0.6) and then from its own defaults (top_k 50 when sampling), and samples from the
global RNG. A dozen lines with the KV cache do exactly greedy / temperature / top-k, seeded by a
generator of their own; the tests check the greedy tokens against `generate`'s.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from hyperparallel.errors import ConfigError

CONFIG_FILE = "config.json"
STOP_REASONS = ("end_of_text", "max_new_tokens", "max_position_embeddings")


@dataclass(frozen=True)
class GenerationResult:
    prompt: str
    continuation: str  # the new tokens as text (the end-of-text token left out)
    prompt_ids: list[int]
    token_ids: list[int]  # the new tokens, the end-of-text token included when it ended them
    stop_reason: str  # one of STOP_REASONS
    seconds: float  # the prompt's forward and every new token's, not the loading

    @property
    def text(self) -> str:
        return self.prompt + self.continuation

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.seconds if self.seconds > 0 else math.inf


@dataclass(frozen=True)
class _Source:
    kind: str  # "checkpoint" | "hf"
    path: Path
    tokenizer_file: Path
    hf_config: dict  # enough to check the prompt's length before the weights are read
    family: str


def _resolve(source: str | os.PathLike) -> _Source:
    from hyperparallel.checkpoint.export import TOKENIZER_FILE, run_tokenizer_file
    from hyperparallel.checkpoint.io import MANIFEST, checkpoint_in, complete_checkpoints, read_manifest
    from hyperparallel.checkpoint.model_card import ModelCard

    path = Path(source)
    if path.is_dir() and not (path / CONFIG_FILE).is_file():
        path = checkpoint_in(path)  # a run directory: its newest checkpoint
    if not path.exists():
        raise ConfigError(f"{path} does not exist; give a checkpoint (RUN_DIR/checkpoints/step_N) or a Hugging Face "
                          f"directory (what `hyperparallel export` writes)")
    if not path.is_dir():
        raise ConfigError(f"{path} is a file; give a checkpoint directory (RUN_DIR/checkpoints/step_N) or a Hugging "
                          f"Face directory")
    if (path / MANIFEST).is_file() or (path / ".metadata").is_file():  # a checkpoint, maybe incomplete
        card = ModelCard.from_manifest(path, read_manifest(path))  # CheckpointError names what is wrong
        tokenizer = run_tokenizer_file(path)
        if not tokenizer.is_file():
            raise ConfigError(f"no tokenizer for checkpoint {path}: {tokenizer} does not exist (a checkpoint finds "
                              f"its run's tokenizer.json at RUN_DIR/{TOKENIZER_FILE} when it sits in "
                              f"RUN_DIR/checkpoints/)")
        return _Source("checkpoint", path, tokenizer, card.hf_config, card.family)
    config_file = path / CONFIG_FILE
    if not config_file.is_file():
        # a run directory, or its checkpoints/: name the newest checkpoint in it
        newest = (complete_checkpoints(path / "checkpoints") or complete_checkpoints(path) or [None])[-1]
        hint = f"; its newest checkpoint is {newest}" if newest is not None else ""
        raise ConfigError(f"{path} is neither a checkpoint (no {MANIFEST}) nor a Hugging Face directory (no "
                          f"{CONFIG_FILE}){hint}")
    try:
        hf_config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ConfigError(f"{config_file} is not JSON: {error}") from None
    if not isinstance(hf_config, dict):
        raise ConfigError(f"{config_file} is not a JSON object")
    from hyperparallel.models.families import get_family

    model_type = hf_config.get("model_type")
    if not isinstance(model_type, str):
        raise ConfigError(f"{config_file} names no model_type; a Hugging Face config.json does")
    try:
        family = get_family(model_type)
    except ConfigError as error:
        raise ConfigError(f"{config_file}: {error}") from None
    tokenizer = path / TOKENIZER_FILE
    if not tokenizer.is_file():
        raise ConfigError(f"no tokenizer for {path}: {tokenizer} does not exist (`hyperparallel export` writes it "
                          f"when the checkpoint sits in its run directory)")
    return _Source("hf", path, tokenizer, hf_config, family.name)


def _check_settings(prompt: str, max_new_tokens: int, temperature: float, top_k: int | None, seed: int) -> None:
    if not isinstance(prompt, str) or not prompt:
        raise ConfigError("the prompt is empty; give some text to continue")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be an integer of at least 1; got {max_new_tokens!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature) \
            or temperature < 0:
        raise ConfigError(f"temperature must be a number >= 0 (0: greedy); got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ConfigError(f"top_k must be an integer of at least 1, or None for the whole vocabulary; got {top_k!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"seed must be an integer; got {seed!r}")


def _load_tokenizer(file: Path):
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(file))
    except Exception as error:  # tokenizers raises its own Exception type
        raise ConfigError(f"{file} is not a tokenizers file: {str(error).splitlines()[0] if str(error) else error!r}") from None


def _load_model(source: _Source):
    if source.kind == "checkpoint":
        from hyperparallel.checkpoint.export import model_from_checkpoint

        return model_from_checkpoint(source.path)[0]
    from hyperparallel.checkpoint.model_card import DTYPES
    from hyperparallel.models import build_model

    # the dtype it was saved in (float16 and others are read as float32); HF's own experts modules
    dtype = DTYPES.get(source.hf_config.get("dtype") or source.hf_config.get("torch_dtype"), torch.float32)
    from hyperparallel.checkpoint.hf_files import plan_hf_read
    from hyperparallel.train.quiet import progress_bars_off

    # the files against the model their config.json describes, from their headers: every missing,
    # unexpected or mis-shaped tensor named, where from_pretrained would draw the missing ones
    meta = build_model(source.family, path=source.path, dtype=dtype, grouped_experts=False, materialize=False)
    plan_hf_read(source.path, meta)
    restore = progress_bars_off()  # from_pretrained's "Loading weights" bar, around the generated text
    try:
        return build_model(source.family, path=source.path, dtype=dtype, grouped_experts=False).eval()
    finally:
        restore()


def generate(source: str | os.PathLike, prompt: str, *, max_new_tokens: int = 64, temperature: float = 0.0,
             top_k: int | None = None, seed: int = 0, device: str | torch.device = "cpu") -> GenerationResult:
    """Continue `prompt` with the model of `source`: a checkpoint of `hyperparallel train`
    (RUN_DIR/checkpoints/step_N, its tokenizer at RUN_DIR/tokenizer.json; a run directory: its
    newest checkpoint) or a Hugging Face
    directory with a tokenizer.json (`hyperparallel export`'s output).

    Greedy with `temperature` 0; otherwise sampled from softmax(logits / temperature), over the
    `top_k` most likely tokens when given, from a generator seeded with `seed` (the global RNG is
    left alone). Stops after the end-of-text token, `max_new_tokens`, or the model's last position.
    A mistake in any argument is a ConfigError (CheckpointError for a broken checkpoint), raised
    before the weights are read.
    """
    _check_settings(prompt, max_new_tokens, temperature, top_k, seed)
    source_ = _resolve(source)
    tokenizer = _load_tokenizer(source_.tokenizer_file)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False).ids
    if not prompt_ids:
        raise ConfigError(f"the prompt {prompt!r} encodes to no tokens; give some text to continue")
    positions = source_.hf_config.get("max_position_embeddings")
    if isinstance(positions, int) and len(prompt_ids) >= positions:
        raise ConfigError(f"the prompt is {len(prompt_ids)} tokens; the model of {source_.path} takes at most "
                          f"{positions} positions (max_position_embeddings), leaving no room for a new token")
    budget = max_new_tokens if not isinstance(positions, int) else min(max_new_tokens, positions - len(prompt_ids))

    from hyperparallel.checkpoint.export import end_of_text_token

    eos = end_of_text_token(tokenizer.get_vocab())
    eos_id = tokenizer.token_to_id(eos) if eos is not None else None
    model = _load_model(source_).to(device)
    start = time.perf_counter()
    token_ids = _sample(model, prompt_ids, budget, temperature, top_k, seed, eos_id)
    seconds = time.perf_counter() - start
    if eos_id is not None and token_ids[-1] == eos_id:
        reason = "end_of_text"
    else:
        reason = "max_new_tokens" if len(token_ids) == max_new_tokens else "max_position_embeddings"
    continuation = _continuation(tokenizer, prompt_ids, token_ids)
    return GenerationResult(prompt, continuation, prompt_ids, token_ids, reason, seconds)


@torch.inference_mode()
def _sample(model, prompt_ids: list[int], budget: int, temperature: float, top_k: int | None, seed: int,
            eos_id: int | None) -> list[int]:
    from transformers import DynamicCache

    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    cache = DynamicCache(config=model.config)
    # transformers renamed forward's `past_key_values` to `cache` (5.x); both are the same object
    cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    inputs = torch.tensor([prompt_ids], device=device)
    new: list[int] = []
    while len(new) < budget:
        logits = model(input_ids=inputs, use_cache=True, logits_to_keep=1, **{cache_kwarg: cache}).logits[0, -1]
        token = _next_token(logits.float(), temperature, top_k, generator)
        new.append(token)
        if token == eos_id:
            break
        inputs = torch.tensor([[token]], device=device)
    return new


def _next_token(logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator) -> int:
    if temperature == 0:
        return int(logits.argmax())
    logits = logits / temperature
    if top_k is not None and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, -math.inf)
    return int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))


def _continuation(tokenizer, prompt_ids: list[int], token_ids: list[int]) -> str:
    """The new tokens as text. Decoded with the prompt: a character whose bytes the prompt's last
    token and the first new one share (byte-level BPE) comes out whole."""
    whole = tokenizer.decode(prompt_ids + token_ids, skip_special_tokens=True)
    head = tokenizer.decode(prompt_ids, skip_special_tokens=True)
    return whole[len(head):] if whole.startswith(head) else tokenizer.decode(token_ids, skip_special_tokens=True)
