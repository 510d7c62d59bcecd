"""The IR pipelines the public API runs, one per stage, and how a ``pipeline=`` argument is read.

    qir.quantization.default_pipeline("prepare")          # fuse{force_bn=true},dce,insert-observers
    qir.quantization.default_pipeline("convert", "bayes")  # quantize{march=bayes}
    qir.quantization.default_pipeline("compile", "bayes")  # legalize{march=bayes},lower{march=bayes}
    prepare_qat_fx(model, qconfig_dict, x, pipeline="fuse{force_bn=true},dce,insert-observers,my-pass")

Where each stage runs its pipeline (docs/pipelines.md):

* ``prepare`` (``prepare_qat_fx``, ``fuse_fx``): on the traced float model's IR. The passes
  before ``insert-observers`` see the float layers; ``prepare_qat_fx`` then fills in
  ``insert-observers``' options (each module's resolved qconfig, the call sites of modules
  called twice), the pass turns the layers into QAT ops, the passes after it see those, and
  the result is emitted as the trainable model. A model with a layer the pass does not
  cover is prepared whole by module swapping instead (``meta["qir.prepare_path"]`` says
  why) and the passes after ``insert-observers`` run on its IR. ``insert-observers`` is
  appended when a ``pipeline=`` leaves it out; ``fuse_fx`` skips it. A pass here changes
  what is trained, converted and deployed.
* ``convert`` (``convert_fx``): on the QAT model's IR; ``quantize`` turns its QAT ops into
  integer ops, and the result is emitted. A model the pass does not cover converts by module
  swapping, and the passes besides ``quantize`` run on the converted model's IR.
* ``compile`` (``compile_model``): on the IR of the converted model; ``legalize`` checks
  it against the march's operator table and ``lower`` (the last pass) turns the graph as
  the passes before it left it into the Program of integer kernels.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal, TypeAlias

from backends.common.lower_pass import Lower
from passes.base import Pass
from passes.dce import DeadCodeElimination
from passes.fuse import Fuse
from passes.insert_observers import InsertObservers
from passes.legalize import Legalize
from passes.manager import PipelineResult, run_pipeline
from passes.pipeline import Pipeline, as_pipeline
from passes.quantize import Quantize
from qir.ir.graph import Graph
from qir.ir.verifier import VerifyError, verify
from qir.march import March

__all__ = [
    "STAGES",
    "PipelineArg",
    "Stage",
    "default_pipeline",
    "resolve_pipeline",
    "run_stage_pipeline",
    "split_at_observers",
    "without_observers",
]

Stage: TypeAlias = Literal["prepare", "convert", "compile"]
#: the stages that run a pipeline, in flow order
STAGES: tuple[Stage, ...] = ("prepare", "convert", "compile")
#: what a ``pipeline=`` argument accepts: pipeline text, a Pipeline, one pass or a list of passes
PipelineArg: TypeAlias = Pipeline | str | Pass | Iterable[Pass]


def _march_name(march: Any) -> str | None:
    if march is None:
        from qir.march import get_march

        march = get_march(None)
        if march is None:
            return None
    return March.parse(march).value


def default_pipeline(stage: str, march: Any = None) -> Pipeline:
    """The pipeline ``stage`` runs when no ``pipeline=`` is given; ``str()`` of it parses back.

    ``march`` (a :class:`~qir.march.March` or its name; default: the current march) only
    matters for ``"compile"``, whose ``legalize`` checks that march's operator table and whose
    ``lower`` emits that march's kernels.
    """
    if stage == "prepare":
        # batch norms always fold (force_bn): a conv's BN is absorbed even when it is
        # followed by an op the conv cannot fuse, as the plugin's fuser does
        return Pipeline((Fuse(absorb_bn=True, force_bn=True), DeadCodeElimination(), InsertObservers()))
    if stage == "convert":
        return Pipeline((Quantize(march=_march_name(march)),))
    if stage == "compile":
        name = _march_name(march)
        return Pipeline((Legalize(march=name), Lower(march=name)))
    raise ValueError(f"unknown pipeline stage {stage!r}; the stages are {', '.join(STAGES)}")


def resolve_pipeline(stage: str, pipeline: PipelineArg | None, march: Any = None) -> Pipeline:
    """``pipeline`` as a :class:`Pipeline` (text is parsed, so a typo fails here, naming the
    spot), or the stage's default when it is None."""
    if pipeline is None:
        return default_pipeline(stage, march)
    try:
        return as_pipeline(pipeline)
    except TypeError as e:
        raise TypeError(
            f"pipeline= of the {stage} stage must be pipeline text, a passes.Pipeline, a pass or a list of passes: {e}"
        ) from None


