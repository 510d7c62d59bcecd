"""``compile_model`` (converted model -> Program -> artifact file) and ``load_compiled``.

    compiled = compile_model(quantized_model, [example_input], hbm="model.hbm")   # or a jit.trace of it
    run = qir.load_compiled("model.hbm")
    torch.equal(run(x), quantized_model(x))   # bit-exact

Accepted models: a ``convert_fx`` GraphModule, an eager ``convert`` result, or a
``torch.jit.trace`` of either. An eager model fx cannot trace is lowered from the path its
forward takes on the example inputs (``qir.frontend.record``): ``program.meta["specialized"]``
says what that path fixes, and the program is checked against the model on those inputs. A
TorchScript trace inlines the FloatFunctional arithmetic into anonymous aten ops, so qir does
not reverse-engineer it: ``jit.trace`` shares its parameter and buffer tensors with the traced
module (the same tensor objects), and ``compile_model`` finds that module among the live
``nn.Module`` objects by tensor identity and lowers it (docs/backends.md "Compiling a jit
trace"). A trace whose module is gone (e.g. ``torch.jit.load``) is refused with an error saying
so.
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from backends.common.artifact import DEFAULT_MAX_MEMORY, read_program, write_program
from backends.common.lower_pass import EXAMPLE_INPUTS_KEY, PROGRAM_KEY, Lower
from backends.common.program import Program
from backends.common.runtime import DEFAULT_THREADS, CompiledModel
from passes.base import Pass, PassContext
from passes.errors import PassFailure
from passes.instruments import Instrument
from passes.legalize import RESULT_KEY, Legalize
from passes.manager import run_pipeline
from passes.pipeline import Pipeline
from qir.frontend.record import Specialization, positional_inputs, same_outputs, trace_or_record
from qir.ir.graph import Graph, Node
from qir.ir.ops.core import Call
from qir.march import March, get_march
from qir.quantization.hybrid_compile import inline_cpu_modules
from qir.quantization.jit_source import TracedSourceError, traced_original
from qir.quantization.pipelines import PipelineArg, default_pipeline, resolve_pipeline

__all__ = ["CompileError", "CompiledModel", "compile_model", "compile_pipeline", "load_compiled"]

_INPUT_SOURCES = ("ddr", "pyramid", "resizer")


class CompileError(RuntimeError):
    """The model cannot be compiled: illegal on the march, or not lowerable (the message says which)."""


def _inputs(example_inputs: Any) -> tuple[Any, ...]:
    return positional_inputs(example_inputs)


def declared_shape(x: Any) -> Any:
    """What ``program.meta.input_shapes`` records for one example input: a tensor's shape, or for a
    list / tuple of tensors (an FPN head's ``feats``) ``{"items": [shape, ...]}``, which fixes its
    length as the traced forward did; None for anything else (not checked at run)."""
    if isinstance(x, torch.Tensor):
        return list(x.shape)
    if isinstance(x, (list, tuple)) and x and all(isinstance(t, torch.Tensor) for t in x):
        return {"items": [list(t.shape) for t in x]}
    return None


def _resolve(module: nn.Module) -> nn.Module:
    if isinstance(module, (torch.jit.ScriptModule, torch.jit.ScriptFunction)):
        if not isinstance(module, torch.jit.ScriptModule):
            raise CompileError("cannot compile a TorchScript function; pass the converted module")
        try:
            module = traced_original(module, "cannot compile")
        except TracedSourceError as e:
            raise CompileError(str(e)) from None
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"compile_model needs a converted nn.Module or its torch.jit.trace, got {type(module).__name__}"
        )
    return module


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


def compile_pipeline(pipeline: PipelineArg | None, march: str, opt: int = 2, check: bool = True) -> Pipeline:
    """The pipeline ``compile_model`` runs: ``pipeline`` (default: the compile stage's) with
    ``legalize{march}`` before the final ``lower`` when ``check`` (appended when the passes
    before ``lower`` do not end with one; ``check=False`` drops the default's), and
    ``lower{march,opt}`` appended when the pipeline does not end with a ``lower``."""
    if pipeline is None:
        body = [p for p in default_pipeline("compile", march) if not isinstance(p, Lower)]
        if not check:
            body = [p for p in body if not isinstance(p, Legalize)]
        return Pipeline((*body, Lower(march=march, opt=opt)))
    body = list(resolve_pipeline("compile", pipeline, march))
    last = body.pop() if body and isinstance(body[-1], Lower) else Lower(march=march, opt=opt)
    if check and not (body and isinstance(body[-1], Legalize)):
        body.append(Legalize(march=march))
    return Pipeline((*body, last))


class _RefuseIllegal(Instrument):
    """Stops the pipeline right after the legalize before ``lower`` when the model is illegal."""

    def __init__(self, legalize: Pass) -> None:
        self.legalize = legalize

    def run_after_pass(self, pass_: Pass, graph: Graph, ctx: PassContext, changed: bool) -> None:
        from qir.quantization import check as check_mod  # importing it registers how qir modules are checked

        result = ctx.options.get(RESULT_KEY)
        if pass_ is not self.legalize or result is None:
            return
        report = check_mod.report_from_result(result)
        if not report.ok:
            lines = [f"  {v.node} ({v.module or '-'}: {v.spelling}): {v.message}" for v in report.violations]
            raise CompileError(
                f"the model is not legal on {report.march} ({len(lines)} violation(s)); compile_model refuses "
                "it (check=False skips this check):\n" + "\n".join(lines)
            )


def _run_pipeline(
    root: nn.Module, inputs: tuple[Any, ...], march: str, pipe: Pipeline, check: bool, user_pipeline: bool
) -> tuple[Program, Specialization | None]:
    """Trace ``root`` (eval mode) to IR, run ``pipe`` and return the Program its ``lower`` stored
    (and, for a model fx cannot trace, what the path recorded on ``inputs`` specializes)."""
    subject = copy.deepcopy(root).eval() if root.training else root  # check and lower what is deployed
    graph, spec = trace_or_record(subject, inputs)
    _refuse_wrapped(graph, subject)
    ctx = PassContext(options={"march": march, EXAMPLE_INPUTS_KEY: inputs})
    legalize = pipe[len(pipe) - 2] if check and len(pipe) >= 2 and isinstance(pipe[len(pipe) - 2], Legalize) else None
    instruments = [_RefuseIllegal(legalize)] if legalize is not None else []
    try:
        # the traced graph is ours; a user's passes run on a copy, so one that writes into a
        # constant (a tensor of the user's model) is caught instead of changing the model
        run_pipeline(graph, pipe, instruments=instruments, ctx=ctx, inplace=not user_pipeline)
    except PassFailure as e:
        cause = e.__cause__
        if isinstance(e.pass_, Lower) and isinstance(cause, (ValueError, TypeError, NotImplementedError, RuntimeError)):
            raise CompileError(
                f"lowering {type(root).__name__} for {march}: {cause}{_float_tail_advice(graph, cause)}"
            ) from cause
        raise
    program = ctx.options.get(PROGRAM_KEY)
    if not isinstance(program, Program):
        raise CompileError(f"the compile pipeline {str(pipe)!r} ran no lower pass: it stored no Program")
    return program, spec


_FAILED_NODE = re.compile(r"node '([^']+)'")


def _float_tail_advice(graph: Graph, cause: BaseException) -> str:
    """For a lowering failure on float code after a DeQuantStub that the program's float part does
    not run (a function off its allowlist: ``torch.nonzero``, a library's NMS), what to do."""
    found = _FAILED_NODE.search(str(cause))
    node = next((n for n in graph.nodes if found and n.name == found.group(1)), None)
    if node is None:
        return ""
    if node.meta.get("is_wrapped"):  # torch.fx.wrap kept it whole: the split runs it after the program
        return (
            f". Node '{node.name}' calls a torch.fx.wrap-ed function, Python that a program's CPU float part "
            "(allow-listed torch functions, docs/backends.md 'The float part') cannot run. Compile the part before "
            "it and run it on its outputs: split = qir.quantization.split_wrapped_tail(model); program = "
            "compile_model(split.head, example_inputs); outputs = split.run(program, *inputs) (docs/hybrid.md, "
            "'Wrapped functions')"
        )
    dequant = _dequantized_ancestor(node)
    if dequant is None:
        return ""
    return (
        f". Node '{node.name}' ({node.op.name}) is float post-processing on the output of DeQuantStub "
        f"'{dequant.scope or dequant.name}' that a program's CPU float part cannot run: it runs the torch "
        "functions listed in docs/backends.md ('The float part': elementwise math, comparisons, reductions, "
        "topk / sort / gather, layout ops), never other code. Compile a model whose forward returns the "
        "DeQuantStub outputs (keep the post-processing in a module or function the deployed model leaves out, "
        "e.g. behind the seeds' `post_process is None` branch) and run it in torch on the program's outputs "
        "(docs/hybrid.md, 'Wrapped functions')"
    )


def _dequantized_ancestor(node: Node) -> Node | None:
    """The nearest DeQuantStub node whose float output ``node`` is computed from, if any."""
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        if n.name in seen:
            continue
        seen.add(n.name)
        if "dequant" in n.op.name:
            return n
        todo.extend(v for v in n.operands if isinstance(v, Node))
    return None


def _refuse_wrapped(graph: Graph, model: nn.Module) -> None:
    """``fx_helper.wrap``-ed calls are user Python run on the CPU, and a program never stores Python code."""
    from qir.quantization.wrapped_modules import modules_called_by
    from qir.quantization.wrapped_split import split_wrapped_tail
    from qir.utils.fx_helper import wrapped_original

    names, modules = [], []
    for n in graph.nodes:
        if isinstance(n.op, Call) and n.op.kind == "function":
            fn = graph.objects.get(n.op.target)
            if fn is not None and wrapped_original(fn) is not None:
                names.append(getattr(fn, "__qualname__", n.name))
                modules.extend(modules_called_by(fn))
    if not names:
        return
    inside = (
        f" The integer modules it calls ({', '.join(repr(m) for m in dict.fromkeys(modules))}) run between a "
        "quantize and a dequantize inside that Python, in torch; to compile them, call them in the traced forward "
        "instead."
        if modules
        else ""
    )
    how = (
        "Compile the part before them and run them on its outputs: split = "
        "qir.quantization.split_wrapped_tail(model); program = compile_model(split.head, example_inputs); "
        "outputs = split.run(program, *inputs), equal to the model's outputs bit for bit"
    )
    if not isinstance(model, torch.fx.GraphModule):  # an eager model: its forward is the user's code
        how = (
            "Compile the BPU part: a model whose forward returns what the wrapped function receives, and run the "
            "wrapped code on the program's outputs"
        )
    else:
        try:
            split_wrapped_tail(model)
        except ValueError as e:  # integer work reads a wrapped call's result: the split says what to do
            how = f"It cannot be split before them: {e}"
    raise CompileError(
        f"cannot compile the wrapped function(s) {', '.join(dict.fromkeys(names))}: code decorated with "
        "fx_helper.wrap is Python that runs on the CPU (on dequantized inputs), and a compiled program "
        f"holds integer kernels and allow-listed torch functions only, never Python code.{inside} {how} "
        "(docs/hybrid.md, 'Wrapped functions')"
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
    (never modified). ``example_inputs``: a tensor or a dict (the forward's one
    argument) or a list of the forward's positional arguments (fixes the shapes
    that some kernels' tables depend on; the batch size stays free). ``march`` defaults to
    the modules' march, then ``qir.march.get_march()``. ``opt >= 2`` times every exact
    engine of each conv / linear on the example inputs and keeps the fastest; ``opt`` 0/1
    take the march's preference order. ``input_source`` (``ddr`` / ``pyramid`` /
    ``resizer``, one per input) is recorded in the program. ``check`` runs
    ``check_model`` first and refuses an illegal model. Returns the runnable
    :class:`CompiledModel` (bit-exact with ``module``).

    ``pipeline``: the IR passes run on the converted model's IR (default
    ``qir.quantization.default_pipeline("compile", march)``: ``legalize``, then ``lower``);
    ``lower`` is appended when the pipeline does not end with one, and lowers the graph as the
    passes before it left it (docs/pipelines.md).
    """
    inputs = _inputs(example_inputs)
    level = int(str(opt).lstrip("Oo")) if isinstance(opt, str) else int(opt)
    sources = [input_source] * len(inputs) if isinstance(input_source, str) else list(input_source or [])
    for s in sources:
        if s not in _INPUT_SOURCES:
            raise ValueError(f"input_source {s!r} is unknown; valid: {', '.join(_INPUT_SOURCES)}")
    if sources and len(sources) != len(inputs):
        raise ValueError(f"input_source has {len(sources)} entries for {len(inputs)} input(s)")
    root = _resolve(module)
    root = inline_cpu_modules(root)  # a hybrid model's CPU part: the program's float part (hybrid_compile.py)
    march_name = _march_of(root, march)
    pipe = compile_pipeline(pipeline, march_name, level, check)
    prev = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        program, spec = _run_pipeline(root, inputs, march_name, pipe, check, pipeline is not None)
    finally:
        torch.set_num_threads(prev)
    program.meta.update(
        {
            "name": name or type(root).__name__,
            "input_source": sources or ["ddr"] * len(inputs),
            # checked on every call: a program lowered for one input size is only exact at that size
            "input_shapes": [declared_shape(x) for x in inputs],
            "torch": torch.__version__,
        }
    )
    if spec is not None:
        # recorded on the example inputs: the program says what it fixed, and the runtime holds it to those shapes
        program.meta.update({"specialized": spec.lines(), "exact_input_shapes": spec.exact_shapes})
    compiled = CompiledModel(program, num_threads=num_threads)
    if spec is not None:
        _check_recorded(root, compiled, inputs)
    if hbm is not None:
        write_program(program, hbm)
    return CompiledModel(program, num_threads=num_threads, source=str(hbm) if hbm is not None else "")


def _check_recorded(root: nn.Module, compiled: CompiledModel, inputs: tuple[Any, ...]) -> None:
    """A program lowered from a recorded path must reproduce the model on the inputs it was recorded on."""
    subject = copy.deepcopy(root).eval() if root.training else root
    with torch.no_grad():
        want = subject(*inputs)
    got = compiled(*inputs)
    if not same_outputs(got, want):
        raise CompileError(
            f"the program compiled from the path {type(root).__name__}'s forward took on the example inputs does not "
            "reproduce the model's output on them bit for bit; the recorded path does not stand for the model"
        )


def load_compiled(
    path: str | os.PathLike[str],
    num_threads: int | None = DEFAULT_THREADS,
    max_memory: int | None = DEFAULT_MAX_MEMORY,
) -> CompiledModel:
    """The callable stored in ``path``: float inputs in, the converted model's outputs out.

    Raises :class:`backends.common.artifact.ArtifactError` for a truncated, corrupted,
    newer-version or foreign file, and for one whose kernels' operands do not fit at its declared
    input shapes or that would need more than ``max_memory`` bytes there (default
    ``backends.common.artifact.DEFAULT_MAX_MEMORY``, 2 GiB; None: no bound). Loading reads data
    only; it never executes code from the file (docs/security.md).
    """
    return CompiledModel(read_program(Path(path), max_memory), num_threads=num_threads, source=str(path))
