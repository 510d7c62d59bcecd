"""The similarity-along-depth picture (matplotlib, imported only here and only when asked for)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qir.quantization.debug.similarity import SimilarityReport

__all__ = ["plot_similarity"]


def plot_similarity(report: SimilarityReport, path: Path) -> Path:
    """Cosine (top) and max error in LSBs (bottom) per layer, in call order; saved as PNG at ``path``."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: never needs a display
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError(
            "the similarity plot needs matplotlib: pip install matplotlib (or pass plot=False / --no-plot)"
        ) from None
    names = [r.name for r in report.rows]
    xs = list(range(len(names)))
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(max(6.0, 0.35 * len(names) + 2), 6))
    top.plot(xs, [r.cosine for r in report.rows], marker="o")
    top.set_ylabel("cosine similarity")
    if report.threshold is not None:
        top.axhline(report.threshold, color="red", linestyle="--", linewidth=1, label=f"threshold {report.threshold}")
        top.legend(loc="lower left")
    top.set_title(f"featuremap similarity: {report.stage_a} (A) vs {report.stage_b} (B)")
    top.grid(True, alpha=0.3)
    lsb = [r.max_lsb if r.max_lsb is not None else float("nan") for r in report.rows]
    bottom.bar(xs, lsb)
    bottom.set_ylabel("max error (output LSBs)")
    bottom.set_xticks(xs)
    bottom.set_xticklabels(names, rotation=60, ha="right", fontsize=8)
    bottom.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
