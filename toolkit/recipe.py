"""Release recipes: one YAML file naming the base, the adapters, the targets, the eval text, the fidelity
gates and where to publish. Validated by a pydantic schema; a bad recipe is one line naming the key.

```yaml
name: smollm2-pirate
version: 1.0.0
base: {path: HuggingFaceTB/SmolLM2-135M-Instruct, revision: main}
adapters: [{name: pirate, path: ./adapters/pirate}]
targets:
  - {type: gguf, quant: [q8_0, q4_k_m], adapters: separate}
  - {type: vllm}
  - {type: exl3, bits: 4.0}           # on a CUDA host; elsewhere recorded as "not measured: needs CUDA"
gates: {kl: {default: 0.5, q8_0: 0.02}, top1: 0.8}
publish: {repo: my-org/smollm2-pirate, private: true, tag: v1.0.0}
```
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tuneport.convert.awq import FORMAT_NAMES, GROUP_SIZES
from tuneport.convert.errors import UserError
from tuneport.convert.gguf.quant_types import QUANT_TYPES
from tuneport.convert.mlx import GROUP_SIZES as MLX_GROUP_SIZES
from tuneport.convert.mlx import QUANT_NAMES as MLX_QUANTS
from tuneport.convert.options import ADAPTER_MODES, DTYPES

NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BaseSpec(_Strict):
    path: str  # a local HF directory (relative to the recipe) or a hub id
    revision: str | None = None  # a hub revision (branch, tag or commit)


class AdapterEntry(_Strict):
    name: Annotated[str, Field(pattern=NAME)]
    path: str  # a PEFT adapter directory (relative to the recipe) or a hub id
    weight: float = 1.0  # in a merge


class GGUFTarget(_Strict):
    type: Literal["gguf"]
    quant: Annotated[list[str], Field(min_length=1)] = ["q8_0"]
    adapters: Literal[ADAPTER_MODES] = "merge"  # type: ignore[valid-type]
    accept_config_keys: list[str] = []  # config audit refusals to proceed past (the model card lists them)
    accept_tokenizer_difference: bool = False  # write a GGUF llama.cpp tokenizes differently (model card lists it)

    @field_validator("quant")
    @classmethod
    def _known_quant(cls, quants: list[str]) -> list[str]:
        for q in quants:
            if q not in QUANT_TYPES:
                raise ValueError(f"{q!r} is not a GGUF type (allowed: {', '.join(QUANT_TYPES)})")
        if len(set(quants)) != len(quants):
            raise ValueError("a quant type is listed twice")
        return quants


class VllmTarget(_Strict):
    type: Literal["vllm"]
    adapters: Literal[ADAPTER_MODES] = "separate"  # type: ignore[valid-type]
    max_lora_rank: int | None = None


class SafetensorsTarget(_Strict):
    type: Literal["safetensors"]
    dtype: Literal[DTYPES] = "auto"  # type: ignore[valid-type]


class AWQTarget(_Strict):
    type: Literal["awq"]
    adapters: Literal[ADAPTER_MODES] = "merge"  # type: ignore[valid-type]
    format: Literal[FORMAT_NAMES] = "compressed-tensors"  # type: ignore[valid-type]
    dtype: Literal["auto", "fp16", "bf16"] = "auto"
    group_size: Literal[GROUP_SIZES] = 128  # type: ignore[valid-type]
    symmetric: bool = False
    ignore: list[str] = []
    calib: str | None = None  # calibration text (relative to the recipe); default: built in
    calib_samples: Annotated[int, Field(ge=1)] | None = None
    calib_seqlen: Annotated[int, Field(ge=2)] | None = None


class MlxTarget(_Strict):
    type: Literal["mlx"]
    adapters: Literal[ADAPTER_MODES] = "merge"  # type: ignore[valid-type]
    quant: Literal[MLX_QUANTS] | None = None  # type: ignore[valid-type]  # none: unquantized
    group_size: Literal[MLX_GROUP_SIZES] | None = None  # type: ignore[valid-type]  # default: mlx-lm's
    dtype: Literal[DTYPES] = "auto"  # type: ignore[valid-type]
    accept_config_keys: list[str] = []  # config audit refusals to proceed past (the model card lists them)

    @field_validator("quant", mode="before")
    @classmethod
    def _none(cls, quant):
        return None if quant == "none" else quant

    @model_validator(mode="after")
    def _group_fits(self) -> MlxTarget:
        """The exporter's own rules for --quant and --group-size, checked before any target runs."""
        from tuneport.convert.mlx.quant import group_size_for, quant_type

        if self.quant is None:
            if self.group_size is not None:
                raise ValueError("group_size applies with a quant type")
            return self
        try:
            group_size_for(quant_type(self.quant), self.group_size)
        except UserError as e:
            raise ValueError(e.line().replace("--group-size", "group_size")) from None
        return self


class Exl3Target(_Strict):
    """EXL3 through exllamav3's converter: exported and checked on a CUDA host, "not measured: needs CUDA"
    elsewhere (adapters always merged: TabbyAPI loads no LoRA)."""

    type: Literal["exl3"]
    bits: Annotated[float, Field(ge=1.0, le=8.0)] = 4.0
    head_bits: Literal[1, 2, 3, 4, 5, 6, 7, 8, 16, 1.5, 2.5, 3.5] = 6  # half-integers: mul1 only (exllamav3 1.6)
    codebook: Literal["mul1", "mcg", "3inst"] = "mul1"

    @model_validator(mode="after")
    def _half_rates_need_mul1(self) -> Exl3Target:
        if not float(self.head_bits).is_integer() and self.codebook != "mul1":
            raise ValueError(f"head_bits {self.head_bits} needs codebook mul1 (exllamav3's half-integer kernels)")
        return self


