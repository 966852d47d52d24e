"""Record formats and loss masks, the chat templates of each family, and the run's tokenizer.

The family templates are fixtures of our own writing (tests/train/chat_templates/) with the
structure and quirks of Qwen3, DeepSeek-V3, Kimi K2 and Llama 3; the expected assistant texts are
written from each family's known format, not from the renderer under test. transformers'
apply_chat_template is the reference for rendering.
"""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from hyperparallel.errors import ConfigError
from hyperparallel.train.data import formats
from hyperparallel.train.data import tokenizer as tokenization

TEMPLATES = Path(__file__).parent / "chat_templates"
CORPUS = ("The quick brown fox answers every question. Plans are made, answers given, tools called. "
          "def add(a, b):\n    return a + b\n") * 8
THINK_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
# Each family: its special tokens, the named ones its tokenizer_config.json gives, and where its
# template sits in its directory (each of the places Hugging Face repositories keep one).
FAMILIES = {
    "qwen3": dict(special=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], added=THINK_TOKENS,
                  named={"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None},
                  template="tokenizer_config"),
    "deepseek_v3": dict(special=["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"],
                        added=[], template="chat_template.jinja",
                        named={"bos_token": {"__type": "AddedToken", "content": "<｜begin▁of▁sentence｜>"},
                               "eos_token": {"__type": "AddedToken", "content": "<｜end▁of▁sentence｜>"}}),
    "kimi_k2": dict(special=["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>",
                             "<|im_middle|>"], added=["<think>", "</think>"],
                    named={"bos_token": "[BOS]", "eos_token": "[EOS]"}, template="chat_template.json"),
    "llama3": dict(special=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                            "<|eot_id|>"], added=[],
                   named={"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
                   template="chat_template.jinja"),
}

SYSTEM, Q1, Q2, Q3 = "Be brief.", "What is a fox?", "And a plan?", "Thanks!"
A1, A2, A3 = "A quick animal.", "Plans are made.  \n", "Welcome."


@pytest.fixture(scope="module")
def base_backend():
    """A small byte-level BPE without special tokens: each family adds its own."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator([CORPUS], trainer=trainers.BpeTrainer(
        vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return backend


def family_dir(base_backend, root: Path, family: str) -> Path:
    """A Hugging Face tokenizer directory of `family`: tokenizer.json, tokenizer_config.json and
    its chat template in the place its family's repositories keep it."""
    from tokenizers import AddedToken, Tokenizer

    spec = FAMILIES[family]
    backend = Tokenizer.from_str(base_backend.to_str())
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in spec["special"]])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec["added"]])
    directory = root / family
    directory.mkdir()
    (directory / "tokenizer.json").write_text(backend.to_str())
    template = (TEMPLATES / f"{family}_style.jinja").read_text()
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **spec["named"]}
    if spec["template"] == "tokenizer_config":
        config["chat_template"] = template
    elif spec["template"] == "chat_template.json":
        (directory / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    else:
        (directory / "chat_template.jinja").write_text(template)
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def data_cfg(tokenizer=None, chat_template=None, vocab_size=320):
    # (the data section's keys this module reads)
    return SimpleNamespace(tokenizer=tokenizer, chat_template=chat_template, vocab_size=vocab_size)


@pytest.fixture(scope="module")
def tokenizers(base_backend, tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    loaded = {f: tokenization.load_tokenizer(data_cfg(str(family_dir(base_backend, root, f))), None,
                                             lambda: pytest.fail("no training"), "-", cache_dir=root / "cache")
              for f in FAMILIES}
    loaded["builtin"] = tokenization.load_tokenizer(data_cfg("builtin"), None, lambda: [CORPUS], "corpus",
                                                    cache_dir=root / "cache")
    return loaded


def trained_runs(tokenizer, ids: np.ndarray, trained: np.ndarray) -> list[str]:
    """The decoded text of each contiguous run of trained tokens."""
    runs, current = [], []
    for token, on in zip(ids.tolist(), trained.tolist(), strict=True):
        if on:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(run) for run in runs]


def encode_chat(tokenizer, messages, assistant_only_loss=True, **record):
    return formats.encode_record({"messages": messages, **record}, "chat", tokenizer, text_field="text",
                                 assistant_only_loss=assistant_only_loss, completion_only_loss=True, where="test")


# A three-turn conversation; the first answer carries its reasoning inline, the last in its own
# field. Expected: what each family writes for each assistant turn, from its format.
CONVERSATION = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": Q1},
    {"role": "assistant", "content": f"<think>\nfoxes first\n</think>\n\n{A1}"},
    {"role": "user", "content": Q2},
    {"role": "assistant", "content": A2},
    {"role": "user", "content": Q3},
    {"role": "assistant", "content": A3, "reasoning_content": "be kind"},
]
EXPECTED_TURNS = {
    "builtin": [f"<think>\nfoxes first\n</think>\n\n{A1}<|im_end|>", f"{A2}<|im_end|>", f"{A3}<|im_end|>"],
    # earlier turns lose their reasoning; the last gets its own in a think block
    "qwen3": [f"{A1}<|im_end|>", f"{A2}<|im_end|>", f"<think>\nbe kind\n</think>\n\n{A3}<|im_end|>"],
    # what follows </think> only; closed by the end-of-sentence token
    "deepseek_v3": [f"\n\n{A1}<｜end▁of▁sentence｜>", f"{A2}<｜end▁of▁sentence｜>", f"{A3}<｜end▁of▁sentence｜>"],
    # an empty think block before earlier answers, the reasoning before the last
    "kimi_k2": [f"<think></think><think>\nfoxes first\n</think>\n\n{A1}<|im_end|>",
                f"<think></think>{A2}<|im_end|>", f"<think>be kind</think>{A3}<|im_end|>"],
    # contents trimmed
    "llama3": [f"<think>\nfoxes first\n</think>\n\n{A1}<|eot_id|>", f"{A2.strip()}<|eot_id|>", f"{A3}<|eot_id|>"],
}


