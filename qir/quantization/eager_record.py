"""Eager ``convert`` without an fx trace: which quantized output feeds each QAT module call.

Eager mode exists for models fx cannot trace (data-dependent control flow, Python loops over
sizes, ...), so ``convert`` cannot always learn the module graph by tracing. ``prepare_qat``
therefore makes every forward of the QAT model record it:

* each QAT module's output is tagged with its producer (``(path, output index)``), a plain
  attribute on the tensor object; a scale-preserving module (ReLU, Identity, ...) passes its
  input's tag on, a ``DeQuantStub`` returns an untagged alias;
* while the model's forward runs, a ``TorchFunctionMode`` passes tags through the torch
  functions that keep values and scale (view, reshape, flatten, permute, getitem, relu, max
  pool, ...). Any other torch function applied to a tagged tensor outside a QAT module would
  compute on integer codes after conversion: it is recorded as a problem, and ``convert``
  refuses the model naming it (as the fx path does);
* each QAT module call records the producers of its tensor arguments (one entry per distinct
  call site), separately for training- and eval-mode forwards (``self.training`` branches).

``convert`` reads the records: a module's input scales are its producers' output scales
(:func:`convert_recorded`). The recording is a dictionary lookup and an attribute write per
torch call in the forward (no extra tensor work); the converted model does not record.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from qir.quantization.outer_forward import OuterForward
from qir.quantization.scale_ops import scales_differ

__all__ = [
    "PRESERVING",
    "SOURCES",
    "VERSION",
    "Source",
    "convert_recorded",
    "functional_call",
    "has_own_observer",
    "has_records",
    "install",
    "shared_observer_message",
    "uninstall",
]

#: tensor attribute: the producing QAT module's path and output index
TAG = "_qir_source"
#: QAT module attribute: {"train"/"eval": [call site: tuple of source-or-None per tensor argument]}
SOURCES = "_qir_input_sources"
#: QAT module attribute: its path in the prepared model
PATH = "_qir_path"
#: root attribute: {"train"/"eval": [problem messages]}
PROBLEMS = "_qir_eager_problems"
#: root attribute: how many call sites its forwards have recorded (grid bindings follow it: eager_grid.py)
VERSION = "_qir_records_version"

Source = tuple[str, int]

# torch functions that keep values and scale: applied to codes they give the converted values
PRESERVING_NAMES = (
    "view",
    "view_as",
    "reshape",
    "reshape_as",
    "flatten",
    "unflatten",
    "permute",
    "transpose",
    "t",
    "contiguous",
    "squeeze",
    "unsqueeze",
    "expand",
    "expand_as",
    "repeat",
    "flip",
    "roll",
    "chunk",
    "split",
    "unbind",
    "narrow",
    "select",
    "clone",
    "detach",
    "__getitem__",
    "relu",
)


def _functions(names: tuple[str, ...]) -> set[Any]:
    """The tensor methods and torch functions of these names."""
    return {f for name in names for owner in (torch.Tensor, torch) if (f := getattr(owner, name, None)) is not None}


PRESERVING: set[Any] = _functions(PRESERVING_NAMES)
#: of those, the ones that keep a tensor's layout as well as its values (a per-channel scale's axis stays valid)
KEEPS_LAYOUT: set[Any] = _functions(("contiguous", "clone", "detach"))
PRESERVING |= {F.relu, F.max_pool1d, F.max_pool2d, F.max_pool3d, F.adaptive_max_pool2d, F.dropout, F.dropout2d}
# reads that give no tensor on the value grid (sizes, dtypes, indices of a maximum)
_NEUTRAL: set[Any] = {
    torch.Tensor.size,
    torch.Tensor.dim,
    torch.Tensor.numel,
    torch.Tensor.__len__,
    torch.Tensor.is_floating_point,
    torch.Tensor.argmax,
    torch.Tensor.argmin,
    torch.argmax,
    torch.argmin,
    torch.Tensor.__repr__,
    torch.Tensor.__format__,
}


def _mode(root: nn.Module) -> str:
    return "train" if root.training else "eval"


def _tag_of(t: Any) -> Source | None:
    return t.__dict__.get(TAG) if isinstance(t, torch.Tensor) else None


def _tensors(args: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []

    def visit(a: Any) -> None:
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            for x in a:
                visit(x)
        elif isinstance(a, Mapping):
            for x in a.values():
                visit(x)

    visit(args)
    return found


def _first_tag(args: Any) -> Source | None:
    for t in _tensors(args):
        src = _tag_of(t)
        if src is not None:
            return src
    return None


def _set_tag(out: Any, src: Source | Callable[[int], Source]) -> None:
    """Tag ``out`` (a tensor, or each tensor of a tuple / list: output ``i`` gets ``src(i)``)."""
    if isinstance(out, torch.Tensor):
        out.__dict__[TAG] = src(0) if callable(src) else src
    elif isinstance(out, (list, tuple)):
        for i, o in enumerate(out):
            if isinstance(o, torch.Tensor):
                o.__dict__[TAG] = src(i) if callable(src) else src


def _func_name(func: Any) -> str:
    owner = getattr(func, "__objclass__", None) or getattr(func, "__self__", None)
    name = str(getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func)))
    if isinstance(owner, type) and "." not in name:
        return f"{owner.__name__}.{name}"
    module = getattr(func, "__module__", None)
    return f"{module}.{name}" if module and "." not in name else str(name)


class _Recorder(TorchFunctionMode):
    """Active during the QAT model's forward: passes tags on, records ops on codes."""

    def __init__(self, root: nn.Module) -> None:
        super().__init__()
        self.root = root
        self.depth = 0  # > 0 inside a QAT module (its own arithmetic is what convert replaces)
        self.calls: dict[str, int] = {}  # QAT module path -> calls in this forward

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.depth:
            return out
        src = _first_tag((args, kwargs))
        if src is None:
            return out
        if func in PRESERVING:
            _set_tag(out, src)
        elif not (func in _NEUTRAL or getattr(func, "__name__", "") == "__get__"):
            problems = self.root.__dict__.setdefault(PROBLEMS, {}).setdefault(_mode(self.root), [])
            what = f"{_func_name(func)} runs on the output of module '{src[0]}', which is integer codes after convert"
            if what not in problems:
                problems.append(what)
        return out


