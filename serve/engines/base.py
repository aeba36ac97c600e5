"""The interface every engine offers the pool and the gateway."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol


@dataclass
class GenerationRequest:
    prompt_tokens: list[int]
    adapters: dict[str, float] = field(default_factory=dict)  # name -> scale; {} = the base
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_tokens: tuple[int, ...] = ()
    ignore_eos: bool = False


class Engine(Protocol):
    def load_adapter(self, name: str, path: Path) -> int: ...

    def unload_adapter(self, name: str) -> None: ...

    def generate(self, request: GenerationRequest) -> Iterator[int]: ...

    def close(self) -> None: ...
