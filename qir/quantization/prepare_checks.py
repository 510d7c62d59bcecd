"""Refusals at prepare time of what convert_fx would refuse only after training.

Found at convert, these cost the user a calibration and a training run; ``prepare_qat_fx`` walks
the prepared graph once and names the module and the fix before the first step:

- an einsum on quantized tensors that is not a batched matmul (prepare rewrites those as a
  FloatFunctional ``matmul``; any other equation has no integer form);
- a high-precision output (a conv / linear whose qconfig has no output fake quant, such as
  ``get_default_qat_out_qconfig()``: qint32 codes with one scale per channel) feeding anything
  but a DeQuantStub, e.g. ``torch.cat`` of detection head outputs: a quantized module takes
  one input scale;
- a float parameter or buffer of the model (a learned bias, a positional embedding, a fixed mask)
  read by a quantized op next to quantized tensors, e.g. ``ff.add(attn, self.rel_bias)``: QAT
  would train with the float tensor unquantized and convert has no scale for it. A QuantStub in
  front of it gives it one, learned like any other;
- the float result of a function registered with ``torch.fx.wrap`` (torchvision's Swin helpers) read by
  a quantized layer: the call runs in float as an ``fx_helper.wrap``'ed one does, and nothing gives its
  result a scale (``hybrid=True`` puts a generated QuantStub after it);
- a quantized value at an argument a QAT module takes in float (``float_inputs``: an attention
  mask behind a QuantStub, RoIAlign's boxes): its integer form has no input scale for it.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from typing import Any

import torch
import torch.fx
from torch import nn

from backends.common.numerics import requant_limits
from qir.ir.numerics import qdtype
from qir.quantization.scale_ops import (
    PRESERVING_FUNCTIONS,
    PRESERVING_METHODS,
    PRESERVING_MODULES,
    QUERY_FUNCTIONS,
    QUERY_METHODS,
    module_self,
)
from qir.utils.fx_helper import torch_fx_wrapped, wrapped_original

__all__ = ["UnconvertibleModelError", "check_convertible", "collected_refusals", "float_module_on_codes"]


class UnconvertibleModelError(ValueError):
    """prepare_qat_fx found something convert_fx would refuse; the message names it and the fix."""

    def __init__(self, message: str, where: str = "") -> None:
        super().__init__(message)
        #: the module path or node at fault
        self.where = where


_COLLECTING: ContextVar[list[UnconvertibleModelError] | None] = ContextVar("qir_collect_refusals", default=None)


@contextlib.contextmanager
def collected_refusals() -> Iterator[list[UnconvertibleModelError]]:
    """Within this context :func:`check_convertible` appends its refusals to the yielded list
    instead of raising the first, so ``check_qconfig`` can report them with its other findings."""
    found: list[UnconvertibleModelError] = []
    token = _COLLECTING.set(found)
    try:
        yield found
    finally:
        _COLLECTING.reset(token)


def _refuse(where: str, message: str) -> None:
    err = UnconvertibleModelError(message, where)
    found = _COLLECTING.get()
    if found is None:
        raise err
    found.append(err)


_EINSUM_FIX = (
    "only a batched-matmul einsum has an integer form (two operands, the same leading letters, one "
    "contracted letter: 'bhqd,bhkd->bhqk', 'bij,bjk->bik'): write this one as torch.matmul after "
    "permute / reshape, or put a DeQuantStub before it (or move it into an fx_wrap'ed function) to run it in float"
)
_LATER = "convert_fx would refuse it after training: fix it before calibrating or training"


def check_convertible(
    gm: torch.fx.GraphModule,
    owners: Mapping[str, tuple[str, str]],
    float_qconfig: Callable[[str, nn.Module], Any] | None = None,
    march: str | None = None,
) -> None:
    """Raise :class:`UnconvertibleModelError` if prepared ``gm`` holds one of the module docstring's cases.

    ``owners`` maps node names to the qualified name and class name of the user's module whose
    forward holds the node (absent for the root), to say where the refused code is written.
    ``float_qconfig(path, module)``: the qconfig of a module prepare left float, None when it is not
    a QAT module's float form (a QAT module, a stub); ``march``: the target march's name."""
    quantized: set[str] = set()
    wrapped_calls: list[torch.fx.Node] = []
    for n in gm.graph.nodes:
        m = _called_module(gm, n)
        if n.op == "call_module" and m is not None:
            on_codes = any(a.name in quantized for a in n.all_input_nodes)
            if _has_output_fake_quant(m) or (on_codes and isinstance(m, PRESERVING_MODULES)):
                if on_codes and hasattr(m, "float_inputs"):
                    _refuse_quantized_float_inputs(n, m, quantized)
                quantized.add(n.name)  # a QuantStub, a QAT layer or FloatFunctional
                if march is not None:
                    _refuse_march_dtypes(str(n.target), m, march)
            elif on_codes and float_qconfig is not None and not isinstance(m, PRESERVING_MODULES):
                _refuse_float_module_with_qconfig(gm, n, m, float_qconfig, march)
            continue  # a DeQuantStub, a float (CPU) module, a high-precision layer: not int8/int16 codes
        if n.op == "call_function" and torch_fx_wrapped(n.target):
            wrapped_calls.append(n)
            continue  # runs in float (convert dequantizes its arguments): its results are float
        if n.op in ("call_function", "call_method") and wrapped_original(n.target) is None:
            if any(a.name in quantized for a in n.all_input_nodes):
                quantized.add(n.name)
            if m is not None and _has_output_fake_quant(m) and n.name in quantized:  # ff.add(x, y), x + y
                _refuse_float_constant_operands(gm, n, m, quantized, owners)
            if _is_einsum(n) and n.name in quantized:
                _refuse(
                    n.name,
                    f"prepare_qat_fx: torch.einsum({n.args[0]!r}, ...) at node '{n.name}' in the forward of "
                    f"{_owner(gm, owners.get(n.name))} runs on quantized tensors; {_EINSUM_FIX}. ({_LATER})",
                )
    for n in gm.graph.nodes:
        m = _called_module(gm, n)
        if n.op == "call_module" and m is not None and _is_high_precision(m):
            _refuse_high_precision_consumers(gm, n)
    for n in wrapped_calls:  # once every quantized value is known
        _refuse_quantized_consumers_of_wrapped(gm, n, owners, quantized)


def _refuse_quantized_float_inputs(n: torch.fx.Node, m: nn.Module, quantized: set[str]) -> None:
    """Refuse quantized values at the arguments QAT module ``m`` takes in float (``m.float_inputs``,
    positions in its forward: an attention mask, RoIAlign's boxes): its integer form has no input
    scale for them (convert_fx: 'expected 3 input scale(s), got 4')."""
    try:
        params = list(inspect.signature(m.forward).parameters)
    except (TypeError, ValueError):
        params = []
    at = {i: a for i, a in enumerate(n.args)}
    at.update({params.index(k): a for k, a in n.kwargs.items() if k in params})
    for i in getattr(m, "float_inputs", ()):
        codes = [x.name for x in _nodes_in(at.get(i)) if x.name in quantized and not _is_size(x)]
        if codes:
            arg = repr(params[i]) if i < len(params) else f"{i}"
            path = str(n.target)
            _refuse(
                path,
                f"prepare_qat_fx: module '{path}' ({type(m).__name__}) takes argument {arg} in float, but it "
                f"receives quantized node '{codes[0]}': its integer form has no input scale for it. Pass that "
                f"argument in float (without a QuantStub in front of it, or after a DeQuantStub). ({_LATER})",
            )


def _is_size(n: torch.fx.Node) -> bool:
    """Whether ``n`` is read from a tensor's shape (``x.shape[-2:]``, ``x.size(0) * 2``): an exact int, not codes."""
    if (n.op == "call_method" and n.target in QUERY_METHODS) or (
        n.op == "call_function" and n.target in QUERY_FUNCTIONS
    ):
        return True
    ins = n.all_input_nodes
    return (
        n.op in ("call_function", "call_method") and bool(ins) and all(_is_size(a) for a in ins if a.op != "get_attr")
    )


def _nodes_in(a: Any) -> list[torch.fx.Node]:
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg(a, found.append)
    return found


def _refuse_float_module_with_qconfig(
    gm: torch.fx.GraphModule,
    n: torch.fx.Node,
    m: nn.Module,
    float_qconfig: Callable[[str, nn.Module], Any],
    march: str | None,
) -> None:
    """Refuse float module ``m`` (call site ``n``, reached by quantized tensors) when it has a qconfig."""
    path = str(n.target)
    qc = float_qconfig(path, m)
    if qc is None or (getattr(qc, "activation", None) is None and getattr(qc, "weight", None) is None):
        return  # kept float on purpose (qconfig None): convert names it if it still receives codes
    _refuse(path, f"prepare_qat_fx: {float_module_on_codes(path, m, has_qconfig=True, march=march)} ({_LATER})")


def float_module_on_codes(path: str, m: nn.Module, *, has_qconfig: bool, march: str | None = None) -> str:
    """Why float module ``m`` at ``path``, reached by quantized tensors, cannot stay so, and the fix that
    fits it: prepare_qat_fx refuses one that has a qconfig (``has_qconfig``: no QAT class took it, so it
    has no quantized form), convert_fx one prepare left float (a qconfig fixes it where it has a QAT
    class, the stubs where not). One wording for both."""
    from qir.quantization.qat_classes import qat_class_for

    cls = type(m).__name__
    head = f"module '{path}' ({cls}) receives quantized tensors"
    float_it = "put a DeQuantStub before it and a QuantStub after it"
    if not has_qconfig and qat_class_for(m) is not None:
        return (
            f"{head} but prepare left it float (its qconfig is None): give it a qconfig so prepare swaps it, "
            f"or {float_it} to run it in float"
        )
    on = f" on {march}" if march else ""
    no_form = f"{cls} has no quantized form{on} (no QAT class in qir.nn.qat.QAT_MODULE_MAP)"
    hybrid = "or prepare with hybrid=True, which places it on the CPU with generated stubs"
    hint = ""
    if isinstance(m, nn.LSTM):
        hint = " nn.LSTMCell has a quantized form: unroll the sequence over cells (one per direction and layer)."
    elif isinstance(m, nn.modules.batchnorm._BatchNorm):
        hint = (
            " A batch norm is quantized folded into the conv / linear before it, whose output it must read alone; a"
            " BatchNorm2d no conv feeds becomes a depthwise 1x1 conv, which a BatchNorm1d / 3d or a batch norm"
            " module called at several places cannot: put it after a conv, or call one module per place."
        )
    elif isinstance(m, torch.ao.nn.intrinsic._FusedModule):
        hint = (
            f" {cls} is torch's fused module (torch.quantization.fuse_modules without fuser_func): fuse with "
            "fuse_modules(model, [...], fuser_func=qir.quantization.fuse_known_modules), which gives qir's "
            "fused modules, or fuse with qir.quantization.fuse_fx."
        )
    if not has_qconfig:
        return f"{head} but prepare left it float: {no_form}. To run it in float, {float_it}; {hybrid}.{hint}"
    return (
        f"{head} and has a qconfig, but {no_form}: QAT would run it in float on fake-quantized values and "
        "convert_fx would refuse it after training. To run it in float, give it the qconfig None "
        f"(qconfig_dict={{'module_name': [('{path}', None)]}}, or `.qconfig = None` on it) and {float_it}; "
        f"{hybrid}.{hint}"
    )


def _refuse_march_dtypes(path: str, m: nn.Module, march: str) -> None:
    """Refuse a QAT module (a QAT LSTMCell) whose fixed-dtype fake quants ``march`` cannot produce (its
    integer form requantizes into each of its ``requantized_fake_quants``; qir.nn.quantized.LSTMCell.from_qat)."""
    names: tuple[str, ...] = getattr(m, "requantized_fake_quants", ())
    if not names:
        return
    out = requant_limits(march).out_dtypes
    bad = sorted(name for name in names if qdtype(getattr(m, name).dtype) not in out)
    if bad:
        _refuse(
            path,
            f"prepare_qat_fx: module '{path}' ({type(m).__name__}) keeps its cell state and the values feeding it "
            f"in qint16 ({', '.join(bad)}), and {march} requantizes to {', '.join(d.name for d in out)} only: it has "
            "no quantized form on this march. Give it the qconfig None (qconfig_dict={'module_name': "
            f"[('{path}', None)]}}) with a DeQuantStub before it and a QuantStub after it to run it in float, prepare "
            f"with hybrid=True to place it on the CPU, or target bayes. ({_LATER})",
        )


def _refuse_float_constant_operands(
    gm: torch.fx.GraphModule,
    n: torch.fx.Node,
    m: nn.Module,
    quantized: set[str],
    owners: Mapping[str, tuple[str, str]],
) -> None:
    """Refuse a FloatFunctional-style call ``n`` (module ``m``) reading a float parameter / buffer of the
    model, directly or through layout ops, next to a quantized operand. (Modules called as a whole may
    take float operands: RoIAlign's boxes.)"""
    inputs = [a for a in n.all_input_nodes if not (n.op == "call_method" and a is n.args[0])]
    for a in inputs:
        src = _float_constant(gm, a)
        if src is None or not any(b.name in quantized for b in inputs if b is not a):
            continue  # a QuantStub's own input, or no quantized operand beside it
        name = str(src.target)
        attr = name.rsplit(".", 1)[-1]
        call = f"{n.target}()" if n.op == "call_method" else f"'{n.target}'"
        _refuse(
            _path(n),
            f"prepare_qat_fx: {call} at node '{n.name}' (module '{_path(n)}', {type(m).__name__}) in the forward of "
            f"{_owner(gm, owners.get(n.name))} takes the float tensor '{name}' (a parameter or buffer of the model) "
            "next to quantized tensors: QAT would train with it unquantized, and a quantized op needs a scale for "
            f"every tensor input. Give it a QuantStub: `self.{attr}_quant = QuantStub()` in __init__ and "
            f"`self.{attr}_quant(self.{attr})` where the forward reads it; its scale is then observed and trained "
            f"like any other. ({_LATER})",
        )


def _float_constant(gm: torch.fx.GraphModule, n: torch.fx.Node) -> torch.fx.Node | None:
    """The get_attr node of a floating-point tensor that ``n`` is or is computed from in float (through
    layout ops, an ``nn.Identity``, float ops), following each node's first input; None if ``n`` comes
    from a model input or a quantizing module (a QuantStub, a QAT layer, a FloatFunctional)."""
    while n.op != "get_attr":
        m = _called_module(gm, n)
        first = next((a for a in _args_of(gm, n) if isinstance(a, torch.fx.Node)), None)
        if (m is not None and _has_output_fake_quant(m)) or first is None:
            return None
        n = first
    value: torch.Tensor
    try:
        value = gm.get_parameter(str(n.target))
    except AttributeError:
        try:
            value = gm.get_buffer(str(n.target))
        except AttributeError:
            return None
    return n if value.is_floating_point() else None


def _args_of(gm: torch.fx.GraphModule, n: torch.fx.Node) -> tuple[object, ...]:
    """The node's operands, without the module a FloatFunctional-style method call is made on."""
    return n.args[1:] if module_self(gm, n) is not None else n.args


def _refuse_high_precision_consumers(gm: torch.fx.GraphModule, src: torch.fx.Node) -> None:
    """Refuse a quantized module (one with an output fake quant, or another high-precision one) reading
    ``src``'s qint32 output directly or through layout ops. A DeQuantStub (no output fake quant) takes it."""
    for u in _users_through(src, _is_layout):
        m = _called_module(gm, u)
        if m is not None and (_has_output_fake_quant(m) or _is_high_precision(m)):
            _refuse(
                _path(u),
                f"prepare_qat_fx: {_module_call(u, m)} takes the output of module '{src.target}' "
                f"({type(gm.get_submodule(str(src.target))).__name__}), a high-precision qint32 output (one scale "
                "per channel, from a qconfig without an output fake quant such as get_default_qat_out_qconfig()); "
                "only a DeQuantStub can take it: give that module a qconfig with an activation "
                "(get_default_qat_qconfig(), or qint16 for precision), or dequantize its output before it "
                f"({_LATER})",
            )


def _refuse_quantized_consumers_of_wrapped(
    gm: torch.fx.GraphModule, call: torch.fx.Node, owners: Mapping[str, tuple[str, str]], quantized: set[str]
) -> None:
    """Refuse a quantized layer (a QAT conv / linear, or a module with an output fake quant that reads a
    quantized operand beside it: a generated FloatFunctional's add) reading the float result of ``call``, a
    ``torch.fx.wrap``'ed function, directly or through float code. (A QuantStub takes it: that is the fix.)"""

    def float_code(u: torch.fx.Node) -> bool:  # float code on the result: its value is float too
        plain = u.op in ("call_function", "call_method") and not torch_fx_wrapped(u.target)
        return plain and _called_module(gm, u) is None

    for u in _users_through(call, float_code):
        m = _called_module(gm, u)
        if m is None:
            continue
        beside = any(a.name in quantized for a in u.all_input_nodes)
        if not (getattr(m, "weight_fake_quant", None) is not None or (beside and _has_output_fake_quant(m))):
            continue
        fn = call.target
        name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}"
        what = _module_call(u, m)
        _refuse(
            _path(u),
            f"prepare_qat_fx: {name}, a function registered with torch.fx.wrap and called at node '{call.name}' "
            f"in the forward of {_owner(gm, owners.get(call.name))}, runs in float as a "
            "qir.utils.fx_helper.wrap'ed function does (convert_fx passes it dequantized values), and its float "
            f"result reaches {what}, which takes quantized inputs only. Prepare with hybrid=True (a generated "
            "DeQuantStub before the call and a QuantStub after it; docs/hybrid.md), or put a QuantStub on the "
            f"result in the forward that calls it ({_LATER})",
        )
        return