@pytest.mark.parametrize("family", list(EXPECTED_TURNS))
def test_every_assistant_turn_of_a_conversation_is_trained_as_its_template_renders_it(tokenizers, family):
    tokenizer = tokenizers[family]
    ids, trained = encode_chat(tokenizer, CONVERSATION)
    assert ids.dtype == np.int32 and trained.dtype == bool and ids.shape == trained.shape
    assert trained_runs(tokenizer, ids, trained) == EXPECTED_TURNS[family]
    # the whole render is tokenized as apply_chat_template tokenizes it (no special tokens added)
    assert ids.tolist() == tokenizer.encode(tokenizer.render_chat(CONVERSATION), False)[0]


def test_a_late_system_message_hoisted_to_the_top_still_leaves_each_answer_its_span(tokenizers):
    # DeepSeek-V3's layout puts every system message first: the render of the conversation before
    # an answer is then no prefix of the whole, and the span starts at the answer's content
    tokenizer = tokenizers["deepseek_v3"]
    messages = [{"role": "user", "content": Q1}, {"role": "assistant", "content": A1},
                {"role": "system", "content": SYSTEM}, {"role": "user", "content": Q2},
                {"role": "assistant", "content": A2}]
    rendered = tokenizer.render_chat(messages)
    assert rendered.startswith(f"<｜begin▁of▁sentence｜>{SYSTEM}<｜User｜>{Q1}")
    assert not rendered.startswith(tokenizer.render_chat(messages[:1], add_generation_prompt=True))
    ids, trained = encode_chat(tokenizer, messages)
    assert trained_runs(tokenizer, ids, trained) == [f"{A1}<｜end▁of▁sentence｜>", f"{A2}<｜end▁of▁sentence｜>"]


