"""Packing jagged prompt + response rows into one right-padded batch for a causal LM.

Row b of `input_ids` is [prompt_b | response_b | pad …]. A causal LM's logits at position i
predict token i + 1, so response token t of row b is predicted at position
`prompt_len_b + t − 1` — that is `response_index[b, t]`. Every prompt needs ≥ 1 token.

Shapes: B rows, L packed length (max prompt + response), T max response length, V vocab.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from infra.token_budget import longest_first_groups
from tasks.masks import lengths_to_mask

__all__ = [
    "EndToEnd",
    "PackedBatch",
    "count_end_to_end_micro_batches",
    "count_token_micro_batches",
    "end_to_end",
    "end_to_end_micro_batches",
    "gather_response_logits",
    "gather_response_logprobs",
    "gather_response_values",
    "logprobs_from_response_logits",
    "pack_batch",
    "token_micro_batches",
    "unpad",
]


@dataclass(frozen=True)
class PackedBatch:
    """A right-padded causal-LM batch and where its response tokens sit.

    input_ids (B, L) long: [prompt | response | pad_id …]
    attention_mask (B, L) bool: True on prompt and response tokens
    response_index (B, T) long: position whose logits predict response token t
        (prompt_len + t − 1; clamped into [0, L − 1] on padding)
    response_mask (B, T) bool: True on real response tokens
    responses (B, T) long: response tokens, padded with pad_id
    prompt_lengths (B,) long, response_lengths (B,) long
    """

    input_ids: Tensor
    attention_mask: Tensor
    response_index: Tensor
    response_mask: Tensor
    responses: Tensor
    prompt_lengths: Tensor
    response_lengths: Tensor

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    def to(self, device: torch.device | str) -> PackedBatch:
        """The same batch with every tensor on `device`."""
        return PackedBatch(
            input_ids=self.input_ids.to(device),
            attention_mask=self.attention_mask.to(device),
            response_index=self.response_index.to(device),
            response_mask=self.response_mask.to(device),
            responses=self.responses.to(device),
            prompt_lengths=self.prompt_lengths.to(device),
            response_lengths=self.response_lengths.to(device),
        )

    def slice(self, start: int, stop: int) -> PackedBatch:
        """Rows start:stop as views, keeping the full widths L and T (outputs concatenate)."""
        return PackedBatch(
            input_ids=self.input_ids[start:stop],
            attention_mask=self.attention_mask[start:stop],
            response_index=self.response_index[start:stop],
            response_mask=self.response_mask[start:stop],
            responses=self.responses[start:stop],
            prompt_lengths=self.prompt_lengths[start:stop],
            response_lengths=self.response_lengths[start:stop],
        )

    def select(self, rows: Tensor) -> PackedBatch:
        """The given rows (a (b,) long index), trimmed to their own longest row (L and T)."""
        prompt_lengths = self.prompt_lengths[rows]  # (b,)
        response_lengths = self.response_lengths[rows]  # (b,)
        width = int(response_lengths.max()) if rows.numel() else 0
        length = int((prompt_lengths + response_lengths).max()) if rows.numel() else 0
        return PackedBatch(
            input_ids=self.input_ids[rows, :length],
            attention_mask=self.attention_mask[rows, :length],
            response_index=self.response_index[rows, :width].clamp(max=max(length - 1, 0)),
            response_mask=self.response_mask[rows, :width],
            responses=self.responses[rows, :width],
            prompt_lengths=prompt_lengths,
            response_lengths=response_lengths,
        )


def _lengths(rows: list[Tensor]) -> Tensor:
    return torch.tensor([int(row.shape[0]) for row in rows], dtype=torch.long)  # (B,)


def _scatter_rows(target: Tensor, rows: list[Tensor], starts: Tensor, lengths: Tensor) -> None:
    """target[b, starts[b] : starts[b] + lengths[b]] = rows[b] for every b, in one indexed write."""
    if int(lengths.sum()) == 0:
        return
    flat = torch.cat([row.reshape(-1).cpu() for row in rows]).to(target.dtype)  # (ΣN,)
    row_of = torch.repeat_interleave(torch.arange(len(rows)), lengths)  # (ΣN,)
    offsets = torch.cumsum(lengths, 0) - lengths  # (B,)
    within = torch.arange(flat.shape[0]) - offsets[row_of]  # (ΣN,)
    target[row_of, starts[row_of] + within] = flat


def pack_batch(*, prompt_ids: list[Tensor], response_ids: list[Tensor], pad_id: int) -> PackedBatch:
    """Pack B jagged prompts and responses (1-D long tensors) into a `PackedBatch`.

    1. Lengths, widths L = max(prompt + response) and T = max(response).
    2. input_ids [prompt | response | pad], responses [response | pad].
    3. Masks and response_index = prompt_len + t − 1 (clamped into [0, L − 1]).
    """
    # 1.
    if len(prompt_ids) != len(response_ids) or not prompt_ids:
        raise ValueError(
            f"pack_batch needs as many prompts as responses and at least one row; got "
            f"{len(prompt_ids)} prompts and {len(response_ids)} responses"
        )
    prompt_lengths, response_lengths = _lengths(prompt_ids), _lengths(response_ids)  # (B,)
    if int(prompt_lengths.min()) < 1:
        row = int(torch.nonzero(prompt_lengths < 1)[0])
        raise ValueError(
            f"prompt {row} is empty: a causal LM needs at least one prompt token before the "
            "first response token"
        )
    batch = len(prompt_ids)
    length = int((prompt_lengths + response_lengths).max())
    width = int(response_lengths.max())
    # 2.
    input_ids = torch.full((batch, length), pad_id, dtype=torch.long)  # (B, L)
    _scatter_rows(input_ids, prompt_ids, torch.zeros(batch, dtype=torch.long), prompt_lengths)
    _scatter_rows(input_ids, response_ids, prompt_lengths, response_lengths)
    responses = torch.full((batch, width), pad_id, dtype=torch.long)  # (B, T)
    _scatter_rows(responses, response_ids, torch.zeros(batch, dtype=torch.long), response_lengths)
    # 3.
    response_index = prompt_lengths.unsqueeze(1) + torch.arange(width) - 1  # (B, T)
    return PackedBatch(
        input_ids=input_ids,
        attention_mask=lengths_to_mask(prompt_lengths + response_lengths, length),  # (B, L)
        response_index=response_index.clamp(0, length - 1),
        response_mask=lengths_to_mask(response_lengths, width),  # (B, T)
        responses=responses,
        prompt_lengths=prompt_lengths,
        response_lengths=response_lengths,
    )


def gather_response_logits(
    *,
    logits: Tensor,
    batch: PackedBatch,
    temperature: float = 1.0,
    layout: EndToEnd | None = None,
) -> Tensor:
    """(B, T, V) float32+ logits / temperature at the positions predicting each response token.

    Only the T response positions are copied out of the (B, L, V) logits, or, with the
    `layout` the logits were computed over, out of its (N, W, V) logits.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if layout is None:
        rows = torch.arange(batch.batch_size, device=logits.device).unsqueeze(1)  # (B, 1)
        index = batch.response_index.to(logits.device)  # (B, T)
    else:
        rows = layout.row_bin.to(logits.device).unsqueeze(1)  # (B, 1)
        index = layout.response_index.to(logits.device)  # (B, T)
    selected = logits[rows, index]  # (B, T, V)
    if selected.dtype in (torch.float16, torch.bfloat16):
        selected = selected.float()
    return selected / temperature if temperature != 1.0 else selected