def split_at_observers(pipeline: Pipeline) -> tuple[Pipeline, InsertObservers, Pipeline]:
    """The passes before ``insert-observers``, the pass, and the passes after it (the pass with
    default options, and nothing after it, when ``pipeline`` leaves it out: observers always go in)."""
    at = next((i for i, p in enumerate(pipeline.passes) if isinstance(p, InsertObservers)), None)
    if at is None:
        return pipeline, InsertObservers(), Pipeline(())
    rest = pipeline.passes[at + 1 :]
    extra = next((p for p in rest if isinstance(p, InsertObservers)), None)
    if extra is not None:
        raise ValueError(f"the prepare pipeline {pipeline} names insert-observers twice; observers go in once")
    observe = pipeline.passes[at]
    assert isinstance(observe, InsertObservers)
    return Pipeline(pipeline.passes[:at]), observe, Pipeline(rest)


def without_observers(pipeline: Pipeline) -> Pipeline:
    """``pipeline`` without its ``insert-observers`` passes (what fusion alone runs)."""
    return Pipeline(tuple(p for p in pipeline.passes if not isinstance(p, InsertObservers)))


#: top-level packages whose passes are qir's own: tested pass by pass (tests/passes), so a stage
#: pipeline made of them only is verified once, at its end
_BUILTIN_PACKAGES = frozenset({"passes", "backends", "qir"})


def builtin_only(pipeline: Pipeline) -> bool:
    """Every pass of ``pipeline`` is one of qir's own (defined under passes/, backends/ or qir/)."""
    return all(type(p).__module__.partition(".")[0] in _BUILTIN_PACKAGES for p in pipeline.passes)


def run_stage_pipeline(
    graph: Graph, pipeline: Pipeline, stage: str, typed: bool, inplace: bool = False
) -> PipelineResult:
    """Run a stage's ``pipeline`` on ``graph`` and return the :class:`passes.PipelineResult`.

    ``typed``: the graph's types are real shapes (example inputs typed it), so the result is
    verified. A pipeline of qir's own passes is verified once, after its last pass (each
    verify walks the whole graph; ``tests/passes`` check every built-in pass keeps a graph
    valid); a pipeline holding a pass of the user's is verified before and after every pass,
    so a failure names the pass that broke the graph.
    """
    each = typed and not builtin_only(pipeline)
    result = run_pipeline(graph, pipeline, verify_each=each, inplace=inplace)
    if typed and not each:
        try:
            verify(result.graph)
        except VerifyError as e:
            raise VerifyError(
                f"the {stage} pipeline {pipeline} left a graph that does not verify: {e}; run "
                "passes.run_pipeline(graph, pipeline) on the traced graph to find the pass",
                e.node,
            ) from e
    return result


def run_on_module(module: Any, pipeline: Pipeline, example_inputs: Any, ctx: Any = None) -> tuple[Any, Any]:
    """Trace ``module`` (an ``nn.Module``, in eval mode) to IR and run ``pipeline`` on it.

    Returns ``(emitted, result)``: ``emitted`` is a GraphModule of the rewritten graph when
    some pass reported a change (None otherwise: the module already is the graph's meaning),
    ``result`` the :class:`passes.PipelineResult`. ``example_inputs`` types the IR (optional:
    without it values are typed by rank only and the type verifier is skipped).
    """
    import torch.fx

    from passes.base import PassContext
    from passes.manager import run_pipeline
    from qir.frontend import emit, trace

    inputs: Any = () if example_inputs is None else example_inputs
    graph = trace(module, inputs)
    result = run_pipeline(
        graph, pipeline, ctx=ctx if ctx is not None else PassContext(), verify_each=example_inputs is not None
    )
    if not result.any_changed:
        return None, result
    gm = emit(result.graph, class_name=type(module).__name__)
    if isinstance(module, torch.fx.GraphModule):
        gm.meta.update(module.meta)
    gm.train(module.training)
    return gm, result
