"""The options of ``merge`` and ``export`` and what every export returns: one model, shared by the CLI
and the Python API (the CLI builds these objects and calls the same functions a Python user calls)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from .errors import UserError

# One spelling of --dtype everywhere (merge, export, serve); engines get their own names from these.
DTYPES = ("auto", "bf16", "fp16", "fp32")
ADAPTER_MODES = ("merge", "separate")
DEFAULT_SHARD_BYTES = 2 << 30


Options = TypeVar("Options")


def coerce_options(cls: type[Options], given: Options | None, fields: dict) -> Options:
    """The options object a command runs with: ``given``, or one built from keyword ``fields`` (the API lets
    Python users write ``tuneport.merge(base=..., ...)`` as well as pass a ``MergeOptions``)."""
    if given is not None and fields:
        raise TypeError(f"pass either a {cls.__name__} or its fields as keywords, not both")
    if given is not None and not isinstance(given, cls):
        raise TypeError(f"expected {cls.__name__}, got {type(given).__name__}")
    return given if given is not None else cls(**fields)


def model_name(spec: str | Path) -> str:
    """What a model or adapter is called, from what the user gave (not where it was downloaded to): a GGUF
    file's stem, a directory's name, a hub id's last part."""
    path = Path(spec).expanduser()
    path = path if path.name else path.resolve()  # "." or "..": the directory's own name
    return path.stem if path.suffix == ".gguf" else path.name


def check_choice(option: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise UserError(f"unknown {option} {value!r}", f"use one of {', '.join(choices)}")


@dataclass
class AdapterSpec:
    """One adapter: a PEFT directory (or hub id), its weight in a merge and the name it is served under.
    On the command line: ``PATH``, ``PATH:WEIGHT``, ``NAME=PATH`` or ``NAME=PATH:WEIGHT``."""

    path: Path | str
    weight: float = 1.0
    name: str | None = None

    @classmethod
    def parse(cls, text: str) -> AdapterSpec:
        name = None
        if "=" in text.split(":")[0]:
            name, text = text.split("=", 1)
        weight = 1.0
        head, sep, tail = text.rpartition(":")
        if sep and head:
            try:
                weight = float(tail)
                text = head
            except ValueError:
                pass
        return cls(Path(text).expanduser(), weight, name or None)

    @classmethod
    def of(cls, value: AdapterSpec | str | Path) -> AdapterSpec:
        return value if isinstance(value, AdapterSpec) else cls.parse(str(value))


@dataclass(kw_only=True)
class MergeOptions:
    """``tuneport merge``: adapters folded into the base, written as one HF directory."""

    base: str | Path  # HF model directory or hub id
    adapters: list[AdapterSpec | str] = field(default_factory=list)
    out: Path
    dtype: str = "auto"  # output dtype; auto keeps each tensor's own
    force: bool = False  # replace an existing output
    allow_pickle: bool = False  # load *.bin / *.pt checkpoints (weights_only)
    max_shard_bytes: int = DEFAULT_SHARD_BYTES

    def __post_init__(self) -> None:
        self.base = str(self.base)
        self.out = Path(self.out)
        self.adapters = [AdapterSpec.of(a) for a in self.adapters]
        check_choice("--dtype", self.dtype, DTYPES)
        self._check_adapters()

    def _check_adapters(self) -> None:
        if not self.adapters:
            raise UserError("merge needs at least one adapter", "pass --adapter PATH (repeatable)")


@dataclass(kw_only=True)
class ExportOptions(MergeOptions):
    """``tuneport export``: an artifact for one engine (see ``tuneport.convert.targets.TARGETS``)."""

    target: str
    adapter_mode: str = "merge"  # --adapters: merge into the model, or keep them as separate files
    quant: str | None = None  # gguf: quantization types, comma-separated
    bpe_pre: str | None = None  # gguf: llama.cpp's name for a byte-level BPE pre-tokenizer
    name: str | None = None  # gguf: file name stem
    max_lora_rank: int | None = None  # vllm: the --max-lora-rank the adapters must fit
    quant_format: str | None = None  # awq: compressed-tensors (default) or awq-gemm
    group_size: int | None = None  # awq: input columns per scale (32, 64, 128; default 128)
    symmetric: bool = False  # awq: no zero points
    ignore: list[str] = field(default_factory=list)  # awq: regexes of module names kept 16-bit
    calib: Path | None = None  # awq, gguf: calibration text (plain text or .jsonl); default: built in
    calib_samples: int | None = None  # awq, gguf: samples of calib_seqlen tokens (default 128)
    calib_seqlen: int | None = None  # awq, gguf: tokens per sample (default 512)
    bits: float | None = None  # exl3: average bits per weight, 1..8 (default 4.0)
    head_bits: float | None = None  # exl3: bits of the output head, 1..8, 16, or 1.5/2.5/3.5 with mul1 (default 6)
    codebook: str | None = None  # exl3: mul1 (default), mcg or 3inst
    work_dir: Path | None = None  # exl3: the merged input and the converter's resumable job
    dry_run: bool = False  # exl3: print the plan and the converter command, write nothing
    accept_config_keys: list[str] = field(default_factory=list)  # gguf, mlx: audit refusals to proceed past
    accept_tokenizer_difference: bool = False  # gguf: write a file llama.cpp tokenizes differently from HF

    def __post_init__(self) -> None:
        super().__post_init__()
        self.calib = Path(self.calib).expanduser() if self.calib is not None else None
        self.work_dir = Path(self.work_dir).expanduser() if self.work_dir is not None else None
        self.ignore = list(self.ignore or [])
        self.accept_config_keys = list(self.accept_config_keys or [])
        check_choice("--adapters", self.adapter_mode, ADAPTER_MODES)  # the target's own rules: export()

    def _check_adapters(self) -> None:  # exporting the base alone is fine
        pass


@dataclass
class ExportResult:
    """What ``merge`` and ``export`` return: where the output is, its manifest, and what the user should
    know about it (notes, warnings, lossless fixes applied to adapters, target-specific details)."""

    out: Path
    target: str
    manifest: dict
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    fixes: dict[str, list[str]] = field(default_factory=dict)
    details: dict = field(default_factory=dict)  # e.g. gguf: models, loras, folded_scales

    @property
    def outputs(self) -> list[dict]:
        return self.manifest.get("outputs", [])

    def to_dict(self) -> dict:
        """The ``--json`` object."""
        return {"out": str(self.out), "target": self.target, "notes": self.notes, "warnings": self.warnings,
                "fixes": self.fixes, **self.details, "outputs": self.outputs}
