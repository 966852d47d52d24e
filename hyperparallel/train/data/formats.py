"""Records to token ids and a loss mask: plain text, prompt / completion, and chat.

`encode_record` gives a record's token ids and `trained`, True where the token is a target the
loss counts (the label of the token before it). Formats (`detect_format` reads them from the
record's fields; `data.format` may fix one):
- text: the text field encoded with the tokenizer's own special tokens (a BOS where its
  post-processor adds one), then EOS; every token trained.
- prompt_completion: `prompt` + `completion` encoded as one text (so the tokens at the seam are
  the ones the whole text gets), then EOS; with completion_only_loss the tokens overlapping the
  completion's characters and the EOS are trained. Both may instead be lists of messages: the
  conversation prompt + completion rendered with the chat template, the completion's assistant
  turns trained.
- chat: `messages` (and the record's `tools`, if any) rendered once with the chat template, no
  EOS added (the template closes each turn); with assistant_only_loss each assistant turn is
  trained, every turn of a multi-turn conversation, found as [Note: assistant spans] says.
System, user and tool messages, and an assistant message that calls tools, are never trained.

[Note: assistant spans]
Stock chat templates carry no {% generation %} markers, and "render messages[:i+1], take what
was added" is wrong for templates that render a turn differently when it is the last one (Qwen3
puts an empty <think>\n\n</think>\n\n before the content of the turn after the last user message
and strips the reasoning of earlier ones; Kimi K2 Thinking does the reverse). So an assistant
turn i's span in the whole render W is found from renders that agree with W:
- its content's end: W against W' (W with turn i's content replaced by a sentinel character
  the content does not hold): what differs between their common prefix and common suffix is
  the content as the template wrote it (stripped, trimmed, its reasoning cut, whatever);
- its start: the end of render(messages[:i], add_generation_prompt=True) when that is a prefix
  of W reaching no further than the content's start (so the turn is what a model generates
  after the generation prompt: Qwen3's think block included), else the content's start;
- its closing text (<|im_end|>, <|eot_id|>, <｜end▁of▁sentence｜>: what the model must learn to
  emit to end a turn): what follows the content both in W and in the render of messages[:i+1]
  (turn i last, content the sentinel), cut after the first added token it reaches into, or
  without trailing whitespace when it reaches none (the newline between turns is the
  template's, not the model's). A template that closes no turn gets none.
Character spans become tokens by the tokens' offsets: a token overlapping a span is trained.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import numpy as np

from hyperparallel.errors import ConfigError
from hyperparallel.train.data.tokenizer import Tokenizer

Format = Literal["text", "chat", "prompt_completion"]
FORMATS: tuple[Format, ...] = ("text", "chat", "prompt_completion")
# Private-use characters: no tokenizer merges them with a neighbour into something else, no
# template strips them; the first one the content does not hold stands in for it.
_SENTINELS = ("\ue000", "\ue001", "\ue002")


def detect_format(record) -> Format:
    """`messages` -> chat, `prompt` and `completion` -> prompt_completion, anything else -> text."""
    if isinstance(record, dict):
        if "messages" in record:
            return "chat"
        if "prompt" in record and "completion" in record:
            return "prompt_completion"
    return "text"


def encode_record(record, fmt: Format, tokenizer: Tokenizer, *, text_field: str, assistant_only_loss: bool,
                  completion_only_loss: bool, where: str = "a record") -> tuple[np.ndarray, np.ndarray]:
    """(ids int32 [T], trained bool [T]) of one record (a dict, or for text a string). `where`
    names the record in errors ("data.files: chats.jsonl line 7"); a malformed record is a
    ConfigError. A record may come back with no trained token: the caller skips and counts it."""
    if fmt == "text":
        ids, _ = tokenizer.encode(_text_of(record, text_field, where), True)
        return _with_eos(ids, np.ones(len(ids), dtype=bool), tokenizer)
    if fmt == "chat":
        messages = _messages(_field(record, "messages", where), where, "messages")
        return _encode_chat(tokenizer, messages, _tools(record, where), 0 if assistant_only_loss else None, where)
    if fmt == "prompt_completion":
        prompt, completion = _field(record, "prompt", where), _field(record, "completion", where)
        if isinstance(prompt, str) and isinstance(completion, str):
            ids, offsets = tokenizer.encode(prompt + completion, True)
            if completion_only_loss:
                trained = _covering(offsets, [(len(prompt), len(prompt) + len(completion))])
            else:
                trained = np.ones(len(ids), dtype=bool)
            return _with_eos(ids, trained, tokenizer)
        if isinstance(prompt, list) and isinstance(completion, list):
            messages = _messages(prompt, where, "prompt") + _messages(completion, where, "completion")
            first = len(prompt) if completion_only_loss else (0 if assistant_only_loss else None)
            return _encode_chat(tokenizer, messages, _tools(record, where), first, where)
        raise ConfigError(f"{where}: prompt and completion are neither both strings nor both lists of messages")
    raise ConfigError(f"data.format: {fmt!r} is not one of {', '.join(FORMATS)}")


def record_texts(record, fmt: Format, text_field: str, where: str = "a record") -> list[str]:
    """The texts of a record, to train the builtin tokenizer on (no template text)."""
    if fmt == "text":
        return [_text_of(record, text_field, where)]
    if fmt == "chat":
        return [m.get("content") or "" for m in _messages(_field(record, "messages", where), where, "messages")]
    parts = [_field(record, "prompt", where), _field(record, "completion", where)]
    if all(isinstance(p, str) for p in parts):
        return ["".join(parts)]
    return [m.get("content") or "" for p, name in zip(parts, ("prompt", "completion"), strict=True) for m in _messages(p, where, name)]


def assistant_spans(tokenizer: Tokenizer, messages: list[dict], *, tools: list | None = None, first: int = 0,
                    where: str = "a conversation") -> list[tuple[int, int]]:
    """Character spans, in render_chat(messages), of the assistant turns from message `first`
    on: each from after its generation prompt through its closing text ([Note: assistant spans])."""
    def render(conversation: list[dict], add_generation_prompt: bool = False) -> str:
        return tokenizer.render_chat(conversation, add_generation_prompt, tools=tools, where=where)

    whole = render(messages)
    spans = []
    for i in range(first, len(messages)):
        if messages[i]["role"] == "assistant" and not messages[i].get("tool_calls"):
            span = _turn_span(whole, messages, i, render, tokenizer.added_tokens)
            if span is not None:
                spans.append(span)
    return spans


def _sentinel(content: str) -> str:
    # (one the content does not hold; failing that, one unlike its ends, all the diff needs when
    # the template writes the content as it is)
    return next((s for s in _SENTINELS if s not in content), None) or \
        next(s for s in _SENTINELS if s not in (content[:1], content[-1:]))


def _turn_span(whole: str, messages: list[dict], i: int, render: Callable, added_tokens: tuple[str, ...]):
    """Turn i's (start, end) in `whole`, or None when the template does not write its content."""
    sentinel = _sentinel(messages[i]["content"])
    swapped_turn = {**messages[i], "content": sentinel}
    variant = render([*messages[:i], swapped_turn, *messages[i + 1:]])
    if variant == whole:
        return None  # the template does not render this turn's content
    head = _common_prefix(whole, variant)
    content_end = len(whole) - _common_suffix(whole, variant, min(len(whole), len(variant)) - head)
    start = head
    try:
        prompt = render(messages[:i], True)
        if len(prompt) <= head and whole.startswith(prompt):
            start = len(prompt)
    except ConfigError:  # (a template may refuse a conversation cut short: the content's start then)
        pass
    try:
        as_last = variant if i == len(messages) - 1 else render([*messages[:i], swapped_turn])
    except ConfigError:
        as_last = ""
    at = as_last.rfind(sentinel)
    closing = 0 if at < 0 else _closing_length(whole[content_end:], as_last[at + len(sentinel):], added_tokens)
    return start, content_end + closing


