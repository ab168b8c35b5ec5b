import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from r3lightning.rollout.trace import RoutedExpertTrace, TokenMetadataTrace

L, K, E = 3, 2, 8


def truth_routes(num_tokens: int, seed: int = 0, high: int = E) -> np.ndarray:
    """The routes an engine would use for every token of the final trajectory."""
    return (
        np.random.default_rng(seed)
        .integers(0, high, (num_tokens, L, K))
        .astype(np.uint8 if high <= 256 else np.int16)
    )


def run_turns(trace: RoutedExpertTrace, turns: list[tuple[int, int]], truth: np.ndarray) -> list[int]:
    """Simulate an engine returning rows from ``prompt_start`` for each (prompt, generated) turn."""
    starts = []
    for prompt, generated in turns:
        starts.append(trace.prompt_start)
        end = prompt + generated - 1 if generated else trace.prompt_start
        trace.record_generation(prompt, generated, truth[trace.prompt_start : end])
    return starts


@pytest.mark.parametrize(
    ("turns", "expected_starts"),
    [
        ([(5, 3), (12, 2)], [0, 7]),  # two turns: tool output of 4 tokens between them
        ([(5, 3), (12, 2), (17, 4)], [0, 7, 13]),  # three turns
        ([(5, 1), (6, 1), (7, 3)], [0, 5, 6]),  # turns with nothing between them
    ],
)
def test_multi_turn_trace_returns_every_forwarded_row(turns, expected_starts):
    n = turns[-1][0] + turns[-1][1]
    truth = truth_routes(n)
    trace = RoutedExpertTrace(L, K, E)
    assert run_turns(trace, turns, truth) == expected_starts
    assert trace.prompt_start == n - 1
    loss_mask = np.zeros(n)
    loss_mask[turns[-1][0] :] = 1
    rows = trace.finalize(n, loss_mask=loss_mask, strict=True)
    assert isinstance(rows, torch.Tensor) and rows.dtype == torch.uint8
    assert torch.equal(rows, torch.from_numpy(truth[: n - 1]))
    assert trace.uncaptured_rows == 1  # the last token is never forwarded by the engine
    assert trace.uncaptured_loss_targets == 0


def test_compact_dtypes_widen_only_to_the_widest_turn():
    truth = truth_routes(10, high=300)
    small = np.minimum(truth[:5], 255).astype(np.uint8)
    trace = RoutedExpertTrace()
    trace.record_generation(4, 2, small)
    trace.record_generation(8, 2, torch.from_numpy(truth[5:9]))  # a torch tensor turn
    assert trace.dtype == np.int16
    rows = trace.finalize(10)
    assert rows.dtype == torch.int16
    assert torch.equal(rows, torch.from_numpy(np.concatenate([small.astype(np.int16), truth[5:9]])))


def test_synthetic_eos_is_counted_not_fatal():
    prompt, generated = 4, 3
    truth = truth_routes(prompt + generated)
    loss_mask = [0] * prompt + [1] * (generated + 1)  # EOS appended after the stop, also a target
    trace = RoutedExpertTrace(L, K)
    trace.record_generation(prompt, generated, truth[: prompt + generated - 1])
    rows = trace.finalize(prompt + generated + 1, loss_mask=loss_mask)
    assert torch.equal(rows, torch.from_numpy(truth[:6]))
    assert trace.uncaptured_rows == 2  # last sampled token and the EOS
    assert trace.uncaptured_loss_targets == 1  # the EOS target reads row 6, never captured
    strict = RoutedExpertTrace(L, K)
    strict.record_generation(prompt, generated, truth[:6])
    with pytest.raises(ValueError, match=r"loss target token 7 needs row 6, but only 6 rows were captured"):
        strict.finalize(8, loss_mask=torch.tensor(loss_mask, dtype=torch.bool), strict=True)
    assert not strict.finalized  # a failed finalize leaves the trace usable
    assert strict.finalize(8, loss_mask=[*loss_mask[:-1], 0], strict=True).shape == (6, L, K)


def test_length_stop_before_first_generation():
    trace = RoutedExpertTrace(L, K)
    trace.record_generation(6, 0, None)
    assert trace.prompt_start == 0
    trace.record_generation(6, 0, np.zeros((0,), dtype=np.int32))  # an empty array is accepted too
    rows = trace.finalize(6, loss_mask=[0] * 6)
    assert rows.shape == (0, L, K)
    assert trace.uncaptured_rows == 6 and trace.uncaptured_loss_targets == 0


def test_zero_generation_then_a_later_turn_returns_the_backlog():
    truth = truth_routes(12)
    trace = RoutedExpertTrace(L, K)
    trace.record_generation(3, 2, truth[:4])
    trace.record_generation(7, 0, None)  # the prompt grew but nothing was forwarded
    assert trace.prompt_start == 4
    trace.record_generation(9, 3, truth[4:11])  # 9 - 4 + 3 - 1 rows
    assert torch.equal(trace.finalize(12), torch.from_numpy(truth[:11]))


