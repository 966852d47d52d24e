"""The run's tokenizer: where it comes from, how it encodes and renders chats, how it is saved.

`data.tokenizer` chooses the source:
- null (the default): model.path's own tokenizer when that directory holds a tokenizer.json,
  else "builtin";
- "builtin": a byte-level BPE trained here on the corpus (at most data.vocab_size tokens), with
  EOS, PAD and ChatML's <|im_start|> / <|im_end|> as special tokens and a ChatML chat template
  of ours, so a chat fine-tune works without a tokenizer of its own;
- a tokenizer.json file: its vocabulary only (EOS found in it, no chat template);
- a Hugging Face tokenizer or model directory: its tokenizer.json, the named special tokens of
  its tokenizer_config.json (or special_tokens_map.json) and its chat template, looked up as
  AutoTokenizer does (chat_template.jinja before tokenizer_config.json's "chat_template"; a
  processor's chat_template.json last).
`data.chat_template` (a jinja file) replaces the template whatever the source.

Chats are rendered by transformers' own renderer (`render_jinja_template`, what
`apply_chat_template` calls) with the same named special tokens passed in, so a conversation
renders here exactly as `AutoTokenizer.from_pretrained(RUN_DIR).apply_chat_template` renders it.

The object pickles (the tokenizing pass hands it to worker processes): `tokenizers.Tokenizer`
pickles as its JSON, the rest is plain data.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from hyperparallel.errors import ConfigError

if TYPE_CHECKING:
    from hyperparallel.train.config import DataSection

EOS = "<|endoftext|>"
PAD = "<|pad|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
BUILTIN_SPECIAL_TOKENS = (EOS, PAD, IM_START, IM_END)
# Bumped whenever the builtin recipe changes, so that a cached tokenizer of an older recipe is
# never taken for the new one (v2: ChatML's tokens joined EOS and PAD).
BUILTIN_RECIPE = "bpe-v2"

# Ours, in ChatML's layout: "<|im_start|>ROLE\nCONTENT<|im_end|>\n" per message; an assistant's
# tool calls as JSON in <tool_call> tags after its content, so that they are not silently lost.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] | default('', true)) }}"
    "{%- for call in message['tool_calls'] | default([]) %}"
    "{{- '\\n<tool_call>\\n' + ((call['function'] | default(call)) | tojson) + '\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# transformers' named special tokens (SPECIAL_TOKENS_ATTRIBUTES): what apply_chat_template hands
# a template, and what tokenizer_config.json names.
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


@dataclass
class Tokenizer:
    """What the trainer needs of a tokenizer. Built by `load_tokenizer` (all fields by keyword)."""

    backend: object  # tokenizers.Tokenizer
    eos_id: int
    pad_id: int
    special_tokens: dict[str, str]  # named special tokens, as transformers names them: what templates see
    chat_template: str | None
    source: str  # "the builtin tokenizer", or the file or directory, for messages
    template_source: str | None  # the config key and file the template came from, for messages
    key: str  # vocabulary + special tokens + chat template (for caches)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size()

    @cached_property
    def added_tokens(self) -> tuple[str, ...]:
        """The added tokens' texts (special or not), longest first: a turn's closing text ends at one."""
        contents = {token.content for token in self.backend.get_added_tokens_decoder().values() if token.content}
        return tuple(sorted(contents, key=len, reverse=True))

    def encode(self, text: str, add_special_tokens: bool) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids and each token's character span in `text` (what loss masks are mapped by)."""
        encoding = self.backend.encode(text, add_special_tokens=add_special_tokens)
        return encoding.ids, encoding.offsets

    def encode_batch(self, texts: list[str], add_special_tokens: bool) -> list[tuple[list[int], list[tuple[int, int]]]]:
        return [(e.ids, e.offsets) for e in self.backend.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=False)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = False, *, tools: list | None = None,
                    where: str = "a conversation") -> str:
        """The conversation as the chat template renders it (transformers' renderer and inputs).
        A template that refuses the conversation is a ConfigError naming `where`."""
        import jinja2
        from transformers.utils.chat_template_utils import render_jinja_template

        if self.chat_template is None:
            raise ConfigError(f"data.chat_template: {self.source} has no chat template (or none named 'default'); "
                              f"give one as data.chat_template (a jinja file)")
        # apply_chat_template drops keys whose value is None before rendering (many templates
        # test for a key's presence, not its value): the same here, or the renders would differ
        messages = [{k: v for k, v in message.items() if v is not None} for message in messages]
        try:
            rendered, _ = render_jinja_template(
                conversations=[messages], tools=tools, chat_template=self.chat_template,
                add_generation_prompt=add_generation_prompt, **self.special_tokens)
        except jinja2.TemplateSyntaxError as error:
            raise ConfigError(f"{self.template_source}: the chat template does not parse "
                              f"(line {error.lineno}: {error.message})") from None
        except (jinja2.TemplateError, TypeError, ValueError) as error:  # raise_exception(), or data it cannot take
            first = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise ConfigError(f"{where}: the chat template ({self.template_source}) refuses it: {first}") from None
        return rendered[0]

    def save(self, directory: str | os.PathLike) -> None:
        """tokenizer.json and a tokenizer_config.json (the named special tokens, the chat template)
        in `directory`, so that AutoTokenizer.from_pretrained(directory) encodes as training did and
        its apply_chat_template renders as render_chat does. Each file appears whole."""
        directory = Path(directory)
        config = {
            # Without it AutoTokenizer may pick the family's tokenizer class, which rebuilds the
            # pipeline from the vocabulary and encodes text to other ids than training did.
            "tokenizer_class": "PreTrainedTokenizerFast",
            "clean_up_tokenization_spaces": False,
            **self.special_tokens,
        }
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        _atomic_write(directory / TOKENIZER_FILE, self.backend.to_str())
        _atomic_write(directory / TOKENIZER_CONFIG_FILE, json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _tokenizer_key(backend, special_tokens: dict[str, str], chat_template: str | None) -> str:
    digest = hashlib.sha256(backend.to_str().encode())
    digest.update(json.dumps(special_tokens, sort_keys=True).encode())
    digest.update((chat_template or "").encode())
    return digest.hexdigest()[:16]


def _make(backend, special_tokens: dict[str, str], chat_template: str | None, *, source: str,
          template_source: str | None, key_name: str) -> Tokenizer:
    vocab = backend.get_vocab()
    eos = special_tokens.get("eos_token")
    if eos is None:
        from hyperparallel.checkpoint.export import end_of_text_token  # (one list of them, export's)

        eos = end_of_text_token(vocab)
    if eos is None:
        raise ConfigError(f"{key_name}: {source} has no end-of-text token (no eos_token in its tokenizer_config.json, "
                          f"and none of {EOS!r}, '</s>', {IM_END!r} in its vocabulary)")
    if eos not in vocab:
        raise ConfigError(f"{key_name}: {source}'s eos_token {eos!r} is not in its vocabulary")
    pad = special_tokens.get("pad_token")
    if pad is not None and pad not in vocab:
        raise ConfigError(f"{key_name}: {source}'s pad_token {pad!r} is not in its vocabulary")
    pad_id = vocab[pad] if pad is not None else vocab.get(PAD, vocab[eos])  # (padding is never trained)
    return Tokenizer(backend=backend, eos_id=vocab[eos], pad_id=pad_id, special_tokens=special_tokens,
                     chat_template=chat_template, source=source, template_source=template_source,
                     key=_tokenizer_key(backend, special_tokens, chat_template))


def tokenizer_source(cfg: DataSection, model_path: str | os.PathLike | None) -> Path | None:
    """The tokenizer.json file or the directory the run's tokenizer is read from; None: builtin."""
    if cfg.tokenizer == "builtin":
        return None
    if cfg.tokenizer is None:
        if model_path is None or not Path(model_path).expanduser().is_dir():
            return None  # (a model.path that is no directory is model.path's problem, named by itself)
        if not (Path(model_path).expanduser() / TOKENIZER_FILE).is_file():  # (a pretrained model's ids are its own)
            raise ConfigError(f"data.tokenizer: model.path {model_path} has no {TOKENIZER_FILE} to tokenize with; give "
                              f"data.tokenizer (a tokenizer.json, or a tokenizer directory), or data.tokenizer: builtin "
                              f"to train one here")
        return Path(model_path).expanduser()
    path = Path(cfg.tokenizer).expanduser()
    if path.is_dir() and not (path / TOKENIZER_FILE).is_file():
        raise ConfigError(f"data.tokenizer: {path} holds no {TOKENIZER_FILE} (give a tokenizer.json, a Hugging Face "
                          f"tokenizer or model directory, or 'builtin')")
    if not path.exists():
        raise ConfigError(f"data.tokenizer: {path} does not exist (give a tokenizer.json, a Hugging Face tokenizer or "
                          f"model directory, or 'builtin')")
    return path


def _key_name(cfg: DataSection) -> str:
    return "data.tokenizer" if cfg.tokenizer is not None else "model.path"


def tokenizer_vocab_size(cfg: DataSection, model_path: str | os.PathLike | None) -> int:
    """The vocabulary as a run will have it, without training a tokenizer: data.vocab_size for
    the builtin one (the most it trains to), the file's otherwise (a ConfigError when it does not
    parse)."""
    source = tokenizer_source(cfg, model_path)
    if source is None:
        return cfg.vocab_size
    return _read_backend(source, _key_name(cfg))[0].get_vocab_size()


def load_tokenizer(cfg: DataSection, model_path: str | os.PathLike | None,
                   texts_for_training: Callable[[], Iterable[str]], corpus_key: str, *,
                   cache_dir: str | os.PathLike) -> Tokenizer:
    """The run's tokenizer. The builtin one is trained on `texts_for_training()` (called only
    when `cache_dir` holds none for this corpus and vocabulary size) and cached there."""
    source = tokenizer_source(cfg, model_path)
    override = _chat_template_file(cfg.chat_template)
    if source is None:
        template, template_source = override or (CHATML_TEMPLATE, "the builtin ChatML template")
        backend = _builtin_backend(cfg.vocab_size, texts_for_training, corpus_key, Path(cache_dir))
        return _make(backend, {"eos_token": EOS, "pad_token": PAD}, template, source="the builtin tokenizer",
                     template_source=template_source, key_name="data.tokenizer")
    key_name = _key_name(cfg)
    backend, file = _read_backend(source, key_name)
    special_tokens, template, template_source = {}, None, None
    if source.is_dir():
        special_tokens = _named_special_tokens(source, key_name)
        template, template_source = _directory_chat_template(source, key_name)
    if override is not None:
        template, template_source = override
    return _make(backend, special_tokens, template, source=str(source if source.is_dir() else file),
                 template_source=template_source, key_name=key_name)


def _builtin_backend(vocab_size: int, texts: Callable[[], Iterable[str]], corpus_key: str, cache_dir: Path):
    from tokenizers import Tokenizer as RustTokenizer

    cached = cache_dir / f"tokenizer-{BUILTIN_RECIPE}-{vocab_size}-{corpus_key}.json"
    if cached.is_file():
        return RustTokenizer.from_file(str(cached))
    backend = train_builtin_tokenizer(texts(), vocab_size)
    cache_dir.mkdir(parents=True, exist_ok=True)
    _atomic_write(cached, backend.to_str())
    return backend


def train_builtin_tokenizer(texts: Iterable[str], vocab_size: int):
    """A byte-level BPE of at most `vocab_size` tokens (its special tokens included)."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(BUILTIN_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def _read_backend(source: Path, key_name: str):
    """(tokenizers.Tokenizer, the file it was read from)."""
    from tokenizers import Tokenizer as RustTokenizer

    file = source / TOKENIZER_FILE if source.is_dir() else source
    try:
        return RustTokenizer.from_str(file.read_bytes().decode("utf-8")), file
    except OSError as error:
        raise ConfigError(f"{key_name}: {file} cannot be read ({error.strerror})") from None
    except Exception as error:  # (the Rust library raises plain Exceptions; UnicodeDecodeError too)
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ConfigError(f"{key_name}: {file} is not a tokenizers JSON file ({first})") from None


def _read_json(file: Path, key_name: str) -> dict:
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(f"{key_name}: {file} is not a readable JSON file ({str(error).splitlines()[0]})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{key_name}: {file} is not a JSON object")
    return value


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken's dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _named_special_tokens(directory: Path, key_name: str) -> dict[str, str]:
    """bos_token, eos_token ... from tokenizer_config.json, missing ones from the legacy
    special_tokens_map.json (what AutoTokenizer merges)."""
    found: dict[str, str] = {}
    for name in (TOKENIZER_CONFIG_FILE, "special_tokens_map.json"):
        if (directory / name).is_file():
            config = _read_json(directory / name, key_name)
            for attr in NAMED_SPECIAL_TOKENS:
                if attr not in found and attr in config:  # (an explicit null is kept: not looked for further)
                    found[attr] = _token_text(config[attr])
    return {attr: token for attr, token in found.items() if token is not None}


def _directory_chat_template(directory: Path, key_name: str) -> tuple[str | None, str | None]:
    """A directory's chat template, and where it was found. Several named templates: the one
    named "default" (as apply_chat_template takes without a name)."""
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return _read_template(jinja, key_name), f"{key_name}: {jinja}"
    for name in (TOKENIZER_CONFIG_FILE, "chat_template.json"):
        if (directory / name).is_file():
            template = _read_json(directory / name, key_name).get("chat_template")
            if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
                template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            if isinstance(template, dict):
                template = template.get("default")
            if isinstance(template, str):
                return template, f"{key_name}: {directory / name}"
    return None, None


def _read_template(file: Path, key_name: str) -> str:
    try:
        return file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"{key_name}: {file} is not a readable text file ({str(error).splitlines()[0]})") from None


def _chat_template_file(path: str | None) -> tuple[str, str] | None:
    if path is None:
        return None
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"data.chat_template: {file} is not a file (give a jinja chat template file)")
    return _read_template(file, "data.chat_template"), f"data.chat_template: {file}"
