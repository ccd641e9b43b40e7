"""Packing prompt + response rows for a causal LM and reading response log-probs back out."""

from __future__ import annotations

import pytest
import torch

from tasks.batching import (
    PackedBatch,
    gather_response_logprobs,
    gather_response_values,
    pack_batch,
    unpad,
)


def _rows(*rows: list[int]) -> list[torch.Tensor]:
    return [torch.tensor(r, dtype=torch.long) for r in rows]


def test_pack_batch_hand_worked() -> None:
    # Prompts [5, 6] and [7]; responses [1, 2, 3] and [] (empty); pad 0.
    # L = max(2 + 3, 1 + 0) = 5, T = 3.  Row 0 = [5 6 | 1 2 3]; row 1 = [7 | pad pad pad pad].
    # response_index = prompt_len + t − 1: row 0 → [1, 2, 3] (logits at 1 predict token 2 …);
    # row 1 → [0, 1, 2], all padding (its mask is all False).
    batch = pack_batch(prompt_ids=_rows([5, 6], [7]), response_ids=_rows([1, 2, 3], []), pad_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 1, 2, 3], [7, 0, 0, 0, 0]]
    assert batch.attention_mask.tolist() == [[True] * 5, [True] + [False] * 4]
    assert batch.response_index.tolist() == [[1, 2, 3], [0, 1, 2]]
    assert batch.response_mask.tolist() == [[True] * 3, [False] * 3]
    assert batch.responses.tolist() == [[1, 2, 3], [0, 0, 0]]
    assert batch.prompt_lengths.tolist() == [2, 1]
    assert batch.response_lengths.tolist() == [3, 0]
    assert batch.attention_mask.dtype == batch.response_mask.dtype == torch.bool


def test_pack_batch_clamps_padding_index_and_rejects_empty_prompt() -> None:
    # Row 1's padded response positions would point past L − 1 = 4: they are clamped to 4.
    batch = pack_batch(
        prompt_ids=_rows([1, 2, 3, 4], [9]), response_ids=_rows([5], [6, 7, 8]), pad_id=0
    )
    assert batch.response_index.tolist() == [[3, 4, 4], [0, 1, 2]]
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        pack_batch(prompt_ids=_rows([1], []), response_ids=_rows([2], [3]), pad_id=0)
    with pytest.raises(ValueError, match="as many prompts"):
        pack_batch(prompt_ids=_rows([1]), response_ids=_rows([2], [3]), pad_id=0)


def random_batch(seed: int, batch: int = 6, vocab: int = 11) -> PackedBatch:
    generator = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(1, vocab, (int(n),), generator=generator)
        for n in torch.randint(1, 5, (batch,), generator=generator)
    ]
    lengths = torch.randint(0, 6, (batch,), generator=generator)
    lengths[0] = 0
    responses = [torch.randint(1, vocab, (int(n),), generator=generator) for n in lengths]
    return pack_batch(prompt_ids=prompts, response_ids=responses, pad_id=0)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gather_response_logprobs_matches_loop_reference(seed: int, temperature: float) -> None:
    batch = random_batch(seed)
    generator = torch.Generator().manual_seed(100 + seed)
    logits = torch.randn(*batch.input_ids.shape, 11, generator=generator, dtype=torch.float64) * 3
    out = gather_response_logprobs(logits=logits, batch=batch, temperature=temperature)
    expected = torch.zeros(out.shape, dtype=torch.float64)
    for b in range(batch.batch_size):
        p = int(batch.prompt_lengths[b])
        for t in range(int(batch.response_lengths[b])):
            token = int(batch.input_ids[b, p + t])  # the response token, read from input_ids
            expected[b, t] = torch.log_softmax(logits[b, p + t - 1] / temperature, dim=-1)[token]
    torch.testing.assert_close(out, expected, atol=1e-10, rtol=0)


def test_gather_response_values_and_unpad() -> None:
    batch = random_batch(4)
    values = torch.arange(batch.input_ids.numel(), dtype=torch.float64).view(batch.input_ids.shape)
    out = gather_response_values(values=values, batch=batch)
    for b in range(batch.batch_size):
        p, r = int(batch.prompt_lengths[b]), int(batch.response_lengths[b])
        assert out[b, :r].tolist() == values[b, p - 1 : p + r - 1].tolist()
        assert not out[b, r:].any()
    rows = unpad(out, batch.response_lengths)
    assert [len(r) for r in rows] == batch.response_lengths.tolist()
    with pytest.raises(ValueError, match="rows"):
        unpad(out, batch.response_lengths[:2])


def test_select_trims_and_slice_keeps_widths() -> None:
    batch = random_batch(5, batch=8)
    rows = torch.tensor([3, 1])
    part = batch.select(rows)
    longest = int((batch.prompt_lengths[rows] + batch.response_lengths[rows]).max())
    assert part.input_ids.shape == (2, longest)
    assert part.response_mask.shape == (2, int(batch.response_lengths[rows].max()))
    assert part.input_ids.tolist() == batch.input_ids[rows, :longest].tolist()
    # The same logits row positions give the same log-probs through either batch.
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(*batch.input_ids.shape, 11, generator=generator, dtype=torch.float64)
    full = gather_response_logprobs(logits=logits, batch=batch)[rows]
    trimmed = gather_response_logprobs(logits=logits[rows, :longest], batch=part)
    torch.testing.assert_close(trimmed, full[:, : trimmed.shape[1]], atol=0, rtol=0)
    sliced = batch.slice(2, 5)
    assert sliced.input_ids.shape == (3, batch.input_ids.shape[1])
    assert sliced.response_mask.shape == (3, batch.response_mask.shape[1])