def test_tool_calls_tool_results_and_the_default_system_turn_are_never_trained(tokenizers):
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": Q1},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"type": "function", "function": {"name": "lookup", "arguments": {"q": "fox"}}}]},
                {"role": "tool", "content": "an animal"},
                {"role": "assistant", "content": A1}]
    qwen = tokenizers["qwen3"]
    ids, trained = encode_chat(qwen, messages, tools=tools)
    rendered = qwen.render_chat(messages, tools=tools)
    assert '<tool_call>\n{"name": "lookup", "arguments": {"q": "fox"}}\n</tool_call>' in rendered
    assert "<tool_response>\nan animal\n</tool_response>" in rendered and "# Tools" in rendered
    # the answer after the tool result is the last turn after the last user message: its think block
    assert trained_runs(qwen, ids, trained) == [f"<think>\n\n</think>\n\n{A1}<|im_end|>"]
    kimi = tokenizers["kimi_k2"]
    plain = [{"role": "user", "content": Q1}, {"role": "assistant", "content": A1}]
    assert kimi.render_chat(plain).startswith("<|im_system|>system<|im_middle|>You are a helpful assistant.<|im_end|>")
    ids, trained = encode_chat(kimi, plain)
    assert trained_runs(kimi, ids, trained) == [f"<think></think>{A1}<|im_end|>"]
    # a turn under a name of its own does not follow the generation prompt (which says "assistant"):
    # its span starts at its content
    named = [{**plain[0], "name": "ana"}, {**plain[1], "name": "kimi"}]
    assert "<|im_user|>ana<|im_middle|>" in kimi.render_chat(named)
    ids, trained = encode_chat(kimi, named)
    assert trained_runs(kimi, ids, trained) == [f"{A1}<|im_end|>"]


@pytest.mark.parametrize(("template", "expected"), [
    # Llama 2's layout: no generation prompt, a space before the answer and one before EOS
    ("{{- bos_token }}{%- for m in messages %}{%- if m['role'] == 'user' %}{{- '[INST] ' + m['content'] + ' [/INST]' }}"
     "{%- else %}{{- ' ' + m['content'] | trim + ' ' + eos_token }}{%- endif %}{%- endfor %}",
     [f" {A1} <|endoftext|>", f" {A2.strip()} <|endoftext|>"]),
    # plain-text turns that nothing closes: the answers alone, not the newline the template puts after them
    ("{%- for m in messages %}{{- '### ' + m['role'] + ':\n' + m['content'] + '\n' }}{%- endfor %}"
     "{%- if add_generation_prompt %}{{- '### assistant:\n' }}{%- endif %}", [A1, A2]),
])
def test_templates_with_other_closings_train_what_ends_their_turns(tmp_path, template, expected):
    file = tmp_path / "template.jinja"
    file.write_text(template)
    tokenizer = tokenization.load_tokenizer(data_cfg("builtin", str(file)), None, lambda: [CORPUS], "corpus",
                                            cache_dir=tmp_path / "cache")
    messages = [{"role": "user", "content": Q1}, {"role": "assistant", "content": A1},
                {"role": "user", "content": Q2}, {"role": "assistant", "content": A2}]
    ids, trained = encode_chat(tokenizer, messages)
    assert trained_runs(tokenizer, ids, trained) == expected


def test_a_conversation_without_an_assistant_turn_has_no_trained_token_unless_all_are(tokenizers):
    tokenizer = tokenizers["builtin"]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": Q1}]
    ids, trained = encode_chat(tokenizer, messages)
    assert len(ids) > 0 and not trained.any()
    ids, trained = encode_chat(tokenizer, messages, assistant_only_loss=False)
    assert trained.all()


def test_prompt_completion_trains_the_completion_and_eos(tokenizers):
    tokenizer = tokenizers["builtin"]
    record = {"prompt": "def add(a, b):\n    return", "completion": " a + b\n"}
    ids, trained = formats.encode_record(record, "prompt_completion", tokenizer, text_field="text",
                                         assistant_only_loss=True, completion_only_loss=True, where="test")
    assert ids[-1] == tokenizer.eos_id and trained[-1]
    assert tokenizer.decode(ids[:-1]) == record["prompt"] + record["completion"]
    assert trained_runs(tokenizer, ids, trained) == [" a + b\n<|endoftext|>"]
    _, everything = formats.encode_record(record, "prompt_completion", tokenizer, text_field="text",
                                          assistant_only_loss=True, completion_only_loss=False, where="test")
    assert everything.all()


def test_a_completion_that_starts_inside_a_word_trains_the_token_it_shares_with_the_prompt(tokenizers):
    tokenizer = tokenizers["builtin"]
    record = {"prompt": "The qui", "completion": "ck brown fox"}
    ids, trained = formats.encode_record(record, "prompt_completion", tokenizer, text_field="text",
                                         assistant_only_loss=True, completion_only_loss=True, where="test")
    runs = trained_runs(tokenizer, ids, trained)
    assert len(runs) == 1 and runs[0].endswith("ck brown fox<|endoftext|>") and "The" not in runs[0]


