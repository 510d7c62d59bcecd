"""``compile_model`` (converted model -> Program -> artifact file) and ``load_compiled``.

    compiled = compile_model(quantized_model, [example_input], hbm="model.hbm")   # or a jit.trace of it
    run = qir.load_compiled("model.hbm")
    torch.equal(run(x), quantized_model(x))   # bit-exact

Accepted models: a ``convert_fx`` GraphModule, an eager ``convert`` result, or a
``torch.jit.trace`` of either. A TorchScript trace inlines the FloatFunctional arithmetic
into anonymous aten ops, so qir does not reverse-engineer it: ``jit.trace`` shares its
parameter and buffer tensors with the traced module (the same tensor objects), and
``compile_model`` finds that module among the live ``nn.Module`` objects by tensor
identity and lowers it (docs/backends.md "Compiling a jit trace"). A trace whose module
is gone (e.g. ``torch.jit.load``) is refused with an error saying so.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx
from torch import nn

from backends.common.artifact import read_program, write_program
from backends.common.lower import lower_graph
from backends.common.runtime import DEFAULT_THREADS, CompiledModel
from passes.base import PassContext
from passes.legalize import RESULT_KEY, Legalize
from passes.pipeline import Pipeline
from qir.march import March, get_march
from qir.quantization.jit_source import TracedSourceError, traced_original
from qir.quantization.pipelines import PipelineArg, default_pipeline, resolve_pipeline, run_on_module

__all__ = ["CompileError", "CompiledModel", "compile_model", "load_compiled"]

_INPUT_SOURCES = ("ddr", "pyramid", "resizer")


class CompileError(RuntimeError):
    """The model cannot be compiled: illegal on the march, or not lowerable (the message says which)."""


def _inputs(example_inputs: Any) -> tuple[Any, ...]:
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, (list, tuple)):
        return tuple(example_inputs)
    raise TypeError(
        f"example_inputs must be a tensor or a list / tuple of tensors, got {type(example_inputs).__name__}"
    )


def _resolve(module: nn.Module) -> tuple[nn.Module, torch.fx.Graph]:
    from qir.quantization.fuse import trace_fx

    if isinstance(module, (torch.jit.ScriptModule, torch.jit.ScriptFunction)):
        if not isinstance(module, torch.jit.ScriptModule):
            raise CompileError("cannot compile a TorchScript function; pass the converted module")
        try:
            module = traced_original(module, "cannot compile")
        except TracedSourceError as e:
            raise CompileError(str(e)) from None
    if isinstance(module, torch.fx.GraphModule):
        return module, module.graph
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"compile_model needs a converted nn.Module or its torch.jit.trace, got {type(module).__name__}"
        )
    return module, trace_fx(module)


def _march_of(module: nn.Module, march: Any) -> str:
    if march is not None:
        return March.parse(march).value
    for m in module.modules():
        found = getattr(m, "march", None)
        if isinstance(found, str):
            return March.parse(found).value
    current = get_march(None)
    if current is None:
        raise CompileError("no march: pass march='bayes' or 'bernoulli2', or call qir.march.set_march first")
    return March.parse(current).value


def _run_pipeline(
    root: nn.Module, inputs: tuple[Any, ...], march: str, pipeline: PipelineArg | None, check: bool
) -> nn.Module | None:
    """Run the compile stage's IR pipeline on ``root``; the emitted module if a pass changed the graph.

    With ``check`` the pipeline ends with ``legalize`` for ``march`` (appended when the
    last pass is not one) and an illegal model is refused."""
    from qir.quantization import check as check_mod  # importing it registers how qir modules are checked

    if pipeline is None:
        pipe = default_pipeline("compile", march) if check else Pipeline(())
    else:
        pipe = resolve_pipeline("compile", pipeline, march)
        if check and not (len(pipe) and isinstance(pipe[-1], Legalize)):
            pipe = Pipeline((*pipe, Legalize(march=march)))
    if not len(pipe):
        return None
    subject = copy.deepcopy(root).eval() if root.training else root  # check and lower what is deployed
    ctx = PassContext(options={"march": march})
    emitted, _ = run_on_module(subject, pipe, inputs, ctx)
    result = ctx.options.get(RESULT_KEY)
    if check and result is not None:
        report = check_mod.report_from_result(result)
        if not report.ok:
            lines = [f"  {v.node} ({v.module or '-'}: {v.spelling}): {v.message}" for v in report.violations]
            raise CompileError(
                f"the model is not legal on {report.march} ({len(lines)} violation(s)); compile_model refuses "
                "it (check=False skips this check):\n" + "\n".join(lines)
            )
    return emitted


def _refuse_hybrid(root: nn.Module) -> None:
    """A hybrid model's CPU modules are float torch code between integer segments: not one program."""
    from qir.quantization.hybrid import hybrid_plan_of

    plan = hybrid_plan_of(root)
    cpu = plan.cpu_modules() if plan is not None else []
    if cpu:
        raise CompileError(
            f"cannot compile a hybrid model: {', '.join(cpu)} {'run' if len(cpu) > 1 else 'runs'} on the CPU in "
            "float between integer BPU segments, and a compiled program is integer kernels only. A hybrid integer "
            "model is for accuracy "
            "evaluation (qir.quantization.hybrid_placement(model) lists the placement). To deploy, compile each BPU "
            "segment as its own model (docs/hybrid.md, 'Segmented deployment'), or export the QAT model with "
            "export_to_onnx for Horizon's toolchain"
        )


