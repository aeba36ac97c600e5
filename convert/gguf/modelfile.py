"""Ollama ``Modelfile``: FROM, ADAPTER, TEMPLATE translated from the chat template, SYSTEM (the default
system prompt the chat template adds when a chat has none, e.g. SmolLM2's), PARAMETER stop."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

log = logging.getLogger(__name__)
PROMPT_SENTINEL = "\x00tuneport-prompt\x00"
BOS_SENTINEL = "\x00tuneport-bos\x00"


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


def _environment():
    from datetime import datetime

    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env


def render_chat(chat_template: str, messages: list[dict], bos: str = "", eos: str = "",
                add_generation_prompt: bool = True) -> str | None:
    """``chat_template`` rendered as transformers renders it (a sandbox, its globals), the leading BOS left out
    (llama.cpp and Ollama add it themselves); None when the template refuses the chat."""
    try:
        text = _environment().from_string(chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, bos_token=BOS_SENTINEL, eos_token=eos)
    except Exception as e:  # a template that needs more than transformers' basics, or refuses this chat
        log.debug("cannot render the chat template: %s", e)
        return None
    # only a BOS the template itself wrote is left out: SmolLM2's bos is "<|im_start|>", which also opens its turns
    return text.removeprefix(BOS_SENTINEL).replace(BOS_SENTINEL, bos)


def ollama_render(template: str, system: str, prompt: str) -> str:
    """What Ollama renders for one turn (``.Response`` empty, cut there) from the Go template subset tuneport
    writes: ``{{ if .X }}A{{ else }}B{{ end }}``, ``{{ if .X }}A{{ end }}`` and ``{{ .X }}``."""
    values = {"System": system, "Prompt": prompt}
    text = template.split("{{ .Response }}")[0]
    text = re.sub(r"\{\{ if \.(\w+) \}\}(.*?)(?:\{\{ else \}\}(.*?))?\{\{ end \}\}",
                  lambda m: m[2] if values[m[1]] else (m[3] or ""), text, flags=re.S)
    return re.sub(r"\{\{ \.(\w+) \}\}", lambda m: values[m[1]], text)


SYSTEM_SENTINEL, PROMPT_SENTINEL_TEXT, RESPONSE_SENTINEL = "\x00system\x00", "\x00prompt\x00", "\x00response\x00"


def translate(chat_template: str, bos: str = "", eos: str = "") -> str | None:
    """An Ollama template that renders one turn, with and without a system message, exactly as ``chat_template``
    does: the chat template rendered around sentinels (None when it cannot be, or its text would need Go escapes)."""
    user = {"role": "user", "content": PROMPT_SENTINEL_TEXT}
    alone = render_chat(chat_template, [user], bos, eos)
    with_system = render_chat(chat_template, [{"role": "system", "content": SYSTEM_SENTINEL}, user], bos, eos)
    answered = render_chat(chat_template, [user, {"role": "assistant", "content": RESPONSE_SENTINEL}], bos, eos,
                           add_generation_prompt=False)
    if alone is None or PROMPT_SENTINEL_TEXT not in alone or "{{" in alone:
        return None
    tail = ""
    if answered and RESPONSE_SENTINEL in answered:
        tail = answered.split(RESPONSE_SENTINEL, 1)[1]
    go = alone.replace(PROMPT_SENTINEL_TEXT, "{{ .Prompt }}")
    if with_system and SYSTEM_SENTINEL in with_system and "{{" not in with_system:
        go = ("{{ if .System }}" + with_system.replace(SYSTEM_SENTINEL, "{{ .System }}").replace(
            PROMPT_SENTINEL_TEXT, "{{ .Prompt }}") + "{{ else }}" + go + "{{ end }}")
    return go + "{{ .Response }}" + tail


def single_turn_parity(template: str, system: str | None, chat_template: str, bos: str = "", eos: str = "") -> bool:
    """Ollama's rendering of ``template`` (with the Modelfile's SYSTEM default ``system``) equals the chat
    template's, for one user turn without and with a system message."""
    for sys_msg in (None, "You are terse."):
        messages = ([{"role": "system", "content": sys_msg}] if sys_msg else []) + [
            {"role": "user", "content": "Name a colour."}]
        want = render_chat(chat_template, messages, bos, eos)
        if want is None or ollama_render(template, sys_msg or system or "", "Name a colour.") != want:
            return False
    return True


def default_system(chat_template: str, family: ChatFamily) -> str | None:
    """The system prompt ``chat_template`` adds to a chat that has none (rendered as transformers does,
    in a sandbox), or None."""
    if family.system_block is None:
        return None
    text = render_chat(chat_template, [{"role": "user", "content": PROMPT_SENTINEL}])
    if text is None:
        return None
    m = re.search(family.system_block, text.split(PROMPT_SENTINEL)[0], re.S)
    return m.group(1) if m else None


def modelfile(model_file: str, chat_template: str | None, adapter_file: str | None = None,
              eos: str | None = None, bos: str | None = None) -> tuple[str, str | None]:
    """The Modelfile text, and a warning when the chat template could not be translated. The family's template
    (which Ollama repeats per turn) when it renders a single turn as the chat template does; else one translated
    from the chat template itself, exact for a single turn."""
    lines = [f"FROM ./{model_file}"]
    if adapter_file:
        lines.append(f"ADAPTER ./{adapter_file}")
    fam = chat_family(chat_template)
    warning = None
    if chat_template:
        system = default_system(chat_template, fam) if fam else None
        template = fam.template if fam else None
        renders = render_chat(chat_template, [{"role": "user", "content": "Hi"}], bos or "", eos or "") is not None
        if template is None or (renders and not single_turn_parity(template, system, chat_template, bos or "",
                                                                     eos or "")):
            # the family's template renders differently (or there is none): one translated from the chat template;
            # a template tuneport cannot render keeps its family's, unchecked
            template, system = translate(chat_template, bos or "", eos or ""), None
        if template is None:
            warning = "chat template could not be rendered for Ollama: TEMPLATE omitted"
        else:
            lines.append(f'TEMPLATE """{template}"""')
            if system and '"""' not in system:
                lines.append(f'SYSTEM """{system}"""')
        stops = (*(fam.stops if fam else ()), *([eos] if eos else []))
        for stop in dict.fromkeys(stops):
            lines.append(f'PARAMETER stop "{stop}"')
    return "\n".join(lines) + "\n", warning
