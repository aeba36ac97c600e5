"""Every OpenAI request field, and which engines honour it: honoured, or refused with a 400 naming the field
and the reason — never dropped. A field a client sets to its neutral value (``n: 1``, ``logprobs: false``,
``tools: []``) asks for nothing and passes everywhere.

The in-process engines (llama.cpp, MLX) answer from this table alone: a field it does not list is refused.
vLLM answers the OpenAI fields itself (its own validation); tuneport forwards those and vLLM's own
extensions, and refuses only what vLLM does not implement. The values of the fields an in-process engine
honours are typed by :mod:`tuneport.serve.openai_request`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ApiError

IN_PROCESS = frozenset({"llamacpp", "mlx"})
ALL = IN_PROCESS | {"vllm"}
VLLM = frozenset({"vllm"})
NOT_MLX = frozenset({"llamacpp", "vllm"})  # llama.cpp (grammars, shared prompt cells) and vLLM


@dataclass(frozen=True)
class Field:
    name: str
    kinds: tuple[str, ...]  # "completions", "chat"
    engines: frozenset[str]  # engines that honour any value
    neutral: tuple = ()  # values that ask for nothing (None is always neutral)
    why: str = ""  # what the engines that do not honour it lack

    def refused(self, value: object, engine: str) -> bool:
        neutral = value is None or any(type(value) is type(n) and value == n for n in self.neutral)
        return engine not in self.engines and not neutral  # type-strict: logprobs 0 is not logprobs false


BOTH = ("completions", "chat")
CHAT = ("chat",)
COMPLETIONS = ("completions",)
SAMPLED_ONLY = "tuneport's sampler here has temperature, top_p and seed only"

FIELDS: dict[str, Field] = {f.name: f for f in (
    Field("model", BOTH, ALL),
    Field("prompt", COMPLETIONS, ALL),
    Field("messages", CHAT, ALL),
    Field("stream", BOTH, ALL),
    Field("stream_options", BOTH, ALL),
    Field("max_tokens", BOTH, ALL),
    Field("max_completion_tokens", CHAT, ALL),
    Field("temperature", BOTH, ALL),
    Field("top_p", BOTH, ALL),
    Field("seed", BOTH, ALL),
    Field("stop", BOTH, ALL),
    Field("user", BOTH, ALL),  # an end-user id for the client's own records: nothing to do with it
    Field("ignore_eos", BOTH, ALL),  # vLLM's extension
    Field("return_token_ids", BOTH, ALL),  # vLLM's extension
    Field("adapters", BOTH, ALL),  # tuneport's weighted mix: Backend.adapters_for refuses it where not served
    Field("cache_prompt", BOTH, IN_PROCESS, (True,), "vLLM's prefix cache cannot be turned off per request (its "
          "key holds the adapter, so it never mixes adapters)"),  # llama-server's field
    Field("n", BOTH, NOT_MLX, (1,), "one choice per request on MLX"),
    Field("best_of", COMPLETIONS, VLLM, (1,), "one sequence per request here"),
    Field("logprobs", BOTH, ALL),
    Field("top_logprobs", CHAT, ALL),
    Field("echo", COMPLETIONS, NOT_MLX, (False,), "the MLX engine does not score prompts"),
    Field("suffix", COMPLETIONS, frozenset(), ("",), "no engine here fills in the middle"),
    Field("presence_penalty", BOTH, VLLM, (0, 0.0), SAMPLED_ONLY),
    Field("frequency_penalty", BOTH, VLLM, (0, 0.0), SAMPLED_ONLY),
    Field("logit_bias", BOTH, VLLM, ({},), SAMPLED_ONLY),
    Field("top_k", BOTH, VLLM, (-1, 0), SAMPLED_ONLY),
    Field("min_p", BOTH, VLLM, (0, 0.0), SAMPLED_ONLY),
    Field("repetition_penalty", BOTH, VLLM, (1, 1.0), SAMPLED_ONLY),
    Field("response_format", BOTH, NOT_MLX, ({"type": "text"},), "the MLX engine has no grammars"),
    Field("tools", CHAT, NOT_MLX, ([],), "the MLX engine has no tool calling"),
    Field("tool_choice", CHAT, NOT_MLX, ("none",), "the MLX engine has no tool calling"),
    Field("parallel_tool_calls", CHAT, NOT_MLX, (True, False), "the MLX engine has no tool calling"),
    Field("store", CHAT, frozenset(), (False,), "tuneport stores no completions"),
    Field("metadata", CHAT, frozenset(), ({},), "tuneport stores no completions"),
)}


def check_fields(kind: str, body: dict, engine: str) -> None:
    """Refuse (ApiError 400) every field of ``body`` that ``engine`` does not honour, naming each."""
    problems = []
    for key, value in body.items():
        field = FIELDS.get(key)
        if field is None or kind not in field.kinds:
            if engine in IN_PROCESS:  # vLLM's own extensions go to vLLM, which validates them
                where = f" on /v1/{'chat/completions' if kind == 'chat' else 'completions'}" if field else ""
                problems.append(f"'{key}' is not a field tuneport knows{where}")
        elif field.refused(value, engine):
            problems.append(f"'{key}' is not honoured by the {engine} engine ({field.why})")
    if problems:
        honours = [f for f in FIELDS.values() if kind in f.kinds and engine not in f.engines
                   and any(e not in IN_PROCESS for e in f.engines)]
        hint = ("serve with --engine vllm for " + ", ".join(f.name for f in honours[:4])
                if honours and engine in IN_PROCESS else "drop the field")
        raise ApiError("; ".join(problems), hint + " (see docs/api-compat.md)")


def markdown_rows() -> list[str]:
    """The table's rows as docs/api-compat.md shows them (a test keeps the page equal to the table)."""
    def shown(v: object) -> str:
        return f'`"{v}"`' if isinstance(v, str) else "`" + repr(v).replace("'", '"') + "`"

    return [f"| `{f.name}` | {', '.join(f.kinds)} | "
            + " | ".join("honoured" if e in f.engines else "refused" for e in ("llamacpp", "mlx", "vllm"))
            + f" | {', '.join(shown(v) for v in f.neutral) or '—'} |" for f in FIELDS.values()]
