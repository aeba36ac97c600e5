"""``tuneport verify``: an artifact run in its own engine against the fp32 fine-tune (transformers + PEFT):
logit metrics, greedy agreement, LoRA strength, tokenizer / chat template / special token parity, gates."""

from .gates import CHECKS, DEFAULT_GATES, METRICS, Gate
from .run import VerifyOptions, VerifyReport, check_passed, format_report, verify

__all__ = ["CHECKS", "DEFAULT_GATES", "METRICS", "Gate", "VerifyOptions", "VerifyReport", "check_passed",
           "format_report", "verify"]
