"""Every real token's route lands exactly where the model reads that token, on every rank.

The whole data path runs on real components: multi-turn rollouts from the embedded bf16 rollout
server (both wire protocols, through ``RemoteGenerateClient`` and ``RoutedExpertTrace`` with
prompt starts) -> ``Trajectory`` -> ``ReplayBuffer`` -> ``R3DataModule`` / ``RolloutCollator`` ->
``RolloutBatch`` transforms (micro-batches, repeat_interleave, data-parallel padding and shards)
-> ``TokenMetadataLayout`` (padded left / right, packed, context-parallel shards, megatron TP x CP
ranks with the sequence-parallel split) + alignment + replay mask -> replay into an fp32 copy of
the served weights, recording the experts used; and once through a real Lightning fit with the
``RouterReplayCallback`` and the main job's GRPO module.

The fp32 model's own (native) routing is the check that nothing is shifted where the model reads:
it picks the server's experts for the token at the same position almost always (bf16 vs fp32
flips a few), including where turns and prefill/decode meet, and a neighbour's only by chance.

The expectation is built without any of that code. A loopback proxy in front of the server keeps
every raw HTTP exchange; the reference decodes them with the standard library: token ``t`` of a
trajectory has the route row ``t - start`` of the turn whose request asked for rows from
``start``. Which token sits at which model-facing position comes from the plain-loop layouts of
``align_reference``, and which trajectory a batch row holds is read from its tokens.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import pickle
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import align_reference as ref
import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.distributed as dist
from aiohttp import ClientSession, web

from r3lightning.align.align import align_packed_token_metadata, build_replay_mask
from r3lightning.align.dummy import dummy_routes
from r3lightning.align.layout import TokenMetadataLayout, split_for_sequence_parallel
from r3lightning.data.batch import RolloutBatch
from r3lightning.data.buffer import ReplayBuffer
from r3lightning.data.datamodule import R3DataModule
from r3lightning.data.trajectory import Trajectory
from r3lightning.job.module import GRPOModule
from r3lightning.replay.callback import RouterReplayCallback
from r3lightning.replay.context import record_routes, replay_routes
from r3lightning.replay.hf.replay import HFRouterReplay
from r3lightning.replay.megatron.layout import MegatronParallelism, megatron_token_layout
from r3lightning.rollout.client import RemoteGenerateClient
from r3lightning.rollout.config import RetryPolicy
from r3lightning.serve.config import EngineConfig
from r3lightning.serve.server import RolloutServer
from r3lightning.testing.tiny import build_tiny_moe
from r3lightning.trace import RoutedExpertTrace
from r3lightning.wire.request import RouteSchema

pytestmark = pytest.mark.slow

L, K, E = 4, 2, 8  # tiny Qwen3-MoE: 4 decoder layers (layer 0 dense), top-2 of 8 experts
MOE_LAYERS = [1, 2, 3]
VOCAB, PAD, EOS = 96, 0, 2
SEED = 0  # the server serves build_tiny_moe(seed=SEED) in bf16; the trainer holds it in fp32


@dataclass(frozen=True)
class Spec:
    """One rollout: a prompt, then turns of (environment tokens appended first, tokens to sample)."""

    protocol: str
    prompt_length: int
    turns: tuple[tuple[int, int], ...]
    synthetic_eos: bool = False  # an EOS appended after the last turn (never forwarded)
    routes: bool = True  # False: an engine that returns no routes (every token routes natively)


SPECS = (
    Spec("skyrl", 5, ((0, 6), (3, 5))),
    Spec("sglang", 3, ((0, 4), (2, 3), (4, 6))),
    Spec("skyrl", 24, ((0, 14),)),
    Spec("sglang", 2, ((0, 1),)),
    Spec("sglang", 6, ((0, 3), (5, 4)), synthetic_eos=True),
    Spec("skyrl", 9, ((0, 2), (1, 1))),
    Spec("skyrl", 4, ((0, 5),), routes=False),
)


@dataclass
class Reference:
    """A trajectory as the server's raw responses describe it."""

    tokens: list[int]
    rows: dict[int, np.ndarray] | None  # token index -> experts [L, K] used with it as input;
    # None: a placeholder row added by padding (one dummy route row, any valid one)
    # tokens where two turns meet: a later turn's first returned row (the previous turn's last
    # sampled token, first forwarded in this turn's prefill)
    joins: frozenset[int] = frozenset()
    # tokens where prefill meets decode: each turn's last prompt token and first sampled token
    edges: frozenset[int] = frozenset()