Target = Annotated[GGUFTarget | VllmTarget | SafetensorsTarget | AWQTarget | MlxTarget | Exl3Target,
                   Field(discriminator="type")]
TARGET_TYPES = ("gguf", "vllm", "safetensors", "awq", "mlx", "exl3")


class EvalSpec(_Strict):
    file: str | None = None  # a UTF-8 text (relative to the recipe); default: verify's built-in corpus
    tokens: Annotated[int, Field(ge=8)] = 256


class GateSpec(_Strict):
    """Limits every verified artifact must meet (``kl`` may differ per GGUF quant type, ``default`` for the
    rest); the checks are required unless set to false."""

    kl: float | dict[str, float] | None = None  # max
    max_abs: float | None = None  # max
    ppl_ratio: float | None = None  # max
    top1: Annotated[float, Field(ge=0, le=1)] | None = None  # min
    greedy: Annotated[float, Field(ge=0, le=1)] | None = None  # min
    strength_error: float | None = 0.1  # max, for GGUF LoRAs
    tokenizer: bool = True
    chat_template: bool = True
    special_tokens: bool = True

    @field_validator("kl")
    @classmethod
    def _kl_keys(cls, kl):
        if isinstance(kl, dict):
            for key in kl:
                if key != "default" and key not in QUANT_TYPES:
                    raise ValueError(f"{key!r} is neither 'default' nor a GGUF type")
        return kl

    def for_artifact(self, quant: str | None = None) -> list[str]:
        """The ``tuneport verify`` gates of one artifact (``quant``: its GGUF type)."""
        kl = self.kl.get(quant or "", self.kl.get("default")) if isinstance(self.kl, dict) else self.kl
        limits = {"kl": ("<=", kl), "max_abs": ("<=", self.max_abs), "ppl_ratio": ("<=", self.ppl_ratio),
                  "top1": (">=", self.top1), "greedy": (">=", self.greedy),
                  "strength_error": ("<=", self.strength_error)}
        gates = [f"{m}{op}{v:g}" for m, (op, v) in limits.items() if v is not None]
        return gates + [c for c in ("tokenizer", "chat_template", "special_tokens") if getattr(self, c)]


class PublishSpec(_Strict):
    repo: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")]
    private: bool = True
    tag: str | None = None


class Recipe(_Strict):
    name: Annotated[str, Field(pattern=NAME)]
    version: str
    license: str | None = None  # for the model card (e.g. apache-2.0)
    base: BaseSpec
    adapters: list[AdapterEntry] = []
    targets: Annotated[list[Target], Field(min_length=1)]
    eval: EvalSpec = EvalSpec()
    gates: GateSpec = GateSpec()
    publish: PublishSpec | None = None

    @model_validator(mode="after")
    def _unique_names(self) -> Recipe:
        names = [a.name for a in self.adapters]
        if len(set(names)) != len(names):
            raise ValueError(f"adapter names must differ (got {', '.join(names)})")
        return self


def _where(loc: tuple) -> str:
    """A pydantic error location as the key path a user reads: ``targets[0].quant[1]``; union branches
    (the target's type) are left out."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part not in TARGET_TYPES and "[" not in str(part):  # union branches, validators
            out += f".{part}" if out else str(part)
    return out or "(top level)"


def _explain(err: dict) -> str:
    kind = err["type"]
    if kind == "extra_forbidden":
        return "unknown key"
    if kind == "missing":
        return "missing key"
    if kind == "union_tag_invalid":
        return f"type {err.get('ctx', {}).get('tag')!r} is not a target (allowed: {', '.join(TARGET_TYPES)})"
    msg = err["msg"].removeprefix("Value error, ")
    return f"{msg} (got {err['input']!r})" if kind in ("literal_error", "string_pattern_mismatch") else msg


def parse_recipe(text: str, source: str = "recipe") -> Recipe:
    import yaml

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise UserError(f"{source} is not valid YAML{at}", "fix the YAML syntax") from e
    if not isinstance(data, dict):
        raise UserError(f"{source} must be a YAML mapping", "start with name:, version:, base:, targets:")
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
        raise UserError(f"{source}: {_where(err['loc'])}: {_explain(err)}{more}",
                        "see docs/release.md for the recipe keys") from e


def load_recipe(path: Path | str) -> tuple[Recipe, str]:
    """The recipe at ``path`` and its sha256 (of the file's bytes)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise UserError(f"cannot read the recipe {path} ({type(e).__name__})", "pass a recipe YAML file") from e
    return parse_recipe(raw.decode("utf-8", "replace"), path.name), hashlib.sha256(raw).hexdigest()


def resolve_local(recipe_path: Path, spec: str) -> str:
    """A path in a recipe, relative to the recipe's folder when it names something there; else as given
    (a hub id)."""
    local = (Path(recipe_path).parent / spec).expanduser()
    return str(local.resolve()) if local.exists() else spec
