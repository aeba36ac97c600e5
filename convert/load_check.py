"""Proof that an exported HF directory opens in the readers its engines use, before the output is renamed into
place: the config and tokenizer through transformers, and every tensor's name and shape against the model
transformers (and vLLM, which reads the same names) builds from that config — built on the meta device, so
nothing is allocated. A vLLM adapter directory's config through PEFT, and each LoRA tensor against a module of
that model. A failure is a UserError with the reader's reason.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import Mapping
from pathlib import Path

from .errors import UserError
from .safetensors_file import SafetensorsFile

log = logging.getLogger(__name__)
HINT = "this export would not load; report it with the input that produced it"


def _written_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for f in sorted(path.glob("*.safetensors")):
        shapes.update({name: tuple(meta.shape) for name, meta in SafetensorsFile(f).tensors.items()})
    return shapes


def _tied_keys(model) -> set[str]:
    """Weights a checkpoint may leave out because they are tied to another (transformers 4: a list, 5: a dict; 5's
    ``all_tied_weights_keys`` with its submodels' too: Llama 4's lm_head is tied inside its language_model)."""
    tied = getattr(model, "all_tied_weights_keys", None) or getattr(model, "_tied_weights_keys", None) or ()
    if not getattr(model.config, "tie_word_embeddings", False):
        return set()
    return set(tied.keys() if isinstance(tied, dict) else tied)


def _meta_model(path: Path):
    """The model transformers builds from the exported config, on the meta device: the class the config names
    (what vLLM loads too: a multimodal Qwen3.5, whose config AutoModelForCausalLM builds the text model of), else
    AutoModelForCausalLM's."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - any reader failure is the export's fault, said with its reason
        raise UserError(f"transformers cannot read the exported config.json: {str(e).splitlines()[0][:200]}",
                        HINT) from e
    named = getattr(transformers, next(iter(getattr(config, "architectures", None) or []), ""), None)
    with torch.device("meta"), contextlib.redirect_stdout(None):
        if isinstance(named, type) and issubclass(named, transformers.PreTrainedModel) and \
                named.config_class is type(config):  # a class of this config (not a stale or other head's name)
            return named._from_config(config)
        return AutoModelForCausalLM.from_config(config)


def _disk_name(renames: tuple[tuple[str, str], ...], name: str) -> str:
    """``name`` as checkpoints store it (``ArchSpec.disk_renames``)."""
    return next((name.removesuffix(memory) + disk for memory, disk in renames if name.endswith(memory)), name)


def check_hf_dir(path: Path, tensors: bool = True) -> str:
    """Check the HF model directory ``path`` (config, tokenizer, and with ``tensors`` every tensor's name and
    shape: quantized directories pack theirs); what was checked."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return "not checked: transformers is not installed (pip install 'tuneport[hf]')"
    model = _meta_model(path)
    if any((path / n).exists() for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        from transformers import AutoTokenizer

        try:
            AutoTokenizer.from_pretrained(path)
        except Exception as e:  # noqa: BLE001
            raise UserError(f"transformers cannot load the exported tokenizer: {str(e).splitlines()[0][:200]}",
                            HINT) from e
    if not tensors:
        return "loaded by transformers' readers: config, tokenizer (quantized tensors are vLLM's to read)"
    from .arch import known_arch
    from .experts import disk_shapes
    from .multimodal import disk_names

    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    # what transformers loads past without a word (Qwen3.5's multi-token-prediction head, which merge keeps)
    ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()]
    if (arch := known_arch(getattr(model.config, "model_type", None))) is not None:
        expected = disk_shapes(arch, expected)  # mixture-of-experts: one tensor per expert on disk
        expected = {_disk_name(arch.disk_renames, n): shape for n, shape in expected.items()}
    written = _written_shapes(path)
    expected = disk_names(getattr(model.config, "model_type", None), expected, written)  # multimodal layouts
    tied = set(disk_names(getattr(model.config, "model_type", None), dict.fromkeys(_tied_keys(model), ()), written))
    missing = sorted(set(expected) - set(written) - tied)
    unexpected = sorted(n for n in set(written) - set(expected) if not any(p.search(n) for p in ignored))
    wrong = sorted(n for n in set(expected) & set(written) if expected[n] != written[n])
    model_type = getattr(model.config, "model_type", None)
    for what, names in (("missing", missing), ("unexpected", unexpected), ("with the wrong shape", wrong)):
        if names and arch is None:  # no table entry: the names were kept as they are, and do not load
            raise UserError(f"the exported model has {len(names)} tensor(s) {what} for {type(model).__name__} "
                            f"(first: {names[0]}): tuneport has no table entry for architecture {model_type!r}, "
                            "whose checkpoint layout differs from what transformers loads",
                            "merge it with PEFT (merge_and_unload), or ask for the architecture to be added")
        if names:
            raise UserError(f"the exported model has {len(names)} tensor(s) {what} for {type(model).__name__} "
                            f"(first: {names[0]})", HINT)
    return f"loaded by transformers' readers: config, tokenizer, {len(written)} tensors' names and shapes"


def check_adapter_dirs(base: Path, adapters: list[Path], aliases: Mapping[str, str] | None = None) -> str:
    """Check each PEFT adapter directory vLLM will load: its config through PEFT, each LoRA tensor on a module
    of the base model with the shapes that module needs; ``aliases``: a module vLLM has and transformers does not ->
    the module whose shape it has (a k_eq_v layer's v_proj, the value shard vLLM fills with k_proj)."""
    try:
        from peft import LoraConfig
    except ImportError:
        return "not checked: peft is not installed (pip install 'tuneport[hf]')"
    modules = dict(_meta_model(base).named_modules())
    for adapter in adapters:
        try:
            config = LoraConfig.from_pretrained(adapter)
        except Exception as e:  # noqa: BLE001
            raise UserError(f"PEFT cannot read the exported {adapter.name}/adapter_config.json: "
                            f"{str(e).splitlines()[0][:200]}", HINT) from e
        for name, shape in _written_shapes(adapter).items():
            if ".lora_" not in name:
                continue  # saved whole modules are checked by vLLM's own rules before writing
            module_name, _, kind = name.removeprefix("base_model.model.").rpartition(".lora_")
            module = modules.get(module_name) or modules.get((aliases or {}).get(module_name, ""))
            if module is None or not hasattr(module, "weight"):
                raise UserError(f"the exported adapter {adapter.name} has {name}, which is not a module of the base",
                                HINT)
            out_dim, in_dim = module.weight.shape[:2]
            if kind.startswith("A") and shape[1:] != (in_dim,) or kind.startswith("B") and shape[:1] != (out_dim,):
                raise UserError(f"the exported adapter {adapter.name} has {name} of shape {list(shape)}, which does "
                                f"not fit {module_name} ({out_dim} x {in_dim})", HINT)
        log.debug("adapter %s: rank %s, %s", adapter.name, config.r, json.dumps(sorted(config.target_modules or [])))
    return f"read by PEFT and checked against the base's modules: {len(adapters)} adapter(s)"
