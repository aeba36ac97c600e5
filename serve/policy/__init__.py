"""Which engine serves a model on this machine, how much memory it takes, and the exact commands.

Everything here is planning: nothing starts an engine. Decisions are a table of rules (first match
wins), memory is a formula per engine whose every number is explained, and ``--dry-run`` prints both
with the command line(s) that would run.
"""

from .artifact import (
    EXL3_SIDE_FILE,
    EXL3_TENSOR_SUFFIX,
    FORMATS,
    GGUF_FLOAT_BYTES,
    QUANT_METHODS,
    SHAPE_READERS,
    ArtifactInfo,
    ShapeReader,
    adapter_nbytes,
    artifact_format,
    describe_artifact,
)
from .choice import (
    ANY_ACCEL,
    APPLE,
    FORMAT_LABELS,
    GPU,
    MANY_ADAPTERS,
    MANY_REQUESTS,
    QUANTIZED,
    RULES,
    EngineDecision,
    Rule,
    ServeLoad,
    choose_engine,
)
from .hardware import ENGINE_NAMES, GIB, INSTALL_HINTS, MIB, Hardware, apple_silicon, detect_hardware, installed_engines
from .plan import (
    LLAMACPP_KV_PAD,
    LLAMACPP_SEQS_PER_CONTEXT,
    MLX_KV_STEP,
    PLAN_COLUMNS,
    VLLM_DTYPE_BYTES,
    MemoryPlan,
    dry_run,
    format_dry_run,
    human_bytes,
    memory_plan,
    plan_llamacpp,
    plan_mlx,
    plan_vllm,
    shell_line,
)
from .scale_out import nginx_upstream, replica_commands

__all__ = [
    "EXL3_SIDE_FILE", "EXL3_TENSOR_SUFFIX", "FORMATS", "GGUF_FLOAT_BYTES", "QUANT_METHODS", "SHAPE_READERS",
    "ArtifactInfo", "ShapeReader", "adapter_nbytes", "artifact_format", "describe_artifact", "ANY_ACCEL", "APPLE",
    "FORMAT_LABELS", "GPU",
    "MANY_ADAPTERS", "MANY_REQUESTS", "QUANTIZED", "RULES", "EngineDecision", "Rule", "ServeLoad",
    "choose_engine", "LLAMACPP_KV_PAD", "LLAMACPP_SEQS_PER_CONTEXT", "MLX_KV_STEP", "PLAN_COLUMNS", "plan_llamacpp",
    "plan_mlx", "plan_vllm",
    "VLLM_DTYPE_BYTES", "MemoryPlan", "dry_run", "format_dry_run", "human_bytes", "memory_plan", "shell_line",
    "ENGINE_NAMES", "GIB", "INSTALL_HINTS", "MIB", "Hardware", "apple_silicon", "detect_hardware",
    "installed_engines", "nginx_upstream", "replica_commands",
]