def test_conversational_prompt_completion_trains_only_the_completions_answer(tokenizers):
    tokenizer = tokenizers["qwen3"]
    record = {"prompt": [{"role": "user", "content": Q1}, {"role": "assistant", "content": A1},
                         {"role": "user", "content": Q2}],
              "completion": [{"role": "assistant", "content": A2}]}
    kwargs = dict(text_field="text", assistant_only_loss=True, where="test")
    ids, trained = formats.encode_record(record, "prompt_completion", tokenizer, completion_only_loss=True, **kwargs)
    assert trained_runs(tokenizer, ids, trained) == [f"<think>\n\n</think>\n\n{A2}<|im_end|>"]
    ids, trained = formats.encode_record(record, "prompt_completion", tokenizer, completion_only_loss=False, **kwargs)
    assert trained_runs(tokenizer, ids, trained) == [f"{A1}<|im_end|>", f"<think>\n\n</think>\n\n{A2}<|im_end|>"]


def test_text_records_are_encoded_with_the_tokenizers_special_tokens_then_eos(tokenizers):
    tokenizer = tokenizers["builtin"]
    for record in ({"body": "return a + b"}, "return a + b"):
        ids, trained = formats.encode_record(record, "text", tokenizer, text_field="body", assistant_only_loss=True,
                                             completion_only_loss=True, where="test")
        assert tokenizer.decode(ids) == "return a + b<|endoftext|>" and trained.all()


def test_the_format_is_read_from_the_records_fields():
    assert formats.detect_format({"messages": []}) == "chat"
    assert formats.detect_format({"prompt": "a", "completion": "b"}) == "prompt_completion"
    assert formats.detect_format({"prompt": "a"}) == "text"
    assert formats.detect_format({"text": "a"}) == "text"
    assert formats.detect_format("a") == "text"


