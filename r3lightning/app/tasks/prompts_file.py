"""Prompts from a dataset file (parquet or JSONL) in verl's column layout (other layouts name their
`Columns`), tokenised with a chat template. The prompts of RL step ``s`` are a pure function
of ``(seed, s)``: a resumed run neither repeats nor skips one, with no cursor to save."""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import orjson
import torch

from r3lightning.app.tasks.settings import check_prompts_file
from r3lightning.rollout.prompts import RolloutPrompt, as_messages, chat_prompt_ids

__all__ = ["Columns", "PromptsFileTask", "load_tokenizer", "lookup",
           "read_rows"]  # fmt: skip

log = logging.getLogger(__name__)

Overlong = Literal["drop", "truncate_left", "truncate_right"]


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """Every row of a ``.parquet`` or ``.jsonl`` / ``.json`` (one object per line) file, as dicts."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"task.path: no such file: {path}")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ImportError(
                "task.path: reading .parquet files needs pyarrow: pip install 'r3lightning[data]'"
            ) from None
        return pq.read_table(path).to_pylist()
    if suffix not in (".jsonl", ".json"):
        raise ValueError(f"task.path must end in .parquet, .jsonl or .json, got {path.name!r}")
    rows = []
    for number, line in enumerate(path.read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            raise ValueError(f"task.path: {path}:{number} is not a JSON object: {exc}") from None
        if not isinstance(row, dict):
            raise ValueError(f"task.path: {path}:{number} must be a JSON object, got {type(row).__name__}")
        rows.append(row)
    return rows


@dataclass(frozen=True)
class Columns:
    """Where a row keeps each field (``task.columns.*``); dotted paths reach into nested columns.
    A missing ``data_source`` column gives ``""``; ``extra_info=None`` passes no extra info."""

    prompt: str = "prompt"
    data_source: str = "data_source"
    ground_truth: str = "reward_model.ground_truth"
    extra_info: str | None = "extra_info"


def lookup(row: Mapping[str, Any], key: str, *, where: str, field: str | None = None) -> Any:
    """``row[a][b]`` for ``key="a.b"``; a missing column is None, or for a required ``field`` of
    `Columns` a ``ValueError`` naming the row, the column, the setting and the row's columns."""
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, Mapping) or part not in value:
            if field is None:
                return None
            raise ValueError(
                f"{where}: no column {key!r} for task.columns.{field} (the row has: "
                f"{', '.join(map(str, row))}); name your file's columns with task.columns.prompt, "
                "task.columns.data_source and task.columns.ground_truth (dotted paths reach into nested columns)"
            )
        value = value[part]
    return value


def load_tokenizer(path: str | Path) -> Any:
    """A tokenizer from a local checkpoint directory; never a hub download."""
    from transformers import AutoTokenizer

    path = Path(path).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"task.tokenizer: expected a local checkpoint directory, got {str(path)!r}")
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


class PromptsFileTask:
    """The prompts of one dataset file, tokenised, served in reproducible shuffled epochs (the
    job's ``task=prompts_file``, whose config comments each argument). ``tokenizer``: an object or
    a local checkpoint directory; prompts over ``max_prompt_length`` ids are dropped, or keep
    their last (``truncate_left``) or first (``truncate_right``) ids, counted and logged."""

    def __init__(
        self,
        path: str | Path,
        tokenizer: Any,
        *,
        columns: Columns | Mapping[str, str | None] | None = None,
        max_prompt_length: int = 1024,
        response_length: int = 256,
        overlong: Overlong = "drop",
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        check_prompts_file(max_prompt_length, response_length, overlong, shuffle, seed)
        if tokenizer is None:
            raise ValueError(
                "task.tokenizer: a prompts file needs the model's tokenizer; set model=hf_checkpoint "
                "model.path=DIR (the default) or task.tokenizer=DIR"
            )
        columns = Columns(**columns) if isinstance(columns, Mapping) else columns or Columns()
        self.tokenizer = load_tokenizer(tokenizer) if isinstance(tokenizer, str | Path) else tokenizer
        self.path = Path(path).expanduser()
        self.response_length, self.shuffle, self.seed = int(response_length), bool(shuffle), int(seed)
        self.dropped = self.truncated = 0
        self.records: list[RolloutPrompt] = []
        self.rows: list[int] = []  # file row of each record (before any drop)
        rows = read_rows(self.path)
        for index, row in enumerate(rows):
            where = f"{self.path.name} row {index}"
            prompt = lookup(row, columns.prompt, where=where, field="prompt")
            ids = chat_prompt_ids(self.tokenizer, as_messages(prompt, where=where))
            if len(ids) > max_prompt_length:
                if overlong == "drop":
                    self.dropped += 1
                    continue
                self.truncated += 1
                ids = ids[-max_prompt_length:] if overlong == "truncate_left" else ids[:max_prompt_length]
            source = lookup(row, columns.data_source, where=where)
            extra = None if columns.extra_info is None else lookup(row, columns.extra_info, where=where)
            truth = lookup(row, columns.ground_truth, where=where, field="ground_truth")
            extra = extra if isinstance(extra, dict) else {}
            self.records.append(RolloutPrompt(ids, "" if source is None else str(source), truth, extra))
            self.rows.append(index)
        if not self.records:
            raise ValueError(
                f"task.path: no usable prompt in {self.path} ({len(rows)} rows, {self.dropped} longer than "
                f"max_prompt_length={max_prompt_length})"
            )
        if self.dropped or self.truncated:
            log.warning(
                f"{self.path.name}: {self.dropped} of {len(rows)} prompts dropped and {self.truncated} "
                f"truncated (longer than max_prompt_length={max_prompt_length} ids)"
            )

    def __len__(self) -> int:
        return len(self.records)

    def epoch_order(self, epoch: int) -> list[int]:
        """The record indices of ``epoch`` in serving order: a permutation seeded by ``(seed, epoch)``."""
        if not self.shuffle:
            return list(range(len(self.records)))
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.records), generator=generator).tolist()

    def prompts_for_step(self, step: int, num_prompts: int) -> list[RolloutPrompt]:
        """Positions ``[step * num_prompts, (step + 1) * num_prompts)`` of the epoch sequence; a step
        that crosses an epoch's end continues into the next permutation."""
        order, n = functools.cache(self.epoch_order), len(self.records)  # one permutation per epoch
        positions = range(step * num_prompts, (step + 1) * num_prompts)
        return [self.records[order(p // n)[p % n]] for p in positions]

    @property
    def stop_token_ids(self) -> list[int]:
        """The tokenizer's end-of-sequence id(s): sent to the engine as stop conditions."""
        eos = getattr(self.tokenizer, "eos_token_id", None)
        return [] if eos is None else [int(e) for e in (eos if isinstance(eos, list | tuple) else [eos])]

    def decode(self, response_ids: Sequence[int]) -> str:
        """The response's text as the reward sees it (special tokens skipped)."""
        return self.tokenizer.decode(list(response_ids), skip_special_tokens=True)