def test_record_errors_leave_trace_unchanged():
    trace = RoutedExpertTrace(L, K, E)
    good = truth_routes(4)
    with pytest.raises(
        ValueError, match=r"routed_experts has 3 rows, expected 4 \(P=3 - prompt_start=0 \+ G=2 - 1\)"
    ):
        trace.record_generation(3, 2, good[:3])
    with pytest.raises(ValueError, match=r"routed_experts row shape changed: expected \[rows, 3, 2\]"):
        trace.record_generation(3, 2, np.zeros((4, 3, 1), dtype=np.uint8))
    with pytest.raises(ValueError, match="must hold integer expert ids, got dtype float32"):
        trace.record_generation(3, 2, good.astype(np.float32))
    with pytest.raises(ValueError, match="must hold integer expert ids, got dtype bool"):
        trace.record_generation(3, 2, good.astype(bool))
    with pytest.raises(ValueError, match=r"negative expert id \(-2\); only -1 marks a missing row"):
        trace.record_generation(3, 2, np.full((4, L, K), -2, dtype=np.int8))
    with pytest.raises(ValueError, match="expert id 8, but num_experts is 8"):
        trace.record_generation(3, 2, np.full((4, L, K), 8, dtype=np.uint8))
    with pytest.raises(ValueError, match=r"routed_experts is missing: expected 4 rows"):
        trace.record_generation(3, 2, None)
    with pytest.raises(ValueError, match=r"must be \[rows, num_layers, top_k\]"):
        RoutedExpertTrace().record_generation(3, 2, np.zeros((4, 6), dtype=np.uint8))
    with pytest.raises(ValueError, match="prompt_token_count must be a non-negative int"):
        trace.record_generation(-1, 2, good)
    with pytest.raises(ValueError, match="generated_token_count must be a non-negative int"):
        trace.record_generation(3, 1.0, good)
    with pytest.raises(ValueError, match="expected 0 \\(G=0: nothing was forwarded\\)"):
        trace.record_generation(3, 0, good)
    assert trace.num_rows == 0 and trace.prompt_start == 0
    trace.record_generation(3, 2, good)
    with pytest.raises(ValueError, match=r"prompt_token_count \(4\) must cover the 5 tokens recorded so far"):
        trace.record_generation(4, 1, good[:1])
    schema_free = RoutedExpertTrace()
    schema_free.record_generation(2, 1, np.zeros((2, 4, 1), dtype=np.uint8))
    with pytest.raises(ValueError, match=r"row shape changed: expected \[rows, 4, 1\], got \(1, 3, 2\)"):
        schema_free.record_generation(3, 1, np.zeros((1, 3, 2), dtype=np.uint8))


def test_finalize_once_and_finalize_errors():
    trace = RoutedExpertTrace(L, K)
    trace.record_generation(3, 2, truth_routes(4))
    with pytest.raises(ValueError, match="4 rows were captured but token_count is 3"):
        trace.finalize(3)
    with pytest.raises(ValueError, match=r"loss_mask must have one entry per token \(token_count=5\)"):
        trace.finalize(5, loss_mask=[1, 1])
    trace.finalize(5)
    with pytest.raises(RuntimeError, match="already finalized"):
        trace.finalize(5)
    with pytest.raises(RuntimeError, match="already finalized"):
        trace.record_generation(5, 1, truth_routes(1))


def test_constructor_errors():
    with pytest.raises(ValueError, match="give both num_layers and top_k, or neither"):
        RoutedExpertTrace(num_layers=2)
    with pytest.raises(ValueError, match="num_experts must be an int >= 1 or None"):
        RoutedExpertTrace(2, 2, 0)


def test_generic_trace_holds_any_schema():
    trace = TokenMetadataTrace((2,), name="logprobs")
    trace.append(np.array([[0.5, 1.0]], dtype=np.float32))
    trace.append(torch.tensor([[2.0, 3.0], [4.0, 5.0]]))
    assert trace.num_rows == 3 and trace.row_shape == (2,)
    with pytest.raises(ValueError, match="logprobs dtype changed from float32 to int64"):
        trace.append(np.zeros((1, 2), dtype=np.int64))
    with pytest.raises(ValueError, match=r"logprobs row shape changed: expected \[rows, 2\]"):
        trace.append(np.zeros((1, 3), dtype=np.float32))
    rows = trace.finalize(4, loss_mask=[0, 1, 1, 1])
    assert rows.tolist() == [[0.5, 1.0], [2.0, 3.0], [4.0, 5.0]]
    assert trace.uncaptured_rows == 1 and trace.uncaptured_loss_targets == 0
    empty = TokenMetadataTrace()
    assert empty.finalize(0).shape == (0,)


@settings(max_examples=40, deadline=None)
@given(
    first_prompt=st.integers(1, 6),
    turns=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 4)), min_size=1, max_size=4),
)
def test_random_multi_turn_traces_capture_every_forwarded_token(first_prompt, turns):
    """Turns of (tokens added to the prompt, tokens generated); the engine returns fresh rows only."""
    schedule, prompt = [], first_prompt
    for added, generated in turns:
        schedule.append((prompt, generated))
        prompt += generated + added
    n = schedule[-1][0] + schedule[-1][1]
    truth = truth_routes(n, seed=n)
    trace = RoutedExpertTrace(L, K, E)
    run_turns(trace, schedule, truth)
    rows = trace.finalize(n)
    # every token forwarded by some generation has its row; the rest are routed natively
    forwarded = max((p + g - 1 for p, g in schedule if g), default=0)
    assert torch.equal(rows, torch.from_numpy(truth[:forwarded]))
    assert trace.uncaptured_rows == n - forwarded


def test_empty_generic_chunks_keep_their_dtype():
    trace = TokenMetadataTrace()
    trace.append(np.zeros((0, 2), dtype=np.int32))
    rows = trace.finalize(3)
    assert rows.dtype == torch.int32 and rows.shape == (0, 2)