@pytest.mark.parametrize(("record", "fmt", "message"), [
    ({"messages": "hi"}, "chat", r"chats.jsonl line 3: messages is not a non-empty list"),
    ({"messages": []}, "chat", r"chats.jsonl line 3: messages is not a non-empty list"),
    ({"messages": [{"content": "hi"}]}, "chat", r"chats.jsonl line 3: messages\[0\] is not a message"),
    ({"messages": [{"role": "user", "content": 3}]}, "chat", r"messages\[0\] \(user\) has no string content"),
    ({"messages": [{"role": "user"}]}, "chat", r"messages\[0\] \(user\) has no string content"),
    ({"messages": [{"role": "assistant", "content": "x", "tool_calls": {}}]}, "chat", r"tool_calls is not a list"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": "all"}, "chat", r"tools is not a list"),
    ({"prompt": "a", "completion": [{"role": "assistant", "content": "b"}]}, "prompt_completion", "neither both"),
    ({"prompt": "a"}, "prompt_completion", r"line 3 has no field 'completion'"),
    ({"body": 1}, "text", r"line 3 has no string field 'text' \(set data.text_field\)"),
    ({"text": "a"}, "parquet", r"data.format: 'parquet' is not one of"),
])
def test_a_malformed_record_is_named_with_what_is_wrong(tokenizers, record, fmt, message):
    with pytest.raises(ConfigError, match=message):
        formats.encode_record(record, fmt, tokenizers["builtin"], text_field="text", assistant_only_loss=True,
                              completion_only_loss=True, where="data.files: chats.jsonl line 3")


def test_a_template_that_refuses_a_conversation_names_the_record(tokenizers, tmp_path):
    strict = tmp_path / "strict.jinja"
    strict.write_text("{%- for m in messages %}{%- if m['role'] == 'tool' %}"
                      "{{- raise_exception('no tools here') }}{%- endif %}{{- m['content'] }}{%- endfor %}")
    tokenizer = tokenization.load_tokenizer(data_cfg("builtin", str(strict)), None, lambda: [CORPUS], "corpus",
                                            cache_dir=tmp_path / "cache")
    want = f"chats.jsonl line 2: the chat template (data.chat_template: {strict}) refuses it: no tools here"
    with pytest.raises(ConfigError, match=f"^{re.escape(want)}$"):
        formats.encode_record({"messages": [{"role": "tool", "content": "x"}]}, "chat", tokenizer, text_field="text",
                              assistant_only_loss=True, completion_only_loss=True, where="chats.jsonl line 2")
    strict.write_text("{% for m in messages %}")
    broken = tokenization.load_tokenizer(data_cfg("builtin", str(strict)), None, lambda: [CORPUS], "corpus",
                                         cache_dir=tmp_path / "cache")
    with pytest.raises(ConfigError, match=r"^data.chat_template: .*strict.jinja: the chat template does not parse"):
        broken.render_chat([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("family", list(EXPECTED_TURNS))
def test_rendering_equals_transformers_apply_chat_template(tokenizers, family):
    from transformers import PreTrainedTokenizerFast

    ours = tokenizers[family]
    from tokenizers import Tokenizer

    # (a copy: transformers may set options on the backend it is given)
    reference = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(ours.backend.to_str()),
                                        chat_template=ours.chat_template, **ours.special_tokens)
    for messages in (CONVERSATION, CONVERSATION[1:2], CONVERSATION[:4]):
        for prompt in (False, True):
            want = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
            assert ours.render_chat(messages, prompt) == want
        want_ids = reference.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
        assert encode_chat(ours, messages)[0].tolist() == want_ids


def test_the_builtin_tokenizer_is_cached_saved_and_loads_with_autotokenizer(tmp_path):
    from transformers import AutoTokenizer

    cfg, cache = data_cfg("builtin"), tmp_path / "cache"
    first = tokenization.load_tokenizer(cfg, None, lambda: [CORPUS], "corpus", cache_dir=cache)
    again = tokenization.load_tokenizer(cfg, None, lambda: pytest.fail("trained twice"), "corpus", cache_dir=cache)
    assert again.key == first.key and first.vocab_size <= 320 == tokenization.tokenizer_vocab_size(cfg, None)
    assert first.special_tokens == {"eos_token": "<|endoftext|>", "pad_token": "<|pad|>"}
    assert [first.backend.token_to_id(t) for t in tokenization.BUILTIN_SPECIAL_TOKENS] == [0, 1, 2, 3]
    assert (first.eos_id, first.pad_id) == (0, 1)
    assert pickle.loads(pickle.dumps(first)).encode(CORPUS, True) == first.encode(CORPUS, True)

    (tmp_path / "run").mkdir()
    first.save(tmp_path / "run")  # (what the run directory gets)
    hf = AutoTokenizer.from_pretrained(tmp_path / "run")
    assert (hf.eos_token, hf.pad_token) == ("<|endoftext|>", "<|pad|>")
    for prompt in (False, True):
        assert hf.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=prompt) == \
            first.render_chat(CONVERSATION, prompt)
    assert hf.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True)["input_ids"] == \
        encode_chat(first, CONVERSATION)[0].tolist()
    assert hf(CORPUS).input_ids == first.encode(CORPUS, True)[0]
    # a different template or vocabulary is a different key (token caches are keyed by it)
    template = tmp_path / "plain.jinja"
    template.write_text("{%- for m in messages %}{{- m['content'] }}{%- endfor %}")
    other = tokenization.load_tokenizer(data_cfg("builtin", str(template)), None, list, "corpus", cache_dir=cache)
    assert other.key != first.key and other.backend.to_str() == first.backend.to_str()


def test_a_directory_saved_from_a_family_tokenizer_renders_and_encodes_the_same(tokenizers, tmp_path):
    from transformers import AutoTokenizer

    ours = tokenizers["deepseek_v3"]
    ours.save(tmp_path)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    assert hf.apply_chat_template(CONVERSATION, tokenize=False) == ours.render_chat(CONVERSATION)
    assert (hf.bos_token, hf.eos_token) == ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>")


