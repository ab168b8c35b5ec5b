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

import io

import numpy as np
import pytest
import torch
from route_checks import (
    agreement_at,
    check_batch,
    reference_rows,
    references_of,
)
from route_reference import MOE_LAYERS, SPECS, VOCAB, E, K, L, Rollouts

from r3lightning.data.buffer import ReplayBuffer
from r3lightning.data.datamodule import DataOptions, R3DataModule

pytestmark = pytest.mark.slow


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
            trajectory.routed_experts.numpy(), reference_rows(reference), err_msg=f"trajectory {index}"
        )
        assert trace.uncaptured_rows == 1 + int(spec.synthetic_eos)
        # only the synthetic EOS is a loss target whose predicting row was never forwarded
        assert trace.uncaptured_loss_targets == int(spec.synthetic_eos)
    lengths = [len(r.tokens) for r in rollouts.references]
    assert max(lengths) >= 10 * min(lengths)  # very different lengths in one batch
    assert sum(len(spec.turns) > 1 for spec in SPECS) >= 3
    # a one-token shift of the reference would not go unnoticed: neighbouring rows differ
    for reference in rollouts.references:
        rows = reference_rows(reference)
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
    references = references_of(batch, rollouts)
    assert sorted(map(id, references)) == sorted(map(id, rollouts.references))  # each rollout once
    assert [r.tokens for r in references] != [r.tokens for r in rollouts.references]  # really shuffled
    routes = batch.routed_experts
    assert routes.dtype == torch.uint8 and tuple(routes.row_shape) == (L, K)
    for i, reference in enumerate(references):  # segment i = row i's captured rows from its first token
        np.testing.assert_array_equal(routes[i].long().numpy(), reference_rows(reference))
    natives = check_batch(batch, rollouts, model)
    # Where two turns or prefill and decode meet, the row still belongs to the token at that
    # position, like everywhere else (the whole batch: enough such tokens that a flip or two of
    # bf16-vs-fp32 noise stays harmless, while a misplaced row agrees only by chance).
    assert sum(len(r.joins) for r in references) >= 5
    for aligned, native in natives:
        for only in (lambda r: r.joins, lambda r: r.edges):
            assert agreement_at(native, aligned, references, 0, only) > 0.75


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
        options=DataOptions(width_multiple=16),
    )
    restored.load_state_dict(torch.load(saved, weights_only=True))
    batches = list(restored.train_dataloader())
    assert [len(b) for b in batches] == [4, 3]
    assert all(b.width % 16 == 0 for b in batches)
    for batch in batches:
        check_batch(batch, rollouts, model)
