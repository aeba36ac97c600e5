"""A deterministic training text for the tiny tokenizers: prose, code, numbers and unicode."""

from __future__ import annotations

import random

_WORDS = (
    "the a an of to in is was for on with as by at from that this it be are have has had not but or "
    "model adapter merge export serve token layer weight tensor rank alpha scale base fine tune llama "
    "quant file engine request stream memory batch vector matrix query key value attention norm head "
    "river mountain coffee morning window garden yellow quickly slowly happy winter summer city light "
    "we you they she he our your their one two three four five six seven eight nine ten hundred"
).split()
_CODE = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    "if (x > 0) { y = x; } else { y = -x; }\n",
    "import torch\nx = torch.zeros(4, 4)\n",
    "SELECT name, count(*) FROM users GROUP BY name;\n",
    '{"key": "value", "list": [1, 2, 3]}\n',
]
_UNICODE = [
    "Grüße aus München, café crème, naïve façade.",
    "日本語のテキストと漢字。",
    "Привет, мир! Как дела?",
    "emoji: 🙂 🚀 🎉 ✨ 👍",
    "math: α + β = γ, ∑ x² ≤ ∞",
    "tabs\tand  double  spaces\n\nand newlines",
]


def training_lines(n: int = 3000, seed: int = 1234) -> list[str]:
    rng = random.Random(seed)
    lines: list[str] = []
    for i in range(n):
        kind = i % 10
        if kind < 7:
            k = rng.randint(4, 16)
            s = " ".join(rng.choice(_WORDS) for _ in range(k))
            lines.append(s.capitalize() + rng.choice([".", "!", "?", ",", ":"]))
        elif kind == 7:
            lines.append(rng.choice(_CODE))
        elif kind == 8:
            lines.append(rng.choice(_UNICODE))
        else:
            lines.append(" ".join(str(rng.randint(0, 99999)) for _ in range(rng.randint(1, 6))))
    return lines


EVAL_TEXT = (
    "The model merges the adapter into the base weights. We export one file for each engine, "
    "then serve many adapters over one shared base. Grüße! 🙂 def f(x): return x * 2"
)

PROMPTS = [
    "The model",
    "We export one file for each",
    "def add(a, b):",
    "Grüße aus München",
]
