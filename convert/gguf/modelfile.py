"""Ollama ``Modelfile``: FROM, ADAPTER, TEMPLATE translated from the chat template, PARAMETER stop."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChatFamily:
    name: str
    markers: tuple[str, ...]  # all must appear in the HF chat template
    template: str  # Ollama (Go) template
    stops: tuple[str, ...]


CHAT_FAMILIES: tuple[ChatFamily, ...] = (
    ChatFamily("llama3", ("<|start_header_id|>", "<|eot_id|>"),
               "{{ if .System }}<|start_header_id|>system<|end_header_id|>\n\n{{ .System }}<|eot_id|>{{ end }}"
               "{{ if .Prompt }}<|start_header_id|>user<|end_header_id|>\n\n{{ .Prompt }}<|eot_id|>{{ end }}"
               "<|start_header_id|>assistant<|end_header_id|>\n\n{{ .Response }}<|eot_id|>",
               ("<|eot_id|>", "<|start_header_id|>")),
    ChatFamily("chatml", ("<|im_start|>", "<|im_end|>"),
               "{{ if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}"
               "{{ if .Prompt }}<|im_start|>user\n{{ .Prompt }}<|im_end|>\n{{ end }}"
               "<|im_start|>assistant\n{{ .Response }}<|im_end|>\n",
               ("<|im_start|>", "<|im_end|>")),
    ChatFamily("gemma", ("<start_of_turn>", "<end_of_turn>"),
               "<start_of_turn>user\n{{ if .System }}{{ .System }} {{ end }}{{ .Prompt }}<end_of_turn>\n"
               "<start_of_turn>model\n{{ .Response }}<end_of_turn>\n",
               ("<start_of_turn>", "<end_of_turn>")),
    ChatFamily("phi3", ("<|user|>", "<|end|>"),
               "{{ if .System }}<|system|>\n{{ .System }}<|end|>\n{{ end }}"
               "{{ if .Prompt }}<|user|>\n{{ .Prompt }}<|end|>\n{{ end }}<|assistant|>\n{{ .Response }}<|end|>\n",
               ("<|end|>", "<|user|>", "<|assistant|>")),
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
        for stop in dict.fromkeys((*fam.stops, *([eos] if eos else []))):
            lines.append(f'PARAMETER stop "{stop}"')
    elif chat_template:
        warning = "chat template not recognised (chatml, llama3, mistral, gemma, phi3): TEMPLATE omitted"
    return "\n".join(lines) + "\n", warning
