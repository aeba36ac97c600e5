"""An HF base model rebuilt from a GGUF file: weights dequantized to fp32 by transformers, saved as
safetensors with the tokenizer (its pre-tokenizer as the GGUF names it), chat template and generation
config. transformers will not save a model it loaded from GGUF, so a fresh model is built from the same
config and given the same state dict."""

from __future__ import annotations

import contextlib
import json
import logging
import re
from pathlib import Path
from unittest import mock

from tuneport.convert.cache import write_once
from tuneport.convert.gguf.read import gguf_field, open_gguf
from tuneport.convert.gguf.vocab import hf_pre_tokenizer

log = logging.getLogger(__name__)

BUILD_VERSION = 1  # bump when the way the base is built changes (the cache key)


def _tokenizer(gguf: Path, pre: str | None):
    """transformers' tokenizer from the GGUF, with the pre-tokenizer llama.cpp's ``pre`` name stands for
    (transformers' GGUF reader keeps only ByteLevel; SmolLM's splits digits one by one first)."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tj = json.loads(tok.backend_tokenizer.to_str())
    if pre and (tj.get("pre_tokenizer") or {}).get("type") == "ByteLevel":
        fixed = hf_pre_tokenizer(pre, tj["pre_tokenizer"])
        if fixed is None:
            log.warning("the GGUF's pre-tokenizer %r is not in tuneport's table: the HF tokenizer keeps "
                        "transformers' ByteLevel and may split some text differently from llama.cpp", pre)
        else:
            tj["pre_tokenizer"] = fixed
            tok = PreTrainedTokenizerFast(
                tokenizer_object=Tokenizer.from_str(json.dumps(tj)), chat_template=tok.chat_template,
                **{k: getattr(tok, k) for k in ("bos_token", "eos_token", "unk_token", "pad_token")})
    return tok


def _build(gguf: Path, tmp: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    # transformers' GGUF reader draws its own tqdm bar whatever the setting; the caller shows progress
    quiet = (mock.patch.object(gguf_utils, "tqdm", lambda it, **_: it) if hasattr(gguf_utils, "tqdm")
             else contextlib.nullcontext())
    with quiet:
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    for key in ("quantization_config", "_name_or_path"):
        if hasattr(config, key):
            delattr(config, key)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), assign=True)
    model.tie_weights()
    del loaded
    pre = gguf_field(open_gguf(gguf), "tokenizer.ggml.pre")
    tok = _tokenizer(gguf, pre)
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    config_file = tmp / "config.json"
    config_json = json.loads(config_file.read_text())
    config_json.pop("_model_name_or_path", None)  # the GGUF's general.name, not a path
    config_file.write_text(json.dumps(config_json, indent=2) + "\n")
    (tmp / "tuneport-source.json").write_text(json.dumps(
        {"built_from": gguf.name, "by": "tuneport.toolkit.smollm.base", "version": BUILD_VERSION,
         "weights": "GGUF tensors dequantized to fp32 by transformers", "bpe_pre": pre}, indent=2))


def hf_base_dir(gguf: Path) -> Path:
    """Where the HF base built from ``gguf`` lives: ``hf-v<build>/<model name>`` beside it (the file's
    name without ``.gguf`` and its quantization, e.g. ``.Q4_1``)."""
    name = re.sub(r"[.-](I?Q\d\w*|F16|F32|BF16)$", "", gguf.name.removesuffix(".gguf"), flags=re.I)
    return gguf.parent / f"hf-v{BUILD_VERSION}" / name


def hf_base_from_gguf(gguf: Path, out: Path | None = None) -> Path:
    """The HF model directory built from ``gguf`` (:func:`hf_base_dir` unless ``out``), built on first use."""
    out = out or hf_base_dir(gguf)
    if not out.exists():
        log.info("building an HF base from %s", gguf.name)
    return write_once(out, lambda tmp: _build(gguf, tmp))
