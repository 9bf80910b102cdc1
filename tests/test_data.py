"""Offline data: the streaming ShareGPT parser (truncated tail), split, chat rendering,
HumanEval and the benchmark prompt sets."""

from __future__ import annotations

import json

import pytest

from hf_selfspec.data import (
    humaneval_prompts,
    iter_json_records,
    prompt_sets,
    render_chat,
    sharegpt_conversations,
    split_conversations,
    split_of,
)


def _records(n: int) -> list[dict]:
    return [
        {
            "id": f"id{i}_0",
            "conversations": [
                {"from": "human", "value": f"question {i} — ünïcødé 日本語 {'x' * i}"},
                {"from": "gpt", "value": f'answer {i} with "quotes" and ]brackets[ {{braces}}'},
            ],
        }
        for i in range(n)
    ]


@pytest.mark.parametrize("chunk_chars", [7, 64, 1 << 20])
def test_truncated_tail_is_dropped(tmp_path, chunk_chars):
    records = _records(6)
    text = json.dumps(records, indent=2, ensure_ascii=False)
    cut = text.index('"id5_0"') + 30  # inside the last record, as in ShareGPT V3
    path = tmp_path / "truncated.json"
    path.write_bytes(text.encode("utf-8")[: len(text[:cut].encode("utf-8")) - 1])
    assert list(iter_json_records(path, chunk_chars=chunk_chars)) == records[:5]
    # A complete file yields everything; a UTF-8 character cut in half at EOF is harmless.
    path.write_text(text, encoding="utf-8")
    assert list(iter_json_records(path, chunk_chars=chunk_chars)) == records
    path.write_bytes(text.encode("utf-8")[:-3] + "日".encode()[:2])
    assert list(iter_json_records(path, chunk_chars=chunk_chars)) == records[:5]


def test_not_a_list_is_an_error(tmp_path):
    path = tmp_path / "x.json"
    path.write_text('{"a": 1}')
    with pytest.raises(ValueError, match="expected a JSON list"):
        list(iter_json_records(path))


def test_conversations_from_synthetic_file(tmp_path):
    records = _records(3) + [
        {"id": "empty", "conversations": []},
        {"id": "only_user", "conversations": [{"from": "human", "value": "hi"}]},
        {
            "id": "odd_speaker",
            "conversations": [
                {"from": "human", "value": "q"},
                {"from": "robot", "value": "?"},
                {"from": "chatgpt", "value": "a"},
            ],
        },
    ]
    path = tmp_path / "c.json"
    path.write_text(json.dumps(records))
    conversations = list(sharegpt_conversations(path=path))
    assert [c.id for c in conversations] == ["id0_0", "id1_0", "id2_0", "odd_speaker"]
    assert [m["role"] for m in conversations[-1].messages] == ["user", "assistant"]
    assert len(list(sharegpt_conversations(limit=2, path=path))) == 2


def test_real_sharegpt_head():
    conversations = list(sharegpt_conversations(limit=40))
    assert len(conversations) == 40
    for c in conversations:
        assert {m["role"] for m in c.messages} >= {"user", "assistant"}
        assert all(isinstance(m["content"], str) and m["content"] for m in c.messages)


@pytest.mark.slow
def test_real_sharegpt_full_parse():
    """The whole 125 MB file streams (~1 s) and the truncated tail is survived."""
    n = sum(1 for _ in sharegpt_conversations())
    assert n > 17000


def test_split_is_deterministic_and_groups_parts():
    ids = [f"conv{i}_{part}" for i in range(2000) for part in range(2)]
    splits = [split_of(i) for i in ids]
    assert splits == [split_of(i) for i in ids]
    assert all(splits[2 * i] == splits[2 * i + 1] for i in range(2000))  # parts together
    eval_share = splits.count("eval") / len(splits)
    assert 0.03 < eval_share < 0.07
    assert split_of("conv1_0", eval_fraction=1.0) == "eval"
    assert split_of("conv1_0", eval_fraction=0.0) == "train"
    with pytest.raises(ValueError):
        list(split_conversations([], "test"))


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from hf_selfspec.defaults import default_model_dir

    return AutoTokenizer.from_pretrained(default_model_dir())


@pytest.mark.slow
def test_render_chat_marks_assistant_tokens(tokenizer):
    messages = [
        {"role": "user", "content": "Say hi."},
        {"role": "assistant", "content": "Hi there!"},
        {"role": "user", "content": "Again."},
        {"role": "assistant", "content": "Hello again, friend."},
    ]
    r = render_chat(tokenizer, messages)
    assert r.input_ids == tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    marked = tokenizer.decode([t for t, m in zip(r.input_ids, r.assistant_mask) if m])
    assert marked == "Hi there!<|im_end|>Hello again, friend.<|im_end|>"
    first = render_chat(
        tokenizer, [{"role": "assistant", "content": "I start."}, {"role": "user", "content": "ok"}]
    )
    assert (
        tokenizer.decode([t for t, m in zip(first.input_ids, first.assistant_mask) if m])
        == "I start."
    )
    short = render_chat(tokenizer, messages, max_tokens=10)
    assert len(short.input_ids) == len(short.assistant_mask) == 10


def test_humaneval():
    problems = humaneval_prompts()
    assert len(problems) == 164 and problems[0]["task_id"] == "HumanEval/0"
    assert "def " in problems[0]["prompt"]
    assert len(humaneval_prompts(limit=3)) == 3


@pytest.mark.slow
def test_prompt_sets(tokenizer):
    sets = prompt_sets(tokenizer, per_category=8)
    assert set(sets) == {"chat", "code", "summarize", "adversarial", "qa", "math", "translate"}
    for name, prompts in sets.items():
        assert len(prompts) == 8, name
        for p in prompts:
            assert p[0]["role"] == "user" and p[0]["content"].strip()
    assert sets == prompt_sets(tokenizer, per_category=8)  # deterministic
    held_out = {
        m["content"]
        for c in split_conversations(sharegpt_conversations(), "eval")
        for m in c.messages
        if m["role"] == "user"
    }
    assert all(p[0]["content"] in held_out for p in sets["chat"])
    assert all("def " in p[0]["content"] for p in sets["code"])
    assert any(p[0]["content"].startswith("Summarize") for p in sets["summarize"])
    assert any(any(ch.isdigit() for ch in p[0]["content"][-50:]) for p in sets["adversarial"])
    assert all(p[0]["content"] in held_out and p[0]["content"].endswith("?") for p in sets["qa"])
    assert not {p[0]["content"] for p in sets["qa"]} & {p[0]["content"] for p in sets["chat"]}
    assert all(any(ch.isdigit() for ch in p[0]["content"]) for p in sets["math"])
    assert all(p[0]["content"].startswith("Translate the following text into ") for p in sets["translate"])
    assert len({p[0]["content"].split("\n\n", 1)[1] for p in sets["translate"]}) == 8  # no repeats
    assert len(prompt_sets(tokenizer)["chat"]) == 12
