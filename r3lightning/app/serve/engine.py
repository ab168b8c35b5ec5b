"""Token generation with route recording for the embedded rollout server (`GenerationEngine`)."""

from __future__ import annotations

import contextlib
import inspect
import logging
import queue
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future

import torch
from torch import Tensor

from r3lightning.app.serve.config import EngineConfig
from r3lightning.app.serve.invariance import batch_invariance_problem, batch_invariant, make_batch_invariant
from r3lightning.app.serve.perturb import RouterLogitPerturbation
from r3lightning.app.serve.requests import GenerationOutput, GenerationRequest
from r3lightning.app.serve.sampling import MAX_SEED, sample_token
from r3lightning.app.serve.weights import check_finite, check_weights, loadable_targets, serving_copy
from r3lightning.checks import check_setting
from r3lightning.padded import position_ids_from_mask
from r3lightning.replay.context import as_backend, record_routes

logger = logging.getLogger(__name__)


class GenerationEngine:
    """A KV-cached sampling loop recording routes (``P`` prompt and ``G`` sampled tokens: ``P -
    prompt_start + G - 1`` rows); one worker thread batches what `submit` queues. Cost: two
    host syncs per row and step, a host copy of each forward's routes when asked for.

    Args:
        model: the Hugging Face causal MoE LM to serve; moved to ``config.device`` and
            ``config.dtype`` in place unless ``config.copy_model``.
        config: device, dtype, batching, seed and serving options (`EngineConfig()` if None).

    Raises:
        TypeError: ``config`` is not an `EngineConfig`.
        ValueError: the model's routers are not of a supported family, or
            ``config.simulated_disagreement`` cannot be calibrated on it.
    """

    invariant_tile_rows: int = 64  # the row tile of the batch-invariant GEMMs

    def __init__(self, model: torch.nn.Module, config: EngineConfig | None = None) -> None:
        self.config = config = EngineConfig() if config is None else config
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        self.device = torch.device(config.device or next(model.parameters()).device)
        served = serving_copy(model) if config.copy_model else model
        self.model = served.to(self.device, config.dtype).eval().requires_grad_(False)
        # transformers >= 5.20 renamed past_key_values to cache (the old name warns)
        arguments = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in arguments else "past_key_values"
        self.batch_invariant = config.batch_invariant
        if self.batch_invariant is None:  # whenever the model allows
            self.batch_invariant = batch_invariance_problem(self.model) is None
        if self.batch_invariant:
            make_batch_invariant(self.model)
        routers = as_backend(self.model)  # the route schema record_routes produces
        self.num_layers = routers.num_layers
        self.top_k = routers.top_k
        self.num_experts = routers.num_experts
        self._moe_layers = list(routers.moe_layers)
        settings = self.model.config
        self.vocab_size = settings.vocab_size
        self.max_context = settings.max_position_embeddings
        self.pad_token_id = getattr(settings, "pad_token_id", None) or 0
        eos: set[int] = set()
        for source in (getattr(model, "generation_config", None), settings):
            ids = getattr(source, "eos_token_id", None)
            eos.update(int(e) for e in ([ids] if isinstance(ids, int) else ids or ()))
        self.eos_token_ids = frozenset(eos)
        self.weight_version = 0
        self._seed_generator = torch.Generator().manual_seed(config.seed)
        self._lock = threading.Lock()  # held while the model runs or its weights change
        self._worker_lock = threading.Lock()  # orders submit() against close()
        self._queue: queue.SimpleQueue[tuple[GenerationRequest, Future] | None] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._closed = False
        # pause(): the worker starts no batch while paused and pause() waits out the running one
        self._gate = threading.Condition()
        self._paused = False
        self._busy = False
        self.perturbation: RouterLogitPerturbation | None = None
        if config.simulated_disagreement is not None:
            self.perturbation = RouterLogitPerturbation(self.model, config.simulated_disagreement)
            self._calibrate_perturbation()

    def check_request(self, request: GenerationRequest, *, prompt_field: str = "prompt_ids") -> None:
        """Refuse a request that cannot run on this model. Cost: two C-speed passes over the prompt.

        Args:
            request: the prompt and its sampling and route options.
            prompt_field: what an error calls the prompt (the wire protocol's field name).

        Raises:
            ValueError: naming the field: an empty prompt, a token id outside the vocabulary, a
                prompt that fills the context, a stop token outside the vocabulary, or a
                ``routed_experts_prompt_start`` outside ``[0, len(prompt)]``.
        """
        prompt = request.prompt_ids
        start = request.routed_experts_prompt_start
        vocab = self.vocab_size
        n = len(prompt)
        if n == 0:
            raise ValueError(f"{prompt_field} must not be empty")
        bad = next((token for token in prompt if type(token) is not int), None)
        if bad is not None:
            raise ValueError(f"{prompt_field} must hold integer token ids, got {bad!r}")
        bad = next((t for t in (min(prompt), max(prompt)) if not 0 <= t < vocab), None)
        if bad is not None:
            where = f"at index {list(prompt).index(bad)}"
            raise ValueError(f"{prompt_field} holds token id {bad} {where}; expected ids in [0, {vocab})")
        if n >= self.max_context:
            room = f"leaving no room in the model context of {self.max_context}"
            raise ValueError(f"{prompt_field} has {n} tokens, {room}")
        bad = next((t for t in request.params.stop_token_ids if t >= vocab), None)
        if bad is not None:
            raise ValueError(f"sampling_params.stop_token_ids must be in [0, {vocab}), got {bad}")
        check_setting("routed_experts_prompt_start", start, low=0, integer=True)
        if start > n:
            raise ValueError(f"routed_experts_prompt_start must be <= the prompt length {n}, got {start}")

    def generate(
        self, requests: Sequence[GenerationRequest], *, return_exceptions: bool = False
    ) -> list[GenerationOutput | Exception]:
        """Run ``requests`` as one batch on the calling thread (it waits for a running batch or
        weight update). Cost: one prefill and one forward per sampled token of the longest request;
        two host syncs per row and step.

        Args:
            requests: the batch; each is checked with `check_request` first.
            return_exceptions: a request whose sampling fails gets its exception as its entry
                (its batch-mates go on); without it the first such exception is raised.

        Returns:
            One `GenerationOutput` per request, in order (an exception only with
            ``return_exceptions``).

        Raises:
            ValueError: a request `check_request` refuses (nothing runs).
        """
        for request in requests:
            self.check_request(request)
        with self._lock:
            results = self._generate_batch(list(requests))
        errors = [r for r in results if isinstance(r, Exception)]
        if errors and not return_exceptions:
            raise errors[0]
        return results

    @torch.inference_mode()
    def _generate_batch(self, requests: list[GenerationRequest]) -> list[GenerationOutput | Exception]:
        batch = len(requests)
        lengths = [len(r.prompt_ids) for r in requests]
        starts = [max(lengths) - n for n in lengths]  # first real key of each cache row (host ints)
        ids = torch.full((batch, max(lengths)), self.pad_token_id, dtype=torch.long)  # [B, S], left-padded
        for row, request in enumerate(requests):
            ids[row, starts[row] :] = torch.tensor(list(request.prompt_ids), dtype=torch.long)
        mask = torch.arange(max(lengths))[None, :] >= torch.tensor(starts)[:, None]  # [B, S]
        positions = position_ids_from_mask(mask).to(self.device)  # [B, S]
        ids = ids.to(self.device)
        mask = mask.to(self.device)
        params = [r.params for r in requests]
        budgets = [min(p.max_new_tokens, self.max_context - n) for p, n in zip(params, lengths, strict=True)]
        generators = [self._generator(p.seed) for p in params]
        stops = [set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids) for p in params]
        record = any(r.return_routed_experts for r in requests)
        route_rows: list[list[Tensor]] = [[] for _ in requests]
        version = self.weight_version
        outputs: list = [GenerationOutput([], [], "length", None, n, weight_version=version) for n in lengths]
        from transformers import DynamicCache  # imported only here: transformers is an optional extra

        cache = DynamicCache(config=self.model.config)
        logits, routes = self._forward(ids, mask, positions, starts, cache, record)  # [B, V], [B, S, L, K]
        for row in range(batch) if routes is not None else ():
            route_rows[row].append(routes[row, starts[row] :])
        active = list(range(batch))  # request index of each row still in the cache
        while active:
            next_ids = []
            keep = []  # the cache rows whose sampled token gets forwarded
            for cache_row, index in enumerate(active):
                out = outputs[index]
                try:
                    token, logprob = sample_token(logits[cache_row], params[index], generators[index])
                except Exception as exc:  # this request fails; its batch-mates go on
                    logger.warning("sampling failed for one request of a batch of %d: %s", batch, exc)
                    outputs[index] = exc
                    continue
                out.token_ids.append(token)
                out.logprobs.append(logprob)
                if token in stops[index]:
                    out.finish_reason = "stop"
                    out.stop_token_id = token
                elif len(out.token_ids) < budgets[index]:
                    keep.append(cache_row)
                    next_ids.append(token)
            if not keep:
                break
            if len(keep) < len(active):  # finished rows leave: later steps pay for live rows only
                select = torch.tensor(keep, device=self.device)
                cache.batch_select_indices(select)
                mask = mask[select]
                positions = positions[select]
                active = [active[r] for r in keep]
                starts = [starts[r] for r in keep]
            mask = torch.cat([mask, mask.new_ones(len(active), 1)], dim=1)
            positions = positions[:, -1:] + 1
            step_ids = torch.tensor(next_ids, dtype=torch.long, device=self.device)[:, None]
            logits, routes = self._forward(step_ids, mask, positions, starts, cache, record)
            for cache_row, index in enumerate(active) if routes is not None else ():
                route_rows[index].append(routes[cache_row])
        for request, out, rows in zip(requests, outputs, route_rows, strict=True):
            if request.return_routed_experts and isinstance(out, GenerationOutput):
                out.routed_experts = torch.cat(rows)[request.routed_experts_prompt_start :].numpy()
        return outputs

    def _forward(
        self, ids: Tensor, mask: Tensor, positions: Tensor, starts: list[int], cache=None, record: bool = True
    ) -> tuple[Tensor, Tensor | None]:
        """One forward: last-position fp32 logits ``[B, V]``, host routes ``[B, S, L, K]`` if ``record``."""
        kwargs = {"input_ids": ids, "attention_mask": mask, "position_ids": positions, self._cache_arg: cache}
        tile = self.invariant_tile_rows
        invariant = batch_invariant(starts, tile) if self.batch_invariant else contextlib.nullcontext()
        with invariant, record_routes(self.model) if record else contextlib.nullcontext() as recorder:
            logits = self.model(**kwargs, use_cache=cache is not None, logits_to_keep=1).logits[:, -1].float()
        return logits, recorder.routes.cpu() if record else None

    @torch.inference_mode()
    def _calibrate_perturbation(self) -> None:
        """Fit the simulated disagreement's scale to the current weights (caller holds the lock)."""
        probe = self.perturbation.probe.to(self.device)  # [n, length]
        mask = torch.ones_like(probe, dtype=torch.bool)
        positions = position_ids_from_mask(mask)
        starts = [0] * probe.shape[0]

        def routes() -> Tensor:  # [n, length, moe_layers, K]
            return self._forward(probe, mask, positions, starts)[1][..., self._moe_layers, :]

        scale = self.perturbation.calibrate(routes)
        knob = self.perturbation
        measured = f"target {knob.target:.4f}, measured {knob.measured:.4f}"
        logger.info("simulated router disagreement: %s (scale %.4g)", measured, scale)

    def _generator(self, seed: int | None) -> torch.Generator:
        seed = int(torch.randint(MAX_SEED, (1,), generator=self._seed_generator)) if seed is None else seed
        return torch.Generator(device=self.device).manual_seed(seed)

    def submit(self, request: GenerationRequest, *, prompt_field: str = "prompt_ids") -> Future:
        """Queue ``request`` for the worker thread (started on the first call), which batches up to
        ``max_batch_size`` requests arriving within ``batch_wait_s`` of each other.

        Args:
            request: the prompt and its options, checked here with `check_request`.
            prompt_field: what an error calls the prompt.

        Returns:
            A future of its `GenerationOutput` (or of the exception its generation raised).

        Raises:
            ValueError: `check_request` refuses the request.
            RuntimeError: the engine is closed.
        """
        self.check_request(request, prompt_field=prompt_field)
        future: Future = Future()
        # under close()'s lock: nothing queued behind the stop sentinel, no worker after close()
        with self._worker_lock:
            if self._closed:
                raise RuntimeError("the generation engine is closed")
            if self._worker is None:
                self._worker = threading.Thread(target=self._serve, name="r3-generation", daemon=True)
                self._worker.start()
            self._queue.put((request, future))
        return future

    @property
    def worker_died(self) -> bool:
        """Whether the batching thread was started and has died (requests would wait forever)."""
        worker = self._worker
        return worker is not None and not worker.is_alive() and not self._closed

    def _serve(self) -> None:
        stop = False
        while not stop:
            item = self._queue.get()
            pending = []
            while item is not None:
                pending.append(item)
                if len(pending) == self.config.max_batch_size:
                    break
                try:
                    item = self._queue.get(timeout=self.config.batch_wait_s)
                except queue.Empty:
                    break
            stop = item is None
            with self._gate:
                while self._paused:
                    self._gate.wait()
                self._busy = True
            try:
                pending = [(r, f) for r, f in pending if f.set_running_or_notify_cancel()]
                results = self._run_isolated([r for r, _ in pending])
                for (_, future), result in zip(pending, results, strict=True):
                    (future.set_exception if isinstance(result, Exception) else future.set_result)(result)
            finally:
                with self._gate:
                    self._busy = False
                    self._gate.notify_all()

    @property
    def paused(self) -> bool:
        """Whether `pause` holds new batches back."""
        return self._paused

    def pause(self) -> None:
        """Start no new batch (requests keep queueing) and return once the running one finished."""
        with self._gate:
            self._paused = True
            while self._busy:
                self._gate.wait()

    def resume(self) -> None:
        """Run queued requests again after `pause`; idempotent."""
        with self._gate:
            self._paused = False
            self._gate.notify_all()

    def _run_isolated(self, requests: list[GenerationRequest]) -> list[GenerationOutput | Exception]:
        """Each request's output or its own exception: a failing batch is rerun one at a time."""
        if not requests:
            return []
        try:
            return self.generate(requests, return_exceptions=True)
        except Exception as exc:
            if len(requests) == 1:
                logger.warning("generation request failed: %s", exc)
                return [exc]
            logger.warning("generation batch of %d failed (%s); rerunning one by one", len(requests), exc)
            return [self._run_isolated([request])[0] for request in requests]

    def close(self) -> None:
        """Stop the worker after the requests already queued (a pause ends); idempotent."""
        self.resume()
        with self._worker_lock:
            worker = self._worker
            closed = self._closed
            self._closed = True
            if worker is not None and not closed:
                self._queue.put(None)
        if worker is not None and not closed:
            worker.join()

    def update_weights(
        self, state_dict: Mapping[str, Tensor], *, strict: bool = False, version: int | None = None
    ) -> int:
        """Copy ``state_dict`` into the serving model, all or nothing, once the running batch ended.

        Args:
            state_dict: parameter or persistent buffer name -> its new value (any device; floating
                values for floating targets).
            strict: every parameter and persistent buffer must be given.
            version: what `weight_version` becomes (the trainer's policy version); None adds one.

        Returns:
            How many tensors were copied. Cost: one finiteness check, cast and copy per tensor,
            and a recalibration of the simulated disagreement when one is set.

        Raises:
            ValueError: a value that is not a tensor, an unknown name, a shape or dtype the target
                cannot take, a non-finite value, a missing name with ``strict``, or a bad
                ``version``; nothing is copied then.
        """
        if version is not None:
            check_setting("weight_version", version, low=0, integer=True)
        targets = loadable_targets(self.model)
        bad = next((name for name, value in state_dict.items() if not isinstance(value, Tensor)), None)
        if bad is not None:
            raise ValueError(f"state_dict[{bad!r}] must be a tensor, got {type(state_dict[bad]).__name__}")
        check_weights(targets, {k: (v.dtype, tuple(v.shape)) for k, v in state_dict.items()}, strict=strict)
        check_finite(state_dict, targets)
        with self._lock, torch.no_grad():
            for name, value in state_dict.items():
                targets[name].copy_(value)
            self.weight_version = self.weight_version + 1 if version is None else version
            if self.perturbation is not None:
                self._calibrate_perturbation()
        return len(state_dict)
