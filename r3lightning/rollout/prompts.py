"""What a rollout request carries (prompt, sampling settings, seed) and how its answer is scored:
``reward_fn(prompt, response_ids)`` returns a real number or ``{"score": number, ...}``."""

from __future__ import annotations

import hashlib
import logging
import math
import numbers
import operator
import struct
import sys
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from r3lightning.wire.request import engine_sampling_params

__all__ = [
    "GuardedReward",
    "RewardFn",
    "RolloutPrompt",
    "SamplingConfig",
    "TextReward",
    "as_messages",
    "chat_prompt_ids",
    "sampling_seed",
    "score_value",
    "text_reward",
    "token_id_list",
]

log = logging.getLogger(__name__)

_MAX_SEED = 2**31 - 1  # what every engine accepts as a sampling seed


def sampling_seed(seed: int, step: int, group: int, sample: int = 0, turn: int = 0) -> int:
    """One request's sampling seed in ``[0, 2**31 - 1)`` (what every engine accepts), hashed so that
    seeds of different steps or groups never collide in a pattern (turn 0 hashes the first four).

    Args:
        seed, step, group, sample, turn: The collector's seed and the request's coordinates.
    """
    fields = (seed, step, group, sample) if turn == 0 else (seed, step, group, sample, turn)
    digest = hashlib.blake2b(struct.pack(f"<{len(fields)}q", *fields), digest_size=8).digest()
    return int.from_bytes(digest, "little") % _MAX_SEED


def token_id_list(values: Any, what: str, *, allow_empty: bool = False) -> list[int]:
    """Token ids as Python ints, what JSON needs.

    Args:
        values: A sequence, ndarray or tensor of integer ids >= 0 (bools refused).
        what: Names the value in the error.
        allow_empty: Accept no ids.

    Raises:
        ValueError: Anything else, naming ``what``.
    """
    ids = None
    if not isinstance(values, str | bytes):
        try:
            values = values.tolist() if hasattr(values, "tolist") else list(values)
            ids = [operator.index(v) for v in values if not isinstance(v, bool)]
        except TypeError:
            pass
    if ids is None or len(ids) != len(values) or not (ids or allow_empty) or min(ids, default=0) < 0:
        expected = "a sequence" if allow_empty else "a non-empty sequence"
        raise ValueError(f"{what} must be {expected} of token ids >= 0, got {values!r:.80}")
    return ids


