"""The release's ``fidelity.png``: file size against KL to the fine-tune, one point per GGUF quant type."""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)


def size_kl_points(artifacts: list[dict]) -> list[tuple[str, float, float]]:
    """(quant type, MB, KL) of each verified GGUF model file on its own, first target that has it."""
    points: dict[str, tuple[str, float, float]] = {}
    for a in artifacts:
        if a.get("verified") and a.get("quant") and not a.get("lora") and a["quant"] not in points:
            points[a["quant"]] = (a["quant"], a["bytes"] / 1e6, max(a["metrics"]["kl"], 1e-12))
    return sorted(points.values(), key=lambda p: p[1])


def write_size_kl_plot(artifacts: list[dict], out: Path, title: str) -> list[tuple[str, float, float]] | None:
    """Write the PNG; None (and nothing written) when matplotlib is missing or there is nothing to plot."""
    points = size_kl_points(artifacts)
    if not points:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no fidelity.png (pip install 'tuneport[release]')")
        return None
    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    ax.plot([p[1] for p in points], [p[2] for p in points], "o-")
    for name, mb, kl in points:
        ax.annotate(name.upper(), (mb, kl), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_yscale("log")
    ax.set_xlabel("file size (MB)")
    ax.set_ylabel("KL(fine-tune ‖ artifact) per token")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, format="png", metadata={"Software": None})  # no version string: byte-stable
    plt.close(fig)
    return points
