"""Token generation with route recording for the embedded rollout server.

:class:`GenerationEngine` runs a KV-cached sampling loop over a batch of requests on a serving
copy of a Hugging Face causal MoE model: one prefill forward of the left-padded prompts, then one
forward per decode step for the rows still generating, each inside
:func:`~r3lightning.replay.context.record_routes`. Route row ``t`` = the experts used when token
``t`` was an input; the last sampled token is never forwarded, so a ``P``-token prompt that
generates ``G`` tokens yields ``P - prompt_start + G - 1`` rows.

Requests from any thread go through :meth:`GenerationEngine.submit` to one worker thread that
batches whatever is pending; the model runs under one lock, which
:meth:`GenerationEngine.update_weights` also takes, so weights never change mid-generation.
With batch invariance (:mod:`r3lightning.serve.invariance`) a seeded request gets the same
tokens, logprobs and routes whatever else is in flight. Each request succeeds or fails on its
own: a sampling error fails only its request, and a failed batch forward is rerun one request
at a time (same results, by batch invariance).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import queue
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from r3lightning.align.layout import position_ids_from_mask
from r3lightning.replay.context import as_backend, record_routes
from r3lightning.rollout.config import check_setting
from r3lightning.serve.config import EngineConfig
from r3lightning.serve.invariance import batch_invariance_problem, batch_invariant, make_batch_invariant
from r3lightning.serve.perturb import RouterLogitPerturbation
from r3lightning.serve.sampling import MAX_SEED, SamplingParams, sample_token
from r3lightning.serve.weights import check_finite, check_weights, loadable_targets

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt to continue.

    ``routed_experts_prompt_start`` (when ``return_routed_experts``): first route row to return,
    i.e. the number of rows the caller already holds for this conversation (``0`` = all rows).
    """

    prompt_ids: Sequence[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    return_routed_experts: bool = False
    routed_experts_prompt_start: int = 0


@dataclass
class GenerationOutput:
    """What one request produced.

    ``logprobs[i]`` is the log-probability of ``token_ids[i]`` under the distribution it was sampled
    from before top-k / top-p truncation: ``log_softmax(logits / temperature)`` (raw logits when
    greedy), computed in float32 from the serving model's logits.
    ``routed_experts``: int32 ``[prompt_tokens - prompt_start + len(token_ids) - 1, L, K]`` or None.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"
    stop_token_id: int | None
    prompt_tokens: int
    routed_experts: np.ndarray | None = None
    weight_version: int = 0  # engine.weight_version the tokens were sampled with


def _config_int(config, *names: str) -> int:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    raise ValueError(f"model config has none of {names}")


def serving_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A fresh instance of ``model``'s class with a copy of its weights and configs.

    Built from the config rather than deep-copied, so the copy carries none of the source
    model's hooks (a router replay backend attached to a training model must not see the serving
    forwards), gradients or wrappers. Random init draws from a forked RNG (the caller's RNG
    stream is untouched) and is then overwritten. Cost: one init plus one copy of every tensor.
    """
    config = getattr(model, "config", None)
    if config is None:
        raise TypeError(f"expected a Hugging Face causal LM with a .config, got {type(model).__name__}")
    with torch.random.fork_rng(devices=[]):
        fresh = type(model)(copy.deepcopy(config))
    fresh.load_state_dict(model.state_dict())
    if getattr(model, "generation_config", None) is not None:
        fresh.generation_config = copy.deepcopy(model.generation_config)
    return fresh


class GenerationEngine:
    """A KV-cached, route-recording sampling loop over a causal MoE model (see the module docstring).

    ``model``: a Hugging Face causal LM with MoE routers :func:`record_routes` understands.
    ``config`` (:class:`~r3lightning.serve.config.EngineConfig`): unless ``copy_model=False``
    the model is rebuilt as a private copy (:func:`serving_copy`) before the cast to ``dtype``
    on ``device``, so the caller's model, hooks and replay backend are never touched.
    ``batch_invariant=None`` turns invariance on whenever the model allows it (not with
    sliding-window attention or attention sinks, e.g. gpt-oss), ``True`` requires it
    (``ValueError`` otherwise), ``False`` batches the padded forward directly: faster, but results
    then depend on the batch within bf16 rounding. ``simulated_disagreement`` attaches a
    :class:`~r3lightning.serve.perturb.RouterLogitPerturbation`, recalibrated after every weight
    update (about 12 forwards of a 128-token probe batch).
    Cost: two host syncs per row and decode step (token id and logprob), plus a host copy of each
    forward's routes when a request asks for them. :attr:`invariant_tile_rows` is the row tile of
    the batch-invariant GEMMs.
    """

    invariant_tile_rows: int = 64

    def __init__(self, model: torch.nn.Module, config: EngineConfig | None = None) -> None:
        config = EngineConfig() if config is None else config
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        self.config = config
        device = config.device if config.device is not None else next(model.parameters()).device
        if config.copy_model:
            model = serving_copy(model)
        self.model = model.to(device=device, dtype=config.dtype).eval().requires_grad_(False)
        forward_args = inspect.signature(self.model.forward).parameters
        # transformers >= 5.20 renamed past_key_values to cache (the old name warns)
        self._cache_arg = "cache" if "cache" in forward_args else "past_key_values"
        invariant = config.batch_invariant
        self.batch_invariant = (
            batch_invariance_problem(self.model) is None if invariant is None else invariant
        )
        if self.batch_invariant:
            make_batch_invariant(self.model)
        self.device, self.dtype = torch.device(device), config.dtype
        routers = as_backend(self.model)  # the route schema record_routes produces
        self.num_layers, self.top_k, self.num_experts = routers.num_layers, routers.top_k, routers.num_experts
        self._moe_layers = list(routers.moe_layers)
        self.vocab_size = _config_int(model.config, "vocab_size")
        self.max_context = _config_int(model.config, "max_position_embeddings")
        self.pad_token_id = getattr(model.config, "pad_token_id", None) or 0
        self.eos_token_ids = self._eos_ids(model)
        self.max_batch_size, self.batch_wait_s = config.max_batch_size, config.batch_wait_s
        self.weight_version = 0
        self._seed_generator = torch.Generator().manual_seed(config.seed)
        self._lock = threading.Lock()  # held while the model runs or its weights change
        self._worker_lock = threading.Lock()  # orders submit() against close()
        self._queue: queue.SimpleQueue[tuple[GenerationRequest, Future] | None] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._closed = False
        self.perturbation: RouterLogitPerturbation | None = None
        if config.simulated_disagreement is not None:
            self.perturbation = RouterLogitPerturbation(self.model, config.simulated_disagreement)
            self._calibrate_perturbation()

    @staticmethod
    def _eos_ids(model: torch.nn.Module) -> frozenset[int]:
        ids: set[int] = set()
        for source in (getattr(model, "generation_config", None), model.config):
            eos = getattr(source, "eos_token_id", None)
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, list | tuple):
                ids.update(int(e) for e in eos)
        return frozenset(ids)

    # ------------------------------------------------------------------ validation

    def check_request(self, request: GenerationRequest, *, prompt_field: str = "prompt_ids") -> None:
        """Raise ``ValueError`` naming the field if ``request`` cannot run on this model.

        ``prompt_field``: how error messages name the prompt (the wire protocols call it
        ``token_ids`` or ``input_ids``). Cost: two C-speed passes over the prompt.
        """
        prompt = request.prompt_ids
        if len(prompt) == 0:
            raise ValueError(f"{prompt_field} must not be empty")
        if not all(type(token) is int for token in prompt):
            bad = next(token for token in prompt if type(token) is not int)
            raise ValueError(f"{prompt_field} must hold integer token ids, got {bad!r}")
        low, high = min(prompt), max(prompt)
        if low < 0 or high >= self.vocab_size:
            bad = low if low < 0 else high
            raise ValueError(
                f"{prompt_field} holds token id {bad} at index {list(prompt).index(bad)}; "
                f"expected ids in [0, {self.vocab_size})"
            )
        if len(prompt) >= self.max_context:
            raise ValueError(
                f"{prompt_field} has {len(prompt)} tokens, leaving no room in the model context "
                f"of {self.max_context}"
            )
        for token in request.params.stop_token_ids:
            if token >= self.vocab_size:
                raise ValueError(
                    f"sampling_params.stop_token_ids must be in [0, {self.vocab_size}), got {token}"
                )
        check_setting("routed_experts_prompt_start", request.routed_experts_prompt_start, low=0, integer=True)
        if request.routed_experts_prompt_start > len(prompt):
            raise ValueError(
                f"routed_experts_prompt_start must be <= the prompt length {len(prompt)}, "
                f"got {request.routed_experts_prompt_start}"
            )

    # ------------------------------------------------------------------ generation

    def generate(
        self, requests: Sequence[GenerationRequest], *, return_exceptions: bool = False
    ) -> list[GenerationOutput]:
        """Run ``requests`` as one batch on the calling thread (blocks while the model is busy).

        A request whose sampling fails does not stop the others: with ``return_exceptions`` its
        entry is the exception, otherwise the first such exception is raised after the batch.
        """
        for request in requests:
            self.check_request(request)
        with self._lock:
            results = self._generate_batch(list(requests))
        if not return_exceptions:
            for result in results:
                if isinstance(result, Exception):
                    raise result
        return results  # type: ignore[return-value]

    @torch.inference_mode()
    def _generate_batch(self, requests: list[GenerationRequest]) -> list[GenerationOutput | Exception]:
        batch = len(requests)
        lengths = [len(r.prompt_ids) for r in requests]
        width = max(lengths)
        ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros(batch, width, dtype=torch.bool)
        for row, request in enumerate(requests):
            ids[row, width - lengths[row] :] = torch.tensor(list(request.prompt_ids), dtype=torch.long)
            mask[row, width - lengths[row] :] = True
        positions = position_ids_from_mask(mask)
        ids, mask, positions = (t.to(self.device) for t in (ids, mask, positions))
        starts = [width - n for n in lengths]  # first real key of each cache row (host ints)

        budgets = [
            min(r.params.max_new_tokens, self.max_context - n) for r, n in zip(requests, lengths, strict=True)
        ]
        generators = [self._generator(r.params.seed) for r in requests]
        stops = [
            frozenset(r.params.stop_token_ids) | (frozenset() if r.params.ignore_eos else self.eos_token_ids)
            for r in requests
        ]
        record = any(r.return_routed_experts for r in requests)
        route_rows: list[list[Tensor]] = [[] for _ in requests]
        # finish reason fixed up when a stop token is sampled
        outputs: list[GenerationOutput | Exception] = [
            GenerationOutput([], [], "length", None, prompt_tokens=n, weight_version=self.weight_version)
            for n in lengths
        ]

        cache = self._new_cache()
        logits, routes = self._forward(ids, mask, positions, cache, record, starts)  # [B, V], [B, S, L, K]
        if routes is not None:
            for row, n in enumerate(lengths):
                route_rows[row].append(routes[row, width - n :])
        active = list(range(batch))  # request index of each row still in the cache
        while active:
            next_ids: list[int] = []
            keep: list[int] = []  # cache rows whose sampled token gets forwarded
            for cache_row, index in enumerate(active):
                out = outputs[index]
                assert isinstance(out, GenerationOutput)
                try:
                    token, logprob = sample_token(
                        logits[cache_row], requests[index].params, generators[index]
                    )
                except Exception as exc:  # this request fails; its batch-mates go on
                    logger.warning("sampling failed for one request of a batch of %d: %s", batch, exc)
                    outputs[index] = exc
                    continue
                out.token_ids.append(token)
                out.logprobs.append(logprob)
                if token in stops[index]:
                    out.finish_reason, out.stop_token_id = "stop", token
                elif len(out.token_ids) < budgets[index]:
                    keep.append(cache_row)
                    next_ids.append(token)
            if not keep:
                break
            if len(keep) < len(active):
                # Finished rows leave the batch: later steps only pay for live rows.
                select = torch.tensor(keep, device=self.device)
                cache.batch_select_indices(select)
                mask, positions = mask[select], positions[select]
                active = [active[r] for r in keep]
                starts = [starts[r] for r in keep]
            mask = torch.cat([mask, mask.new_ones(len(active), 1)], dim=1)
            positions = positions[:, -1:] + 1
            step_ids = torch.tensor(next_ids, dtype=torch.long, device=self.device)[:, None]
            logits, routes = self._forward(step_ids, mask, positions, cache, record, starts)
            if routes is not None:
                for cache_row, index in enumerate(active):
                    route_rows[index].append(routes[cache_row])

        for index, request in enumerate(requests):
            out = outputs[index]
            if request.return_routed_experts and isinstance(out, GenerationOutput):
                rows = torch.cat(route_rows[index])[request.routed_experts_prompt_start :]
                out.routed_experts = rows.numpy()  # [rows, L, K]
        return outputs

    def _forward(
        self, ids: Tensor, mask: Tensor, positions: Tensor, cache, record: bool, starts: list[int]
    ) -> tuple[Tensor, Tensor | None]:
        """One forward; returns last-position float32 logits ``[B, V]`` and host routes ``[B, S, L, K]``.

        ``starts``: first real key position of each row (its left padding), for batch invariance.
        """
        kwargs = {"input_ids": ids, "attention_mask": mask, "position_ids": positions}
        kwargs.update({self._cache_arg: cache, "use_cache": True, "logits_to_keep": 1})
        invariant = (
            batch_invariant(starts, self.invariant_tile_rows)
            if self.batch_invariant
            else contextlib.nullcontext()
        )
        with invariant:
            if not record:
                return self.model(**kwargs).logits[:, -1].float(), None
            with record_routes(self.model) as recorder:
                logits = self.model(**kwargs).logits[:, -1].float()
        return logits, recorder.routes.cpu()

    @torch.inference_mode()
    def _calibrate_perturbation(self) -> None:
        """Fit the simulated disagreement's scale to the current weights (caller holds the lock)."""
        assert self.perturbation is not None
        probe = self.perturbation.probe.to(self.device)  # [n, length]
        mask = torch.ones_like(probe, dtype=torch.bool)
        positions = position_ids_from_mask(mask)
        starts = [0] * probe.shape[0]

        def routes() -> Tensor:
            invariant = (
                batch_invariant(starts, self.invariant_tile_rows)
                if self.batch_invariant
                else contextlib.nullcontext()
            )
            with invariant, record_routes(self.model) as recorder:
                self.model(input_ids=probe, attention_mask=mask, position_ids=positions, use_cache=False)
            return recorder.routes[..., self._moe_layers, :]  # [n, length, moe_layers, K]

        scale = self.perturbation.calibrate(routes)
        logger.info(
            "simulated router disagreement: target %.4f, measured %.4f on the probe (scale %.4g)",
            self.perturbation.target,
            self.perturbation.measured,
            scale,
        )

    def _new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def _generator(self, seed: int | None) -> torch.Generator:
        if seed is None:
            seed = int(torch.randint(MAX_SEED, (1,), generator=self._seed_generator))
        return torch.Generator(device=self.device).manual_seed(seed)

    # ------------------------------------------------------------------ worker thread

    def submit(self, request: GenerationRequest, *, prompt_field: str = "prompt_ids") -> Future:
        """Queue ``request`` for the worker thread; the future resolves to a :class:`GenerationOutput`.

        Validates first (``ValueError`` raised here, not through the future; see
        :meth:`check_request`).
        """
        self.check_request(request, prompt_field=prompt_field)
        future: Future = Future()
        # Under the lock that close() takes, so nothing is queued behind the worker's stop
        # sentinel (its future would never resolve) and no worker starts after close().
        with self._worker_lock:
            if self._closed:
                raise RuntimeError("the generation engine is closed")
            if self._worker is None:
                self._worker = threading.Thread(target=self._serve, name="r3-generation", daemon=True)
                self._worker.start()
            self._queue.put((request, future))
        return future

    def _serve(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            pending = [item]
            stop = False
            while len(pending) < self.max_batch_size:
                try:
                    item = self._queue.get(timeout=self.batch_wait_s)
                except queue.Empty:
                    break
                if item is None:
                    stop = True
                    break
                pending.append(item)
            pending = [(r, f) for r, f in pending if f.set_running_or_notify_cancel()]
            if pending:
                results = self._run_isolated([r for r, _ in pending])
                for (_, future), result in zip(pending, results, strict=True):
                    if isinstance(result, Exception):
                        future.set_exception(result)
                    else:
                        future.set_result(result)
            if stop:
                return

    def _run_isolated(self, requests: list[GenerationRequest]) -> list[GenerationOutput | Exception]:
        """Each request's output or its own exception; the worker lives on whatever fails.

        A failing batch forward is retried one request at a time, so only the request that
        causes it fails (the others get what the batch would have given them: batch invariance).
        """
        try:
            return self.generate(requests, return_exceptions=True)  # type: ignore[return-value]
        except Exception as exc:
            if len(requests) == 1:
                logger.warning("generation request failed: %s", exc)
                return [exc]
            logger.warning(
                "generation batch of %d failed (%s); running its requests one by one", len(requests), exc
            )
            return [self._run_isolated([request])[0] for request in requests]

    def close(self) -> None:
        """Stop the worker after the requests already queued; idempotent."""
        with self._worker_lock:
            if self._closed:
                return
            self._closed = True
            worker = self._worker
            if worker is not None:
                self._queue.put(None)
        if worker is not None:
            worker.join()

    # ------------------------------------------------------------------ weights

    def update_weights(self, state_dict: Mapping[str, Tensor], *, strict: bool = False) -> int:
        """Copy ``state_dict`` (floating tensors of any width from fp16, any device) into the serving
        model; returns the count.

        All or nothing: every tensor is checked first (names, shapes, dtypes and finite values,
        see :mod:`r3lightning.serve.weights`; ``strict`` also fails on missing names), then the
        copy waits for the running batch, so weights never change mid-generation. Cost: one
        finiteness pass and one copy (and cast) per tensor, host->device when on the host.
        """
        targets = loadable_targets(self.model)
        for name, value in state_dict.items():
            if not isinstance(value, Tensor):
                raise ValueError(f"state_dict[{name!r}] must be a tensor, got {type(value).__name__}")
        check_weights(targets, {k: (v.dtype, tuple(v.shape)) for k, v in state_dict.items()}, strict=strict)
        check_finite(state_dict, targets)
        with self._lock, torch.no_grad():
            for name, value in state_dict.items():
                targets[name].copy_(value)
            self.weight_version += 1
            if self.perturbation is not None:
                self._calibrate_perturbation()
        return len(state_dict)
