"""Ollama ``Modelfile``: FROM, ADAPTER, TEMPLATE translated from the chat template, SYSTEM (the default
system prompt the chat template adds when a chat has none, e.g. SmolLM2's), PARAMETER stop."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

log = logging.getLogger(__name__)
PROMPT_SENTINEL = "\x00tuneport-prompt\x00"


@dataclass(frozen=True)
class ChatFamily:
    name: str
    markers: tuple[str, ...]  # all must appear in the HF chat template
    template: str  # Ollama (Go) template
    stops: tuple[str, ...]
    system_block: str | None = None  # regex: the system turn in a rendered chat, its text as group 1


CHAT_FAMILIES: tuple[ChatFamily, ...] = (
    ChatFamily("llama3", ("<|start_header_id|>", "<|eot_id|>"),
               "{{ if .System }}<|start_header_id|>system<|end_header_id|>\n\n{{ .System }}<|eot_id|>{{ end }}"
               "{{ if .Prompt }}<|start_header_id|>user<|end_header_id|>\n\n{{ .Prompt }}<|eot_id|>{{ end }}"
               "<|start_header_id|>assistant<|end_header_id|>\n\n{{ .Response }}<|eot_id|>",
               ("<|eot_id|>", "<|start_header_id|>"),
               r"<\|start_header_id\|>system<\|end_header_id\|>\n\n(.*?)<\|eot_id\|>"),
    ChatFamily("chatml", ("<|im_start|>", "<|im_end|>"),
               "{{ if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}"
               "{{ if .Prompt }}<|im_start|>user\n{{ .Prompt }}<|im_end|>\n{{ end }}"
               "<|im_start|>assistant\n{{ .Response }}<|im_end|>\n",
               ("<|im_start|>", "<|im_end|>"), r"<\|im_start\|>system\n(.*?)<\|im_end\|>"),
    ChatFamily("gemma", ("<start_of_turn>", "<end_of_turn>"),
               "<start_of_turn>user\n{{ if .System }}{{ .System }} {{ end }}{{ .Prompt }}<end_of_turn>\n"
               "<start_of_turn>model\n{{ .Response }}<end_of_turn>\n",
               ("<start_of_turn>", "<end_of_turn>")),
    ChatFamily("phi3", ("<|user|>", "<|end|>"),
               "{{ if .System }}<|system|>\n{{ .System }}<|end|>\n{{ end }}"
               "{{ if .Prompt }}<|user|>\n{{ .Prompt }}<|end|>\n{{ end }}<|assistant|>\n{{ .Response }}<|end|>\n",
               ("<|end|>", "<|user|>", "<|assistant|>"), r"<\|system\|>\n(.*?)<\|end\|>"),
    ChatFamily("mistral", ("[INST]", "[/INST]"),
               "[INST] {{ if .System }}{{ .System }} {{ end }}{{ .Prompt }} [/INST]{{ .Response }}",
               ("[INST]", "[/INST]")),
)


def chat_family(chat_template: str | None) -> ChatFamily | None:
    if not chat_template:
        return None
    for fam in CHAT_FAMILIES:
        if all(m in chat_template for m in fam.markers):
            return fam
    return None


def default_system(chat_template: str, family: ChatFamily) -> str | None:
    """The system prompt ``chat_template`` adds to a chat that has none (rendered as transformers does,
    in a sandbox), or None."""
    if family.system_block is None:
        return None
    try:
        from datetime import datetime

        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        return None

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    try:
        text = env.from_string(chat_template).render(
            messages=[{"role": "user", "content": PROMPT_SENTINEL}], add_generation_prompt=True, bos_token="",
            eos_token="")
    except Exception as e:  # a template that needs more than transformers' basics: no SYSTEM line
        log.debug("cannot render the chat template for its default system prompt: %s", e)
        return None
    m = re.search(family.system_block, text.split(PROMPT_SENTINEL)[0], re.S)
    return m.group(1) if m else None


def modelfile(model_file: str, chat_template: str | None, adapter_file: str | None = None,
              eos: str | None = None) -> tuple[str, str | None]:
    """The Modelfile text, and a warning when the chat template could not be translated."""
    lines = [f"FROM ./{model_file}"]
    if adapter_file:
        lines.append(f"ADAPTER ./{adapter_file}")
    fam = chat_family(chat_template)
    warning = None
    if fam:
        lines.append(f'TEMPLATE """{fam.template}"""')
        system = default_system(chat_template, fam) if chat_template else None
        if system and '"""' not in system:
            lines.append(f'SYSTEM """{system}"""')
        for stop in dict.fromkeys((*fam.stops, *([eos] if eos else []))):
            lines.append(f'PARAMETER stop "{stop}"')
    elif chat_template:
        warning = "chat template not recognised (chatml, llama3, mistral, gemma, phi3): TEMPLATE omitted"
    return "\n".join(lines) + "\n", warning
