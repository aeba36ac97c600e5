"""Property-based fuzzing (hypothesis) of the readers that take input from outside: the safetensors header
parser, the GGUF reader ``tuneport inspect`` uses, the adapter config reader, and the gateway's request
parsing (the typed models alone, and the routes of a running gateway over the in-process llama.cpp
engine). The property is the refusal contract: a reader returns or raises UserError, a route answers below
500, never another exception, a crash or a hang (each example has a deadline, each test a timeout).

The budget (examples per target) is in each test's id and printed at the end of the test output.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
import tempfile
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from corpus.cases import GGUF_STRING, GGUF_UINT32, gguf_file, gguf_str, start_gateway
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from tuneport.convert.errors import UserError
from tuneport.convert.tensors import ST_DTYPES

BUDGET = {"safetensors header": 400, "GGUF reader": 400, "adapter config": 200, "request models": 500,
          "gateway routes": 150}


def fuzz(target: str, deadline_s: float, warnings: str = "error"):
    """The settings of one target: its example budget, a deadline per example, no example database; a warning
    fails a reader (the CLI's refusal is one line on stderr, a warning another)."""
    n = BUDGET[target]
    return lambda f: pytest.mark.filterwarnings(warnings)(pytest.mark.timeout(300)(pytest.mark.parametrize(
        "budget", [n], ids=[f"{n}-examples"])(
        settings(max_examples=n, deadline=timedelta(seconds=deadline_s), database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                        HealthCheck.data_too_large])(f))))


@pytest.fixture(scope="module", autouse=True)
def _budget(summary):
    summary.append("fuzzing budget (examples per target): " + ", ".join(f"{k} {v}" for k, v in BUDGET.items()))


@pytest.fixture(scope="module")
def scratch():
    d = Path(tempfile.mkdtemp(prefix="tuneport-fuzz-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


# -- values ---------------------------------------------------------------------------------------------------
HUGE = st.sampled_from([-1, 0, 1, 2**31, 2**32 - 1, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63)])
SCALARS = (st.none() | st.booleans() | st.integers(-(2**66), 2**66) | HUGE | st.floats()
           | st.text(max_size=12))
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                          max_size=4), max_leaves=12)


def mutated(data: bytes) -> st.SearchStrategy[bytes]:
    """``data`` with a few bytes flipped, 8-byte windows set to extreme counts, and maybe truncated."""
    def apply(edits):
        flips, counts, cut = edits
        b = bytearray(data)
        for pos, value in flips:
            b[pos % len(b)] = value
        for pos, value in counts:
            pos %= max(1, len(b) - 8)
            b[pos:pos + 8] = struct.pack("<Q", value % 2**64)
        return bytes(b[:cut] if cut is not None else b)

    return st.tuples(st.lists(st.tuples(st.integers(0, 2**16), st.integers(0, 255)), max_size=6),
                     st.lists(st.tuples(st.integers(0, 2**16), HUGE | st.integers(0, 2**64 - 1)), max_size=3),
                     st.none() | st.integers(0, len(data))).map(apply)


# -- safetensors ------------------------------------------------------------------------------------------------
def st_bytes(header: object, data: bytes, length: int | None) -> bytes:
    raw = json.dumps(header).encode() if not isinstance(header, bytes) else header
    return struct.pack("<Q", len(raw) if length is None else length % 2**64) + raw + data


VALID_ST = st_bytes({"__metadata__": {"format": "pt"}, "a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
                     "b": {"dtype": "I8", "shape": [4], "data_offsets": [16, 20]}}, bytes(range(20)), None)
DIM = st.integers(0, 6) | HUGE | SCALARS
ENTRY = st.fixed_dictionaries({}, optional={
    "dtype": st.sampled_from([*ST_DTYPES, "F8_E4M3", "f32", ""]) | SCALARS,
    "shape": st.lists(DIM, max_size=4) | SCALARS,
    "data_offsets": st.lists(st.integers(-4, 64) | HUGE, max_size=3) | SCALARS,
}) | JSON
HEADERS = st.dictionaries(st.sampled_from(["a", "b", "c", "__metadata__"]) | st.text(max_size=4), ENTRY, max_size=4)


