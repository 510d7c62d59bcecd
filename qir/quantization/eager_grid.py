"""Eager QAT models train on the integer grid too: bindings from what their forwards recorded.

``prepare_qat_fx`` binds each conv / linear / average pool to the fake quants that put its
inputs on their grids by walking the fx graph (:mod:`qir.quantization.integer_grid`). An eager
model may not trace, so its bindings come from its recorded forwards
(:mod:`qir.quantization.eager_record`): each call site's tensor arguments were produced by QAT
modules (through views, max pools, relu, ...) whose output fake quant sets the argument's grid;
a FloatFunctional's methods are recorded by the QAT class, which runs the grid inside the recorded
call.
Records grow while the first forwards run, so the bindings are refreshed after every forward
that recorded a new call site: a freshly prepared model's first forward runs float fake
quantization, the following ones run on the grid (docs/semantics.md, "Training on the integer
grid").
"""

from __future__ import annotations

from torch import nn

from qir.quantization.eager_record import SOURCES, Source
from qir.quantization.fake_quantize import FakeQuantize
from qir.quantization.integer_grid import bind_sites, output_fake_quant, source_of_module

__all__ = ["CALLED_METHODS", "bind_eager_grid"]

#: QAT FloatFunctional attribute: the methods its forwards called (qir.nn.qat.functional)
CALLED_METHODS = "_qir_called_methods"


def _fake_quant_of(root: nn.Module, src: Source | None) -> FakeQuantize | None:
    """The per-tensor fake quant whose grid the recorded producer's output is on, or None."""
    if src is None:
        return None
    path, index = src
    m = root.get_submodule(path)
    if callable(getattr(m, "output_fake_quants", None)):  # one fake quant per output (attention's (out, weights))
        return output_fake_quant(m, index)
    if index != 0:
        return None  # one output of several: several scales
    return source_of_module(m, None)


def bind_eager_grid(root: nn.Module, march: str) -> dict[str, str]:
    """Bind every grid-capable QAT module of eager ``root`` whose recorded inputs come from known
    fake quants (all call sites, training and eval forwards); in place. ``{path: reason}`` for
    the modules left on float fake quantization."""
    sites: dict[str, list[list[FakeQuantize | None]]] = {}
    methods: dict[str, set[str]] = {}
    for path, m in root.named_modules():
        want = getattr(type(m), "grid_inputs", 0)
        if not want:
            continue
        if want < 0:  # a FloatFunctional: its recorded call site and the methods it called
            methods[path] = set(m.__dict__.get(CALLED_METHODS, ()))
        calls = [
            [_fake_quant_of(root, src) for src in site]
            for mode_sites in m.__dict__.get(SOURCES, {}).values()
            for site in mode_sites
        ]
        if calls:
            sites[path] = calls
    return bind_sites(root, sites, methods, march)