# ----------------------------------------------------------------------------------- rollouts
class RecordingProxy:
    """Loopback HTTP proxy in front of the rollout server keeping each raw exchange by session id."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.exchanges: dict[str, tuple[bytes, bytes]] = {}  # session id -> (request, response)
        self.url = ""

    async def serve(self, body) -> None:
        async with ClientSession() as session:

            async def forward(request: web.Request) -> web.Response:
                raw_request = await request.read()
                headers = {"Content-Type": "application/json"}
                async with session.post(
                    self.upstream + request.path, data=raw_request, headers=headers
                ) as up:
                    raw_response = await up.read()
                    status = up.status
                self.exchanges[request.headers["X-Session-ID"]] = (raw_request, raw_response)
                return web.Response(body=raw_response, status=status, content_type="application/json")

            app = web.Application()
            app.router.add_post("/{tail:.*}", forward)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
            try:
                await body()
            finally:
                await runner.cleanup()


def _random_tokens(seed: int, count: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (count,), generator=generator).tolist()


async def _roll_out(
    index: int, spec: Spec, client: RemoteGenerateClient
) -> tuple[Trajectory, RoutedExpertTrace | None]:
    """A multi-turn rollout as a training loop would run it: one trace, prompt starts per turn."""
    prompt = _random_tokens(100 + index, spec.prompt_length)
    tokens, loss_mask, logprobs = list(prompt), [], []
    trace = RoutedExpertTrace(L, K, E) if spec.routes else None
    length_key, seed_key = (
        ("max_tokens", "seed") if spec.protocol == "skyrl" else ("max_new_tokens", "sampling_seed")
    )
    for turn, (environment, new_tokens) in enumerate(spec.turns):
        extra = _random_tokens(1000 * index + turn, environment) if environment else []
        tokens += extra
        loss_mask += [0.0] * len(extra)
        logprobs += [0.0] * len(extra)
        params = {length_key: new_tokens, seed_key: 10 * index + turn, "temperature": 1.0, "ignore_eos": True}
        result = await client.generate(
            tokens,
            params,
            return_routed_experts=spec.routes,
            routed_experts_prompt_start=None if trace is None else trace.prompt_start,
            session_id=f"{index}/{turn}",
        )
        if trace is None:
            assert result.routed_experts is None
        else:
            trace.record_generation(len(tokens), len(result.response_ids), result.routed_experts)
        tokens += result.response_ids
        loss_mask += [1.0] * len(result.response_ids)
        logprobs += list(result.response_logprobs)
    if spec.synthetic_eos:
        # a loss target whose predicting row (the last sampled token's) was never captured
        tokens.append(EOS)
        loss_mask.append(1.0)
        logprobs.append(0.0)
    routes = None if trace is None else trace.finalize(len(tokens), loss_mask=[0.0] * len(prompt) + loss_mask)
    trajectory = Trajectory(
        prompt,
        tokens[len(prompt) :],
        loss_mask=loss_mask,
        rollout_logprobs=logprobs,
        reward=float(index),
        routed_experts=routes,
    )
    return trajectory, trace


def _decode_exchange(
    protocol: str, raw_request: bytes, raw_response: bytes
) -> tuple[list[int], int, list[int], np.ndarray | None]:
    """(prompt, first route row's token, sampled tokens, routes [rows, L, K] or None) of one exchange."""
    request, response = json.loads(raw_request), json.loads(raw_response)
    if protocol == "skyrl":
        prompt = request["token_ids"]
        start = request["sampling_params"].get("routed_experts_prompt_start", 0)
        choice = response["choices"][0]
        output = choice["token_ids"]
        envelope = choice["routed_experts"]
        if envelope is None:
            return prompt, start, output, None
        dtype = np.dtype(envelope["dtype"]).newbyteorder("<")
        routes = np.frombuffer(base64.b64decode(envelope["data"]), dtype=dtype).reshape(envelope["shape"])
    else:
        prompt = request["input_ids"]
        start = request.get("routed_experts_start_len", 0)
        output = response["output_ids"]
        if "routed_experts" not in response["meta_info"]:
            return prompt, start, output, None
        routes = np.frombuffer(base64.b64decode(response["meta_info"]["routed_experts"]), dtype="<i4")
        routes = routes.reshape(-1, L, K)
    return prompt, start, output, routes.astype(np.int64)


def _reference(index: int, spec: Spec, exchanges: dict[str, tuple[bytes, bytes]]) -> Reference:
    rows: dict[int, np.ndarray] = {}
    tokens: list[int] = []
    joins: set[int] = set()
    edges: set[int] = set()
    for turn in range(len(spec.turns)):
        prompt, start, output, routes = _decode_exchange(spec.protocol, *exchanges[f"{index}/{turn}"])
        assert prompt[: len(tokens)] == tokens, "each turn's prompt extends the conversation"
        tokens = prompt + output
        if not spec.routes:
            # a skyrl server returns routes whenever it records them (unasked); the client drops them
            assert routes is None or spec.protocol == "skyrl"
            continue
        # the engine forwards tokens start .. P + G - 2; the last sampled token is never an input
        assert routes.shape == (len(prompt) - start + len(output) - 1, L, K)
        for j, row in enumerate(routes):
            assert start + j not in rows, f"trajectory {index}: token {start + j} routed twice"
            rows[start + j] = row
        edges.update((len(prompt) - 1, len(prompt)))
        if turn:
            joins.add(start)
    if spec.synthetic_eos:
        tokens = [*tokens, EOS]
    assert sorted(rows) == list(range(len(rows))), "the turns' rows tile the trajectory without gaps"
    assert len(rows) == (len(tokens) - 1 - int(spec.synthetic_eos) if spec.routes else 0)
    return Reference(tokens, rows, frozenset(joins), frozenset(edges))


@dataclass
class Rollouts:
    trajectories: list[Trajectory]
    traces: list[RoutedExpertTrace | None]
    references: list[Reference]
    server_state: dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def rollouts() -> Rollouts:
    with RolloutServer(
        engine=EngineConfig(seed=SEED)
    ) as server:  # bf16 tiny Qwen3-MoE, the main job's default engine
        proxy = RecordingProxy(server.url)
        results: list[tuple[Trajectory, RoutedExpertTrace | None]] = []

        async def run_all() -> None:
            clients = {
                protocol: RemoteGenerateClient(
                    proxy.url,
                    protocol=protocol,
                    schema=RouteSchema(L, K, E),
                    retry=RetryPolicy(max_attempts=1),
                )
                for protocol in ("skyrl", "sglang")
            }
            try:  # concurrent: the engine batches requests of different lengths together
                results.extend(
                    await asyncio.gather(*(_roll_out(i, s, clients[s.protocol]) for i, s in enumerate(SPECS)))
                )
            finally:
                for client in clients.values():
                    await client.close()

        asyncio.run(proxy.serve(run_all))
        server_state = {k: v.clone() for k, v in server.engine.model.state_dict().items()}
    references = [_reference(i, spec, proxy.exchanges) for i, spec in enumerate(SPECS)]
    return Rollouts([t for t, _ in results], [tr for _, tr in results], references, server_state)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    """The trainer's fp32 copy of the weights the server samples with (bf16 values, fp32 math)."""
    return build_tiny_moe(seed=SEED)


@pytest.fixture(scope="module")
def buffer(rollouts: Rollouts) -> ReplayBuffer:
    buffer = ReplayBuffer(vocab_size=VOCAB, num_experts=E)
    buffer.extend(rollouts.trajectories)
    return buffer


# ----------------------------------------------------------------------------------- checks
def _rows(reference: Reference) -> np.ndarray:
    """The reference's captured rows in token order, ``[captured, L, K]``."""
    assert reference.rows is not None
    rows = [reference.rows[t] for t in range(len(reference.rows))]
    return np.stack(rows) if rows else np.empty((0, L, K), dtype=np.int64)


def _valid_routes(rows: torch.Tensor) -> bool:
    """Experts in range and distinct within each row on every MoE layer (``[..., L, K]``)."""
    moe = rows[..., MOE_LAYERS, :].long()
    ordered = moe.sort(dim=-1).values
    return bool((moe >= 0).all() and (moe < E).all() and (ordered[..., 1:] != ordered[..., :-1]).all())


def _references_of(batch: RolloutBatch, rollouts: Rollouts) -> list[Reference]:
    """Which trajectory each batch row holds, read from its real tokens alone."""
    by_tokens = {tuple(r.tokens): r for r in rollouts.references}
    out = []
    for ids, mask in zip(batch.input_ids, batch.attention_mask, strict=True):
        tokens = tuple(ids[mask].tolist())
        if tokens in by_tokens:
            out.append(by_tokens[tokens])
        else:
            assert tokens == (PAD,), f"batch row {tokens} is neither a rollout nor a placeholder"
            out.append(Reference([PAD], None))
    return out


def _reference_grid(layout_spec: dict, lengths: list[int], width: int) -> list[list[object]]:
    if layout_spec["kind"] == "padded":
        return ref.padded_positions(
            lengths, width, layout_spec.get("pad_to_multiple", 1), layout_spec.get("side", "left")
        )
    return ref.packed_positions(
        lengths, layout_spec["pad_to_multiple"], layout_spec.get("cp_size", 1), layout_spec.get("cp_rank", 0)
    )


def _build_layout(layout_spec: dict, batch: RolloutBatch) -> TokenMetadataLayout:
    kwargs = {k: v for k, v in layout_spec.items() if k != "kind"}
    if layout_spec["kind"] == "padded":
        return TokenMetadataLayout.padded(batch.attention_mask, **kwargs)
    return TokenMetadataLayout.packed(batch.lengths_host()[0], **kwargs)


@dataclass
class Aligned:
    layout: TokenMetadataLayout
    grid: list[list[object]]
    model_ids: torch.Tensor  # [*token_shape] the token the model reads at each position
    routes: torch.Tensor  # [*token_shape, L, K]
    mask: torch.Tensor  # [*token_shape] bool


def _check_positions(aligned: Aligned, references: list[Reference], label: object) -> None:
    """Every position of ``aligned`` against the references (``grid`` says who sits where)."""
    grid = aligned.grid
    shape = (len(grid), len(grid[0]))
    assert tuple(aligned.model_ids.shape) == shape and tuple(aligned.mask.shape) == shape, label
    assert tuple(aligned.routes.shape) == (*shape, L, K), label
    ids, dense, replay = aligned.model_ids.tolist(), aligned.routes.long().numpy(), aligned.mask.tolist()
    for r, row in enumerate(grid):
        for c, cell in enumerate(row):
            where = f"{label} position ({r}, {c})"
            if cell is None:
                assert not replay[r][c], f"{where}: padding must route natively"
                continue
            i, t = cell
            reference = references[i]
            assert ids[r][c] == reference.tokens[t], f"{where}: the model reads the wrong token"
            if reference.rows is None:  # placeholder: its one dummy row is replayed
                assert replay[r][c], f"{where}: a placeholder's route row must be replayed"
            elif t in reference.rows:
                assert replay[r][c], f"{where}: captured token {t} of row {i} must be replayed"
                np.testing.assert_array_equal(
                    dense[r, c], reference.rows[t], err_msg=f"{where}: token {t} of row {i}"
                )
            else:
                assert not replay[r][c], f"{where}: uncaptured token {t} of row {i} must route natively"
    assert _valid_routes(aligned.routes), f"{label}: some position holds invalid routes"


def _align(batch: RolloutBatch, layout: TokenMetadataLayout, grid: list[list[object]]) -> Aligned:
    """The batch's routes, replay mask and tokens as ``layout`` puts them in front of the model."""
    routes = batch.routed_experts
    assert routes is not None
    dense = align_packed_token_metadata(routes, layout, pad=lambda n: dummy_routes(n, L, K, E))
    mask = build_replay_mask(routes, layout)
    assert layout.token_shape == (len(grid), len(grid[0]))
    return Aligned(layout, grid, layout.from_batch(batch.input_ids, pad=PAD), dense, mask)


def _align_and_check(batch: RolloutBatch, references: list[Reference], layout_spec: dict) -> Aligned:
    """Align the batch's routes to one layout and check every position against the references."""
    lengths = batch.lengths_host()[0].tolist()
    aligned = _align(
        batch, _build_layout(layout_spec, batch), _reference_grid(layout_spec, lengths, batch.width)
    )
    _check_positions(aligned, references, layout_spec)
    return aligned


def _model_inputs(aligned: Aligned) -> dict:
    layout = aligned.layout
    inputs = {"input_ids": aligned.model_ids, "position_ids": layout.position_ids, "use_cache": False}
    if layout.kind == "padded":
        inputs["attention_mask"] = layout.token_mask.long()
    # packed: no attention mask; the per-sequence position ids keep the sequences apart
    return inputs


def _replay_and_check(model: torch.nn.Module, aligned: Aligned, references: list[Reference]) -> torch.Tensor:
    """Replay into the fp32 model, record in the same pass; returns the native routes of a plain pass."""
    inputs = _model_inputs(aligned)
    with torch.no_grad():
        with replay_routes(model, aligned.routes, aligned.mask) as backend, record_routes(model) as recording:
            model(**inputs)
            stats = backend.routing_stats()  # cleared with the routes on exit
        with record_routes(model) as native_recording:
            model(**inputs)
    used = recording.routes.long()  # [*token_shape, L, K]
    assert tuple(used.shape) == tuple(aligned.routes.shape)
    assert bool((used[..., 0, :] == 0).all()), "the dense layer holds no routes"
    assert _valid_routes(used)
    replayed = aligned.mask
    # 100%: every replayed position used exactly the aligned experts on every MoE layer
    assert torch.equal(used[replayed][:, MOE_LAYERS], aligned.routes.long()[replayed][:, MOE_LAYERS])
    expected_rows = torch.full((len(MOE_LAYERS),), int(replayed.sum()), dtype=torch.int64)
    assert torch.equal(stats["replayed_rows"], expected_rows)

    used_np = used.numpy()
    for r, row in enumerate(aligned.grid):
        for c, cell in enumerate(row):
            if cell is None or references[cell[0]].rows is None or cell[1] not in references[cell[0]].rows:
                continue
            i, t = cell
            np.testing.assert_array_equal(
                used_np[r, c, MOE_LAYERS], references[i].rows[t][MOE_LAYERS], err_msg=f"row {i} token {t}"
            )
    return native_recording.routes.long()


def _agreement(
    native: torch.Tensor,
    aligned: Aligned,
    references: list[Reference],
    shift: int,
    only: Callable[[Reference], frozenset[int]] | None = None,
) -> float:
    """Fraction of (token, MoE layer) whose native fp32 expert set equals the server's for token
    ``t + shift``; over the tokens ``only(reference)`` when given."""
    hits = total = 0
    native_np = np.sort(native.numpy()[..., MOE_LAYERS, :], axis=-1)
    for r, row in enumerate(aligned.grid):
        for c, cell in enumerate(row):
            if cell is None or references[cell[0]].rows is None:
                continue
            i, t = cell
            server = references[i].rows.get(t + shift)
            if server is None or (only is not None and t not in only(references[i])):
                continue
            hits += int((native_np[r, c] == np.sort(server[MOE_LAYERS], axis=-1)).all(-1).sum())
            total += len(MOE_LAYERS)
    return hits / total


REPLAYED_LAYOUTS = (
    {"kind": "padded"},
    {"kind": "padded", "side": "right", "pad_to_multiple": 8},
    {"kind": "packed", "pad_to_multiple": 4},
)
CP_LAYOUTS = tuple({"kind": "packed", "pad_to_multiple": 8, "cp_size": 2, "cp_rank": r} for r in range(2))


def _check_batch(
    batch: RolloutBatch, rollouts: Rollouts, model: torch.nn.Module
) -> list[tuple[Aligned, torch.Tensor]]:
    """Every layout of one batch: alignment against the references, replay in the fp32 model.
    Returns each replayed layout with the fp32 model's native routes ``[*token_shape, L, K]``."""
    references = _references_of(batch, rollouts)
    captured = sum(0 if r.rows is None else len(r.rows) for r in references)
    placeholders = sum(r.rows is None for r in references)
    natives = []
    for layout_spec in REPLAYED_LAYOUTS:
        aligned = _align_and_check(batch, references, layout_spec)
        assert int(aligned.mask.sum()) == captured + placeholders  # each captured row lands once
        native = _replay_and_check(model, aligned, references)
        # The fp32 model's own routing follows the server's for the token at that very position
        # (bf16 vs fp32 flips a few); one token off it agrees no better than chance.
        agreement = _agreement(native, aligned, references, 0)
        assert agreement > 0.8
        for shift in (-1, 1):
            assert _agreement(native, aligned, references, shift) < agreement - 0.3
        natives.append((aligned, native))
    shards = [_align_and_check(batch, references, spec) for spec in CP_LAYOUTS]
    _check_covered_once(shards, references, captured + placeholders)
    for packed in (True, False):
        _check_covered_once(_megatron_ranks(batch, references, packed), references, captured + placeholders)
    return natives


def _check_covered_once(shards: list[Aligned], references: list[Reference], replayed: int) -> None:
    """Across the ranks' shards every real token sits exactly once and every captured row lands once."""
    assert sum(int(s.mask.sum()) for s in shards) == replayed
    seen = [cell for s in shards for row in s.grid for cell in row if cell is not None]
    assert len(seen) == len(set(seen)) == sum(len(r.tokens) for r in references)


def _megatron_ranks(batch: RolloutBatch, references: list[Reference], packed: bool) -> list[Aligned]:
    """What each TP x CP rank's routers see under megatron with sequence parallelism (TP = CP = 2
    packed, TP = 2 unpacked): the rank's layout, then its contiguous 1/TP of the sequence."""
    tp, cp = 2, 2 if packed else 1
    lengths = batch.lengths_host()[0].tolist()
    out = []
    for cp_rank in range(cp):
        for tp_rank in range(tp):
            parallelism = MegatronParallelism(tp, tp_rank, cp, cp_rank, sequence_parallel=True)
            layout = megatron_token_layout(batch, packed=packed, parallelism=parallelism)
            if packed:
                grid = ref.packed_positions(lengths, 2 * tp * cp, cp, cp_rank)
            else:
                grid = ref.padded_positions(lengths, batch.width, tp, "right")
            whole = _align(batch, layout, grid)
            share = len(grid[0]) // tp
            local = Aligned(
                layout,
                [row[tp_rank * share : (tp_rank + 1) * share] for row in grid],
                *(
                    split_for_sequence_parallel(t, tp, tp_rank)
                    for t in (whole.model_ids, whole.routes, whole.mask)
                ),
            )
            _check_positions(local, references, f"megatron packed={packed} tp={tp_rank} cp={cp_rank}")
            out.append(local)
    return out


# ----------------------------------------------------------------------------------- tests
def test_rollouts_capture_every_forwarded_token(rollouts: Rollouts):
    for index, (spec, trajectory, trace, reference) in enumerate(
        zip(SPECS, rollouts.trajectories, rollouts.traces, rollouts.references, strict=True)
    ):
        assert trajectory.num_tokens == len(reference.tokens)
        assert torch.cat([trajectory.prompt_ids, trajectory.response_ids]).tolist() == reference.tokens
        if not spec.routes:
            assert trajectory.routed_experts is None and trace is None
            continue
        assert trajectory.routed_experts.dtype == torch.uint8  # compact on the host
        np.testing.assert_array_equal(
            trajectory.routed_experts.numpy(), _rows(reference), err_msg=f"trajectory {index}"
        )
        assert trace.uncaptured_rows == 1 + int(spec.synthetic_eos)
        # only the synthetic EOS is a loss target whose predicting row was never forwarded
        assert trace.uncaptured_loss_targets == int(spec.synthetic_eos)
    lengths = [len(r.tokens) for r in rollouts.references]
    assert max(lengths) >= 10 * min(lengths)  # very different lengths in one batch
    assert sum(len(spec.turns) > 1 for spec in SPECS) >= 3
    # a one-token shift of the reference would not go unnoticed: neighbouring rows differ
    for reference in rollouts.references:
        rows = _rows(reference)
        if len(rows) > 4:
            assert (rows[1:, MOE_LAYERS] != rows[:-1, MOE_LAYERS]).any(axis=(1, 2)).mean() > 0.5


def test_trainer_weights_are_the_served_weights(rollouts: Rollouts, model: torch.nn.Module):
    state = model.state_dict()
    assert rollouts.server_state.keys() == state.keys()
    for name, served in rollouts.server_state.items():
        assert served.dtype == torch.bfloat16
        assert torch.equal(served, state[name].to(torch.bfloat16)), name


def test_collated_batch_from_the_data_module(
    rollouts: Rollouts, buffer: ReplayBuffer, model: torch.nn.Module
):
    datamodule = R3DataModule(
        buffer, batch_size=len(SPECS), shuffle=True, seed=3, collate_threads=2, pin_memory=False
    )
    (batch,) = list(datamodule.train_dataloader())
    batch = datamodule.transfer_batch_to_device(batch, torch.device("cpu"), 0)
    references = _references_of(batch, rollouts)
    assert sorted(map(id, references)) == sorted(map(id, rollouts.references))  # each rollout once
    assert [r.tokens for r in references] != [r.tokens for r in rollouts.references]  # really shuffled
    routes = batch.routed_experts
    assert routes.dtype == torch.uint8 and tuple(routes.row_shape) == (L, K)
    for i, reference in enumerate(references):  # segment i = row i's captured rows from its first token
        np.testing.assert_array_equal(routes[i].long().numpy(), _rows(reference))
    natives = _check_batch(batch, rollouts, model)
    # Where two turns or prefill and decode meet, the row still belongs to the token at that
    # position, like everywhere else (the whole batch: enough such tokens that a flip or two of
    # bf16-vs-fp32 noise stays harmless, while a misplaced row agrees only by chance).
    assert sum(len(r.joins) for r in references) >= 5
    for aligned, native in natives:
        for only in (lambda r: r.joins, lambda r: r.edges):
            assert _agreement(native, aligned, references, 0, only) > 0.75


def test_checkpointed_data_module(rollouts: Rollouts, buffer: ReplayBuffer, model: torch.nn.Module):
    """Routes survive the data module's checkpoint (weights-only torch.save / torch.load), and a
    batch width rounded up by the collator only adds padding."""
    saved = io.BytesIO()
    torch.save(R3DataModule(buffer, batch_size=4, seed=5).state_dict(), saved)
    saved.seek(0)
    restored = R3DataModule(
        ReplayBuffer(vocab_size=VOCAB, num_experts=E),
        batch_size=4,
        seed=5,
        collate_threads=1,
        width_multiple=16,
    )
    restored.load_state_dict(torch.load(saved, weights_only=True))
    batches = list(restored.train_dataloader())
    assert [len(b) for b in batches] == [4, 3]
    assert all(b.width % 16 == 0 for b in batches)
    for batch in batches:
        _check_batch(batch, rollouts, model)


@pytest.fixture(scope="module")
def full_batch(buffer: ReplayBuffer) -> RolloutBatch:
    datamodule = R3DataModule(
        buffer, batch_size=len(SPECS), shuffle=False, collate_threads=1, pin_memory=False
    )
    (batch,) = list(datamodule.train_dataloader())
    return batch


@pytest.mark.parametrize(
    "transform",
    ["micro_batches", "repeat_interleave", "pad_to_multiple", "cat", "pickle"],
)
def test_batch_transforms_keep_routes_on_their_tokens(transform, full_batch, rollouts, model):
    if transform == "micro_batches":
        batches = full_batch.split([4, 3])
        batches.append(batches[1].trim())
        assert batches[2].width < batches[1].width
    elif transform == "repeat_interleave":  # GRPO-style duplicates, uneven counts
        batches = [full_batch[[2, 0, 3]].repeat_interleave(torch.tensor([2, 1, 3]))]
    elif transform == "pad_to_multiple":  # data-parallel evening with placeholder rows
        batches = [full_batch[:5].pad_to_multiple(4, num_experts=E)]
        assert len(batches[0]) == 8
    elif transform == "cat":
        batches = [RolloutBatch.cat([full_batch[3:], full_batch[:2]])]
    else:  # how batches travel between processes
        batches = [pickle.loads(pickle.dumps(full_batch))]
    for batch in batches:
        _check_batch(batch, rollouts, model)


@contextmanager
def _data_parallel_rank(rank: int, world: int) -> Iterator[None]:
    """This process acts as data-parallel ``rank`` of ``world``: torch's in-process "fake" backend
    answers rank and world size without starting ``world`` processes."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_every_data_parallel_rank(buffer: ReplayBuffer, rollouts: Rollouts, model: torch.nn.Module):
    world = 4  # 7 rollouts over 4 ranks: one rank gets a placeholder
    seen: list[Reference] = []
    for rank in range(world):
        datamodule = R3DataModule(
            buffer, batch_size=2, shuffle=True, seed=1, collate_threads=1, pin_memory=False
        )
        with _data_parallel_rank(rank, world):
            batches = list(datamodule.train_dataloader())
        assert len(batches) == 1 and len(batches[0]) == 2
        for batch in batches:
            _check_batch(batch, rollouts, model)
            seen.extend(r for r in _references_of(batch, rollouts) if r.rows is not None)
    assert sorted(map(id, seen)) == sorted(map(id, rollouts.references))  # disjoint shards, nothing lost


def test_callback_alignment_matches(full_batch: RolloutBatch, rollouts: Rollouts, model: torch.nn.Module):
    """The Lightning callback's own layout + alignment put the same routes on the same tokens."""
    callback = RouterReplayCallback(backend=HFRouterReplay.for_model(model))
    layout = callback.build_layout(full_batch.attention_mask)
    dense, mask = callback.align_routes(full_batch.routed_experts, layout)
    aligned = _align_and_check(full_batch, _references_of(full_batch, rollouts), {"kind": "padded"})
    assert torch.equal(mask, aligned.mask)
    assert torch.equal(dense[mask].long(), aligned.routes[mask].long())
    assert _valid_routes(dense)


class _RecordingGRPOModule(GRPOModule):
    """The main job's GRPO module, keeping the experts each training forward actually used."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self.steps: list[tuple[RolloutBatch, torch.Tensor]] = []

    def training_step(self, batch: RolloutBatch, batch_idx: int) -> torch.Tensor:
        with record_routes(self.model) as recording:
            loss = super().training_step(batch, batch_idx)
        self.steps.append((batch, recording.routes))
        return loss


def test_lightning_training_forwards_replay_every_captured_route(rollouts: Rollouts, buffer: ReplayBuffer):
    """A real fit: data module -> RouterReplayCallback -> the GRPO module's forwards. Every
    training forward uses the server's experts on every captured token, also after the first
    optimizer step has moved the weights away from the served ones."""
    module = _RecordingGRPOModule(build_tiny_moe(seed=SEED))  # trained: not the shared fp32 copy
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[RouterReplayCallback(backend="hf")],
    )
    trainer.fit(module, datamodule=R3DataModule(buffer, batch_size=4, seed=7, collate_threads=1))
    assert [len(batch) for batch, _ in module.steps] == [4, 3]
    for batch, used in module.steps:
        references = _references_of(batch, rollouts)
        grid = ref.padded_positions(batch.lengths_host()[0].tolist(), batch.width, 1, "left")
        assert tuple(used.shape) == (len(batch), batch.width, L, K)
        assert _valid_routes(used)  # padding and uncaptured tokens route natively, validly
        used_np = used.long().numpy()
        replayed = 0
        for r, row in enumerate(grid):
            for c, cell in enumerate(row):
                if cell is not None and cell[1] in references[cell[0]].rows:
                    i, t = cell
                    np.testing.assert_array_equal(used_np[r, c], references[i].rows[t], err_msg=f"{i}:{t}")
                    replayed += 1
        assert replayed == sum(len(r.rows) for r in references)
    for layer in MOE_LAYERS:
        assert float(trainer.callback_metrics[f"used_agreement/layer_{layer:02d}"]) == 1.0
