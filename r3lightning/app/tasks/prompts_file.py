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

__all__ = ["Columns", "PromptsFileTask", "load_tokenizer", "lookup", "read_rows"]

log = logging.getLogger(__name__)

Overlong = Literal["drop", "truncate_left", "truncate_right"]


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """Every row of a dataset file.

    Cost: the whole file is read into memory.

    Args:
        path: A ``.parquet`` file, or a ``.jsonl`` / ``.json`` file of one JSON object per line
            (blank lines are skipped); ``~`` is expanded.

    Returns:
        One dict per row, in file order.

    Raises:
        FileNotFoundError: ``path`` is not a file.
        ImportError: A parquet file without pyarrow installed (the message names the extra).
        ValueError: Another suffix, or a line that is not a JSON object (naming its number).
    """
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

    Args:
        prompt: The chat messages (or a plain string) to prompt with; required.
        data_source: The row's data source, given to the scorer; a missing column gives ``""``.
        ground_truth: The answer the scorer compares with; required.
        extra_info: A mapping of extra fields given to the scorer; None passes none.
    """

    prompt: str = "prompt"
    data_source: str = "data_source"
    ground_truth: str = "reward_model.ground_truth"
    extra_info: str | None = "extra_info"


def lookup(row: Mapping[str, Any], key: str, *, where: str, field: str | None = None) -> Any:
    """The value of a (possibly nested) column of a row.

    Args:
        row: One row of the file.
        key: The column; ``"a.b"`` is ``row["a"]["b"]``.
        where: The row, as error messages name it (``"train.jsonl row 3"``).
        field: The `Columns` field a required column comes from; None: the column is optional.

    Returns:
        The value; None for a missing optional column.

    Raises:
        ValueError: A required column is missing; the message names the row, the column, the
            ``task.columns.*`` setting and the row's columns.
    """
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
    """A tokenizer from a local checkpoint directory; never a hub download.

    Args:
        path: The checkpoint directory; ``~`` is expanded.

    Returns:
        ``AutoTokenizer.from_pretrained(path, local_files_only=True)``.

    Raises:
        FileNotFoundError: ``path`` is not a directory.
    """
    from transformers import AutoTokenizer

    path = Path(path).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"task.tokenizer: expected a local checkpoint directory, got {str(path)!r}")
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


class PromptsFileTask:
    """The prompts of one dataset file, tokenised, served in reproducible shuffled epochs (the
    job's ``task=prompts_file``).

    Cost: the whole file is read and every prompt tokenised when the task is built.

    Args:
        path: The dataset file (`read_rows`).
        tokenizer: A tokenizer object, or a local checkpoint directory holding one; prompts get
            its chat template.
        columns: Where a row keeps each field: a `Columns`, or a mapping of its fields; None:
            verl's layout.
        max_prompt_length: The most ids of a tokenised prompt; a longer prompt is handled as
            ``overlong`` says (counted and logged).
        response_length: The most tokens generated per response.
        overlong: ``drop`` a longer prompt, or keep its last (``truncate_left``) or first
            (``truncate_right``) ``max_prompt_length`` ids.
        shuffle: Serve each epoch of the file in a new permutation, from ``seed``; False: file
            order.
        seed: The permutations' seed.

    Raises:
        ValueError: A setting out of range, no tokenizer, a row without a required column, or
            no usable prompt in the file.
        FileNotFoundError: ``path`` or a tokenizer directory that does not exist.
    """

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
        if isinstance(columns, Mapping):
            columns = Columns(**columns)
        elif columns is None:
            columns = Columns()
        self.tokenizer = load_tokenizer(tokenizer) if isinstance(tokenizer, str | Path) else tokenizer
        self.path = Path(path).expanduser()
        self.response_length = int(response_length)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.dropped = 0  # prompts over max_prompt_length left out (overlong=drop)
        self.truncated = 0  # prompts over max_prompt_length cut to it
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
            truth = lookup(row, columns.ground_truth, where=where, field="ground_truth")
            extra = None
            if columns.extra_info is not None:
                extra = lookup(row, columns.extra_info, where=where)
            if not isinstance(extra, dict):
                extra = {}  # missing, or not a mapping: the scorer gets no extra info
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
        """The record indices of one epoch of the file, in serving order.

        Args:
            epoch: The epoch (0 first).

        Returns:
            A permutation of the record indices seeded by ``(seed, epoch)``; without
            ``shuffle``, file order.
        """
        if not self.shuffle:
            return list(range(len(self.records)))
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.records), generator=generator).tolist()

    def prompts_for_step(self, step: int, num_prompts: int) -> list[RolloutPrompt]:
        """The prompts of one RL step: a pure function of ``(seed, step)``, so a resumed run
        neither repeats nor skips a prompt.

        Args:
            step: The RL step.
            num_prompts: Prompts per step.

        Returns:
            Positions ``[step * num_prompts, (step + 1) * num_prompts)`` of the epochs' serving
            orders laid end to end: a step that crosses an epoch's end continues into the next
            permutation.
        """
        order = functools.cache(self.epoch_order)  # each permutation the step reaches, drawn once
        size = len(self.records)
        prompts = []
        for position in range(step * num_prompts, (step + 1) * num_prompts):
            epoch, offset = divmod(position, size)
            prompts.append(self.records[order(epoch)[offset]])
        return prompts

    @property
    def stop_token_ids(self) -> list[int]:
        """The tokenizer's end-of-sequence id(s): sent to the engine as stop conditions."""
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is None:
            return []
        eos_ids = eos if isinstance(eos, list | tuple) else [eos]  # some tokenizers have several
        return [int(e) for e in eos_ids]

    def decode(self, response_ids: Sequence[int]) -> str:
        """The response's text as the reward sees it.

        Args:
            response_ids: The response's token ids.

        Returns:
            The decoded text, special tokens skipped.
        """
        return self.tokenizer.decode(list(response_ids), skip_special_tokens=True)
