"""``featuremap_similarity``: per-layer agreement of two models on the same inputs, matched by module path.

Any pair among float, calibration / QAT (prepared), converted and a compiled artifact (its
final output only). A float model compared with a quantized one is fused first (on a copy)
so that paths name the same tensors. Per layer: cosine, relative L2, max abs error and
max error in LSBs of the quantized model's output scale; as a table, JSON and a plot.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from qir.quantization.debug.metrics import cosine, max_abs, relative_l2
from qir.quantization.debug.taps import OUTPUT, Tap, as_inputs, comparable, model_stage, record

__all__ = ["LayerSimilarity", "SimilarityReport", "featuremap_similarity"]

_QUANT_FIRST = {"converted": 0, "prepared": 1, "opaque": 2, "float": 3}


@dataclass
class LayerSimilarity:
    """One compared tensor. ``max_lsb`` is ``None`` when neither side is quantized there."""

    index: int
    name: str
    module_type: str
    dtype: str
    shape: list[int]
    cosine: float
    relative_l2: float
    max_abs: float
    max_lsb: float | None
    note: str = ""


@dataclass
class SimilarityReport:
    """Rows in call order of model B, the final output(s) last, and what could not be matched."""

    stage_a: str
    stage_b: str
    rows: list[LayerSimilarity]
    only_in_a: list[str] = field(default_factory=list)
    only_in_b: list[str] = field(default_factory=list)
    threshold: float | None = None

    def row(self, name: str) -> LayerSimilarity:
        for r in self.rows:
            if r.name == name:
                return r
        raise KeyError(f"no compared layer named {name!r}; compared: {', '.join(r.name for r in self.rows)}")

    def below(self, threshold: float) -> list[LayerSimilarity]:
        """Rows whose cosine similarity is under ``threshold``, in call order."""
        return [r for r in self.rows if r.cosine < threshold]

    def first_drop(self, threshold: float) -> LayerSimilarity | None:
        """The first layer (in call order) whose cosine falls under ``threshold``: where to look first."""
        rows = self.below(threshold)
        return rows[0] if rows else None

    def table(self) -> str:
        head = f"featuremap similarity: A = {self.stage_a} model, B = {self.stage_b} model ({len(self.rows)} tensors)"
        cols = ["#", "layer", "type", "dtype", "cosine", "rel L2", "max abs", "max LSB", "note"]
        body = []
        for r in self.rows:
            flag = "<<" if self.threshold is not None and r.cosine < self.threshold else ""
            body.append(
                [
                    str(r.index),
                    r.name,
                    r.module_type,
                    r.dtype,
                    f"{r.cosine:.6f}",
                    f"{r.relative_l2:.3g}",
                    f"{r.max_abs:.3g}",
                    "" if r.max_lsb is None else f"{r.max_lsb:.2f}",
                    " ".join(x for x in (flag, r.note) if x),
                ]
            )
        widths = [max(len(c), *(len(b[i]) for b in body)) if body else len(c) for i, c in enumerate(cols)]
        lines = [head, "  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)).rstrip()]
        lines.append("  ".join("-" * w for w in widths).rstrip())
        lines += ["  ".join(v.ljust(w) for v, w in zip(b, widths, strict=True)).rstrip() for b in body]
        if self.threshold is not None:
            lines.append(f"<<: cosine below {self.threshold}")
        for side, names in (("A", self.only_in_a), ("B", self.only_in_b)):
            if names:
                lines.append(f"only in {side} (not compared): {', '.join(names)}")
        return "\n".join(lines) + "\n"

    def to_dict(self) -> dict[str, Any]:
        def clean(v: Any) -> Any:  # JSON has no inf / nan
            return None if isinstance(v, float) and not math.isfinite(v) else v

        return {
            "stage_a": self.stage_a,
            "stage_b": self.stage_b,
            "threshold": self.threshold,
            "layers": [{k: clean(v) for k, v in asdict(r).items()} for r in self.rows],
            "only_in_a": self.only_in_a,
            "only_in_b": self.only_in_b,
        }

    def save(self, out_dir: str | Path, plot: bool = True, name: str = "similarity") -> list[Path]:
        """Write ``<name>.txt``, ``<name>.json`` and (``plot``) ``<name>.png`` into ``out_dir``; the paths."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = [out / f"{name}.txt", out / f"{name}.json"]
        paths[0].write_text(self.table())
        paths[1].write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        if plot:
            paths.append(self.plot(out / f"{name}.png"))
        return paths

    def plot(self, path: str | Path) -> Path:
        """A PNG of cosine similarity and max LSB error along depth (needs matplotlib)."""
        from qir.quantization.debug.plot import plot_similarity

        return plot_similarity(self, Path(path))