def logprobs_from_response_logits(*, response_logits: Tensor, batch: PackedBatch) -> Tensor:
    """(B, T) log-probabilities of the response tokens; 0 at masked positions.

    log p = logit[token] − logsumexp(logits): no (B, T, V) log-softmax is materialised.
    """
    tokens = batch.responses.to(response_logits.device).unsqueeze(-1)  # (B, T, 1)
    token_logits = response_logits.gather(-1, tokens).squeeze(-1)  # (B, T)
    logprobs = token_logits - torch.logsumexp(response_logits, dim=-1)  # (B, T)
    mask = batch.response_mask.to(response_logits.device)
    return torch.where(mask, logprobs, torch.zeros_like(logprobs))


def gather_response_logprobs(
    *, logits: Tensor, batch: PackedBatch, temperature: float = 1.0, chunk_tokens: int = 4096
) -> Tensor:
    """(B, T) log_softmax(logits / temperature) of each response token; masked positions 0.

    Computed on the logits' device over chunks of rows holding at most `chunk_tokens` response
    positions (at least one row), so no more than that many positions' vocabulary logits are
    cast to float32 at a time.
    """
    width = max(int(batch.response_mask.shape[1]), 1)
    rows = max(chunk_tokens // width, 1)
    chunks = []
    for start in range(0, batch.batch_size, rows):
        part = batch.slice(start, start + rows)
        response_logits = gather_response_logits(
            logits=logits[start : start + rows], batch=part, temperature=temperature
        )  # (rows, T, V)
        chunks.append(logprobs_from_response_logits(response_logits=response_logits, batch=part))
    return torch.cat(chunks)  # (B, T)


def gather_response_values(*, values: Tensor, batch: PackedBatch) -> Tensor:
    """(B, T) critic values at the positions predicting each response token; masked 0.

    The value of response token t is read where the state before emitting it ends, i.e. at
    `response_index[b, t]`.
    """
    gathered = values.gather(1, batch.response_index.to(values.device))  # (B, T)
    mask = batch.response_mask.to(values.device)
    return torch.where(mask, gathered, torch.zeros_like(gathered))


def unpad(tensor: Tensor, lengths: Tensor) -> list[Tensor]:
    """Rows of a right-padded (B, T) tensor cut to their lengths (views, not copies)."""
    if tensor.shape[0] != lengths.shape[0]:
        raise ValueError(f"tensor has {tensor.shape[0]} rows but lengths has {lengths.shape[0]}")
    return [row[: int(n)] for row, n in zip(tensor, lengths.tolist())]


def _greedy_groups(lengths: Tensor, budget: int) -> list[list[int]]:
    """Rows sorted by length (longest first, ties in row order), cut into runs that each hold
    as many rows as fit: a run that starts at a row of length n holds up to budget // n rows
    (at least that one row), since its first row is its longest
    (`infra.token_budget.longest_first_groups`)."""
    if budget < 1:
        raise ValueError(f"the token budget must be ≥ 1, got {budget}")
    if lengths.dim() != 1:
        raise ValueError(f"lengths must be 1-D (B,), got shape {tuple(lengths.shape)}")
    return longest_first_groups(lengths.detach().cpu().tolist(), budget)


@dataclass(frozen=True)
class EndToEnd:
    """The rows of a `PackedBatch` laid end to end in N bins of W tokens, without padding
    between them (the padding-free layout of ``actor.padding_free``).

    input_ids (N, W) long: each bin's rows one after another, the rest of the bin filled with
        the bin's first token (a segment of its own, whose outputs are never read)
    position_ids (N, W) long: 0, 1, … within each row, and again from 0 on the filler
    row_bin (B,) long: the bin of each row
    response_index (B, T) long: the bin position whose logits predict response token t
        (the row's start in its bin + prompt_len + t − 1, clamped into [0, W − 1] on padding)

    A model that derives its attention from ``position_ids`` when neither an ``attention_mask``
    nor a cache is given (transformers' masks for packed sequences: call it with
    ``use_cache=False``) keeps every row to its own tokens, so the row's logits are those of its
    padded forward up to float rounding.
    """

    input_ids: Tensor
    position_ids: Tensor
    row_bin: Tensor
    response_index: Tensor


def _first_fit_bins(lengths: list[int], capacity: int) -> list[list[int]]:
    """Rows (by index) in bins of at most `capacity` tokens: longest first, each into the
    first bin it fits (first-fit decreasing; a row longer than `capacity` is a bin alone)."""
    order = sorted(range(len(lengths)), key=lambda row: (-lengths[row], row))
    free: list[int] = []
    bins: list[list[int]] = []
    for row in order:
        for at, room in enumerate(free):
            if lengths[row] <= room:
                free[at] -= lengths[row]
                bins[at].append(row)
                break
        else:
            free.append(capacity - lengths[row])
            bins.append([row])
    return bins


def end_to_end(batch: PackedBatch, width: int | None = None) -> EndToEnd:
    """Lay the batch's rows end to end (`EndToEnd`) in bins `width` tokens wide (None: as wide
    as its longest row; a row longer than `width` widens the bins to it).

    1. Bins: first-fit decreasing of the rows' prompt + response lengths.
    2. Each row's tokens copied to its bin at its offset, its positions 0 … n − 1.
    3. The filler after a bin's last row: the bin's first token, positions 0, 1, ….
    """
    # 1.
    lengths = (batch.prompt_lengths + batch.response_lengths).tolist()
    width = max(max(lengths), width or 0, 1)
    bins = _first_fit_bins(lengths, width)
    input_ids = torch.empty((len(bins), width), dtype=torch.long)  # (N, W)
    position_ids = torch.empty((len(bins), width), dtype=torch.long)  # (N, W)
    row_bin = torch.empty(batch.batch_size, dtype=torch.long)  # (B,)
    offsets = torch.empty(batch.batch_size, dtype=torch.long)  # (B,)
    ids = batch.input_ids.cpu()
    for at, rows in enumerate(bins):
        # 2.
        start = 0
        for row in rows:
            n = lengths[row]
            input_ids[at, start : start + n] = ids[row, :n]
            position_ids[at, start : start + n] = torch.arange(n)
            row_bin[row], offsets[row] = at, start
            start += n
        # 3.
        input_ids[at, start:] = input_ids[at, 0]
        position_ids[at, start:] = torch.arange(width - start)
    index = offsets.unsqueeze(1) + batch.response_index.cpu()  # (B, T)
    return EndToEnd(
        input_ids=input_ids.to(batch.input_ids.device),
        position_ids=position_ids.to(batch.input_ids.device),
        row_bin=row_bin,
        response_index=index.clamp(max=width - 1),
    )


def _end_to_end_groups(lengths: Tensor, budget: int) -> list[list[int]]:
    """First-fit-decreasing bins of all the rows, as wide as the longest; then consecutive bins
    grouped so a group's bins × that width stay ≤ `budget` (at least one bin a group); each
    group's rows in row order. `end_to_end` of a group's rows at that width makes the same
    bins: first-fit decreasing over a union of bins refills exactly those bins."""
    if budget < 1:
        raise ValueError(f"the token budget must be ≥ 1, got {budget}")
    if lengths.dim() != 1:
        raise ValueError(f"lengths must be 1-D (B,), got shape {tuple(lengths.shape)}")
    sizes = lengths.detach().cpu().tolist()
    if not sizes:
        return []
    width = max(max(sizes), 1)
    bins = _first_fit_bins(sizes, width)
    per_group = max(budget // width, 1)
    return [
        sorted(row for rows in bins[start : start + per_group] for row in rows)
        for start in range(0, len(bins), per_group)
    ]


def count_end_to_end_micro_batches(lengths: Tensor, budget: int) -> int:
    """The micro-batches `end_to_end_micro_batches` makes for rows of these (B,) lengths."""
    return len(_end_to_end_groups(lengths, budget))


def end_to_end_micro_batches(
    lengths: Tensor, budget: int, count: int | None = None
) -> list[Tensor]:
    """Row indices (long) of each micro-batch whose rows are laid end to end (`end_to_end` at
    the width of the longest of all these rows): `budget // width` first-fit-decreasing bins a
    micro-batch, so a micro-batch costs about its real tokens, not its rows × its longest row.
    With `count` (from that many up to B): the micro-batch of the most tokens halved (every
    second of its rows, longest first) until there are `count`."""
    sizes = lengths.detach().cpu().tolist()

    def halve(rows: list[int]) -> list[list[int]]:
        longest_first = sorted(rows, key=lambda row: (-sizes[row], row))
        return [sorted(longest_first[0::2]), sorted(longest_first[1::2])]

    def tokens(rows: list[int]) -> int:
        return int(sum(sizes[row] for row in rows))

    groups = _end_to_end_groups(lengths, budget)
    return _split_to_count(groups, budget, count, cost=tokens, halve=halve)


def count_token_micro_batches(lengths: Tensor, budget: int) -> int:
    """The fewest micro-batches for rows of these (B,) lengths under a token budget.

    Rows are sorted by length (longest first) and packed greedily; a micro-batch costs its
    rows × its longest row (the tokens of a right-padded batch) and stays ≤ `budget`, except
    that a row longer than the budget is a micro-batch of its own.
    """
    return len(_greedy_groups(lengths, budget))


def token_micro_batches(lengths: Tensor, budget: int, count: int | None = None) -> list[Tensor]:
    """Row indices (long, into the given (B,) rows) of each token-budget micro-batch.

    Without `count`: the greedy packing of `count_token_micro_batches`. With `count` (from the
    fewest up to B): exactly `count` non-empty micro-batches, made by halving the costliest
    micro-batch of more than one row (the first such on ties) until there are `count`; halving
    only lowers costs, so the budget still holds. Rows are sorted by length, longest first,
    within and across micro-batches.
    """
    sizes = lengths.detach().cpu().tolist()

    def halve(rows: list[int]) -> list[list[int]]:
        half = (len(rows) + 1) // 2
        return [rows[:half], rows[half:]]

    def padded(rows: list[int]) -> int:
        return len(rows) * int(sizes[rows[0]])

    groups = _greedy_groups(lengths, budget)
    return _split_to_count(groups, budget, count, cost=padded, halve=halve)


def _split_to_count(
    groups: list[list[int]],
    budget: int,
    count: int | None,
    *,
    cost: Callable[[list[int]], int],
    halve: Callable[[list[int]], list[list[int]]],
) -> list[Tensor]:
    """The groups as long tensors; with `count` (from len(groups) up to the rows), the group of
    more than one row with the highest `cost` (the first on ties) replaced by its `halve` until
    there are `count`."""
    rows = sum(len(group) for group in groups)
    if count is not None:
        if not len(groups) <= count <= rows:
            raise ValueError(
                f"count={count} micro-batches is outside [{len(groups)}, {rows}]: at "
                f"least the fewest packing under budget {budget}, at most one per row"
            )
        while len(groups) < count:
            costs = [cost(group) if len(group) > 1 else -1 for group in groups]
            at = costs.index(max(costs))
            groups[at : at + 1] = halve(groups[at])
    return [torch.tensor(group, dtype=torch.long) for group in groups]