def _closing_length(rest: str, after_last: str, added_tokens: tuple[str, ...]) -> int:
    """How much of `rest` (W after the content) closes the turn: see [Note: assistant spans]."""
    common = _common_prefix(rest, after_last)
    if common == 0:
        return 0
    window = rest[: common + (len(added_tokens[0]) if added_tokens else 0)]
    best = None
    for token in added_tokens:  # (longest first: a token beats any it starts with)
        at = window.find(token)
        if 0 <= at < common and (best is None or at < best[0]):
            best = (at, at + len(token))
    return best[1] if best is not None else len(rest[:common].rstrip())


def _common_prefix(a: str, b: str) -> int:
    # Bisection over slices compares in C; a character loop would dominate long conversations.
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _common_suffix(a: str, b: str, limit: int) -> int:
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[len(a) - mid:] == b[len(b) - mid:]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _encode_chat(tokenizer: Tokenizer, messages: list[dict], tools: list | None, first: int | None,
                 where: str) -> tuple[np.ndarray, np.ndarray]:
    """`first`: the first message whose assistant turns are trained; None: every token."""
    whole = tokenizer.render_chat(messages, tools=tools, where=where)
    # (add_special_tokens=False, as apply_chat_template tokenizes: the template writes BOS itself)
    ids, offsets = tokenizer.encode(whole, False)
    if first is None:
        trained = np.ones(len(ids), dtype=bool)
    else:
        trained = _covering(offsets, assistant_spans(tokenizer, messages, tools=tools, first=first, where=where))
    return np.asarray(ids, dtype=np.int32), trained


def _covering(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """True for each token whose characters overlap a span (one that trims its offsets to
    nothing counts when it sits strictly inside one)."""
    trained = np.zeros(len(offsets), dtype=bool)
    if not offsets or not spans:
        return trained
    bounds = np.asarray(offsets, dtype=np.int64)
    starts, ends = bounds[:, 0], bounds[:, 1]
    for lo, hi in spans:
        trained |= ((starts < hi) & (ends > lo)) | ((starts == ends) & (starts > lo) & (starts < hi))
    return trained


def _with_eos(ids: list[int], trained: np.ndarray, tokenizer: Tokenizer) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray([*ids, tokenizer.eos_id], dtype=np.int32), np.append(trained, True)


def _field(record, name: str, where: str):
    if not isinstance(record, dict) or name not in record:
        raise ConfigError(f"{where} has no field {name!r}")
    return record[name]


def _text_of(record, text_field: str, where: str) -> str:
    if isinstance(record, str):
        return record
    if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
        raise ConfigError(f"{where} has no string field {text_field!r} (set data.text_field)")
    return record[text_field]


def _tools(record: dict, where: str) -> list | None:
    tools = record.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise ConfigError(f"{where}: tools is not a list of tool schemas")
    return tools


def _messages(value, where: str, field: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{where}: {field} is not a non-empty list of messages")
    for k, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ConfigError(f"{where}: {field}[{k}] is not a message (a dict with a string role and content)")
        calls = message.get("tool_calls")
        if calls is not None and not isinstance(calls, list):
            raise ConfigError(f"{where}: {field}[{k}].tool_calls is not a list")
        content = message.get("content")
        if not isinstance(content, str) and not (content is None and calls):
            raise ConfigError(f"{where}: {field}[{k}] ({message['role']}) has no string content")
    return value
