"""Rollout with plain transformers models: our own batched KV-cache sampling loop (CPU or GPU).

``TransformersEngine`` loads a causal LM with ``AutoModelForCausalLM.from_pretrained`` (or wraps
one already in memory) and samples with a loop written for RL rollouts:

1. left-pad the distinct prompts and prefill them once (only the last position's logits),
2. repeat the KV cache ``n`` times (prompt-major rows),
3. decode one token per step from the cache (which grows in place, ``GrowingLayer``, instead of
   concatenating per token and layer), sampling with a seeded ``torch.Generator`` (greedy at
   temperature 0, nucleus filtering when ``top_p < 1``),
4. stop a row at EOS, drop finished rows from the batch once half of it is done, and stop
   when every row is done or ``max_new_tokens`` is reached.

Same inputs + same seed give the same outputs (checkpoint/resume relies on it). The logprobs
are ``log_softmax(logits / temperature)`` at the chosen token, without top-p renormalisation;
at temperature 0 they are taken at temperature 1 (see ``infra.engines.base``).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from infra.engines.base import (
    GenerationOutput,
    ModuleResidency,
    check_generate_args,
    eos_ids,
    pad_id,
)
from infra.engines.probe import trainer_probe_logprobs
from infra.kernels import fuse_activations

__all__ = ["TransformersEngine", "sample_next_tokens"]


class TransformersEngine:
    """A ``GenerationEngine`` over a transformers causal LM.

    ``model`` is a folder for ``from_pretrained`` (loaded in ``dtype``) or a model already in
    memory (used as is: no copy, no dtype change, moved to ``device``). ``eos_token_id`` (one id
    or several) and ``pad_token_id`` default to the model's generation config, then its config.
    """

    def __init__(
        self,
        model: str | Path | PreTrainedModel,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
    ) -> None:
        self._device = torch.device(device)
        if isinstance(model, (str, Path)):
            model = AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
        fuse_activations(model)
        torch.nn.Module.to(model, self._device)  # (transformers' wrapped .to confuses mypy)
        self.model: PreTrainedModel = torch.nn.Module.eval(model)  # (transformers' eval is untyped)
        if eos_token_id is None:
            eos_token_id = _model_default(self.model, "eos_token_id")
        self.eos_token_ids: tuple[int, ...] = eos_ids(eos_token_id)
        self.pad_token_id: int = pad_id(
            pad_token_id, _model_default(self.model, "pad_token_id"), eos=self.eos_token_ids
        )
        self._eos = torch.tensor(self.eos_token_ids, dtype=torch.long, device=self._device)
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._keeps_last_logits = "logits_to_keep" in params
        self._residency = ModuleResidency(self.model, self._device)

    # -- state ---------------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def is_awake(self) -> bool:
        return self._residency.is_awake

    def sleep(self) -> None:
        """Release device memory: on CUDA the weights move to pinned CPU memory; on CPU the
        weights stay where they are and only the engine is marked asleep. Idempotent."""
        self._residency.sleep()

    def wake_up(self) -> None:
        """Bring the (bit-identical) weights back to the device. Idempotent."""
        self._residency.wake_up()

    @torch.no_grad()
    def load_weights(self, state_dict: Mapping[str, Tensor]) -> None:
        """Copy the trainer's weights in (allowed awake or asleep; values cast to our dtype).

        Every parameter must be given (tied duplicates such as ``lm_head.weight`` may be left
        out); a name this model does not have raises KeyError, before anything is copied.
        """
        own = self.model.state_dict(keep_vars=True)
        unknown = sorted(set(state_dict) - set(own))
        if unknown:
            raise KeyError(f"load_weights: names not in the rollout model: {unknown[:5]}")
        missing = sorted(
            name for name, _ in self.model.named_parameters() if name not in state_dict
        )
        if missing:
            raise KeyError(f"load_weights: parameters missing from the state dict: {missing[:5]}")
        for name, value in state_dict.items():
            own[name].copy_(value)

    def probe_logprobs(self, ids: Tensor) -> Tensor:
        """``log p(ids[t] | ids[:t])`` for t = 1 .. L-1 at temperature 1, float32 on the CPU
        (the weight-sync probe: the same forward the trainer's side runs)."""
        self._residency.require_awake("TransformersEngine.probe_logprobs()")
        return trainer_probe_logprobs(self.model, ids)

    # -- generation ----------------------------------------------------------------------------

    @torch.inference_mode()
    def generate(
        self,
        prompt_ids: list[Tensor],
        *,
        n: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int,
        min_new_tokens: int = 0,
    ) -> GenerationOutput:
        """Sample ``n`` responses per prompt; rows are prompt-major (see ``GenerationOutput``).

        ``min_new_tokens`` forbids EOS before that many tokens (benchmarks use it to compare
        systems on equal work); logprobs are then those of the distribution without EOS."""
        self._residency.require_awake("TransformersEngine.generate()")
        check_generate_args(
            prompt_ids, n=n, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p
        )
        rows = len(prompt_ids) * n
        if rows == 0 or max_new_tokens == 0:
            empty = [torch.zeros(0, dtype=torch.long) for _ in range(rows)]
            return GenerationOutput(empty, [torch.zeros(0, dtype=torch.float32) for _ in empty])
        tokens, logprobs, lengths = self._sample_loop(
            prompt_ids, n, max_new_tokens, temperature, top_p, seed, min_new_tokens
        )
        tokens, logprobs, cut = tokens.cpu(), logprobs.cpu(), lengths.tolist()
        return GenerationOutput(
            response_ids=[tokens[r, :k].clone() for r, k in enumerate(cut)],
            rollout_logprobs=[logprobs[r, :k].clone() for r, k in enumerate(cut)],
        )

    def _forward(
        self, input_ids: Tensor, mask: Tensor | None, positions: Tensor, cache: Any
    ) -> Tensor:
        kwargs: dict[str, Any] = {self._cache_kw: cache}
        if self._keeps_last_logits:
            kwargs["logits_to_keep"] = 1
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **kwargs,
        )
        logits: Tensor = out.logits[:, -1, :]  # (B, V)
        return logits

    def _sample_loop(
        self,
        prompt_ids: list[Tensor],
        n: int,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        seed: int,
        min_new_tokens: int = 0,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Return tokens (B, T), logprobs (B, T) and response lengths (B,) for B = prompts * n."""
        device = self._device
        # 1. Left-pad the distinct prompts and prefill them once.
        input_ids, prompt_mask = _left_pad(prompt_ids, self.pad_token_id, device)  # (U, P)
        positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)  # (U, P)
        padded = not bool(prompt_mask.all())
        cache = _new_cache(self.model)
        logits = self._forward(input_ids, prompt_mask if padded else None, positions, cache)
        # 2. Expand to n rows per prompt: prompt i -> rows i*n .. i*n+n-1.
        if n > 1:
            cache.batch_repeat_interleave(n)
            logits = logits.repeat_interleave(n, dim=0)  # (B, V)
        batch = logits.shape[0]
        width = input_ids.shape[1]
        next_pos = prompt_mask.sum(-1).repeat_interleave(n)  # (B,) position of the next token
        mask = torch.ones(batch, width + max_new_tokens, dtype=torch.long, device=device)
        mask[:, :width] = prompt_mask.repeat_interleave(n, dim=0)  # (B, P + T)
        tokens = torch.full((batch, max_new_tokens), self.pad_token_id, device=device)  # (B, T)
        logprobs = torch.zeros(batch, max_new_tokens, dtype=torch.float32, device=device)  # (B, T)
        live = torch.arange(batch, device=device)  # (b,) original row of each batch row
        done = torch.zeros(batch, dtype=torch.bool, device=device)  # (b,)
        generator = torch.Generator(device=device).manual_seed(seed)
        steps = 0
        # 3. Decode step by step from the cache.
        for step in range(max_new_tokens):
            if step < min_new_tokens and self._eos.numel():
                logits[:, self._eos] = float("-inf")
            token, token_logprob = sample_next_tokens(
                logits, temperature=temperature, top_p=top_p, generator=generator
            )
            tokens[live, step] = token
            logprobs[live, step] = token_logprob
            steps = step + 1
            if self._eos.numel():
                done |= torch.isin(token, self._eos)
            if steps == max_new_tokens or (self._eos.numel() and bool(done.all())):
                break
            # 4. Drop finished rows once at least half of the batch is done.
            if self._eos.numel() and 2 * int(done.sum()) >= done.numel():
                keep = (~done).nonzero().squeeze(-1)  # (b',)
                cache.batch_select_indices(keep)
                live, token, next_pos, mask = live[keep], token[keep], next_pos[keep], mask[keep]
                done = done[keep]
            step_mask = mask[:, : width + step + 1] if padded else None
            logits = self._forward(token[:, None], step_mask, next_pos[:, None], cache)
            next_pos = next_pos + 1
        return tokens, logprobs, self._response_lengths(tokens, steps)

    def _response_lengths(self, tokens: Tensor, steps: int) -> Tensor:
        """Length up to and including the first EOS; ``steps`` for rows that never emitted one."""
        lengths = torch.full((tokens.shape[0],), steps, dtype=torch.long, device=tokens.device)
        if not self._eos.numel():
            return lengths
        is_eos = torch.isin(tokens[:, :steps], self._eos)  # (B, steps)
        first = is_eos.int().argmax(-1)  # (B,) 0 when there is none
        return torch.where(is_eos.any(-1), first + 1, lengths)


def sample_next_tokens(
    logits: Tensor, *, temperature: float, top_p: float, generator: torch.Generator
) -> tuple[Tensor, Tensor]:
    """Draw one token per row of ``logits`` (B, V); return (tokens (B,), logprobs (B,)).

    Temperature 0 is greedy (argmax, logprob at temperature 1). Otherwise tokens are drawn from
    softmax(logits / T) restricted to the top-p nucleus, by the exponential race
    ``argmax(log p - log E)``, E ~ Exp(1) i.i.d. — the same law as multinomial sampling. The
    returned logprob is log softmax(logits / T) at the token, without top-p renormalisation.
    """
    logits = logits.float()
    if temperature == 0:
        token = logits.argmax(-1)  # (B,)
        logp = torch.log_softmax(logits, dim=-1)  # (B, V)
        return token, logp.gather(-1, token[:, None]).squeeze(-1)
    logp = torch.log_softmax(logits / temperature, dim=-1)  # (B, V)
    candidates = (
        logp if top_p >= 1.0 else logp.masked_fill(_outside_nucleus(logp, top_p), -torch.inf)
    )
    noise = torch.empty_like(logp).exponential_(generator=generator)  # (B, V)
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)  # log(0) would let a masked token win
    token = (candidates - noise.log()).argmax(-1)  # (B,)
    return token, logp.gather(-1, token[:, None]).squeeze(-1)


def _outside_nucleus(logp: Tensor, top_p: float) -> Tensor:
    """Bool (B, V): True for tokens outside the smallest set whose mass reaches ``top_p``."""
    sorted_p, order = logp.exp().sort(dim=-1, descending=True)  # (B, V)
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p  # (B, V) mass of strictly likelier tokens
    outside_sorted = mass_before >= top_p  # the most likely token always stays
    return torch.zeros_like(outside_sorted).scatter(-1, order, outside_sorted)


def _left_pad(
    prompt_ids: list[Tensor], pad_token_id: int, device: torch.device
) -> tuple[Tensor, Tensor]:
    """Left-pad 1-D prompts: (ids (U, P) int64, mask (U, P) int64 with 1 = real token)."""
    width = max(int(ids.numel()) for ids in prompt_ids)
    ids = torch.full((len(prompt_ids), width), pad_token_id, dtype=torch.long)  # (U, P)
    mask = torch.zeros(len(prompt_ids), width, dtype=torch.long)  # (U, P)
    for row, prompt in enumerate(prompt_ids):
        ids[row, width - prompt.numel() :] = prompt
        mask[row, width - prompt.numel() :] = 1
    return ids.to(device), mask.to(device)


def _new_cache(model: PreTrainedModel) -> DynamicCache:
    """A DynamicCache whose full-attention layers grow in place (``GrowingLayer``)."""
    try:
        cache = DynamicCache(config=model.config)
    except TypeError:  # transformers versions whose DynamicCache takes no config
        return DynamicCache()
    layers = getattr(cache, "layers", None)
    if isinstance(layers, list):
        cache.layers = [
            # GrowingLayer inherits transformers' unannotated CacheLayerMixin.__init__
            GrowingLayer() if type(x) is DynamicLayer else x  # type: ignore[no-untyped-call]
            for x in layers
        ]
    return cache


# transformers' CacheLayerMixin.__init_subclass__ is unannotated
class GrowingLayer(DynamicLayer):  # type: ignore[no-untyped-call]
    """A ``DynamicLayer`` that appends into spare capacity instead of concatenating.

    transformers' layer makes a new (B, H, L + 1, D) tensor per decoded token and layer (a
    ``torch.cat`` copying the whole cache); this one keeps (B, H, capacity, D) buffers, writes
    the new positions in place and hands attention the first L positions as a view, doubling
    the capacity when it runs out. When someone else replaced ``keys``/``values`` (batch
    selection, repeat, crop), the next update starts a buffer from them.
    """

    _key_buf: Tensor | None = None
    _value_buf: Tensor | None = None

    def update(
        self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any
    ) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.keys, self.values = key_states[..., :0, :], value_states[..., :0, :]
        if self.keys is None or self.values is None:
            raise RuntimeError("GrowingLayer.update: initialized but holds no keys or values")
        self._key_buf, self.keys = _append(self._key_buf, self.keys, key_states)
        self._value_buf, self.values = _append(self._value_buf, self.values, value_states)
        return self.keys, self.values


def _append(buf: Tensor | None, held: Tensor, new: Tensor) -> tuple[Tensor, Tensor]:
    """Append ``new`` (B, H, t, D) after ``held`` (B, H, L, D) -> (buffer, view of L + t)."""
    length, end = held.shape[-2], held.shape[-2] + new.shape[-2]
    in_buf = (
        buf is not None
        and held.data_ptr() == buf.data_ptr()
        and held.stride() == buf.stride()
        and held.shape[:2] == buf.shape[:2]
        and held.shape[-1] == buf.shape[-1]
        and held.dtype == buf.dtype
    )
    if not in_buf or buf is None or buf.shape[-2] < end:
        shape = (*new.shape[:2], max(end, 2 * length, 64), new.shape[-1])
        fresh = new.new_empty(shape)  # (B, H, capacity, D)
        if length:
            fresh[..., :length, :].copy_(held)
        buf = fresh
    buf[..., length:end, :].copy_(new)
    return buf, buf[..., :end, :]


def _model_default(model: PreTrainedModel, name: str) -> Any:
    """``name`` from the model's generation config, else from its config (None when neither)."""
    value = getattr(getattr(model, "generation_config", None), name, None)
    return getattr(model.config, name, None) if value is None else value