def has_own_observer(m: nn.Module) -> bool:
    """Whether QAT module ``m`` observes its output (a range learned from its calls)."""
    from qir.quantization.fake_quantize import FakeQuantize

    fq = getattr(m, "activation_post_process", None)
    return isinstance(fq, FakeQuantize) and not fq.has_fixed_scale


def shared_observer_message(m: nn.Module, path: str, calls: int | None = None) -> str:
    """Why eager mode refuses module ``m`` at ``path`` called at several places, and the fixes."""
    where = f"at {calls} places" if calls is not None else "more than once"
    return (
        f"module '{path}' ({type(m).__name__}) is called {where} in one forward; eager prepare_qat gives a module "
        "one output observer, which would quantize every call with the widest call's range, and its quantized "
        "form has one input scale. Give each call its own module (e.g. copy.deepcopy it into an nn.ModuleList), "
        "or prepare with prepare_qat_fx, which gives each call site its own output observer and keeps the "
        "weights shared"
    )


def _enter(m: nn.Module, args: Any) -> None:
    rec = _OUTER.active
    if rec is None:
        return
    if rec.depth == 0:
        path = m.__dict__.get(PATH, "")
        rec.calls[path] = rec.calls.get(path, 0) + 1
        if rec.calls[path] == 2 and has_own_observer(m):
            # a model fx cannot trace: prepare_qat could not find the shared module, its first forward does
            raise ValueError(shared_observer_message(m, path))
        site = tuple(_tag_of(t) for t in _tensors(args))
        sites = m.__dict__.setdefault(SOURCES, {}).setdefault(_mode(rec.root), [])
        if site not in sites:
            sites.append(site)
            rec.root.__dict__[VERSION] = rec.root.__dict__.get(VERSION, 0) + 1
    rec.depth += 1