def _compare(index: int, name: str, a: Tap, b: Tap) -> LayerSimilarity:
    dtype = b.dtype if b.dtype != "float32" else a.dtype
    mtype = b.module_type if b.module_type != "output" else a.module_type
    if a.value.shape != b.value.shape:
        nan = math.nan
        note = f"shapes differ: {list(a.value.shape)} vs {list(b.value.shape)}"
        return LayerSimilarity(index, name, mtype, dtype, list(b.value.shape), nan, nan, nan, None, note)
    lsb = b.lsb if b.lsb is not None else a.lsb
    max_lsb = None
    if lsb is not None:
        err = (b.value - a.value).abs() / lsb.to(torch.float32)
        max_lsb = float(err.max()) if err.numel() else 0.0
    return LayerSimilarity(
        index,
        name,
        mtype,
        dtype,
        list(b.value.shape),
        cosine(a.value, b.value),
        relative_l2(a.value, b.value),
        max_abs(a.value, b.value),
        max_lsb,
    )


def featuremap_similarity(
    model1: Any,
    model2: Any,
    inputs: Any,
    threshold: float | None = None,
    out_dir: str | Path | None = None,
    plot: bool = True,
) -> SimilarityReport:
    """Compare ``model1`` (A, the reference) and ``model2`` (B) layer by layer on one call with ``inputs``.

    ``inputs``: a tensor or a tuple of positional inputs. Layers are matched by module path
    (a module called several times: ``name#2``...); the final output(s) are the last rows.
    A float model paired with a prepared or converted one is fused (on a copy) so the paths
    name the same tensors. Prepared models run in validation state (observers frozen, fake
    quant on); every model gets its own mode back. ``threshold`` marks rows whose cosine is
    below it. ``out_dir``: also write similarity.txt / .json (and .png with ``plot``).
    """
    s1, s2 = model_stage(model1), model_stage(model2)
    if s1 == "float":
        model1 = comparable(model1, s2)
    if s2 == "float":
        model2 = comparable(model2, s1)
    args = as_inputs(inputs)
    taps1, out1 = record(model1, args)
    taps2, out2 = record(model2, args)
    rows: list[LayerSimilarity] = []
    for name, tb in taps2.items():
        if name in taps1:
            rows.append(_compare(len(rows), name, taps1[name], tb))
    if len(out1) != len(out2):
        raise ValueError(f"the models return different numbers of tensors: {len(out1)} (A) vs {len(out2)} (B)")
    for oa, ob in zip(out1, out2, strict=True):
        row = _compare(len(rows), ob.name, oa, ob)
        for t, side in ((oa, "A"), (ob, "B")):
            if t.dtype.startswith("q"):
                row.note = f"{side} returns integer codes with no scale: compared as integers"
        rows.append(row)
    compared = {r.name for r in rows}

    def unmatched(mine: dict[str, Tap], other: dict[str, Tap]) -> list[str]:
        # Submodules of a compared module (a fused conv's .conv / .relu) are inside its row already.
        inside = lambda n: any(n.startswith(c + ".") for c in compared)
        return [n for n in mine if n not in other and not inside(n)]

    report = SimilarityReport(
        stage_a=s1,
        stage_b=s2,
        rows=rows,
        only_in_a=unmatched(taps1, taps2),
        only_in_b=unmatched(taps2, taps1),
        threshold=threshold,
    )
    if out_dir is not None:
        report.save(out_dir, plot=plot)
    return report


__all__ += ["OUTPUT"]
