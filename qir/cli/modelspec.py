"""``package.module:factory`` / ``path/to/file.py:factory``: load a user's model for the CLI.

The factory is called with no arguments and must return an ``nn.Module``: a float model,
a QAT model (``prepare_qat_fx`` result) or a converted one (``convert_fx`` / ``convert``).
An ``nn.Module`` instance named instead of a factory is used as it is.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import sys
import types
from pathlib import Path

from torch import nn

from qir.cli.errors import UserError

FLOAT, QAT, CONVERTED = "float", "qat", "converted"

_FORMAT = "give the model as package.module:factory or path/to/file.py:factory"


def split_spec(spec: str) -> tuple[str, str]:
    """``"a/b.py:make"`` -> ``("a/b.py", "make")``."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name or not name.replace(".", "_").isidentifier():
        raise UserError(f"model {spec!r} names no factory: {_FORMAT}, e.g. torchvision.models:resnet18")
    return where, name


def _import_file(path: Path) -> types.ModuleType:
    if not path.is_file():
        raise UserError(f"model file '{path}' does not exist: {_FORMAT}")
    name = f"qir_cli_model_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise UserError(f"model file '{path}' cannot be imported as Python (name it *.py)")
    module = importlib.util.module_from_spec(spec)
    # As `python file.py` does: the file's folder is importable, so it can import its neighbours.
    sys.path.insert(0, str(path.resolve().parent))
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(name, None)
        raise UserError(f"importing model file '{path}' failed: {type(e).__name__}: {e}") from None
    finally:
        sys.path.remove(str(path.resolve().parent))
    return module


def _import_module(dotted: str) -> types.ModuleType:
    try:
        return importlib.import_module(dotted)
    except ModuleNotFoundError as e:
        hint = "is it installed in this Python?" if e.name == dotted.split(".")[0] else "check the module path"
        raise UserError(f"cannot import model module '{dotted}': {e} ({hint}; {_FORMAT})") from None
    except Exception as e:
        raise UserError(f"importing model module '{dotted}' failed: {type(e).__name__}: {e}") from None


def load_model(spec: str) -> nn.Module:
    """Import the module named by ``spec``, call its factory, check it returned an ``nn.Module``."""
    where, name = split_spec(spec)
    is_file = where.endswith(".py") or "/" in where or "\\" in where
    module = _import_file(Path(where)) if is_file else _import_module(where)
    obj: object = module
    for part in name.split("."):
        if not hasattr(obj, part):
            public = sorted(n for n, v in vars(obj).items() if callable(v) and not n.startswith("_"))
            close = difflib.get_close_matches(part, public, n=5) or public[:8]
            hint = f"did you mean: {', '.join(close)}" if close else "it defines nothing callable"
            raise UserError(f"'{where}' has no attribute '{name}' ({hint})")
        obj = getattr(obj, part)
    if isinstance(obj, nn.Module):
        return obj
    if not callable(obj):
        raise UserError(
            f"'{spec}' is a {type(obj).__name__}, not a factory: name a function or class that returns an nn.Module"
        )
    try:
        model = obj()
    except Exception as e:
        raise UserError(f"factory '{spec}' raised {type(e).__name__}: {e}") from None
    if not isinstance(model, nn.Module):
        raise UserError(f"factory '{spec}' returned a {type(model).__name__}, not a torch nn.Module")
    return model


def model_kind(model: nn.Module) -> str:
    """``converted`` (holds qir quantized modules), ``qat`` (holds QAT modules) or ``float``."""
    from qir.nn.qat._base import QATModule
    from qir.nn.quantized._base import QuantizedModule

    mods = list(model.modules())
    if any(isinstance(m, QuantizedModule) for m in mods):
        return CONVERTED
    if any(isinstance(m, QATModule) for m in mods):
        return QAT
    return FLOAT