@dataclass
class RolloutPrompt:
    """One prompt and what its reward needs.

    Args:
        token_ids: The prompt's token ids (non-empty, non-negative ints).
        data_source: verl's dataset field, passed to the reward untouched.
        ground_truth: verl's dataset field, passed to the reward untouched.
        extra_info: verl's dataset field, passed to the reward untouched.

    Raises:
        ValueError: ``token_ids`` is empty or holds something other than non-negative ints.
    """

    token_ids: list[int]
    data_source: str | None = None
    ground_truth: Any = None
    extra_info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.token_ids = token_id_list(self.token_ids, "RolloutPrompt.token_ids")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingConfig:
    """Sampling settings of every request, spelled per protocol by
    [`engine_sampling_params`][r3lightning.wire.request.engine_sampling_params].

    Args:
        temperature: 0 is greedy.
        top_p: In ``(0, 1]``; 1 disables the filter.
        top_k: -1 or 0 disables the filter.
        max_new_tokens: The longest response.
        ignore_eos: Keep sampling past an end-of-sequence token.
        stop_token_ids: Ids that also end a response (e.g. a chat template's end of turn).
        extra: Engine-specific parameters, merged in as they are.

    Raises:
        ValueError: A field of the wrong type or out of range (the message names it).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 256
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None  # e.g. the tokenizer's end-of-turn ids
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        temperature, top_p = (
            None if isinstance(v, bool) else _real(v) for v in (self.temperature, self.top_p)
        )
        stop = self.stop_token_ids
        ids = isinstance(stop, list | tuple) and all(_is_int(t) and t >= 0 for t in stop)
        checks = (
            ("temperature", "a finite number >= 0", temperature is not None and temperature >= 0),
            ("top_p", "a number in (0, 1]", top_p is not None and 0 < top_p <= 1),
            ("top_k", "an integer >= -1 (-1 or 0: no filter)", _is_int(self.top_k) and self.top_k >= -1),
            ("max_new_tokens", "an integer >= 1", _is_int(self.max_new_tokens) and self.max_new_tokens >= 1),
            ("ignore_eos", "true or false", isinstance(self.ignore_eos, bool)),
            ("stop_token_ids", "null or a list of token ids >= 0", stop is None or ids),
            ("extra", "a mapping of extra sampling parameters", isinstance(self.extra, Mapping)),
        )
        for name, expected, ok in checks:
            if not ok:
                raise ValueError(f"{name} must be {expected}, got {getattr(self, name)!r}")

    def wire_params(self, protocol: str, seed: int) -> dict[str, Any]:
        """The request's ``sampling_params`` in ``protocol``'s names, ``extra`` merged last.

        Args:
            protocol, seed: As for `engine_sampling_params`.
        """
        fields = ("max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "ignore_eos")
        params = engine_sampling_params(protocol, seed=seed, **{f: getattr(self, f) for f in fields})
        return {**params, **self.extra}


RewardFn = Callable[[RolloutPrompt, list[int]], "float | Mapping[str, Any] | Awaitable[Any]"]


def _real(value: Any) -> float | None:
    """``value`` as a finite float when it is one real number (a Python or numpy number, a bool,
    a one-element ndarray or tensor); else None."""
    torch = sys.modules.get("torch")  # a tensor exists only once torch is imported: never import it here
    if torch is not None and isinstance(value, torch.Tensor):
        value = value.item() if value.numel() == 1 else None
    elif isinstance(value, np.ndarray | np.generic):
        value = value.item() if value.size == 1 else None
    if not isinstance(value, numbers.Real):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


_FLOAT32_MAX = float(np.finfo(np.float32).max)


def score_value(value: Any, where: str) -> float:
    """The reward of a ``reward_fn`` result, within float32 range (batches carry rewards as float32).

    Args:
        value: A real number, or a mapping with a ``score`` entry.
        where: Names the sample in the error.

    Raises:
        ValueError: Anything else: NaN, inf, text, several numbers, a mapping without ``score``.
    """
    if isinstance(value, Mapping):
        if "score" not in value:
            raise ValueError(
                f"reward_fn returned a mapping without a 'score' entry for {where}: {value!r:.120}"
            )
        value = value["score"]
    number = _real(value)
    if number is None:
        raise ValueError(
            f"reward_fn must return a finite number (or {{'score': number}}) for {where}, got {value!r}"
        )
    if abs(number) > _FLOAT32_MAX:  # batches carry rewards and advantages as float32
        raise ValueError(
            f"reward_fn must return a number within float32 range (|score| <= {_FLOAT32_MAX:.4g}) "
            f"for {where}, got {number!r}"
        )
    return number


def callable_name(fn: Any) -> str:
    """``fn``'s qualified name, through a ``functools.partial`` (Hydra's ``_partial_: true``).

    Args:
        fn: Any callable.
    """
    target = getattr(fn, "func", fn)
    return getattr(target, "__qualname__", None) or type(target).__name__


_TIMED_OUT = object()


def in_daemon_thread(fn: Callable[..., Any], *args: Any, name: str = "r3-reward") -> futures.Future:
    """A future of ``fn(*args)`` started in a fresh daemon thread (~0.1 ms to start): a caller can
    stop waiting, and a call that never returns is left behind without blocking the exit.

    Args:
        fn, *args: The call.
        name: The thread's name.
    """
    done: futures.Future = futures.Future()

    def run() -> None:
        if not done.set_running_or_notify_cancel():  # running: a caller that gives up cannot cancel it
            return
        try:
            done.set_result(fn(*args))
        except BaseException as exc:  # handed to the caller
            done.set_exception(exc)

    threading.Thread(target=run, daemon=True, name=name).start()
    return done


def _bounded_call(fn: Callable[..., Any], timeout_s: float | None, *args: Any) -> Any:
    """``fn(*args)``, or ``_TIMED_OUT`` after ``timeout_s`` (None: called inline), in a daemon thread."""
    if timeout_s is None:
        return fn(*args)
    done = in_daemon_thread(fn, *args)
    if not futures.wait([done], timeout_s).done:
        return _TIMED_OUT
    return done.result()


class GuardedReward:
    """``score(prompt, response_ids)`` made safe inside a collection (thread-safe): a non-number result
    or a raising scorer (if ``errors_score_zero``) scores 0 and counts in ``reward/failures``, one
    running past ``timeout_s`` seconds scores 0 and counts in ``reward/timeouts`` (each logged once
    per run). A mapping's ``score`` is the reward; its other real entries average into ``reward/<key>``.

    Args:
        score: The scorer, sync.
        timeout_s: Seconds a call may take, run in a daemon thread (None: inline, unbounded).
        errors_score_zero: Score a raising scorer 0 instead of raising.
        name: Names the scorer in logs (default: its qualified name).

    Raises:
        ValueError: ``timeout_s`` not a number > 0 or None.
    """

    def __init__(
        self,
        score: Callable[[RolloutPrompt, list[int]], Any],
        *,
        timeout_s: float | None = 60.0,
        errors_score_zero: bool = True,
        name: str | None = None,
    ) -> None:
        if timeout_s is not None and (isinstance(timeout_s, bool) or (_real(timeout_s) or 0) <= 0):
            raise ValueError(f"timeout_s must be a number > 0 or None, got {timeout_s!r}")
        self.score = score
        self.timeout_s = timeout_s
        self.errors_score_zero = errors_score_zero
        self.name = name or callable_name(score)
        self._lock = threading.Lock()
        # since pop_metrics: responses scored, sums of their extra entries, zeros of each kind
        self._count = 0
        self._sums = Counter()
        self._zeros = Counter()
        self._logged: set[str] = set()  # "failures" / "timeouts" already logged: once per run

    def __call__(self, prompt: RolloutPrompt, response_ids: list[int]) -> float:
        try:
            value = _bounded_call(self.score, self.timeout_s, prompt, response_ids)
            if value is _TIMED_OUT:
                return self._zero("timeouts", f"did not return within {self.timeout_s:g} s", None)
            reward = score_value(value, self.name)
        except Exception as exc:
            if not self.errors_score_zero:
                raise
            return self._zero("failures", f"raised {type(exc).__name__}: {' '.join(str(exc).split())}", exc)
        pairs = value.items() if isinstance(value, Mapping) else ()
        extra = {str(k): _real(v) for k, v in pairs if k != "score"}
        with self._lock:
            self._count += 1
            self._sums.update({k: v for k, v in extra.items() if v is not None})  # a Counter: adds
        return reward

    def _zero(self, kind: str, what: str, exc: BaseException | None) -> float:
        with self._lock:
            self._count += 1
            self._zeros[kind] += 1
            first = kind not in self._logged
            self._logged.add(kind)
        if first:
            message = "reward %s %s; the response scored 0 (counted in reward/%s; logged once per run)"
            log.warning(message, self.name, what, kind, exc_info=exc)
        return 0.0

    def pop_metrics(self) -> dict[str, float]:
        """``reward/<key>`` (the mean of each extra entry over the responses scored since the last
        call; a response without it counts as 0), ``reward/failures`` and ``reward/timeouts``;
        then resets them."""
        with self._lock:
            count = self._count
            sums = self._sums
            zeros = self._zeros
            self._count = 0
            self._sums = Counter()
            self._zeros = Counter()
        metrics = {f"reward/{k}": v / max(count, 1) for k, v in sums.items()}
        return metrics | {f"reward/{kind}": float(zeros[kind]) for kind in ("failures", "timeouts")}


class TextReward(GuardedReward):
    """A `GuardedReward` of a verl-style scorer on the decoded response: one bad row never ends a run.

    Args:
        compute_score: ``(data_source, solution_str, ground_truth, extra_info=None) -> score``.
        decode: ``response_ids -> text`` (e.g. a tokenizer's ``decode``).
        timeout_s: As for `GuardedReward`.

    Raises:
        TypeError: ``compute_score`` is not callable.
    """

    def __init__(
        self,
        compute_score: Callable[..., Any],
        decode: Callable[[list[int]], str],
        *,
        timeout_s: float | None = 60.0,
    ) -> None:
        if not callable(compute_score):
            raise TypeError(f"reward: compute_score must be callable, got {compute_score!r}")
        self.compute_score = compute_score
        self.decode = decode
        super().__init__(self._verl_score, timeout_s=timeout_s, name=callable_name(compute_score))

    def _verl_score(self, prompt: RolloutPrompt, response_ids: list[int]) -> Any:
        text = self.decode(response_ids)
        return self.compute_score(prompt.data_source, text, prompt.ground_truth, extra_info=prompt.extra_info)


text_reward = TextReward  # the spelling of verl recipes


def as_messages(prompt: Any, *, where: str) -> list[dict[str, str]]:
    """verl's chat messages as they are; a plain string becomes one user message.

    Args:
        prompt: A string or a non-empty list of ``{"role", "content"}`` string mappings.
        where: Names the prompt in the error.

    Raises:
        ValueError: Anything else.
    """
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if not (isinstance(prompt, Sequence) and prompt and all(isinstance(m, Mapping) for m in prompt)):
        raise ValueError(
            f"{where}: the prompt must be a string or a non-empty list of chat messages, got {prompt!r}"
        )
    for m in prompt:
        if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: each message needs string 'role' and 'content', got {dict(m)}")
    return [{"role": m["role"], "content": m["content"]} for m in prompt]


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """``apply_chat_template(messages, add_generation_prompt=True)`` as a plain list of ids.

    Args:
        tokenizer, messages: A Hugging Face tokenizer and the chat.
    """
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, Mapping):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return [int(i) for i in ids]
