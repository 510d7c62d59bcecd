"""``perf_model``: a static, per-layer profile of the compiled Program with *estimated* times.

    perf_model(traced_model, [example_input], opt=2, input_source=["pyramid"],
               layer_details=True, out_dir="hbdk_model")   # writes perf.json and perf.txt

The model is lowered exactly as :func:`~qir.quantization.compile.compile_model` lowers it
(the same call, without the legality refusal), so the profile describes the kernels a
compiled artifact runs. Times are a roofline estimate from :mod:`backends.common.roofline`
(docs/perf-and-visualize.md), never a measurement.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.fx
from torch import nn

from backends.common.perf import ProgramProfile, ValueInfo, profile_program, value_infos
from backends.common.program import Program
from backends.common.roofline import get_roofline
from qir.frontend.tracer import TraceError
from qir.quantization.compile import _inputs, _march_of, _resolve, compile_model
from qir.quantization.hybrid_compile import INLINED_AS, INLINED_FROM, inline_cpu_modules

__all__ = ["Lowered", "lower_for_analysis", "perf_model"]


@dataclass
class Lowered:
    """A model lowered for analysis: the Program, the module and fx graph it came from, value shapes."""

    program: Program
    root: nn.Module
    graph: torch.fx.Graph
    inputs: tuple[Any, ...]
    march: str
    infos: dict[str, ValueInfo]

    def node_modules(self) -> dict[str, str]:
        """Layer (fx node) name -> the qualified name of the module it calls (QFunctional: ``name.method``)."""
        nodes = {n.name: n for n in self.graph.nodes}
        out: dict[str, str] = {}
        for name in {i.source for i in self.program.instructions}:
            n = nodes.get(name)
            if n is None:
                out[name] = name
            elif INLINED_AS in n.meta:
                out[name] = str(n.meta[INLINED_AS])  # a hybrid CPU module's forward, traced inline
            elif n.op == "call_module":
                out[name] = str(n.target)
            elif (
                n.op == "call_method" and n.args and isinstance(n.args[0], torch.fx.Node) and n.args[0].op == "get_attr"
            ):
                out[name] = f"{n.args[0].target}.{n.target}"
            else:
                out[name] = name
        return out

    def node_module_objects(self) -> dict[str, nn.Module]:
        """Layer name -> the module object whose buffers describe it (call_module / QFunctional nodes)."""
        out: dict[str, nn.Module] = {}
        for n in self.graph.nodes:
            obj: Any = None
            if INLINED_FROM in n.meta and n.op != "call_module":
                obj = self.root.get_submodule(str(n.meta[INLINED_FROM]))  # the CPU module it was inlined from
            elif n.op == "call_module":
                obj = self.root.get_submodule(str(n.target))
            elif (
                n.op == "call_method" and n.args and isinstance(n.args[0], torch.fx.Node) and n.args[0].op == "get_attr"
            ):
                obj = self.root
                for part in str(n.args[0].target).split("."):
                    obj = getattr(obj, part, None)
            if isinstance(obj, nn.Module):
                out[n.name] = obj
        return out


def lower_for_analysis(
    module: nn.Module,
    example_inputs: Any,
    *,
    march: Any = None,
    opt: int | str = 2,
    input_source: str | Sequence[str] | None = None,
) -> Lowered:
    """Lower ``module`` (converted model or its ``torch.jit.trace``) with ``compile_model``'s lowering.

    Legality is not enforced here (``check=False``): the profile and the picture are most
    useful exactly when a model is not legal yet. ``module`` is not modified.
    """
    inputs = _inputs(example_inputs)
    root = _resolve(module)
    # the fx graph names the modules behind the program's instruction sources (IR names are fx names);
    # compile_model lowers a hybrid model's CPU modules from their forwards' calls, traced inline
    inlined = inline_cpu_modules(root)
    graph = inlined.graph if isinstance(inlined, torch.fx.GraphModule) else _fx_graph(root, inputs)
    march_name = _march_of(root, march)
    compiled = compile_model(root, list(inputs), march=march_name, opt=opt, input_source=input_source, check=False)
    program = compiled.program
    infos = value_infos(program, [x for x in inputs])
    return Lowered(program, root, graph, inputs, march_name, infos)


def _fx_graph(root: nn.Module, inputs: tuple[Any, ...]) -> torch.fx.Graph:
    """The fx graph ``compile_model`` lowers: the symbolic trace, or for a model fx cannot trace the
    path recorded on ``inputs`` (the same node names as the program's instruction sources)."""
    from qir.frontend.record import record
    from qir.quantization.fuse import trace_fx

    try:
        return trace_fx(root)
    except TraceError:
        subject = copy.deepcopy(root).eval() if root.training else root
        return record(subject, inputs)[0]


def perf_model(
    module: nn.Module,
    example_inputs: Any,
    *,
    out_dir: str | os.PathLike[str] = ".",
    opt: int | str = 2,
    input_source: str | Sequence[str] | None = None,
    layer_details: bool = False,
    march: Any = None,
    name: str | None = None,
    show: bool = False,
) -> ProgramProfile:
    """Profile the lowered model; write ``out_dir/perf.json`` and ``out_dir/perf.txt``; return the profile.

    ``module`` / ``example_inputs`` / ``march``: as for ``compile_model``. ``opt`` is the
    lowering level (it picks CPU engines; the estimate does not depend on it) and is
    recorded. ``input_source`` (``ddr`` / ``pyramid`` / ``resizer``, one per input or one
    for all) is recorded and decides how the input is counted: ``ddr`` reads the float
    tensor from DRAM (4 bytes an element), ``pyramid`` / ``resizer`` deliver 8-bit pixels
    (1 byte). ``layer_details`` adds a row per layer to ``perf.txt`` (``perf.json`` always
    has them). ``show`` prints ``perf.txt``. Times and FPS are roofline ESTIMATES.
    """
    low = lower_for_analysis(module, example_inputs, march=march, opt=opt, input_source=input_source)
    level = int(str(opt).lstrip("Oo")) if isinstance(opt, str) else int(opt)
    prof = profile_program(
        low.program,
        low.infos,
        get_roofline(low.march),
        model=name or type(low.root).__name__,
        modules=low.node_modules(),
        input_source=low.program.meta.get("input_source"),
        opt=level,
    )
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "perf.json").write_text(prof.dumps() + "\n")
        text = prof.text(layer_details=layer_details)
        (out / "perf.txt").write_text(text)
    except OSError as e:
        raise OSError(f"perf_model: cannot write the profile to '{out}': {e}") from e
    if show:
        print(text, end="")
    return prof
