"""Tiny tokenizers trained locally: SentencePiece (llama-style) and byte-level BPE (qwen2-style)."""

from __future__ import annotations

import io
import json
from pathlib import Path

from .corpus import training_lines

SP_VOCAB = 512
BPE_VOCAB = 600

# Mistral-style instruction template for the SentencePiece tokenizer.
INST_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] + eos_token }}"
    "{% elif message['role'] == 'system' %}{{ message['content'] + '\\n' }}{% endif %}"
    "{% endfor %}"
)
# ChatML for the byte-level BPE tokenizer.
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
    "+ '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% endif %}"
)

# ChatML with tools in the Hermes syntax (as Qwen 2.5's template): tools listed in the system turn, calls
# answered inside <tool_call></tool_call>, results given back inside <tool_response></tool_response>. HF renders
# with trim_blocks: a newline right after a block tag is written as an expression.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n"
    "{% endif %}# Tools\n\nYou may call one or more functions to assist with the user query.\n\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
    "{% elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'user' or (message.role == 'system' and not loop.first) "
    "or (message.role == 'assistant' and not message.tool_calls) %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% elif message.role == 'assistant' %}<|im_start|>assistant"
    "{% if message.content %}\n{{ message.content }}{% endif %}"
    "{% for call in message.tool_calls %}{% if call.function is defined %}{% set call = call.function %}{% endif %}"
    "{{ '\\n' }}<tool_call>\n{\"name\": \"{{ call.name }}\", "
    "\"arguments\": {{ call.arguments | tojson }}}\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_sentencepiece(out: Path, space_prefix: bool = False) -> None:
    """Train a BPE SentencePiece model with byte fallback; write HF tokenizer files into ``out``. Without a
    space prefix (as Gemma's), which llama.cpp tokenizes exactly as transformers; with one (as Llama 2's and
    Mistral's), transformers 5's Metaspace puts no space before text that starts with one, or after special
    tokens, where llama.cpp always does (``export --target gguf`` refuses it unless told to accept that)."""
    import sentencepiece as spm
    from transformers import AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(training_lines()),
        model_writer=model,
        vocab_size=SP_VOCAB,
        model_type="bpe",
        byte_fallback=True,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        character_coverage=1.0,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        user_defined_symbols=["[INST]", "[/INST]", "<|endoftext|>"],
        add_dummy_prefix=space_prefix,
        num_threads=1,
        minloglevel=2,
    )
    (out / "tokenizer.model").write_bytes(model.getvalue())
    config = {
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "legacy": False,
        "add_prefix_space": space_prefix,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    tok = AutoTokenizer.from_pretrained(out)  # converts tokenizer.model into tokenizer.json
    tok.chat_template = INST_TEMPLATE
    tok.save_pretrained(out)
    _drop_auto_map(out)


def write_bytelevel_bpe(out: Path) -> None:
    """Train a byte-level BPE with a Qwen2-style pre-tokenizer; write HF tokenizer files into ``out``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    qwen2_split = (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+"
    )
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(qwen2_split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_lines(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(out)
    _drop_auto_map(out)


def _drop_auto_map(out: Path) -> None:
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("auto_map", None)
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False))


TOKENIZER_WRITERS = {"sentencepiece": write_sentencepiece, "bpe": write_bytelevel_bpe,
                     "sentencepiece_prefixed": lambda out: write_sentencepiece(out, space_prefix=True)}
