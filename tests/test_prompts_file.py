"""Prompt datasets in verl's layout, the tiny chat tokenizer, and resumable shuffled epochs."""

from __future__ import annotations

import json
import logging

import pytest

from r3lightning.job.prompts_file import PromptsFile, read_rows
from r3lightning.models.tiny_tokenizer import CHARACTERS, build_tiny_tokenizer, save_tiny_checkpoint

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def verl_rows(count: int) -> list[dict]:
    """Rows as verl's GSM8K preprocessing writes them (prompt messages, nested reward_model)."""
    return [
        {
            "data_source": "toy/add",
            "prompt": [{"role": "user", "content": f"what is {i}+{i % 7}?"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(i + i % 7)},
            "extra_info": {"split": "train", "index": i},
        }
        for i in range(count)
    ]


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def test_tiny_tokenizer_ids_and_chat_template_by_hand(tokenizer):
    vocab = tokenizer.get_vocab()
    # the tiny models' special ids
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    text = "What is 12+3?"
    assert tokenizer.decode(tokenizer.encode(text)) == text.lower()
    expected = [
        vocab["<|user|>"],
        *(vocab[c] for c in text.lower()),
        vocab["<|end|>"],
        vocab["<|assistant|>"],
    ]
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert list(ids) == expected
    assert len(tokenizer) == 8 + len(CHARACTERS) <= 96


def test_tiny_checkpoint_loads_offline(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    save_tiny_checkpoint(tmp_path / "ckpt")
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "ckpt"), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ckpt"))
    assert model.config.eos_token_id == tok.eos_token_id == 2
    assert tok.decode(tok.encode("1+1=2")) == "1+1=2"


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_verl_layout_read_and_tokenised_with_the_chat_template(tmp_path, tokenizer, fmt):
    rows = verl_rows(20)
    path = (write_parquet if fmt == "parquet" else write_jsonl)(tmp_path / f"d.{fmt}", rows)
    assert read_rows(path) == rows
    prompts = PromptsFile(path, tokenizer, shuffle=False)
    assert len(prompts) == 20
    for record, row in zip(prompts.next_prompts(20), rows, strict=True):
        reference = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True)["input_ids"]
        assert list(record.token_ids) == list(reference)
        assert record.ground_truth == row["reward_model"]["ground_truth"]
        assert record.data_source == "toy/add"
        assert record.extra_info == row["extra_info"]


def test_custom_columns_and_plain_string_prompts(tmp_path, tokenizer):
    rows = [{"question": f"q{i}", "meta": {"answer": i}} for i in range(3)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    prompts = PromptsFile(
        path,
        tokenizer,
        prompt_key="question",
        data_source_key="source",  # absent: empty data source
        ground_truth_key="meta.answer",
        extra_info_key=None,
        shuffle=False,
    )
    first = prompts.next_prompts(1)[0]
    reference = tokenizer.apply_chat_template([{"role": "user", "content": "q0"}], add_generation_prompt=True)
    assert list(first.token_ids) == list(reference["input_ids"])
    assert (first.data_source, first.ground_truth, first.extra_info) == ("", 0, None)


def test_missing_column_and_bad_files_name_what_is_wrong(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "hi"}])
    with pytest.raises(KeyError, match=r"d.jsonl row 0: no column 'reward_model.ground_truth'"):
        PromptsFile(path, tokenizer)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2 is not a JSON object"):
        read_rows(bad)
    (tmp_path / "d.csv").write_text("x")
    with pytest.raises(ValueError, match=r"must end in \.parquet, \.jsonl or \.json"):
        read_rows(tmp_path / "d.csv")
    with pytest.raises(FileNotFoundError, match="no such file"):
        read_rows(tmp_path / "missing.parquet")


@pytest.mark.parametrize("overlong", ["drop", "truncate_left", "truncate_right"])
def test_overlong_prompts_are_dropped_or_truncated_and_counted(tmp_path, tokenizer, overlong, caplog):
    rows = verl_rows(4)
    rows[1]["prompt"][0]["content"] = "x" * 40
    rows[3]["prompt"][0]["content"] = "y" * 50
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    full = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True)["input_ids"] for r in rows]
    limit = 30
    with caplog.at_level(logging.WARNING):
        prompts = PromptsFile(path, tokenizer, max_prompt_length=limit, overlong=overlong, shuffle=False)
    records = prompts.next_prompts(len(prompts))
    if overlong == "drop":
        assert (prompts.dropped, prompts.truncated) == (2, 0)
        assert [r.row for r in records] == [0, 2]
    else:
        assert (prompts.dropped, prompts.truncated) == (0, 2)
        cut = (lambda ids: ids[-limit:]) if overlong == "truncate_left" else (lambda ids: ids[:limit])
        assert [list(r.token_ids) for r in records] == [f if len(f) <= limit else cut(f) for f in full]
    assert "2 truncated" in caplog.text or "2 of 4 prompts dropped" in caplog.text


def test_epochs_are_seeded_permutations_and_wrap(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", verl_rows(10))
    a = PromptsFile(path, tokenizer, seed=3)
    epoch0 = [r.row for r in a.next_prompts(10)]
    epoch1 = [r.row for r in a.next_prompts(10)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(10))
    assert epoch0 != list(range(10)) and epoch0 != epoch1
    assert [r.row for r in PromptsFile(path, tokenizer, seed=3).next_prompts(10)] == epoch0
    assert [r.row for r in PromptsFile(path, tokenizer, seed=4).next_prompts(10)] != epoch0
    assert [r.row for r in PromptsFile(path, tokenizer, shuffle=False).next_prompts(10)] == list(range(10))


def test_resume_continues_at_the_next_unseen_prompt(tmp_path, tokenizer):
    path = write_parquet(tmp_path / "d.parquet", verl_rows(10))
    straight = PromptsFile(path, tokenizer, seed=1)
    expected = [r.row for r in straight.next_prompts(14)]

    first = PromptsFile(path, tokenizer, seed=1)
    seen = [r.row for r in first.next_prompts(6)]
    state = first.state_dict()
    resumed = PromptsFile(path, tokenizer, seed=1)
    resumed.load_state_dict(state)
    assert seen + [r.row for r in resumed.next_prompts(8)] == expected

    other = PromptsFile(path, tokenizer, seed=1, max_prompt_length=14, overlong="truncate_left")
    with pytest.raises(ValueError, match="different prompts"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="missing key 'position'"):
        resumed.load_state_dict({"epoch": 0, "fingerprint": state["fingerprint"]})
    before = resumed.state_dict()
    with pytest.raises(ValueError, match="out of range"):
        resumed.load_state_dict({**state, "position": 11})
    assert resumed.state_dict() == before  # a refused state changes nothing


def test_settings_are_checked(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", verl_rows(2))
    with pytest.raises(ValueError, match=r"task\.max_prompt_length must be an integer >= 1"):
        PromptsFile(path, tokenizer, max_prompt_length=0)
    with pytest.raises(ValueError, match=r"task\.overlong must be"):
        PromptsFile(path, tokenizer, overlong="cut")
    with pytest.raises(FileNotFoundError, match="expected a local checkpoint directory"):
        PromptsFile(path, str(tmp_path / "nope"))
