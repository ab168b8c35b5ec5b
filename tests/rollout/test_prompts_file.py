"""Prompt datasets in verl's layout, the tiny chat tokenizer, and resumable shuffled epochs."""

from __future__ import annotations

import json
import logging

import pytest

from r3lightning.app.models.tiny_tokenizer import CHARACTERS, build_tiny_tokenizer, save_tiny_checkpoint
from r3lightning.app.tasks.prompts_file import Columns, PromptsFileTask, read_rows

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
    prompts = PromptsFileTask(path, tokenizer, shuffle=False)
    assert len(prompts) == 20
    for record, row in zip(prompts.prompts_for_step(0, 20), rows, strict=True):
        reference = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True)["input_ids"]
        assert list(record.token_ids) == list(reference)
        assert record.ground_truth == row["reward_model"]["ground_truth"]
        assert record.data_source == "toy/add"
        assert record.extra_info == row["extra_info"]


def test_custom_columns_and_plain_string_prompts(tmp_path, tokenizer):
    rows = [{"question": f"q{i}", "meta": {"answer": i}} for i in range(3)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    prompts = PromptsFileTask(
        path,
        tokenizer,
        columns=Columns(
            prompt="question",
            data_source="source",  # absent: empty data source
            ground_truth="meta.answer",
            extra_info=None,
        ),
        shuffle=False,
    )
    first = prompts.prompts_for_step(0, 1)[0]
    reference = tokenizer.apply_chat_template([{"role": "user", "content": "q0"}], add_generation_prompt=True)
    assert list(first.token_ids) == list(reference["input_ids"])
    assert (first.data_source, first.ground_truth, first.extra_info) == ("", 0, {})


def test_missing_column_and_bad_files_name_what_is_wrong(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "hi"}])
    with pytest.raises(ValueError) as info:
        PromptsFileTask(path, tokenizer)
    assert str(info.value) == (  # str(): no KeyError quotes around the message
        "d.jsonl row 0: no column 'reward_model.ground_truth' for task.columns.ground_truth (the row has: "
        "prompt); name your file's columns with task.columns.prompt, task.columns.data_source and "
        "task.columns.ground_truth (dotted paths reach into nested columns)"
    )
    with pytest.raises(
        ValueError, match=r"^d.jsonl row 0: no column 'question' for task.columns.prompt \(the row"
    ):
        PromptsFileTask(path, tokenizer, columns={"prompt": "question"})  # a mapping of Columns' fields
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
        prompts = PromptsFileTask(path, tokenizer, max_prompt_length=limit, overlong=overlong, shuffle=False)
    records = prompts.prompts_for_step(0, len(prompts))
    if overlong == "drop":
        assert (prompts.dropped, prompts.truncated) == (2, 0)
        assert prompts.rows == [0, 2] and [r.token_ids for r in records] == [full[0], full[2]]
    else:
        assert (prompts.dropped, prompts.truncated) == (0, 2)
        cut = (lambda ids: ids[-limit:]) if overlong == "truncate_left" else (lambda ids: ids[:limit])
        assert [list(r.token_ids) for r in records] == [f if len(f) <= limit else cut(f) for f in full]
    assert "2 truncated" in caplog.text or "2 of 4 prompts dropped" in caplog.text


@pytest.mark.parametrize("overlong", ["drop", "truncate_left"])
def test_a_prompt_of_exactly_max_prompt_length_ids_is_kept_whole(tmp_path, tokenizer, overlong):
    rows = verl_rows(2)
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    ids = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True)["input_ids"] for r in rows]
    assert len(ids[0]) == len(ids[1])  # the premise: both prompts sit on the boundary together
    at = PromptsFileTask(path, tokenizer, max_prompt_length=len(ids[0]), overlong=overlong, shuffle=False)
    assert (at.dropped, at.truncated) == (0, 0)
    assert [list(r.token_ids) for r in at.prompts_for_step(0, 2)] == ids
    if overlong == "drop":  # one id fewer: both are over
        with pytest.raises(ValueError, match=r"no usable prompt .* 2 longer than max_prompt_length"):
            PromptsFileTask(path, tokenizer, max_prompt_length=len(ids[0]) - 1, overlong=overlong)
    else:
        below = PromptsFileTask(path, tokenizer, max_prompt_length=len(ids[0]) - 1, overlong=overlong)
        assert below.truncated == 2


def _rows(task, step, count):
    return [task.rows[task.records.index(p)] for p in task.prompts_for_step(step, count)]


def test_epochs_are_seeded_permutations_and_steps_cover_them_in_order(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", verl_rows(10))
    a = PromptsFileTask(path, tokenizer, seed=3)
    epoch0 = _rows(a, 0, 10)
    epoch1 = _rows(a, 1, 10)
    assert sorted(epoch0) == sorted(epoch1) == list(range(10))
    assert epoch0 != list(range(10)) and epoch0 != epoch1
    assert _rows(PromptsFileTask(path, tokenizer, seed=3), 0, 10) == epoch0
    assert _rows(PromptsFileTask(path, tokenizer, seed=4), 0, 10) != epoch0
    assert _rows(PromptsFileTask(path, tokenizer, shuffle=False), 0, 10) == list(range(10))
    # steps of 4 prompts walk the same sequence: no prompt repeated or skipped within an epoch,
    # and step 2 crosses into epoch 1
    steps = [_rows(a, step, 4) for step in range(5)]
    assert steps[0] + steps[1] + steps[2][:2] == epoch0
    assert steps[2][2:] + steps[3] + steps[4] == epoch1


def test_stop_ids_and_decode_come_from_the_tokenizer(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", verl_rows(2))
    task = PromptsFileTask(path, tokenizer)
    assert task.stop_token_ids == [tokenizer.eos_token_id] == [2]
    assert task.decode([*tokenizer.encode("7+1"), 2]) == "7+1"


def test_settings_are_checked(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", verl_rows(2))
    with pytest.raises(ValueError, match=r"task\.max_prompt_length must be an integer >= 1"):
        PromptsFileTask(path, tokenizer, max_prompt_length=0)
    with pytest.raises(ValueError, match=r"task\.overlong must be"):
        PromptsFileTask(path, tokenizer, overlong="cut")
    with pytest.raises(ValueError, match=r"task\.tokenizer: a prompts file needs the model's tokenizer"):
        PromptsFileTask(path, None)
    with pytest.raises(FileNotFoundError, match="expected a local checkpoint directory"):
        PromptsFileTask(path, str(tmp_path / "nope"))
