"""qir: a compiler-style quantization toolkit for PyTorch (Horizon BPU: Bernoulli2, Bayes)."""

from qir.march import March, get_march, set_march

__version__ = "0.1.0"

__all__ = ["March", "get_march", "set_march"]


def __getattr__(name: str) -> object:
    # Seed code reaches submodules as attributes (`horizon.quantization.prepare_qat`,
    # `horizon.qconfig.default_...`); import them on first use to keep `import qir` light.
    if name in ("quantization", "qconfig"):
        import importlib

        return importlib.import_module(f"qir.{name}")
    raise AttributeError(f"module 'qir' has no attribute {name!r}")


_base_getattr = __getattr__


def __getattr__(name: str) -> object:  # type: ignore[no-redef]
    # qir.load_compiled: imported on first use (the runtime pulls in the kernels)
    if name == "load_compiled":
        from qir.quantization.compile import load_compiled

        return load_compiled
    return _base_getattr(name)
