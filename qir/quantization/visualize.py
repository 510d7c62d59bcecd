"""``visualize_model``: an SVG of the lowered Program (what a compiled artifact runs).

    visualize_model(traced_model, [example_input], save_path="hbdk_model/model.svg", show=False)

One box per kernel call, labelled with the kernel and the module it came from; edges
carry the value's dtype, shape and scale; a fused layer (conv + add + relu) is a dashed
group box with its parts inside; a layer that ``check_model`` finds illegal on the march
has a red border and a ``!``, and its tooltip states the rule. See docs/perf-and-visualize.md.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from backends.common.visualize import Scale, program_picture, render_svg
from qir.quantization.perf import Lowered, lower_for_analysis

__all__ = ["program_scales", "visualize_model"]

#: Kernels whose output codes carry their input's scale (shape moves, clamps, max, nearest resize,
#: the ops on codes).
_SCALE_PRESERVING = frozenset(
    {"shape_fn", "clamp", "maxpool2d", "resize_nearest", "abs", "pad", "gather", "reduce_max", "topk"}
)
#: Kernels that may return a tuple whose tensors keep their input's scale (indices are int64: no scale).
_TUPLES = frozenset({"shape_fn", "reduce_max", "topk"})


def program_scales(low: Lowered) -> dict[str, Scale]:
    """Scale of every integer value the Program computes, where it is recorded.

    Boundary scales come from the Program (``quantize``); the rest from the ``scale``
    buffer of the converted module each layer came from, or, for kernels that keep their
    input's codes (reshape, relu, max pool), from their input. Values absent from the
    result have no recorded scale (the picture says ``scale ?``).
    """
    mods = low.node_module_objects()
    scales: dict[str, Scale] = {}
    for inst in low.program.instructions:
        for o in inst.outputs:
            info = low.infos.get(o)
            if info is not None and info.parts and inst.op in _TUPLES:
                # a tuple of tensors (chunk, split; max / topk values and indices): its codes keep the input's scale
                s0 = next((scales[v] for v in inst.inputs if v in scales), None)
                if s0 is not None:
                    scales[o] = s0
                continue
            if info is None or info.dtype not in ("qint8", "qint16", "qint32"):
                continue
            s: Scale = None
            if inst.op == "quantize":
                s = float(inst.attrs["scale"])
            else:
                buf = getattr(mods.get(inst.source), "scale", None)
                if isinstance(buf, torch.Tensor) and buf.is_floating_point() and buf.numel() > 0:
                    s = float(buf.reshape(-1)[0]) if buf.numel() == 1 else [float(v) for v in buf.reshape(-1)]
                elif inst.op in _SCALE_PRESERVING:
                    s = next((scales[v] for v in inst.inputs if v in scales), None)
            if s is not None:
                scales[o] = s
    return scales


def _violations(low: Lowered) -> tuple[dict[str, list[tuple[str, str]]], list[str]]:
    """Layer -> rules it breaks, and the findings that match no kernel call (e.g. a removed Identity)."""
    from qir.quantization.check import check_model

    inputs = low.inputs[0] if len(low.inputs) == 1 else low.inputs
    report = check_model(low.root, inputs, march=low.march)
    by_module: dict[str, list[str]] = {}
    for layer, mod in low.node_modules().items():
        by_module.setdefault(mod, []).append(layer)
    layers = {i.source for i in low.program.instructions}
    out: dict[str, list[tuple[str, str]]] = {}
    unplaced: list[str] = []
    for v in report.violations:
        short = v.rule if v.kind == "violation" else "unsupported"
        text = (
            f"{v.spelling} breaks '{v.rule}' (actual {v.actual}, bound {v.bound})"
            if v.kind == "violation"
            else f"{v.spelling}: {v.message}"
        )
        node = v.node.lstrip("%")
        targets = by_module.get(v.module or "", []) or ([node] if node in layers else [])
        for t in targets:
            out.setdefault(t, []).append((short, text))
        if not targets:
            unplaced.append(f"{v.module or v.node}: {text}")
    return out, unplaced


def _fused_from(low: Lowered) -> dict[str, str]:
    """Layer -> "fused from a + b + c" for layers ``fuse_fx`` built from several float modules."""
    record = getattr(low.root, "meta", {}).get("qir.fuse_record")
    sources = getattr(record, "sources", None)
    if not isinstance(sources, dict):
        return {}
    out: dict[str, str] = {}
    for layer, mod in low.node_modules().items():
        parts = sources.get(mod)
        if isinstance(parts, list) and len(parts) > 1:
            out[layer] = "fused from " + " + ".join(str(p) for p in parts)
    return out


def visualize_model(
    module: nn.Module,
    example_inputs: Any,
    *,
    save_path: str | os.PathLike[str] = "model.svg",
    show: bool = False,
    march: Any = None,
    input_source: str | Sequence[str] | None = None,
    check: bool = True,
    shape_ops: bool = False,
) -> Path:
    """Write an SVG of ``module``'s lowered Program to ``save_path``; return the path.

    ``module`` / ``example_inputs`` / ``march``: as for ``compile_model`` (a converted
    model or its ``torch.jit.trace``; not modified). ``check`` runs ``check_model`` and
    marks illegal layers. ``shape_ops`` also draws the shape arithmetic feeding reshapes
    (``x.size(0)``, int math), left out by default. ``show`` prints the path (there is no viewer).
    """
    low = lower_for_analysis(module, example_inputs, march=march, opt=1, input_source=input_source)
    rules, unplaced = _violations(low) if check else ({}, [])
    objs = low.node_module_objects()
    n_illegal = len(rules) + len(unplaced)
    title = [
        f"{type(low.root).__name__}: lowered for {low.march}, {len(low.program.instructions)} kernel calls",
        "box: kernel / source module; dashed box: fused layer and its parts; edge label: dtype shape scale",
        (
            f"red border (!): not legal on {low.march}, {n_illegal} layer(s); the box tooltip states the rule"
            if n_illegal
            else f"every layer passes check_model on {low.march}"
            if check
            else "legality not checked"
        ),
    ]
    title += [f"not legal, no kernel call of its own: {u}" for u in unplaced]
    pic = program_picture(
        low.program,
        low.infos,
        scales=program_scales(low),
        modules=low.node_modules(),
        module_types={k: type(m).__name__ for k, m in objs.items()},
        violations=rules,
        title=title,
        notes=_fused_from(low),
        shape_ops=shape_ops,
    )
    path = Path(save_path)
    try:
        if path.parent != Path(""):
            path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(render_svg(pic))
    except OSError as e:
        raise OSError(f"visualize_model: cannot write '{path}': {e}") from e
    if show:
        print(f"visualize_model: wrote {path}")
    return path
