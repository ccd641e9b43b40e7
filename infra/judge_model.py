"""The LLM judge's model on a worker (the template, the parse functions and the scores are
``infra.judge``'s): its own tokenizer, the compiled ``reward.judge.template`` and a rollout-style
generation engine that writes one verdict per sample.

Torch, transformers and the engines are imported when a judge is built, so importing this module
loads no model library.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from infra.judge import JudgeInput, compile_template, render_template

if TYPE_CHECKING:
    import torch


class Judge:
    """The judge model on one worker: its own tokenizer (from ``model_path``), the rendered
    template and a generation engine of kind ``engine`` (``infra.engines.make_engine``, with
    ``engine_options``); ``Sleepable`` like the rollout engine. Verdicts are generated in
    batches of ``batch_size`` prompts. Every setting is the run's, as ``ModelWorker`` resolves
    it (``reward.judge.*``, ``reward.batch_size``): none has a default here."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        template: str,
        device: str | torch.device,
        dtype: torch.dtype,
        max_new_tokens: int,
        temperature: float,
        batch_size: int,
        engine: Literal["hf", "vllm"],
        engine_options: dict[str, Any],
    ) -> None:
        from transformers import AutoTokenizer

        from infra.engines import make_engine, pad_token_id, stop_token_ids

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.template = compile_template(template)
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.batch_size = batch_size
        self.engine = make_engine(
            engine,
            model_path,
            device=str(device),
            dtype=dtype,
            eos_token_id=stop_token_ids(self.tokenizer, str(model_path)),
            pad_token_id=pad_token_id(self.tokenizer),
            **engine_options,
        )

    @property
    def is_awake(self) -> bool:
        return self.engine.is_awake

    def sleep(self) -> None:
        self.engine.sleep()

    def wake_up(self) -> None:
        self.engine.wake_up()

    def prompt_ids(self, sample: JudgeInput) -> list[int]:
        """The judge's prompt for ``sample``: the template's message in the judge's chat
        template, with the generation prompt."""
        from infra.rl_data import chat_prompt_ids

        text = render_template(
            self.template,
            {
                "question": sample.question,
                "response": sample.response,
                "ground_truth": sample.ground_truth,
                "data_source": sample.data_source,
            },
        )
        return list(chat_prompt_ids(self.tokenizer, [{"role": "user", "content": text}]))

    def verdicts(self, samples: Sequence[JudgeInput], *, seed: int) -> list[str]:
        """One verdict per sample, in order (each at most ``max_new_tokens`` tokens)."""
        import torch

        out: list[str] = []
        for start in range(0, len(samples), self.batch_size):
            chunk = samples[start : start + self.batch_size]
            prompts = [torch.tensor(self.prompt_ids(s), dtype=torch.int64) for s in chunk]
            generated = self.engine.generate(
                prompts,
                n=1,
                max_new_tokens=self.max_new_tokens,
                temperature=self.temperature,
                seed=seed + start,
            )
            out.extend(
                self.tokenizer.batch_decode(
                    [r.tolist() for r in generated.response_ids], skip_special_tokens=True
                )
            )
        return out