def _refuse_wrapped(graph: torch.fx.Graph) -> None:
    """``fx_helper.wrap``-ed calls are user Python run on the CPU: a program holds integer kernels only."""
    from qir.utils.fx_helper import wrapped_original

    names = [
        getattr(n.target, "__qualname__", n.name)
        for n in graph.nodes
        if n.op == "call_function" and wrapped_original(n.target) is not None
    ]
    if names:
        raise CompileError(
            f"cannot compile the wrapped function(s) {', '.join(dict.fromkeys(names))}: code decorated with "
            "fx_helper.wrap is Python that runs on the CPU in float (on dequantized inputs), and a compiled program "
            "holds integer kernels only. Compile the BPU part: a model whose forward returns what the wrapped "
            "function receives (e.g. the head outputs, the seed's `post_process is None` branch), and run the "
            "wrapped post-processing on the program's outputs (docs/hybrid.md, 'Wrapped functions')"
        )


def compile_model(
    module: nn.Module,
    example_inputs: Any,
    hbm: str | os.PathLike[str] | None = None,
    march: Any = None,
    opt: int | str = 2,
    input_source: str | Sequence[str] | None = None,
    check: bool = True,
    name: str | None = None,
    num_threads: int | None = DEFAULT_THREADS,
    pipeline: PipelineArg | None = None,
) -> CompiledModel:
    """Lower a converted model to a Program of integer kernels; write it to ``hbm`` when given.

    ``module``: a converted GraphModule / eager module or a ``torch.jit.trace`` of one
    (never modified). ``example_inputs``: a tensor or list of tensors (fixes the shapes
    that some kernels' tables depend on; the batch size stays free). ``march`` defaults to
    the modules' march, then ``qir.march.get_march()``. ``opt >= 2`` times every exact
    engine of each conv / linear on the example inputs and keeps the fastest; ``opt`` 0/1
    take the march's preference order. ``input_source`` (``ddr`` / ``pyramid`` /
    ``resizer``, one per input) is recorded in the program. ``check`` runs
    ``check_model`` first and refuses an illegal model. Returns the runnable
    :class:`CompiledModel` (bit-exact with ``module``).

    ``pipeline``: the IR passes run on the converted model before lowering (default
    ``qir.quantization.default_pipeline("compile", march)``: ``legalize``); a pass that
    changes the graph has the changed graph lowered (docs/pipelines.md).
    """
    inputs = _inputs(example_inputs)
    level = int(str(opt).lstrip("Oo")) if isinstance(opt, str) else int(opt)
    sources = [input_source] * len(inputs) if isinstance(input_source, str) else list(input_source or [])
    for s in sources:
        if s not in _INPUT_SOURCES:
            raise ValueError(f"input_source {s!r} is unknown; valid: {', '.join(_INPUT_SOURCES)}")
    if sources and len(sources) != len(inputs):
        raise ValueError(f"input_source has {len(sources)} entries for {len(inputs)} input(s)")
    root, graph = _resolve(module)
    _refuse_hybrid(root)
    _refuse_wrapped(graph)
    march_name = _march_of(root, march)
    emitted = _run_pipeline(root, inputs, march_name, pipeline, check)
    if emitted is not None:
        root, graph = emitted, emitted.graph  # type: ignore[assignment]
    prev = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        with torch.no_grad():
            program = lower_graph(root, graph, inputs, march_name, level)
    except (ValueError, TypeError, NotImplementedError, RuntimeError) as e:
        if isinstance(e, CompileError):
            raise
        raise CompileError(f"lowering {type(root).__name__} for {march_name}: {e}") from e
    finally:
        torch.set_num_threads(prev)
    program.meta.update(
        {
            "name": name or type(root).__name__,
            "input_source": sources or ["ddr"] * len(inputs),
            # checked on every call: a program lowered for one input size is only exact at that size
            "input_shapes": [list(x.shape) if isinstance(x, torch.Tensor) else None for x in inputs],
            "torch": torch.__version__,
        }
    )
    if hbm is not None:
        write_program(program, hbm)
    return CompiledModel(program, num_threads=num_threads, source=str(hbm) if hbm is not None else "")


def load_compiled(path: str | os.PathLike[str], num_threads: int | None = DEFAULT_THREADS) -> CompiledModel:
    """The callable stored in ``path``: float inputs in, the converted model's outputs out.

    Raises :class:`backends.common.artifact.ArtifactError` for a truncated, corrupted,
    newer-version or foreign file. Loading reads data only; it never executes code from the file.
    """
    return CompiledModel(read_program(Path(path)), num_threads=num_threads, source=str(path))