def test_the_tokenizer_comes_from_model_path_a_directory_a_file_or_is_builtin(base_backend, tmp_path):
    model = family_dir(base_backend, tmp_path, "llama3")
    (model / "config.json").write_text("{}")
    never = lambda: pytest.fail("no training")  # noqa: E731
    # data.tokenizer unset: model.path's own tokenizer, with its special tokens and template
    own = tokenization.load_tokenizer(data_cfg(), model, never, "-", cache_dir=tmp_path / "cache")
    assert own.eos_id == own.backend.token_to_id("<|eot_id|>") and own.chat_template is not None
    assert own.pad_id == own.eos_id  # (no pad token: padding is EOS, never trained)
    assert own.special_tokens == {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    assert tokenization.tokenizer_vocab_size(data_cfg(), model) == own.vocab_size
    # ... and builtin when model.path has none
    bare = tmp_path / "bare"
    bare.mkdir()
    # a pretrained model without a tokenizer.json: refused (its ids are not a new BPE's), unless builtin is asked for
    with pytest.raises(ConfigError, match=r"data.tokenizer: model.path .*bare has no tokenizer.json"):
        tokenization.tokenizer_source(data_cfg(), bare)
    assert tokenization.tokenizer_source(data_cfg(tokenizer="builtin"), bare) is None
    assert tokenization.tokenizer_vocab_size(data_cfg(vocab_size=512, tokenizer="builtin"), bare) == 512
    # a tokenizer.json alone: its vocabulary, EOS found in it, no template until data.chat_template gives one
    alone_file = family_dir(base_backend, tmp_path, "qwen3") / "tokenizer.json"
    alone = tokenization.load_tokenizer(data_cfg(str(alone_file)), None, never, "-", cache_dir=tmp_path / "cache")
    assert alone.chat_template is None and alone.eos_id == alone.backend.token_to_id("<|endoftext|>")
    with pytest.raises(ConfigError, match=r"^data.chat_template: .*tokenizer.json has no chat template"):
        alone.render_chat(CONVERSATION)
    chatml = tokenization.load_tokenizer(data_cfg(str(alone_file), str(TEMPLATES / "qwen3_style.jinja")), None,
                                         never, "-", cache_dir=tmp_path / "cache")
    assert chatml.render_chat(CONVERSATION[1:2]) == f"<|im_start|>user\n{Q1}<|im_end|>\n"
    # chat_template.jinja before tokenizer_config.json's, as AutoTokenizer reads them
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "ignored"}))
    assert tokenization.load_tokenizer(data_cfg(str(model)), None, never, "-",
                                       cache_dir=tmp_path / "cache").chat_template == own.chat_template


@pytest.mark.parametrize(("setup", "message"), [
    ("missing", r"^data.tokenizer: .*nowhere does not exist"),
    ("empty_dir", r"^data.tokenizer: .*empty holds no tokenizer.json"),
    ("not_json", r"^data.tokenizer: .*tokenizer.json is not a tokenizers JSON file"),
    ("bad_config", r"^data.tokenizer: .*tokenizer_config.json is not a readable JSON file"),
    ("eos_unknown", r"^data.tokenizer: .*'s eos_token '<nope>' is not in its vocabulary"),
    ("no_eos", r"^data.tokenizer: .*llama3/tokenizer.json has no end-of-text token"),
    ("template_missing", r"^data.chat_template: .*absent.jinja is not a file"),
    ("model_path_bad", r"^model.path: .*tokenizer.json is not a tokenizers JSON file"),
])
def test_a_bad_tokenizer_source_names_its_key(base_backend, tmp_path, setup, message):
    good = family_dir(base_backend, tmp_path, "qwen3")
    cfg, model_path = data_cfg(str(good)), None
    if setup == "missing":
        cfg = data_cfg(str(tmp_path / "nowhere"))
    elif setup == "empty_dir":
        (tmp_path / "empty").mkdir()
        cfg = data_cfg(str(tmp_path / "empty"))
    elif setup == "not_json":
        (good / "tokenizer.json").write_text("{not json")
    elif setup == "model_path_bad":
        (good / "tokenizer.json").write_text("{not json")
        cfg, model_path = data_cfg(), good
    elif setup == "bad_config":
        (good / "tokenizer_config.json").write_text("[")
    elif setup == "eos_unknown":
        (good / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<nope>"}))
    elif setup == "no_eos":  # (a lone file names no EOS, and Llama 3's is none of the trainer's usual ones)
        cfg = data_cfg(str(family_dir(base_backend, tmp_path, "llama3") / "tokenizer.json"))
    elif setup == "template_missing":
        cfg = data_cfg(str(good), str(tmp_path / "absent.jinja"))
    with pytest.raises(ConfigError, match=message):
        tokenization.load_tokenizer(cfg, model_path, list, "-", cache_dir=tmp_path / "cache")