def _exit(m: nn.Module, args: Any, out: Any) -> Any:
    from qir.quantization.convert import _is_dequant_stub

    rec = _OUTER.active
    if rec is None:
        return None
    rec.depth -= 1
    if rec.depth:
        return None
    if _is_dequant_stub(m):
        if isinstance(out, torch.Tensor) and TAG in out.__dict__:
            out = out.view_as(out)  # the input stays tagged for its other readers; the alias is float
            out.__dict__.pop(TAG, None)
            return out
        return None
    if getattr(m, "is_scale_preserving", False):
        src = _first_tag(args)
        if src is not None:
            _set_tag(out, src)
        return None
    path = m.__dict__.get(PATH, "")
    _set_tag(out, lambda i: (path, i))
    return None


def _pre_hook(m: nn.Module, args: Any) -> None:
    _enter(m, args)


def _post_hook(m: nn.Module, args: Any, out: Any) -> Any:
    return _exit(m, args, out)


_OUTER = OuterForward(_Recorder)  # a nested call of the root: the outer forward records


def _root_pre_hook(root: nn.Module, args: Any) -> None:
    _OUTER.enter(root)


def _root_post_hook(root: nn.Module, args: Any, out: Any) -> None:
    _OUTER.leave(root)


def functional_call(m: nn.Module, fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    """A QAT FloatFunctional method call (not a module call, so no hooks): recorded like one."""
    if _OUTER.active is None:
        return fn(m, *args, **kwargs)
    _enter(m, (args, kwargs))
    out = None
    try:
        out = fn(m, *args, **kwargs)
    finally:
        replaced = _exit(m, (args, kwargs), out)
    return out if replaced is None else replaced


def install(root: nn.Module, paths: Sequence[str]) -> None:
    """Make ``root``'s forwards record (``paths``: its QAT modules)."""
    uninstall(root)
    for path in paths:
        m = root.get_submodule(path)
        m.__dict__[PATH] = path
        m.register_forward_pre_hook(_pre_hook)
        m.register_forward_hook(_post_hook, always_call=True)
    root.register_forward_pre_hook(_root_pre_hook)
    root.register_forward_hook(_root_post_hook, always_call=True)


def uninstall(root: nn.Module) -> None:
    """Remove the recording hooks from ``root`` and its modules (the converted model does not record)."""
    for m in root.modules():
        for hooks in (m._forward_pre_hooks, m._forward_hooks):
            for key, fn in list(hooks.items()):
                if fn in (_pre_hook, _post_hook, _root_pre_hook, _root_post_hook):
                    del hooks[key]
                    m._forward_hooks_always_called.pop(key, None)


def has_records(root: nn.Module) -> bool:
    return any(SOURCES in m.__dict__ for m in root.modules())


def convert_recorded(root: nn.Module, march: Any, mapping: Mapping[type, type] | None, error: type[Exception]) -> None:
    """Swap the recorded QAT modules of ``root`` for integer ones, scales from the records.

    Eval-mode records are used when there are any (what the converted model computes), else
    training-mode ones. ``error`` is the exception class to raise (ConvertError)."""
    from qir.quantization.convert import (
        _is_dequant_stub,
        _is_qat_module,
        _is_quant_stub,
        _out_scale_of_qat,
        per_call_dequant_stub,
        quantized_class_for,
        tag_scales,
    )
    from qir.quantization.multi_output import multi_output_scales
    from qir.quantization.prepare import set_submodule
    from qir.quantization.stubs import DeQuantStub as FloatDeQuantStub

    modes = ("eval", "train")
    mode = next((k for k in modes if any(k in m.__dict__.get(SOURCES, {}) for m in root.modules())), "eval")
    problems = root.__dict__.get(PROBLEMS, {}).get(mode, [])
    if problems:
        raise error(
            f"{problems[0]}: an eager forward cannot be rewritten, so this op would compute on codes. Use a module "
            "with a quantized form (a FloatFunctional method, nn.ReLU6, qir.nn.Interpolate, ...) or call a "
            "DeQuantStub before it" + (f" ({len(problems) - 1} more such op(s))" if len(problems) > 1 else "")
        )
    records: dict[str, list[tuple[Source | None, ...]]] = {}
    for path, m in root.named_modules():
        sites = m.__dict__.get(SOURCES, {}).get(mode)
        if sites and _is_qat_module(m):
            records[path] = sites
    built: dict[str, nn.Module] = {}
    resolving: set[str] = set()

    def scale_of(src: Source) -> torch.Tensor:
        path, index = src
        m = root.get_submodule(path)
        outs = multi_output_scales(m)
        if outs is not None:
            s = outs[index][0]
        else:
            s = _out_scale_of_qat(m, inputs(path))
            if s is None:  # a high-precision output: the integer module knows its scale
                q_scale = getattr(build(path), "scale", None)
                if not isinstance(q_scale, torch.Tensor):
                    raise error(f"module '{path}' ({type(m).__name__}) gives no output scale to its consumers")
                s = q_scale.detach().clone()
        if s is None:
            raise error(f"module '{path}' ({type(m).__name__}) gives no output scale to its consumers")
        return s

    def inputs(path: str) -> list[torch.Tensor]:
        m = root.get_submodule(path)
        if _is_quant_stub(m):
            return []
        allowed = set(getattr(m, "float_inputs", ()))
        per_site: list[list[torch.Tensor]] = []
        for site in records.get(path, []):
            scales = []
            for i, src in enumerate(site):
                if src is None:
                    if i in allowed or _is_dequant_stub(m):
                        continue
                    raise error(
                        f"module '{path}' ({type(m).__name__}) receives a float tensor (tensor argument {i}); "
                        "quantized modules take quantized inputs: put a QuantStub in front of it"
                    )
                scales.append(scale_of(src))
            per_site.append(scales)
        if not per_site:
            return []
        if scales_differ(per_site):
            raise error(
                f"module '{path}' is called at several places with different input scales; a quantized module "
                "has fixed input scales. prepare_qat_fx gives every call site its own module (docs/qconfig.md, "
                "'Modules called at several places'); in eager mode, use one module instance per call site"
            )
        return per_site[0]

    def build(path: str) -> nn.Module:
        if path in built:
            return built[path]
        if path in resolving:
            raise error(f"module '{path}' feeds its own input (a cycle in the recorded calls)")
        resolving.add(path)
        m = root.get_submodule(path)
        cls = quantized_class_for(m, mapping)
        if cls is None:
            raise error(f"module '{path}' ({type(m).__name__}) has no quantized class in QUANTIZED_MODULE_MAP")
        try:
            built[path] = cls.from_qat(m, inputs(path), march)  # type: ignore[attr-defined]
        except (ValueError, TypeError) as e:
            raise error(f"converting module '{path}' ({type(m).__name__}): {e}") from e
        resolving.discard(path)
        return built[path]

    def sites_differ(path: str) -> bool:
        """Whether DeQuantStub ``path`` dequantizes outputs of different scales (codes, or codes and floats)."""
        sites = [[scale_of(src) for src in site if src is not None] for site in records[path]]
        return scales_differ(sites)

    swaps: dict[str, nn.Module] = {}
    per_call: list[str] = []
    for path in records:
        m = root.get_submodule(path)
        if _is_dequant_stub(m) and all(src is None for site in records[path] for src in site):
            swaps[path] = FloatDeQuantStub()  # float in, float out
        elif _is_dequant_stub(m) and sites_differ(path):
            swaps[path] = per_call_dequant_stub(path)  # one stub for outputs of different scales: the scale travels
            per_call.append(path)
        else:
            swaps[path] = build(path)
    for path, q in swaps.items():
        q.train(False)
        set_submodule(root, path, q)
    uninstall(root)
    if per_call:
        tag_scales(root)
