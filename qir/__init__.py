"""qir: a compiler-style quantization toolkit for PyTorch (Horizon BPU: Bernoulli2, Bayes)."""

import importlib

from qir.march import March, get_march, set_march

__version__ = "0.1.0"

__all__ = ["March", "get_march", "set_march"]

# Seed code reaches submodules as attributes after `import qir as horizon`
# (`horizon.quantization.prepare_qat`, `horizon.nn.Exp`, `horizon.functional.rgb2centered_yuv`,
# `horizon.march.set_march`): import them on first use to keep `import qir` light.
_SUBMODULES = frozenset(
    {
        "quantization",
        "qconfig",
        "nn",
        "functional",
        "utils",
        "march",
        "frontend",
        "ir",
        "testing",
        "examples",
        "dtype",
        "qtensor",
    }
)


def __getattr__(name: str) -> object:
    if name in _SUBMODULES:
        return importlib.import_module(f"qir.{name}")
    if name == "load_compiled":
        # the runtime pulls in the kernels, so it too loads on first use
        from qir.quantization.compile import load_compiled

        return load_compiled
    raise AttributeError(f"module 'qir' has no attribute {name!r}")