def _users_through(src: torch.fx.Node, through: Callable[[torch.fx.Node], bool]) -> Iterator[torch.fx.Node]:
    """Every node reading ``src``, directly or through nodes ``through`` accepts, once each."""
    todo = list(src.users)
    seen: set[str] = set()
    while todo:
        u = todo.pop()
        if u.name in seen:
            continue
        seen.add(u.name)
        yield u
        if through(u):
            todo.extend(u.users)


def _module_call(u: torch.fx.Node, m: nn.Module) -> str:
    """``module 'path' (Class)``, and the method a call_method node calls on it."""
    what = f"module '{_path(u)}' ({type(m).__name__})"
    return f"{what}, its {u.target}() at node '{u.name}'" if u.op == "call_method" else what


def _called_module(gm: torch.fx.GraphModule, n: torch.fx.Node) -> nn.Module | None:
    if n.op == "call_module":
        return gm.get_submodule(str(n.target))
    return module_self(gm, n)


def _path(n: torch.fx.Node) -> str:
    return str(n.target) if n.op == "call_module" else str(n.args[0].target)  # type: ignore[union-attr]


def _has_output_fake_quant(m: nn.Module) -> bool:
    return getattr(m, "activation_post_process", None) is not None


def _is_high_precision(m: nn.Module) -> bool:
    """A QAT conv / linear without an output fake quant and with per-channel weight scales over
    several channels: its qint32 output has one scale per channel (one channel: one scale, which
    any consumer can take). The scale tensors fill in at the first observation, so this reads the
    fake quant's axis and the weight's size."""
    fq = getattr(m, "weight_fake_quant", None)
    axis = getattr(fq, "ch_axis", None)
    w = getattr(m, "weight", None)
    if _has_output_fake_quant(m) or axis is None or not isinstance(w, torch.Tensor):
        return False
    return w.dim() > axis and w.shape[axis] > 1


def _is_layout(n: torch.fx.Node) -> bool:
    """Ops that pass codes and their scale through (view, reshape, permute, getitem, ...)."""
    if n.op == "call_function":
        return n.target in PRESERVING_FUNCTIONS
    return n.op == "call_method" and n.target in PRESERVING_METHODS


def _is_einsum(n: torch.fx.Node) -> bool:
    return (n.op == "call_function" and n.target is torch.einsum) or (n.op == "call_method" and n.target == "einsum")


def _owner(gm: torch.fx.GraphModule, owner: tuple[str, str] | None) -> str:
    if owner is None:
        return f"the root module ({type(gm).__name__})"
    path, cls = owner
    return f"module '{path}' ({cls})" if cls else f"module '{path}'"
