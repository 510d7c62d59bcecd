"""Graph passes and the machinery that runs them.

    import passes
    result = passes.run_pipeline(graph, "absorb-bn,fuse,dce", instruments=[passes.TimingInstrument()])

Importing this package loads no pass modules: built-in passes are imported when a
pipeline first names them (``passes.registry.BUILTIN_PASSES``).
"""

from passes.base import PASS_REGISTRY, Pass, PassContext, PassRecord, register_pass
from passes.describe import describe_passes
from passes.errors import PassFailure, PassVerificationFailure, PipelineError
from passes.instruments import (
    DumpIRInstrument,
    Instrument,
    PrintIRInstrument,
    TimingInstrument,
    VerifyInstrument,
)
from passes.manager import PassManager, PipelineResult, run_pipeline
from passes.pipeline import Pipeline, format_pipeline, parse_pipeline
from passes.plugins import ENTRY_POINT_GROUP, load_pass_module
from passes.registry import BUILTIN_PASSES, available_passes, get_pass_class

__all__ = [
    "ENTRY_POINT_GROUP",
    "BUILTIN_PASSES",
    "PASS_REGISTRY",
    "DumpIRInstrument",
    "Instrument",
    "Pass",
    "PassContext",
    "PassFailure",
    "PassManager",
    "PassRecord",
    "PassVerificationFailure",
    "Pipeline",
    "PipelineError",
    "PipelineResult",
    "PrintIRInstrument",
    "TimingInstrument",
    "VerifyInstrument",
    "available_passes",
    "describe_passes",
    "format_pipeline",
    "get_pass_class",
    "load_pass_module",
    "parse_pipeline",
    "register_pass",
    "run_pipeline",
]