@st.composite
def consistent(draw) -> bytes:
    """Entries whose offsets match their dtype and shape (so the checks after the byte count run), with data
    that may fall short; dimensions may be 0 or huge."""
    header, pos = {}, 0
    for name in draw(st.lists(st.text(max_size=4), max_size=3, unique=True)):
        dtype = draw(st.sampled_from(sorted(ST_DTYPES)))
        shape = draw(st.lists(st.integers(0, 4) | HUGE.filter(lambda v: v >= 0), max_size=3))
        n = math.prod(shape) * ST_DTYPES[dtype].itemsize
        lo = draw(st.sampled_from([pos, pos, 0, max(0, pos - 1)]))
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [lo, lo + n]}
        pos = lo + n
    return st_bytes(header, bytes(max(0, min(pos, 256) - draw(st.integers(0, 2)))), None)


SAFETENSORS = (consistent() | st.builds(st_bytes, HEADERS | JSON, st.binary(max_size=96), st.none() | st.none() | HUGE)
               | mutated(VALID_ST) | st.binary(max_size=64))


@fuzz("safetensors header", deadline_s=2)
@given(data=SAFETENSORS)
@example(data=st_bytes({"": {"dtype": "BF16", "shape": [0, 2**63], "data_offsets": [0, 0]}}, b"", None))  # found
@example(data=st_bytes({"": {"dtype": "BF16", "shape": [0, 2, 2**63 - 1], "data_offsets": [0, 0]}}, b"", None))
def test_safetensors_header_parser(budget, data, scratch):
    from tuneport.convert.safetensors_file import SafetensorsFile

    path = scratch / "fuzz.safetensors"
    path.write_bytes(data)
    try:
        sf = SafetensorsFile(path)
        for name, meta in sf.tensors.items():  # what the header promises is readable as said
            assert tuple(sf.read(name).shape) == meta.shape
        event("read")
    except UserError:
        event("refused")


# -- GGUF -------------------------------------------------------------------------------------------------------------
def _kv(key: str, vtype: int, value: bytes) -> tuple[str, int, bytes]:
    return key, vtype, value


VALID_GGUF = gguf_file(kv=[
    _kv("general.architecture", GGUF_STRING, gguf_str("llama")),
    _kv("general.alignment", GGUF_UINT32, struct.pack("<I", 32)),
    _kv("llama.context_length", GGUF_UINT32, struct.pack("<I", 128)),
    _kv("general.type", GGUF_STRING, gguf_str("adapter")),
    _kv("adapter.type", GGUF_STRING, gguf_str("lora")),
    _kv("adapter.lora.alpha", 6, struct.pack("<f", 16.0)),
    _kv("tokenizer.ggml.tokens", 9, struct.pack("<IQ", GGUF_STRING, 3) + b"".join(map(gguf_str, ("a", "bc", "")))),
    _kv("tokenizer.ggml.scores", 9, struct.pack("<IQ", 6, 2) + struct.pack("<ff", 0.5, -1.0)),
    _kv("tokenizer.ggml.add_bos_token", 7, b"\x01"),
])
RAW_KV = st.tuples(st.text(max_size=12), st.integers(0, 15) | HUGE.map(lambda v: v % 2**32), st.binary(max_size=24))
RAW_TENSOR = st.tuples(st.text(max_size=12), st.lists(st.integers(0, 8) | HUGE.map(lambda v: v % 2**64), max_size=5),
                       st.integers(0, 40) | HUGE.map(lambda v: v % 2**32), st.integers(0, 256) | HUGE.map(
                           lambda v: v % 2**64))
GGUF = (mutated(VALID_GGUF) | st.binary(max_size=64).map(lambda b: b"GGUF" + b)
        | st.builds(lambda kv, tensors, version: gguf_file(kv=kv, tensors=tensors, version=version),
                    st.lists(RAW_KV, max_size=3), st.lists(RAW_TENSOR, max_size=3), st.sampled_from([2, 3, 3, 4])))


@fuzz("GGUF reader", deadline_s=2)
@given(data=GGUF)
@example(data=gguf_file(kv=[("x", 9, struct.pack("<IQ", 4, 1 << 60))]))  # found: an array past the end hung
def test_gguf_reader_as_inspect_uses_it(budget, data, scratch):
    from tuneport.toolkit.inspect import format_report, inspect_gguf

    path = scratch / "fuzz.gguf"
    path.write_bytes(data)
    try:
        format_report(inspect_gguf(path))
        event("read")
    except UserError:
        event("refused")


