"""Gates: ``METRIC<=X`` / ``METRIC>=X`` on a measured figure, or a check's name (it must pass)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from tuneport.convert.errors import UserError

# metric -> (what it is, the direction that is better)
METRICS: dict[str, tuple[str, str]] = {
    "max_abs": ("max |Δlogit| against the reference", "lower"),
    "kl": ("mean KL(reference ‖ artifact) per token", "lower"),
    "top1": ("top-1 agreement with the reference", "higher"),
    "ppl_ratio": ("perplexity of the artifact / of the reference on the eval text", "lower"),
    "greedy": ("share of greedy tokens equal to the reference's before the first difference", "higher"),
    "strength_error": ("|LoRA strength - 1|: the artifact's adapter delta against PEFT's", "lower"),
}
CHECKS = ("tokenizer", "chat_template", "special_tokens")
# Applied unless the user gates the same metric (a gate that does not apply, e.g. strength without a
# LoRA, is skipped).
DEFAULT_GATES = ("tokenizer", "chat_template", "special_tokens", "strength_error<=0.1")
_GATE = re.compile(r"^\s*([a-z_0-9]+)\s*(<=|>=)\s*([-+0-9.eE]+)\s*$")


@dataclass(frozen=True)
class Gate:
    metric: str
    op: str | None = None  # "<=" / ">=", None for a check
    limit: float | None = None

    @classmethod
    def parse(cls, text: str) -> Gate:
        if text.strip() in CHECKS:
            return cls(text.strip())
        m = _GATE.match(text)
        if not m or m.group(1) not in METRICS:
            raise UserError(f"bad gate {text!r}", f"use METRIC<=X or METRIC>=X with METRIC one of "
                            f"{', '.join(METRICS)}, or a check: {', '.join(CHECKS)}")
        try:
            return cls(m.group(1), m.group(2), float(m.group(3)))
        except ValueError as e:
            raise UserError(f"bad gate {text!r}: {m.group(3)!r} is not a number", "e.g. kl<=0.01") from e

    def __str__(self) -> str:
        return self.metric if self.op is None else f"{self.metric}{self.op}{self.limit:g}"

    def evaluate(self, metrics: dict[str, float | None], checks: dict[str, dict]) -> dict | None:
        """``{gate, value, passed}``, or None when it does not apply to this artifact."""
        if self.op is None:
            passed = checks.get(self.metric, {}).get("passed")
            return None if passed is None else {"gate": str(self), "value": passed, "passed": passed,
                                                "detail": checks[self.metric]["detail"]}
        value = metrics.get(self.metric)
        if value is None:
            return None
        ok = value <= self.limit if self.op == "<=" else value >= self.limit
        return {"gate": str(self), "value": value, "passed": ok, "detail": METRICS[self.metric][0]}


def parse_gates(texts: list[str] | tuple[str, ...], defaults: bool = True) -> list[Gate]:
    """The user's gates, after the defaults on metrics they do not gate themselves."""
    given = [Gate.parse(t) for t in texts]
    ours = [g for g in map(Gate.parse, DEFAULT_GATES) if g.metric not in {u.metric for u in given}] if defaults else []
    return list(dict.fromkeys([*ours, *given]))
