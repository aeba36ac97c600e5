"""The malformed-input corpus (tests/corpus/): each case must produce its exact one-line refusal.

A command case must exit 2 with that line alone on stderr (``error: ...``), no traceback, nothing at the
output path and no temporary left beside it; an HTTP case must answer 400 with that message in an
OpenAI-style error body, and the server must answer the next request. The corpus count, by category, is
printed at the end of the test output.
"""

from __future__ import annotations

from collections import Counter

import httpx
import pytest
from corpus.cases import CASES, HTTP_CASES, Work, post, start_gateway


def corpus_line() -> str:
    counts = Counter([c.category for c in CASES] + ["http"] * len(HTTP_CASES))
    known = sum(bool(c.known_bug) for c in CASES)
    return (f"malformed-input corpus: {sum(counts.values())} cases ("
            + ", ".join(f"{k} {n}" for k, n in counts.items()) + ")"
            + (f"; {known} known bugs expected to fail (xfail)" if known else ""))


@pytest.fixture(scope="module", autouse=True)
def _count(summary):
    summary.append(corpus_line())


def params(cases):
    return [pytest.param(c, id=c.id, marks=[pytest.mark.xfail(strict=True, reason=c.known_bug)] if
                         getattr(c, "known_bug", "") else []) for c in cases]


@pytest.mark.parametrize("case", params(CASES))
def test_command_refuses(case, zoo, tmp_path, cli):
    w = Work(zoo, tmp_path)
    args = case.run(w)
    code, _, stderr = cli(*args)
    assert "Traceback" not in stderr
    assert (code, stderr.strip().splitlines()) == (2, [case.expect.format(**w.fields())])
    assert not w.out.exists(), "output left behind"
    assert not list(tmp_path.glob(".tuneport-tmp-*")), "temporary left behind"


@pytest.fixture(scope="module")
def gateway(zoo):
    pytest.importorskip("llama_cpp")
    with start_gateway(zoo) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


@pytest.mark.parametrize("case", params(HTTP_CASES))
def test_gateway_refuses(case, gateway):
    r = post(gateway, case)
    assert (r.status_code, r.json()) == (400, {"error": {"message": case.message, "type": "invalid_request_error",
                                                         "code": 400}})
    assert gateway.get("/health").status_code == 200


def test_corpus_is_large_and_named_uniquely():
    ids = [c.id for c in CASES] + [c.id for c in HTTP_CASES]
    assert len(ids) == len(set(ids)) and len(ids) >= 60
    assert {c.category for c in CASES} >= {"safetensors", "index", "config", "tokenizer", "adapter-config",
                                           "adapter-weights", "gguf", "recipe"}