# -- adapter_config.json ----------------------------------------------------------------------------------------
KNOWN_KEYS = ["r", "lora_alpha", "target_modules", "peft_type", "rank_pattern", "alpha_pattern", "use_rslora",
              "use_dora", "bias", "layers_to_transform", "modules_to_save", "fan_in_fan_out", "init_lora_weights",
              "auto_mapping", "base_model_name_or_path", "lora_bias", "layers_pattern", "exclude_modules"]
CONFIG_CHANGES = st.dictionaries(st.sampled_from(KNOWN_KEYS) | st.text(max_size=6), JSON, max_size=4)


@pytest.fixture(scope="module")
def adapter_copy(zoo, scratch):
    dst = scratch / "adapter"
    shutil.copytree(zoo.adapter("llama", "plain"), dst)
    return dst, json.loads((dst / "adapter_config.json").read_text())


@fuzz("adapter config", deadline_s=5)
@given(changes=CONFIG_CHANGES, text=st.integers(0, 5).flatmap(lambda i: st.text(max_size=40) if i == 0 else st.none()))
def test_adapter_config_reader(budget, adapter_copy, changes, text):
    from tuneport.convert.adapter import load_adapter
    from tuneport.toolkit.inspect import format_report, inspect_path

    path, config = adapter_copy
    (path / "adapter_config.json").write_text(text if text is not None else json.dumps({**config, **changes}))
    try:
        adapter = load_adapter(path)
        assert all(math.isfinite(m.scale) for m in adapter.modules.values())
        format_report(inspect_path(str(path)))
        event("read")
    except UserError:
        event("refused")


# -- the gateway's request parsing -----------------------------------------------------------------------------------
def _fields(kind: str) -> dict[str, st.SearchStrategy]:
    """Values each field takes in a request the tiny llama.cpp gateway answers (generating up to 3 tokens)."""
    common = {"max_tokens": st.integers(0, 3), "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
              "seed": st.integers(0, 9), "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=2),
              "n": st.integers(1, 2), "stream": st.booleans(), "model": st.sampled_from(["llama-fp32", "nope", ""]),
              "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
              "ignore_eos": st.booleans(), "return_token_ids": st.booleans(), "user": st.text(max_size=4)}
    if kind == "chat":
        message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                         "content": st.text(max_size=12)})
        return {**common, "messages": st.lists(message, min_size=1, max_size=3), "logprobs": st.booleans(),
                "top_logprobs": st.integers(0, 3), "max_completion_tokens": st.integers(0, 3),
                "tool_choice": st.just("none")}
    return {**common, "prompt": st.text(max_size=12) | st.lists(st.integers(0, 511), min_size=1, max_size=4),
            "echo": st.booleans(), "logprobs": st.integers(0, 3)}


NAMES = sorted({*_fields("chat"), *_fields("completions"), "tools", "adapters", "stream_options", "cache_prompt"})
WILD = st.dictionaries(st.sampled_from(NAMES) | st.text(max_size=6), JSON, max_size=2)  # a few fields set to anything
REQUESTS = st.sampled_from(["completions", "chat"]).flatmap(lambda kind: st.tuples(
    st.just(kind), st.builds(lambda typed, wild: {**typed, **wild},
                             st.fixed_dictionaries({}, optional=_fields(kind)), st.just({}) | WILD)))


@fuzz("request models", deadline_s=2)
@given(request=REQUESTS)
def test_request_models(budget, request):
    from tuneport.serve.errors import ApiError
    from tuneport.serve.openai_fields import check_fields
    from tuneport.serve.openai_request import parse_request

    kind, body = request
    try:
        check_fields(kind, body, "llamacpp")
        parse_request(kind, body).top_k()
        event("accepted")
    except ApiError as e:
        assert 400 <= e.status < 500
        event("refused")


@pytest.fixture(scope="module")
def gateway(zoo):
    pytest.importorskip("llama_cpp")
    with start_gateway(zoo) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        yield client
        assert client.get("/health").status_code == 200  # still serving after every example


@fuzz("gateway routes", deadline_s=10, warnings="default")  # the server's threads share the warning filters
@given(request=REQUESTS | st.tuples(st.sampled_from(["completions", "chat"]), JSON))
def test_gateway_routes(budget, gateway, request):
    kind, body = request
    r = gateway.post("/v1/chat/completions" if kind == "chat" else "/v1/completions",
                     content=json.dumps(body).encode(), headers={"content-type": "application/json"})  # NaN too
    assert r.status_code < 500, r.text
    event(f"HTTP {r.status_code}")
    if r.status_code >= 400:
        assert isinstance(r.json()["error"]["message"], str)
