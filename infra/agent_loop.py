"""The multi-turn agent loop: sample → parse tool calls → run tools → append the tool messages'
tokens → sample again, token-in/token-out over any ``GenerationEngine``.

``run_agent_loop`` drives the engine's ``generate`` (ids in, ids out) turn by turn:

1. Turn 1 samples ``n`` responses per prompt, exactly as a single-turn rollout does.
2. Each turn's sampled ids are kept as sampled (``loss_mask`` True, the engine's log-probs); a
   turn that wrote a complete call (its format's closing text, ``</tool_call>`` for Hermes) is
   cut right after it.
3. The turn's text is read for tool calls in the policy's format (``tool_call_format``): the
   format its tokenizer declares (a ``response_template`` with a ``tool_calls`` field, read by
   transformers' ``parse_response``), else Hermes/Qwen calls, ``<tool_call>{"name": …,
   "arguments": {…}}</tool_call>``. Each call runs in the tool runner
   (``infra.tools.ToolPool``), and a call that does not parse, names an unknown tool, takes the
   wrong arguments, raises or times out becomes an error ``tool`` message, counted.
4. The tool messages are rendered by the chat template and only the tokens the template adds
   after the sampled ones are appended (``tool_turn_ids``; ``loss_mask`` False, log-prob 0):
   nothing already sampled is ever re-tokenized.
5. The rollout ends at an answer without a tool call, after ``max_turns`` assistant turns, or
   when ``max_new_tokens`` — the budget of the whole response, tool tokens included — is spent.

Pure of Prefect, Ray and the store: it imports torch and the engine contract only.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor

from infra.engines.base import GenerationEngine
from infra.text import first_line
from infra.tools import ToolCall, ToolResult

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase as Tokenizer

    from infra.config import RolloutConfig

__all__ = [
    "AgentTemplateError",
    "ToolRunner",
    "Trajectory",
    "agent_metrics",
    "HERMES",
    "ToolCallFormat",
    "check_tool_template",
    "final_answer",
    "parse_declared_calls",
    "parse_tool_calls",
    "run_agent_loop",
    "tool_call_format",
    "tool_turn_ids",
]

TOOL_CALL_END = "</tool_call>"
REASONING_END = "</think>"  # reasoning templates (Qwen3 style) close a turn's thinking with it
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_TURN_SEED_STRIDE = 1_000_003


class AgentTemplateError(ValueError):
    """The chat template cannot render a tool turn after the sampled text (see the message)."""


class ToolRunner(Protocol):
    """Runs tool calls: one result per call, in order, never raising for a bad call."""

    def run(self, calls: Sequence[ToolCall]) -> list[ToolResult]: ...


@dataclass
class Trajectory:
    """One multi-turn sample: every token after the prompt and what produced it.

    ``response_ids`` (T,) the sampled tokens and the tool messages' tokens; ``loss_mask`` (T,)
    True on sampled tokens; ``rollout_logprobs`` (T,) the engine's, 0 on tool tokens;
    ``messages`` the conversation (prompt, assistant turns as sampled, tool results);
    ``num_turns`` assistant turns generated; ``tool_calls``/``tool_errors`` calls asked for and
    those that failed; ``truncated_tool_responses`` tool answers cut at
    ``max_tool_response_tokens``.
    """

    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[bool] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    segments: list[tuple[str, list[int]]] = field(default_factory=list)  # ("sampled"|"tool", ids)
    num_turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    truncated_tool_responses: int = 0
    done: bool = False

    def extend(self, ids: list[int], logprobs: list[float] | None) -> None:
        sampled = logprobs is not None
        self.response_ids += ids
        self.loss_mask += [sampled] * len(ids)
        self.rollout_logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.segments.append(("sampled" if sampled else "tool", list(ids)))


@dataclass(frozen=True)
class ToolCallFormat:
    """How the policy writes tool calls. ``declared``: its tokenizer's ``response_template``
    has a ``tool_calls`` field, and transformers' ``parse_response`` reads the calls;
    ``hermes``: ``<tool_call>{json}</tool_call>``, read by ``parse_tool_calls``. ``closes`` and
    ``close_pattern`` (a regex): what ends one call (a turn is cut after the first; neither: it
    runs to its EOS)."""

    declared: bool
    closes: tuple[str, ...]
    close_pattern: str | None = None

    def closed(self, text: str) -> bool:
        """``text`` holds the end of a call."""
        if any(close in text for close in self.closes):
            return True
        return self.close_pattern is not None and re.search(self.close_pattern, text) is not None


HERMES = ToolCallFormat(declared=False, closes=(TOOL_CALL_END,))


def tool_call_format(tokenizer: Tokenizer) -> ToolCallFormat:
    """The tokenizer's declared format when its ``response_template`` has a ``tool_calls``
    field (what ends a call from that field's ``close`` texts or ``close_pattern``), else
    Hermes."""
    template = getattr(tokenizer, "response_template", None)
    fields = template.get("fields") if isinstance(template, dict) else None
    field = fields.get("tool_calls") if isinstance(fields, dict) else None
    if not isinstance(field, dict):
        return HERMES
    close = field.get("close")
    closes = [close] if isinstance(close, str) else close if isinstance(close, list) else []
    pattern = field.get("close_pattern")
    return ToolCallFormat(
        declared=True,
        closes=tuple(str(c) for c in closes if c),
        close_pattern=pattern if isinstance(pattern, str) and pattern else None,
    )


_CALL_SHAPE = 'error: a tool call is {"name": <tool>, "arguments": {<name>: <value>}}'


def _tool_call(value: Any) -> ToolCall | ToolResult:
    """A call from its parsed JSON ``{"name": …, "arguments": {…} or a JSON string}``, or the
    error result that says what a call looks like."""
    name = value.get("name") if isinstance(value, dict) else None
    arguments = value.get("arguments", {}) if isinstance(value, dict) else None
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            arguments = None
    if not isinstance(name, str) or not isinstance(arguments, dict):
        return ToolResult(_CALL_SHAPE, True)
    return ToolCall(name, arguments)


def parse_tool_calls(text: str) -> list[ToolCall | ToolResult]:
    """The Hermes tool calls in ``text``, in order; a call that does not parse is an error
    ``ToolResult`` in its place."""
    out: list[ToolCall | ToolResult] = []
    for body in _TOOL_CALL.findall(text):
        try:
            value = json.loads(body)
        except json.JSONDecodeError as exc:
            out.append(ToolResult(f"error: the tool call is not JSON ({exc.msg})", True))
            continue
        out.append(_tool_call(value))
    return out


def parse_declared_calls(
    tokenizer: Tokenizer,
    text: str,
    *,
    prefix: str,
    tools: list[dict[str, Any]] | None,
    form: ToolCallFormat | None = None,
) -> list[ToolCall | ToolResult]:
    """The tool calls in ``text`` as the tokenizer's ``response_template`` reads them
    (``prefix``: the conversation before the turn, which a template may have opened); each call
    is ``{"name", "arguments"}``, or an OpenAI-style ``{"type": "function", "function": {…}}``.
    A response the template cannot parse is one error ``ToolResult`` when it holds the end of a
    call (``form``, the tokenizer's format by default), else an answer without calls."""
    schemas: list[dict[Any, Any] | Callable[..., Any]] | None = (
        list(tools) if tools is not None else None
    )
    try:
        message = tokenizer.parse_response(text, prefix=prefix, tools=schemas)
    except Exception as exc:  # noqa: BLE001 - the parser's own error, whatever its type
        if not (form or tool_call_format(tokenizer)).closed(text):
            return []
        return [ToolResult(f"error: the tool call does not parse ({first_line(exc)})", True)]
    calls = message.get("tool_calls") if isinstance(message, dict) else None
    out: list[ToolCall | ToolResult] = []
    for item in calls if isinstance(calls, list) else []:
        inner = item.get("function", item) if isinstance(item, dict) else item
        out.append(_tool_call(inner))
    return out


def _render(tokenizer: Tokenizer, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    return str(text)


def tool_turn_ids(
    tokenizer: Tokenizer,
    conversation: list[dict[str, Any]],
    tool_messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None,
    eos_text: str | None,
) -> list[int]:
    """The ids the chat template adds after the last assistant turn's sampled text when
    ``tool_messages`` follow it, up to and including the next assistant generation prompt.

    1. The conversation is rendered with the tool messages and the generation prompt, and
       without its last (assistant) turn: what the two share comes before that turn.
    2. After the shared part, the end of the assistant's text: the whole sampled text, or,
       when the template re-renders a turn other messages follow (Qwen3 style: an empty
       ``<think>`` block is dropped), the part after its ``</think>``; of the two, the one
       that ends first.
    3. The new text runs from there to the end, less the EOS text the policy sampled
       (``eos_text``); it must hold every tool message (as written, stripped, or as a JSON
       string, as ``tojson`` renders it). The template's special tokens delimit it, so its
       ids are those of the whole rendering's tail.

    Raises ``AgentTemplateError`` when the template drops a tool message or the assistant's
    text.
    """
    after = _render(
        tokenizer, conversation + tool_messages, tools=tools, add_generation_prompt=True
    )
    # 1. What comes before the assistant's turn.
    try:
        before = _render(tokenizer, conversation[:-1], tools=tools)
    except Exception:  # noqa: BLE001 - a template that refuses to end on that message
        before = ""
    shared = len(os.path.commonprefix([before, after]))
    # 2. The end of the assistant's text, as the template renders it.
    content = str(conversation[-1].get("content") or "")
    ends = [
        at + len(anchor)
        for anchor in {content, content.rsplit(REASONING_END, 1)[-1].lstrip()}
        if anchor and (at := after.find(anchor, shared)) >= 0
    ]
    tail = after[min(ends) :] if ends else ""
    # 3. The tool turn, less the EOS the policy sampled.
    if not ends or not all(_rendered(str(m["content"]), tail) for m in tool_messages):
        raise AgentTemplateError(
            "the chat template does not render a tool turn after the assistant's text "
            "verbatim; use a template with a `tool` role (Hermes/ChatML or Qwen3 style) for "
            "rollout.tools"
        )
    if eos_text and tail.startswith(eos_text):
        tail = tail[len(eos_text) :]
    return list(tokenizer.encode(tail, add_special_tokens=False))


def _rendered(content: str, text: str) -> bool:
    """``content`` appears in ``text`` as written, stripped, or as a JSON string (Jinja's
    ``tojson`` also escapes ``<``, ``>``, ``&`` and ``'``)."""
    quoted = json.dumps(content)[1:-1]
    jinja = "".join(_JINJA_JSON.get(c, c) for c in quoted)
    return any(form in text for form in (content, content.strip(), quoted, jinja))


_JINJA_JSON = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "'": "\\u0027"}
# A tool answer with what templates escape or trim: checks that it is found however rendered.
CHECK_ANSWER = ' tool answer "3" <ok> & it\'s\nline 2 '


def check_tool_template(tokenizer: Tokenizer, tools: list[dict[str, Any]]) -> None:
    """Render one tool turn as the loop does (``tool_turn_ids``): a user message, an assistant
    turn that calls the first tool (once as is, once after a reasoning block), an answer with
    quotes, markup and a newline. With a declared call format, its ``response_template`` must
    parse a plain answer. Raises ``AgentTemplateError`` when the tokenizer cannot."""
    name = str(tools[0].get("function", tools[0]).get("name", "tool"))
    call = f"<tool_call>{json.dumps({'name': name, 'arguments': {}})}{TOOL_CALL_END}"
    answer = [{"role": "tool", "name": name, "content": CHECK_ANSWER}]
    eos = getattr(tokenizer, "eos_token", None)
    for content in (call, f"<think>\nI add.\n{REASONING_END}\n\n{call}"):
        conversation = [
            {"role": "user", "content": "What is 1 + 2?"},
            {"role": "assistant", "content": content},
        ]
        try:
            tool_turn_ids(
                tokenizer, conversation, answer, tools=tools, eos_text=eos if eos else None
            )
        except AgentTemplateError:
            raise
        except Exception as exc:  # a template's own error (an unknown role, a raise_exception)
            raise AgentTemplateError(
                f"the chat template fails on a tool turn ({first_line(exc)}); use a template "
                "with a `tool` role (Hermes/ChatML or Qwen3 style) for rollout.tools"
            ) from None
    if tool_call_format(tokenizer).declared:
        try:
            tokenizer.parse_response("3", prefix="")
        except Exception as exc:  # noqa: BLE001 - transformers' own error for the template
            raise AgentTemplateError(
                f"the tokenizer's response_template does not parse an answer "
                f"({first_line(exc)}); fix its response_template or remove it (Hermes calls)"
            ) from None


def final_answer(messages: list[dict[str, Any]]) -> str:
    """The last assistant message's text (a reward function's ``solution_str``)."""
    for message in reversed(messages):
        if message.get("role") == "assistant":
            return str(message.get("content") or "")
    return ""


@dataclass(frozen=True)
class _Turn:
    """What the loop needs of the tokenizer and the tools, computed once per batch."""

    tokenizer: Tokenizer
    format: ToolCallFormat
    schemas: list[dict[str, Any]] | None
    eos_ids: frozenset[int]

    @classmethod
    def of(
        cls,
        tokenizer: Tokenizer,
        schemas: list[dict[str, Any]] | None,
        eos_token_ids: Sequence[int],
    ) -> _Turn:
        ids = frozenset(int(i) for i in eos_token_ids)
        return cls(tokenizer, tool_call_format(tokenizer), schemas, ids)

    def calls(self, text: str, context: Tensor) -> list[ToolCall | ToolResult]:
        """The calls in one turn's ``text``; ``context`` (the ids before the turn) is decoded
        only for a declared format, whose parser reads the turn in its conversation."""
        if not self.format.declared:
            return parse_tool_calls(text)
        prefix = str(self.tokenizer.decode(context.tolist(), skip_special_tokens=False))
        return parse_declared_calls(
            self.tokenizer, text, prefix=prefix, tools=self.schemas, form=self.format
        )


def _call_end(ids: list[int], turn: _Turn) -> int:
    """Index just after the token that completes the turn's first call (what ends a call in
    its format), -1 when none does. Found in the decoded text, so an end the policy spelled in
    other tokens than the tokenizer's own counts too: the shortest prefix of ``ids`` whose text
    holds it (a binary search over prefixes: a prefix that holds it stays holding it)."""

    def closed(k: int) -> bool:
        return turn.format.closed(str(turn.tokenizer.decode(ids[:k], skip_special_tokens=False)))

    if not closed(len(ids)):
        return -1
    low, high = 1, len(ids)
    while low < high:
        middle = (low + high) // 2
        if closed(middle):
            high = middle
        else:
            low = middle + 1
    return high


def _messages(raw_prompt: Any) -> list[dict[str, Any]]:
    if isinstance(raw_prompt, str):
        return [{"role": "user", "content": raw_prompt}]
    return [dict(m) for m in raw_prompt]


def run_agent_loop(
    engine: GenerationEngine,
    tokenizer: Tokenizer,
    *,
    prompt_ids: list[Tensor],
    raw_prompts: list[Any],
    n: int,
    seed: int,
    rollout: RolloutConfig,
    temperature: float,
    min_new_tokens: int,
    tools: ToolRunner,
    tool_schemas: list[dict[str, Any]] | None,
    eos_token_ids: Sequence[int],
) -> list[Trajectory]:
    """``n`` trajectories per prompt, prompt-major (see the module docstring). ``rollout`` is
    the run's ``rollout`` section (``max_turns``, ``max_new_tokens``,
    ``max_tool_response_tokens``, ``top_p``); ``temperature`` and ``min_new_tokens`` are this
    batch's (the first turn's minimum; a validation batch samples at its own temperature)."""
    turn = _Turn.of(tokenizer, tool_schemas, eos_token_ids)
    trajectories = [Trajectory(messages=_messages(p)) for p in raw_prompts for _ in range(n)]
    contexts = [ids for ids in prompt_ids for _ in range(n)]
    # 1. The first turn: n samples per prompt, as a single-turn rollout.
    out = engine.generate(
        prompt_ids,
        n=n,
        max_new_tokens=rollout.max_new_tokens,
        temperature=temperature,
        top_p=rollout.top_p,
        seed=seed,
        min_new_tokens=min_new_tokens,
    )
    live = list(range(len(trajectories)))
    segments = list(zip(out.response_ids, out.rollout_logprobs))
    for number in range(1, rollout.max_turns + 1):
        # 2.-4. Keep the sampled turn, run its calls, append the tool turn.
        calls = [
            _take_turn(
                trajectories[r],
                ids,
                lps,
                turn,
                context=_context(contexts[r], trajectories[r]),
                last=number == rollout.max_turns,
            )
            for r, (ids, lps) in zip(live, segments)
        ]
        _run_tools(trajectories, live, calls, tools, tokenizer, tool_schemas, rollout)
        live = [r for r in live if not trajectories[r].done]
        if not live:
            break
        # 5. The next turn from each live row's whole context.
        rows = [(contexts[r], trajectories[r]) for r in live]
        seed_of_turn = (seed + number * _TURN_SEED_STRIDE) % (2**31 - 1)
        segments = _next_turn(engine, rows, rollout, temperature=temperature, seed=seed_of_turn)
    return trajectories


def _next_turn(
    engine: GenerationEngine,
    rows: list[tuple[Tensor, Trajectory]],
    rollout: RolloutConfig,
    *,
    temperature: float,
    seed: int,
) -> list[tuple[Tensor, Tensor]]:
    """One more sampled turn of each (prompt, trajectory) row, from its whole context, cut to
    the response budget the row has left: (token ids, their log-probs) per row."""
    remaining = [rollout.max_new_tokens - len(t.response_ids) for _, t in rows]
    out = engine.generate(
        [_context(prompt, t) for prompt, t in rows],
        n=1,
        max_new_tokens=max(remaining),
        temperature=temperature,
        top_p=rollout.top_p,
        seed=seed,
    )
    return [
        (ids[:left], lps[:left])
        for ids, lps, left in zip(out.response_ids, out.rollout_logprobs, remaining)
    ]


def _context(prompt: Tensor, t: Trajectory) -> Tensor:
    """The ids a row's next turn starts from: its prompt and every response token so far."""
    return torch.cat([prompt, torch.tensor(t.response_ids, dtype=torch.int64)])


def _take_turn(
    t: Trajectory, ids: Tensor, logprobs: Tensor, turn: _Turn, *, context: Tensor, last: bool
) -> list[ToolCall | ToolResult]:
    """Keep one sampled turn (cut after its first complete call and the EOS right after it, if
    any); the calls it asks for (none when the rollout ends here)."""
    sampled, lps = [int(i) for i in ids.tolist()], [float(x) for x in logprobs.tolist()]
    cut = _call_end(sampled, turn)
    if 0 < cut < len(sampled) and sampled[cut] in turn.eos_ids:
        cut += 1  # the EOS that closes the call's turn stays the policy's
    if cut > 0:
        sampled, lps = sampled[:cut], lps[:cut]
    t.extend(sampled, lps)
    t.num_turns += 1
    ended = bool(sampled) and sampled[-1] in turn.eos_ids
    text = str(turn.tokenizer.decode(sampled[:-1] if ended else sampled, skip_special_tokens=False))
    t.messages.append({"role": "assistant", "content": text})
    calls = turn.calls(text, context)
    if not calls or last:
        t.done = True
        return []
    t.tool_calls += len(calls)
    if ended:  # the EOS the policy sampled closes its turn (``tool_turn_ids``)
        eos = turn.tokenizer.decode(sampled[-1:], skip_special_tokens=False)
        t.messages[-1]["eos_text"] = str(eos)
    return calls


def _run_tools(
    trajectories: list[Trajectory],
    live: list[int],
    calls: list[list[ToolCall | ToolResult]],
    tools: ToolRunner,
    tokenizer: Tokenizer,
    schemas: list[dict[str, Any]] | None,
    rollout: RolloutConfig,
) -> None:
    """Run every live row's calls in one batch; append each row's tool turn."""
    asked = [c for row in calls for c in row if isinstance(c, ToolCall)]
    answers = iter(tools.run(asked) if asked else [])
    for r, row in zip(live, calls):
        t = trajectories[r]
        if t.done:
            continue
        results = [next(answers) if isinstance(c, ToolCall) else c for c in row]
        t.tool_errors += sum(result.error for result in results)
        messages = []
        for call, result in zip(row, results):
            content = _cut(tokenizer, result.content, rollout.max_tool_response_tokens)
            t.truncated_tool_responses += content != result.content
            name = call.name if isinstance(call, ToolCall) else "invalid"
            messages.append({"role": "tool", "name": name, "content": content})
        eos_text = t.messages[-1].pop("eos_text", None)
        ids = tool_turn_ids(tokenizer, t.messages, messages, tools=schemas, eos_text=eos_text)
        t.messages += messages
        left = rollout.max_new_tokens - len(t.response_ids)
        t.extend(ids[:left], None)
        t.done = len(ids) >= left


def _cut(tokenizer: Tokenizer, text: str, limit: int) -> str:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return text if len(ids) <= limit else str(tokenizer.decode(ids[:limit]))


def agent_metrics(
    *,
    num_turns: Tensor,
    tool_calls: Tensor,
    tool_errors: Tensor,
    truncated_tool_responses: Tensor,
) -> dict[str, float]:
    """``agent/num_turns/mean``, ``agent/tool_calls/mean``, ``agent/tool_errors/mean`` (per
    sample) and ``agent/truncated_tool_responses`` (the batch's count)."""
    return {
        "agent/num_turns/mean": float(num_turns.double().mean()) if num_turns.numel() else 0.0,
        "agent/tool_calls/mean": float(tool_calls.double().mean()) if tool_calls.numel() else 0.0,
        "agent/tool_errors/mean": (
            float(tool_errors.double().mean()) if tool_errors.numel() else 0.0
        ),
        "agent/truncated_tool_responses": float(truncated_tool_responses.sum()),
    }
