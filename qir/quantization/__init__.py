"""The public quantization API: observers, fake quant, qconfigs and stubs (seed-compatible names).

``qir.quantization.fake_quantize`` is the module (``fake_quantize.FakeQuantize``,
``fake_quantize.default_8bit_fake_quant``, as in the plugin); calling it calls the function
:func:`qir.quantization.fake_quantize.fake_quantize`.
"""

from qir.quantization.default_qconfig import get_default_qconfig
from qir.quantization.fake_quantize import (
    CalibFakeQuantize,
    FakeQuantize,
    FakeQuantState,
    default_8bit_fake_quant,
    default_16bit_fake_quant,
    default_weight_8bit_fake_quant,
    disable_fake_quant,
    disable_observer,
    enable_fake_quant,
    enable_observer,
    set_fake_quantize,
)
from qir.quantization.lsq import LSQFakeQuantize, PACTFakeQuantize
from qir.quantization.observer import (
    FixedScaleObserver,
    HistogramObserver,
    MinMaxObserver,
    ModuleFactory,
    MovingAverageMinMaxObserver,
    MovingAveragePerChannelMinMaxObserver,
    MovingAveragePerTensorMinMaxObserver,
    ObserverBase,
    PercentileObserver,
    nonfinite_report,
)
from qir.quantization.observer_search import KLObserver, MixObserver, MSEObserver
from qir.quantization.qconfig import (
    QConfig,
    as_qir_qconfig,
    default_calib_8bit_fake_quant_qconfig,
    default_calib_8bit_weight_32bit_out_fake_quant_qconfig,
    default_calib_16bit_fake_quant_qconfig,
    default_qat_8bit_fake_quant_qconfig,
    default_qat_8bit_weight_32bit_out_fake_quant_qconfig,
    default_qat_16bit_fake_quant_qconfig,
    get_default_calib_qconfig,
    get_default_qat_out_qconfig,
    get_default_qat_qconfig,
    qconfig_kind,
)
from qir.quantization.stubs import DeQuantStub, QuantStub

__all__ = [
    "CalibFakeQuantize",
    "DeQuantStub",
    "FakeQuantState",
    "FakeQuantize",
    "FixedScaleObserver",
    "HistogramObserver",
    "KLObserver",
    "LSQFakeQuantize",
    "MSEObserver",
    "MinMaxObserver",
    "MixObserver",
    "ModuleFactory",
    "MovingAverageMinMaxObserver",
    "MovingAveragePerChannelMinMaxObserver",
    "MovingAveragePerTensorMinMaxObserver",
    "ObserverBase",
    "PACTFakeQuantize",
    "PercentileObserver",
    "QConfig",
    "QuantStub",
    "as_qir_qconfig",
    "default_16bit_fake_quant",
    "default_8bit_fake_quant",
    "default_calib_16bit_fake_quant_qconfig",
    "default_calib_8bit_fake_quant_qconfig",
    "default_calib_8bit_weight_32bit_out_fake_quant_qconfig",
    "default_qat_16bit_fake_quant_qconfig",
    "default_qat_8bit_fake_quant_qconfig",
    "default_qat_8bit_weight_32bit_out_fake_quant_qconfig",
    "default_weight_8bit_fake_quant",
    "disable_fake_quant",
    "disable_observer",
    "enable_fake_quant",
    "enable_observer",
    "fake_quantize",
    "get_default_calib_qconfig",
    "get_default_qat_out_qconfig",
    "get_default_qat_qconfig",
    "get_default_qconfig",
    "nonfinite_report",
    "qconfig_kind",
    "set_fake_quantize",
]
from qir.quantization.calibration import fuse_conv_shared_modules, prepare_calibration
from qir.quantization.check import LegalityReport, Violation, check_model  # noqa: F401  (re-exported)

# -- the fx and eager flows (fuse / prepare / convert) ------------------------------------------
from qir.quantization.convert import convert_fx
from qir.quantization.eager import convert, fuse_known_modules, prepare_qat
from qir.quantization.fuse import fuse_fx
from qir.quantization.hybrid import HybridPlan, hybrid_placement
from qir.quantization.prepare import prepare_qat_fx

__all__ += [
    "HybridPlan",
    "convert",
    "convert_fx",
    "fuse_conv_shared_modules",
    "fuse_fx",
    "fuse_known_modules",
    "hybrid_placement",
    "prepare_calibration",
    "prepare_qat",
    "prepare_qat_fx",
]

# -- compile / load: converted model -> Program -> artifact (backends.common) -------------------
from qir.quantization.compile import CompileError, compile_model, load_compiled  # noqa: E402

__all__ += ["CompileError", "compile_model", "load_compiled"]

# -- static profile and picture of the lowered Program (backends.common.perf / visualize) -------
from qir.quantization.perf import perf_model  # noqa: E402
from qir.quantization.visualize import visualize_model  # noqa: E402

__all__ += ["perf_model", "visualize_model"]

# -- the IR pipeline each stage runs (prepare / convert / compile) -------------------------------
from qir.quantization.pipelines import STAGES, default_pipeline  # noqa: E402

__all__ += ["STAGES", "default_pipeline"]

# -- validation runs the integer twin (docs/semantics.md "Validation is the deployed model") -------
from qir.quantization.exact_validation import QATGraphModule, set_exact_validation  # noqa: E402
from qir.quantization.fake_quantize import float_fake_quant  # noqa: E402
from qir.quantization.integer_grid import integer_grid_report, set_integer_grid  # noqa: E402

__all__ += ["QATGraphModule", "float_fake_quant", "integer_grid_report", "set_integer_grid", "set_exact_validation"]

# -- checkpoints without the input stubs of modules wrapped methods call (the plugin's) --------------
from qir.quantization.wrapped_checkpoints import calibrate_wrapped_inputs  # noqa: E402

__all__ += ["calibrate_wrapped_inputs"]

# -- a converted model cut before its wrapped calls: a head to compile, the wrapped Python after it ------
from qir.quantization.wrapped_split import WrappedSplit, split_wrapped_tail  # noqa: E402

__all__ += ["WrappedSplit", "split_wrapped_tail"]
