"""``convert_fx``: QAT GraphModule -> integer model, with every scale fixed at conversion.

Quantized modules see integer codes only, so conversion computes each module's input
scales from the graph (:func:`input_scales`): a tensor's scale is its producer's output
fake-quant scale, passed unchanged through scale-preserving ops (relu, max pool,
reshape / view / flatten / permute / getitem, nearest interpolate, identity, dropout).
Each QAT module is then replaced by ``QUANTIZED_MODULE_MAP[type].from_qat(module,
input_scales, march)``. Functional ops that are exact on codes stay; ``relu6`` becomes a
clamp at ``round(6 / s)``, nearest ``interpolate`` a float round trip (exact), ``dropout``
disappears. abs, clamp, comparisons, pads, gather, max / min, top-k and arg-reductions run
on codes too (:mod:`qir.quantization.code_convert` gives them their integer forms).
"""

from __future__ import annotations

import copy
import inspect
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from backends.common import numerics
from passes.one_thread import one_intra_op_thread
from passes.pipeline import Pipeline
from passes.quantize import WRAP_DEQUANT_PREFIX, Quantize, code_rule_covers_module, uncovered
from qir.frontend.convert import gc_paused
from qir.ir.types import DType
from qir.march import March, march_scope
from qir.quantization.code_convert import EXACT, CodeOpError, classify, rewrite_code_ops
from qir.quantization.exact_validation import set_twin_builder
from qir.quantization.exact_validation import uninstall as uninstall_exact_validation
from qir.quantization.fuse import trace_fx
from qir.quantization.hybrid import hybrid_plan_of
from qir.quantization.multi_output import multi_output_item, multi_output_scales
from qir.quantization.pipelines import PipelineArg, builtin_only, resolve_pipeline, run_on_module
from qir.quantization.prepare import PREPARE_RECORD_KEY, PrepareRecord, require_march, set_submodule
from qir.quantization.prepare_checks import float_module_on_codes
from qir.quantization.scale_ops import (
    PAIR,
    PRESERVING_FUNCTIONS,
    PRESERVING_METHODS,
    PRESERVING_MODULES,
    QUERY_FUNCTIONS,
    QUERY_METHODS,
    code_op,
    is_nearest,
    module_self,
    pair_item,
    same_scales,
    scales_differ,
)
from qir.quantization.stubs import DeQuantStub as FloatDeQuantStub
from qir.quantization.wrapped_self import follow_training
from qir.utils.fx_helper import torch_fx_wrapped, wrapped_original

__all__ = [
    "CONVERT_PATH_KEY",
    "ConvertError",
    "ScalePlan",
    "convert_fx",
    "input_scales",
    "nearest_interpolate_codes",
    "quantized_class_for",
    "relu6_bound",
    "relu6_codes",
]


class ConvertError(RuntimeError):
    """The QAT model cannot be converted; the message names the module or op and the fix."""


# which ops keep their input's scale: qir/quantization/scale_ops.py (these names are kept for
# qir/cli/coverage.py)
_PRESERVING_FUNCTIONS = PRESERVING_FUNCTIONS
_PRESERVING_METHODS = PRESERVING_METHODS
_QUERY_METHODS = QUERY_METHODS
_PRESERVING_MODULES = PRESERVING_MODULES


def quantized_class_for(m: nn.Module, mapping: Mapping[type, type] | None = None) -> type | None:
    if mapping is None:
        from qir.nn.quantized import QUANTIZED_MODULE_MAP

        mapping = QUANTIZED_MODULE_MAP
    return mapping.get(type(m))


def _is_qat_module(m: nn.Module) -> bool:
    from qir.nn.qat import QATModule

    return isinstance(m, QATModule)


# ---------------------------------------------------------------------------------------------
# scale propagation


Scale = torch.Tensor | None


@dataclass
class ScalePlan:
    """Per QAT module path: its call sites' input scales; per fx node: its output scale and code dtype."""

    module_inputs: dict[str, list[list[torch.Tensor]]] = field(default_factory=dict)
    node_scales: dict[str, Scale] = field(default_factory=dict)
    node_dtypes: dict[str, DType | None] = field(default_factory=dict)
    #: hybrid models: DeQuantStubs called on float values only (identities); also DeQuantStubs
    #: of exact values (indices, booleans)
    float_dequants: set[str] = field(default_factory=set)
    #: nodes returning (values, indices) on codes (max / min along a dim, topk)
    pairs: set[str] = field(default_factory=set)
    #: nodes whose results are exact values without a scale (indices, booleans of calls on codes)
    exact_values: set[str] = field(default_factory=set)
    #: DeQuantStub path -> its call nodes on exact values (identities even when the stub also dequantizes)
    exact_dequants: dict[str, list[str]] = field(default_factory=dict)
    #: calls of modules with several quantized outputs (LSTMCell's (h', c')): each output's scale and dtype
    multi_outputs: dict[str, list[tuple[Scale, DType | None]]] = field(default_factory=dict)
    #: calls of ``fx_helper.wrap``-ed functions / methods that receive quantized tensors: they get
    #: float (dequantized) arguments and run on the CPU (:func:`_dequantize_wrapped_inputs`)
    wrapped_calls: list[str] = field(default_factory=list)
    #: ``x.float()`` / ``x.to(torch.float32)`` of a quantized tensor: an identity in QAT (fake-quantized
    #: values are float32 already), so the converted model keeps the codes (:func:`_drop_float_casts`)
    float_casts: list[str] = field(default_factory=list)

    def sites_differ(self, path: str) -> bool:
        """Whether module ``path``'s call sites see different input scales."""
        return scales_differ(self.module_inputs.get(path, []))

    def inputs_of(self, path: str) -> list[torch.Tensor]:
        sites = self.module_inputs.get(path, [])
        if not sites:
            return []
        first = sites[0]
        for other in sites[1:]:
            if not same_scales(first, other):
                raise ConvertError(
                    f"module '{path}' is called at several places with different input scales "
                    f"({[s.tolist() for s in first]} vs {[s.tolist() for s in other]}); a quantized module has "
                    "fixed input scales. prepare_qat_fx gives every call site its own module (docs/qconfig.md, "
                    "'Modules called at several places'); in eager mode, use one module instance per call site"
                )
        return first


def _nodes_in(args: Any) -> list[torch.fx.Node]:
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg(args, found.append)
    return found


def _undeclared_float_args(m: nn.Module, n: torch.fx.Node, env: Mapping[str, Scale]) -> list[str]:
    """The arguments of call ``n`` of QAT module ``m`` that carry unquantized values and are not
    among ``m.float_inputs`` (positions in its ``forward``: RoIAlign's boxes, attention masks)."""
    allowed = set(getattr(m, "float_inputs", ()))
    if n.op == "call_method" and n.target in ("add_scalar", "mul_scalar"):
        allowed.add(1)  # FloatFunctional's number operand (computed at run time: ``x * (1.0 / w)``)
    args = n.args if n.op == "call_module" else n.args[1:]  # a method call's first argument is the module
    try:
        params = list(inspect.signature(m.forward).parameters) if n.op == "call_module" else []
    except (TypeError, ValueError):
        params = []

    def is_float(a: Any) -> bool:
        return any(x.op != "get_attr" and env.get(x.name) is None for x in _nodes_in(a))

    bad = [str(i) for i, a in enumerate(args) if i not in allowed and is_float(a)]
    for k, a in n.kwargs.items():
        if (params.index(k) if k in params else None) not in allowed and is_float(a):
            bad.append(repr(k))
    return bad


def _out_scale_of_qat(m: nn.Module, ins: Sequence[torch.Tensor]) -> Scale:
    from qir.quantization.fake_quantize import FakeQuantize

    fq = getattr(m, "activation_post_process", None)
    if isinstance(fq, FakeQuantize):
        return fq.scale.detach().clone()
    if getattr(type(m), "scale_preserving", False):
        return ins[0] if ins else None
    return None  # a high-precision output: known once the quantized module exists


def _out_dtype_of_qat(m: nn.Module, ins: Sequence[DType | None]) -> DType | None:
    from qir.quantization.fake_quantize import FakeQuantize

    fq = getattr(m, "activation_post_process", None)
    if isinstance(fq, FakeQuantize):
        return DType(fq.dtype)
    if getattr(m, "is_scale_preserving", False):
        return ins[0] if ins else None
    return DType.qint32  # a high-precision output


def input_scales(
    gm: torch.fx.GraphModule,
    out_scale: Callable[[str, nn.Module, list[torch.Tensor]], Scale] | None = None,
    hybrid: bool = False,
) -> ScalePlan:
    """Walk ``gm``'s graph once: every QAT module call site's input scales.

    ``out_scale(path, module, ins)`` may supply the output scale of a module whose QAT
    form does not show it (high-precision convs: convert passes the quantized module's).
    ``hybrid``: a DeQuantStub of a float value (after a CPU op) is an identity, left out of
    the plan, instead of an error.
    """
    plan = ScalePlan()
    env = plan.node_scales
    dts = plan.node_dtypes

    def keep(n: torch.fx.Node, src: torch.fx.Node) -> None:
        env[n.name], dts[n.name] = env.get(src.name), dts.get(src.name)

    for n in gm.graph.nodes:
        in_nodes = _nodes_in((n.args, n.kwargs))
        ins = [env.get(a.name) for a in in_nodes]
        quantized = [s for s in ins if s is not None]
        first_q = next((a for a in in_nodes if env.get(a.name) is not None), None)
        if n.op in ("placeholder", "output"):
            env[n.name] = None
            continue
        if n.op == "get_attr":
            env[n.name] = None
            continue
        if n.op == "call_module" or (n.op == "call_method" and module_self(gm, n) is not None):
            path = str(n.target) if n.op == "call_module" else str(n.args[0].target)  # type: ignore[union-attr]
            m = gm.get_submodule(path)
            exact_only = bool(in_nodes) and all(a.name in plan.exact_values for a in in_nodes)
            if _is_dequant_stub(m) and not quantized and (hybrid or exact_only):
                plan.float_dequants.add(path)  # float (hybrid) or exact values (indices, booleans): identity
                if exact_only:
                    plan.exact_dequants.setdefault(path, []).append(n.name)
                env[n.name] = None
                continue
            if _is_qat_module(m):
                # a multi-output result passed whole (cell(x, hx), hx another cell's (h', c')): each output
                whole = plan.multi_outputs
                tensor_ins = [
                    s
                    for a in in_nodes
                    for s in ([o[0] for o in whole[a.name]] if a.name in whole else [env.get(a.name)])
                    if s is not None
                ]
                floats = [] if _is_quant_stub(m) else _undeclared_float_args(m, n, env)
                if floats:
                    raise ConvertError(
                        f"module '{path}' ({type(m).__name__}) receives a float tensor (argument "
                        f"{', '.join(floats)}); quantized modules take quantized inputs: put a QuantStub in front of it"
                    )
                if _is_quant_stub(m):
                    tensor_ins = []
                elif not _is_dequant_stub(m):
                    _refuse_per_channel_input(path, m, in_nodes, env)
                plan.module_inputs.setdefault(path, []).append(tensor_ins)
                s = _out_scale_of_qat(m, tensor_ins)
                if s is None and out_scale is not None and not _is_dequant_stub(m):
                    s = out_scale(path, m, tensor_ins)
                env[n.name] = None if _is_dequant_stub(m) else s
                dts[n.name] = (
                    None
                    if _is_dequant_stub(m)
                    else _out_dtype_of_qat(m, [dts.get(a.name) for a in in_nodes if env.get(a.name) is not None])
                )
                outs = multi_output_scales(m)
                if outs is not None:  # r[i] of the result reads output i's scale
                    plan.multi_outputs[n.name] = outs
                    env[n.name], dts[n.name] = outs[0]
                continue
            if not quantized:
                env[n.name] = None
                continue
            if isinstance(m, _PRESERVING_MODULES):
                keep(n, first_q)  # type: ignore[arg-type]
                continue
            raise ConvertError(float_module_on_codes(path, m, has_qconfig=False))
        # call_function / call_method
        if not quantized:
            env[n.name] = None
            continue
        target = n.target
        part = multi_output_item(n, plan.multi_outputs)
        if part is not None:
            env[n.name], dts[n.name] = part
            continue
        item = pair_item(n)
        if item is not None and item[0].name in plan.pairs:  # (values, indices): values keep the scale
            if item[1] == 0:
                keep(n, item[0])
            else:
                env[n.name] = None
                plan.exact_values.add(n.name)
            continue
        if (n.op == "call_method" and target in _QUERY_METHODS) or (
            n.op == "call_function" and target in QUERY_FUNCTIONS
        ):
            env[n.name] = None
            continue
        if n.op == "call_function" and (wrapped_original(target) is not None or torch_fx_wrapped(target)):
            _check_wrapped_args(n, plan)
            plan.wrapped_calls.append(n.name)
            env[n.name] = None  # runs in float on the CPU: its results are float
            continue
        op = code_op(n)
        if op is not None:
            try:
                res = classify(n, op, env, dts)
            except CodeOpError as e:
                raise ConvertError(str(e)) from e
            env[n.name], dts[n.name] = res.scale, res.dtype
            if res.kind == PAIR:
                plan.pairs.add(n.name)
            elif res.kind == EXACT:
                plan.exact_values.add(n.name)
            continue
        if _is_float32_cast(n) and first_q is not None and len(quantized) == 1:
            plan.float_casts.append(n.name)
            keep(n, first_q)
            continue
        if (n.op == "call_function" and target in _PRESERVING_FUNCTIONS) or (
            n.op == "call_method" and target in _PRESERVING_METHODS
        ):
            if target is F.interpolate and not is_nearest(n):
                raise ConvertError(
                    f"F.interpolate at node '{n.name}' (mode={n.kwargs.get('mode')}) on a quantized tensor "
                    "changes its values; use qir.nn.Interpolate so it gets a quantized form"
                )
            keep(n, first_q)  # type: ignore[arg-type]
            continue
        name = getattr(target, "__name__", str(target))
        raise ConvertError(
            f"op {name} at node '{n.name}' runs on quantized tensors but has no integer form; "
            "prepare_qat_fx turns +, cat, mul, mean, ... into generated FloatFunctional modules: prepare "
            "again with a qconfig that covers it, or put a DeQuantStub before it"
        )
    return plan


def _is_float32_cast(n: torch.fx.Node) -> bool:
    """``x.float()``, ``x.to(torch.float32)``, ``x.type(torch.float32)`` (a dtype-only cast to float32)."""
    if n.op != "call_method":
        return False
    if n.target == "float" and len(n.args) == 1 and not n.kwargs:
        return True
    if n.target in ("to", "type"):
        dtypes = [*n.args[1:], *n.kwargs.values()]
        return dtypes in ([torch.float32], ["torch.FloatTensor"])
    return False


def _drop_float_casts(gm: torch.fx.GraphModule, plan: ScalePlan, eager: bool) -> None:
    """Remove the float32 casts of quantized tensors: on codes they would make float codes."""
    if not plan.float_casts:
        return
    if eager:  # the eager forward runs as written: its cast would turn the codes into float codes
        raise ConvertError(
            f"node '{plan.float_casts[0]}' casts a quantized tensor to float32 (x.float() / x.to(torch.float32)), "
            "an identity in QAT; the eager forward would cast the integer codes: drop the cast, or use "
            "prepare_qat_fx / convert_fx, which remove it"
        )
    nodes = {n.name: n for n in gm.graph.nodes}
    for name in plan.float_casts:
        n = nodes[name]
        n.replace_all_uses_with(n.args[0])  # type: ignore[arg-type]
        gm.graph.erase_node(n)
    gm.recompile()


def _check_wrapped_args(n: torch.fx.Node, plan: ScalePlan) -> None:
    """A wrapped call's quantized arguments must be single tensors (they are dequantized one by one)."""
    for a in _nodes_in((n.args, n.kwargs)):
        if a.name in plan.pairs or a.name in plan.multi_outputs:
            raise ConvertError(
                f"wrapped function {_wrapped_name(n)} at node '{n.name}' receives the whole (values, indices) result "
                f"of node '{a.name}'; pass its parts (r[0], r[1]) so each can be dequantized on its own"
            )


def _wrapped_name(n: torch.fx.Node) -> str:
    fn = n.target
    return getattr(fn, "__qualname__", getattr(fn, "__name__", str(fn)))


def _is_quant_stub(m: nn.Module) -> bool:
    from qir.nn.qat import QuantStub

    return isinstance(m, QuantStub)


def _is_dequant_stub(m: nn.Module) -> bool:
    from qir.nn.qat import DeQuantStub

    return isinstance(m, DeQuantStub)


# ---------------------------------------------------------------------------------------------
# swapping


def nearest_interpolate_codes(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """Nearest resize of integer codes (torch has no integer kernel; the float round trip is exact)."""
    if x.is_floating_point():
        return F.interpolate(x, *args, **kwargs)
    return F.interpolate(x.to(torch.float32), *args, **kwargs).to(x.dtype)


def relu6_codes(x: torch.Tensor, bound: int) -> torch.Tensor:
    """``relu6`` on codes at scale ``s``: clamp to ``[0, round(6 / s)]`` (within the code dtype's range)."""
    if x.is_floating_point():
        return F.relu6(x)
    return x.clamp(0, min(bound, int(torch.iinfo(x.dtype).max)))


def relu6_bound(scale: torch.Tensor) -> int:
    """The code of 6.0 at ``scale``: relu6's upper bound on codes."""
    return int(numerics.quantize(torch.tensor([6.0]), float(scale.reshape(-1)[0]), "qint32")[0])


def _rewrite_functionals(gm: torch.fx.GraphModule, plan: ScalePlan, eager: bool = False) -> None:
    """Functional ops on codes that are not exact as written: relu6, hardtanh(0, 6), interpolate, dropout.

    An eager model's forward cannot be rewritten: there they are errors naming the module to use."""
    g = gm.graph
    for n in list(g.nodes):
        if n.op != "call_function":
            continue
        ins = [plan.node_scales.get(a.name) for a in _nodes_in(n.args[:1])]
        s = ins[0] if ins else None
        if s is None:
            continue
        if eager and n.target in (F.relu6, F.hardtanh, F.interpolate):
            fix = "nn.ReLU6" if n.target is not F.interpolate else "qir.nn.Interpolate"
            raise ConvertError(
                f"the forward calls {n.target.__name__} on a quantized tensor (node '{n.name}'); eager convert "
                f"cannot rewrite a forward: use the module {fix} instead so it gets a quantized form"
            )
        if eager:
            continue
        if n.target is F.relu6 or n.target is F.hardtanh:
            if n.target is F.hardtanh and (n.kwargs.get("min_val", n.args[1] if len(n.args) > 1 else -1.0) != 0.0):
                raise ConvertError(f"F.hardtanh at node '{n.name}' on a quantized tensor: only hardtanh(0, 6) (relu6)")
            with g.inserting_after(n):
                new = g.call_function(relu6_codes, (n.args[0], relu6_bound(s)))
            plan.node_scales[new.name] = s
            n.replace_all_uses_with(new)
            g.erase_node(n)
        elif n.target is F.interpolate:
            n.target = nearest_interpolate_codes
        elif n.target in (F.dropout, F.dropout2d, torch.dropout):
            n.replace_all_uses_with(n.args[0])  # type: ignore[arg-type]
            g.erase_node(n)
    gm.recompile()


def build_quantized(
    path: str, m: nn.Module, ins: Sequence[torch.Tensor], march: March, mapping: Mapping[type, type] | None = None
) -> nn.Module:
    """The quantized module of QAT module ``m`` at ``path`` whose inputs have scales ``ins``."""
    cls = quantized_class_for(m, mapping)
    if cls is None:
        raise ConvertError(f"module '{path}' ({type(m).__name__}) has no quantized class in QUANTIZED_MODULE_MAP")
    try:
        return cls.from_qat(m, list(ins), march)  # type: ignore[attr-defined,no-any-return]
    except (ValueError, TypeError) as e:
        raise ConvertError(f"converting module '{path}' ({type(m).__name__}): {e}") from e


@one_intra_op_thread()  # once per model: each layer's passes over its weight (passes/one_thread.py says why)
def _convert_modules(
    root: nn.Module, gm: torch.fx.GraphModule, march: March, mapping: Mapping[type, type] | None, eager: bool = False
) -> None:
    """Swap every called QAT module of ``gm`` (submodules shared with ``root``) in ``root``."""
    built: dict[str, nn.Module] = {}

    def out_scale(path: str, m: nn.Module, ins: list[torch.Tensor]) -> Scale:
        q = build(path, m, ins)
        s = getattr(q, "scale", None)
        return s.detach().clone() if isinstance(s, torch.Tensor) else None

    def build(path: str, m: nn.Module, ins: Sequence[torch.Tensor]) -> nn.Module:
        if path not in built:
            built[path] = build_quantized(path, m, ins, march, mapping)
        return built[path]

    plan = input_scales(gm, out_scale, hybrid=hybrid_plan_of(gm) is not None)
    _rewrite_functionals(gm, plan, eager)  # before any swap: an eager error leaves the model whole
    try:
        rewrite_code_ops(root, gm, plan.node_scales, plan.node_dtypes, eager)
    except CodeOpError as e:
        raise ConvertError(str(e)) from e
    _bypass_exact_dequants(gm, plan, eager)
    _drop_float_casts(gm, plan, eager)
    _dequantize_wrapped_inputs(gm, plan, eager)
    for path in plan.float_dequants - plan.module_inputs.keys():
        set_submodule(root, path, FloatDeQuantStub())  # float in, float out: the float stub (identity)
        if root is not gm:
            set_submodule(gm, path, FloatDeQuantStub())
    per_call: list[str] = []
    for path in plan.module_inputs:
        m = gm.get_submodule(path)
        if eager and _is_dequant_stub(m) and plan.sites_differ(path):
            q: nn.Module = per_call_dequant_stub(path)  # one stub for outputs of different scales: the scale travels
            per_call.append(path)
        else:
            q = build(path, m, plan.inputs_of(path))
        q.train(False)
        set_submodule(root, path, q)
        if root is not gm:
            set_submodule(gm, path, q)
    if per_call:
        tag_scales(root)


def per_call_dequant_stub(path: str) -> nn.Module:
    """The converted form of eager DeQuantStub ``path`` whose call sites see different input scales:
    it dequantizes each call with the scale its input carries (qir.nn.quantized.scale_tags)."""
    from qir.nn.quantized import PerCallDeQuantStub

    return PerCallDeQuantStub(path)


def tag_scales(root: nn.Module) -> None:
    """Make the converted eager model ``root`` tag its codes with their scales (it has a shared stub)."""
    from qir.nn.quantized import install_scale_tags

    install_scale_tags(root)


def _refuse_per_channel_input(path: str, m: nn.Module, in_nodes: list[torch.fx.Node], env: Mapping[str, Scale]) -> None:
    """A high-precision (qint32, per-channel scale) output feeds only a DeQuantStub: any other
    quantized module would need one input scale and fail when the converted model runs."""
    for a in in_nodes:
        s = env.get(a.name)
        if isinstance(s, torch.Tensor) and s.numel() != 1:
            raise ConvertError(
                f"module '{path}' ({type(m).__name__}) takes node '{a.name}', a high-precision qint32 output "
                f"(per-channel scale, from a qconfig without an output fake quant such as "
                f"get_default_qat_out_qconfig()); only a DeQuantStub can take it: give its producer a qconfig "
                f"with an activation (get_default_qat_qconfig(), or qint16 for precision), or dequantize it first"
            )


def _bypass_exact_dequants(gm: torch.fx.GraphModule, plan: ScalePlan, eager: bool) -> None:
    """A DeQuantStub called on indices or booleans (and elsewhere on codes) is an identity at those calls."""
    shared = {path: names for path, names in plan.exact_dequants.items() if path in plan.module_inputs}
    if not shared:
        return
    if eager:
        path, names = next(iter(shared.items()))
        raise ConvertError(
            f"DeQuantStub '{path}' is called on codes and on indices / booleans (node '{names[0]}'); the eager "
            "forward cannot tell the calls apart: use one DeQuantStub per call site, or none for indices / booleans"
        )
    nodes = {n.name: n for n in gm.graph.nodes}
    for names in shared.values():
        for name in names:
            n = nodes[name]
            n.replace_all_uses_with(n.args[0])  # type: ignore[arg-type]
            gm.graph.erase_node(n)
    gm.recompile()


def _dequantize_wrapped_inputs(gm: torch.fx.GraphModule, plan: ScalePlan, eager: bool) -> None:
    """Each quantized argument of a wrapped call goes through a generated DeQuantStub first.

    A wrapped function is user Python qir does not look into (post-processing: anchor decoding,
    score thresholds, top-k); it computed on the QAT model's fake-quantized float tensors and now
    receives the same values, ``codes * scale``, in float32, and runs on the CPU. The stubs are
    ordinary DeQuantStubs, so ``check_model`` / ``compile_model`` see a BPU segment ending there.
    One stub per quantized value, shared by every wrapped call that reads it.
    """
    if not plan.wrapped_calls:
        return
    nodes = {n.name: n for n in gm.graph.nodes}
    if eager:
        n = nodes[plan.wrapped_calls[0]]
        raise ConvertError(
            f"wrapped function {_wrapped_name(n)} receives quantized tensors; an eager model's forward cannot be "
            "rewritten to dequantize them: call a DeQuantStub on its arguments in the forward"
        )
    from qir.nn.qat import DeQuantStub as QATDeQuantStub

    used = {name for name, _ in gm.named_modules()}
    made: dict[str, torch.fx.Node] = {}
    counter = 0
    for name in plan.wrapped_calls:
        n = nodes[name]
        for a in _nodes_in((n.args, n.kwargs)):
            if plan.node_scales.get(a.name) is None or a.name in made:
                continue
            while f"{WRAP_DEQUANT_PREFIX}{counter}" in used:
                counter += 1
            path = f"{WRAP_DEQUANT_PREFIX}{counter}"
            used.add(path)
            gm.add_submodule(path, QATDeQuantStub())
            with gm.graph.inserting_after(a):
                dq = gm.graph.call_module(path, (a,))
            made[a.name] = dq
            plan.module_inputs[path] = [[plan.node_scales[a.name]]]  # type: ignore[list-item]
            plan.node_scales[dq.name] = None
        n.args = torch.fx.node.map_arg(n.args, lambda x: made.get(x.name, x))
        n.kwargs = torch.fx.node.map_arg(n.kwargs, lambda x: made.get(x.name, x))
    gm.graph.lint()
    gm.recompile()


def _march_for(model: nn.Module, what: str) -> March:
    record = model.meta.get(PREPARE_RECORD_KEY) if isinstance(model, torch.fx.GraphModule) else None
    march = require_march(what)
    if isinstance(record, PrepareRecord) and record.march != march:
        raise ConvertError(
            f"the model was prepared for march {record.march.value} but the current march is {march.value}; "
            f"call qir.march.set_march('{record.march.value}') before {what}"
        )
    return march


# Like tracing, these build many small objects; a paused cyclic GC keeps the cost linear in model
# size (benchmarks/pipeline_cost.py: 1.13x growth per node from 500 to 2,500 blocks with it, 1.00x without).
@gc_paused()
def convert_fx(
    qat_model: nn.Module,
    mapping: Mapping[type, type] | None = None,
    pipeline: PipelineArg | None = None,
    example_inputs: Any = None,
) -> torch.fx.GraphModule:
    """The integer model of a deep copy of ``qat_model`` (a :func:`prepare_qat_fx` result).

    Tensors between quantized modules are integer codes; the result is in eval mode,
    traceable by ``torch.jit.trace``, and its ``graph`` can be edited (seed 001's
    ``centered_yuv2rgb`` insertion). The input is not modified. A hybrid model's CPU
    modules stay float between the generated stubs (docs/hybrid.md); its placement stays
    in ``meta`` for ``check_model`` / ``compile_model``.

    ``pipeline``: the convert pipeline (default ``qir.quantization.default_pipeline("convert")``,
    ``quantize{march=M}``; ``quantize`` is appended when missing). With ``example_inputs``
    (default: the ones given to ``prepare_qat_fx``) and a model whose layers the ``quantize``
    pass covers, it runs on the QAT model's IR and the result is emitted from it; otherwise the
    model converts by module swapping and the other passes run on its IR. ``meta["qir.convert_path"]``
    of the result says which, and why not the pass (docs/pipelines.md); a ``pipeline`` given here
    that so could not run as given also gets a warning saying so.
    """
    march = _march_for(qat_model, "convert_fx")
    pipe = resolve_pipeline("convert", pipeline, march)
    if not any(isinstance(p, Quantize) for p in pipe.passes):
        pipe = pipe + Pipeline((Quantize(march=march.value),))  # the conversion itself always runs
    from qir.nn.qat import QATConvBNBase, fold_batch_norms

    record = getattr(qat_model, "meta", {}).get(PREPARE_RECORD_KEY)
    recorded = record.example_inputs if isinstance(record, PrepareRecord) else None
    inputs = example_inputs if example_inputs is not None else recorded
    graph, why = None, ""
    if isinstance(qat_model, torch.fx.GraphModule) and not any(
        isinstance(m, QATConvBNBase) for m in qat_model.modules()
    ):
        # The pass path reads the QAT model without copying it: the trace runs it on scratch
        # buffers and the conversion rules write new tensors only (the model is left as it was,
        # tests/quantization/test_convert_untouched.py).
        graph, why = _qat_ir(qat_model, mapping, inputs)
        if graph is not None:
            converted, why = _try_passes(qat_model, graph, pipe)
            if converted is not None:
                return _with_wrapped_modules(qat_model, converted, march, mapping)
    model = copy.deepcopy(qat_model)  # module swapping rebuilds the model in place
    fold_batch_norms(model)  # with_bn QAT convs become their fuse_bn classes (the eval forward's fold)
    if isinstance(model, torch.fx.GraphModule):
        gm = model
    else:
        gm = torch.fx.GraphModule(model, trace_fx(model), class_name=type(model).__name__)
    if not why:
        graph, why = _qat_ir(gm, mapping, inputs)
        if graph is not None:
            converted, why = _try_passes(gm, graph, pipe)
            if converted is not None:
                return _with_wrapped_modules(qat_model, converted, march, mapping)
    _convert_modules(gm, gm, march, mapping)
    gm.eval()
    gm.meta.pop(PREPARE_RECORD_KEY, None)
    gm.meta[CONVERT_PATH_KEY] = f"module swap: {why}"
    uninstall_exact_validation(gm)
    rest = Pipeline(tuple(p for p in pipe.passes if not isinstance(p, Quantize)))
    if pipeline is not None:  # the user's pipeline does not run as given: never silently
        also = f"; {rest} runs on the integer model's IR instead" if len(rest) else ""
        warnings.warn(
            f"convert_fx(pipeline='{pipe}'): the quantize pass did not convert the QAT model's IR ({why}), "
            f"so the model converts by module swapping{also}. meta['{CONVERT_PATH_KEY}'] of the result says why",
            stacklevel=2,
        )
    if len(rest):  # the integer model has no QAT op left: the passes besides quantize run on it
        emitted, _ = run_on_module(gm, rest, inputs)  # the recorded ones when none are given here
        if emitted is not None:
            emitted.meta[CONVERT_PATH_KEY] = gm.meta[CONVERT_PATH_KEY]
            gm = emitted
    return _with_wrapped_modules(qat_model, follow_training(gm), march, mapping)


def _with_wrapped_modules(
    qat_model: nn.Module, converted: torch.fx.GraphModule, march: March, mapping: Mapping[type, type] | None
) -> torch.fx.GraphModule:
    """``converted`` with the integer forms of the modules ``qat_model``'s wrapped methods call
    (qir/quantization/wrapped_modules.py), whichever path converted the graph."""
    from qir.quantization.wrapped_modules import convert_wrapped_modules

    return convert_wrapped_modules(
        qat_model, converted, lambda path, m, ins: build_quantized(path, m, ins, march, mapping)
    )


#: ``meta`` key of a ``convert_fx`` result: how it was converted ("quantize pass", or
#: "module swap: <why the pass could not>")
CONVERT_PATH_KEY = "qir.convert_path"


def _qat_ir(gm: torch.fx.GraphModule, mapping: Mapping[type, type] | None, example_inputs: Any) -> tuple[Any, str]:
    """The QAT model's IR when the ``quantize`` pass converts all of it, else ``(None, why not)``.

    The pass converts conv / linear layers and the stubs with the layout ops between them
    (passes/quantize.py); a model with any other layer converts by module swapping, which the
    pass's rules reuse, so both paths give the same integer model (tests/quantization/test_convert_paths.py).
    """
    if mapping is not None:
        return None, "a custom mapping= is honoured by module swapping only"
    hybrid = hybrid_plan_of(gm)
    screened = _without_qat_op(gm, set(hybrid.cpu_modules()) if hybrid is not None else set())
    if screened is not None:  # known before tracing: the pass cannot cover the model
        return None, f"the quantize pass does not cover {screened}"
    from qir.frontend import trace
    from qir.frontend.tracer import TraceError
    from qir.ir.op import IRError
    from qir.quantization.fake_quantize import float_fake_quant, types_only_fake_quant

    def typed(model: torch.fx.GraphModule, inputs: Any) -> Any:
        # types come from each op's shape inference (formulas, no convolution runs); a model with an op
        # that cannot infer its type is run once instead: the float forward with fake quants passing
        # their inputs through gives the same shapes and dtypes as the integer-grid one, at a fraction
        # of the cost (the graph's constants are the model's own tensors, not values of this run)
        with float_fake_quant(), types_only_fake_quant():
            return trace(model, inputs, infer_types=True)

    if example_inputs is None:  # a model that never ran: typed with unknown batch and image sizes
        from qir.quantization.unrun_typing import type_without_inputs

        graph, why = type_without_inputs(gm, typed)
        if graph is None:
            return (
                None,
                f"{why}; give example_inputs to prepare_qat_fx or convert_fx, "
                "or call the model on one batch before convert_fx",
            )
    else:
        try:
            graph = typed(gm, example_inputs)
        except (TraceError, IRError) as e:
            return None, f"the QAT model's IR could not be built: {e}"
    if hybrid is not None:
        _float_dequants_in_ir(graph)
    bad = uncovered(graph)
    if bad:
        node, reason = bad[0]
        return None, f"the quantize pass does not cover %{node}: {reason}"
    return graph, ""


def _float_dequants_in_ir(graph: Any) -> None:
    """A hybrid model's DeQuantStubs called on float values (after a CPU op) are identities: in its
    QAT IR they become calls of the float stub, the module module swapping installs there, so the
    ``quantize`` pass leaves them float. A value is codes after conversion when a QAT layer makes it
    or an op other than an opaque (CPU) call computes it from codes."""
    from qir.ir.graph import split_operands
    from qir.ir.ops.core import Call, Constant
    from qir.ir.ops.qat import QATDequantStub, QATModuleOp

    codes: set[Any] = set()
    floats = []
    for n in graph.nodes:
        op = n.op
        if isinstance(op, QATModuleOp):
            if op.makes_codes:
                codes.add(n)
            elif isinstance(op, QATDequantStub) and n.operands[0] not in codes:
                floats.append(n)
        elif not isinstance(op, (Call, Constant)) and any(v in codes for v in n.operands):
            codes.add(n)
    for n in floats:
        operands, (args, kwargs) = split_operands(((n.operands[0],), {}))
        call = Call(kind="module", target=n.scope, args=args, kwargs=kwargs)
        new = graph.create_node(call, operands, n.type, name=f"{n.name}_float", scope=n.scope)
        graph.insert_node(new, after=n)
        new.meta.update(n.meta)
        name = n.name
        n.replace_all_uses_with(new)
        graph.erase_node(n)
        graph.rename(new, name)
        graph.objects[f"module:{n.scope}"] = FloatDeQuantStub()


def _without_qat_op(gm: torch.fx.GraphModule, cpu: set[str]) -> str | None:
    """The first module call of ``gm`` that cannot become a QAT op, or None (one walk of the fx
    graph, so a model the pass cannot cover is not traced for nothing)."""
    from qir.frontend.lookup import tables
    from qir.ir.ops.qat import QATModuleOp
    from qir.ir.ops.qat_functional import FF_METHOD_FORMS, qat_method_reader

    ops = tables()
    for n in gm.graph.nodes:
        if n.op == "call_module" and str(n.target) not in cpu:  # a hybrid model's CPU modules stay float
            m = gm.get_submodule(str(n.target))
            cls = ops.for_module(m)
            if type(m) not in (nn.Identity, nn.Flatten) and (
                cls is None or not (issubclass(cls, QATModuleOp) or code_rule_covers_module(cls.name))
            ):
                return f"module '{n.target}' ({type(m).__name__}): it has no QAT op"
        elif n.op == "call_method" and module_self(gm, n) is not None:
            if qat_method_reader(module_self(gm, n)) is None or n.target not in FF_METHOD_FORMS:
                return f"'{n.args[0].target}.{n.target}' (a FloatFunctional method): it has no QAT op"  # type: ignore[union-attr]
    return None


def _try_passes(gm: torch.fx.GraphModule, graph: Any, pipe: Pipeline) -> tuple[torch.fx.GraphModule | None, str]:
    """The model converted by the pipeline, or ``(None, why not)`` when the ``quantize`` pass itself
    refuses it (a layer's dtype the march cannot requantize to, a table reading qint16): module
    swapping then converts it and raises, or defers to run time, as it always has. A failure of
    any other pass is the user's and propagates."""
    from passes.errors import PassFailure

    try:
        return follow_training(_convert_by_passes(gm, graph, pipe)), ""
    except PassFailure as e:
        if not isinstance(e.pass_, Quantize):
            raise
        return None, f"the quantize pass refused the model: {e.__cause__ or e}"


def _convert_by_passes(gm: torch.fx.GraphModule, graph: Any, pipe: Pipeline) -> torch.fx.GraphModule:
    """Run the convert pipeline (``quantize`` and the user's passes) on the QAT IR and emit it."""
    from passes.base import PassContext
    from passes.instruments import VerifyInstrument
    from passes.manager import run_pipeline
    from qir.frontend import emit

    # the graph comes straight from the front end (_qat_ir): its nodes carry the types their ops give
    # and were checked when bound, so only what the passes make is verified (after each pass)
    verify = VerifyInstrument(verify_input=False)
    # the graph is this call's own (traced for it), and qir's passes bind new tensors, writing none of the
    # QAT model's (tests/quantization/test_convert_untouched.py): a pipeline of them runs on the graph itself,
    # one with a user's pass on a copy whose constants the manager guards against writes (prepare's rule too)
    result = run_pipeline(
        graph, pipe, instruments=[verify], ctx=PassContext(), verify_each=True, inplace=builtin_only(pipe)
    )
    out = emit(result.graph, class_name=type(gm).__name__)
    _keep_unread_modules(out, gm)
    out.meta.update(copy.deepcopy({k: v for k, v in gm.meta.items() if k != PREPARE_RECORD_KEY}))
    out.meta[CONVERT_PATH_KEY] = "quantize pass"
    out.eval()
    return out


def _keep_unread_modules(out: nn.Module, qat: nn.Module) -> None:
    """Modules of the QAT model no call reads (a fused-away batch norm's Identity slot, an unused
    submodule) in place in ``out``, as module swapping keeps them: emit builds only what the graph
    calls. Only stateless ones (a module with state has it in the graph's constants, so emit made
    its path); each a copy, so the converted model shares nothing with the QAT model."""
    # one walk, every path of a shared module: the paths of the modules holding state, their own or a
    # submodule's (a module's parameters() / buffers() would walk its subtree once per module), and each
    # module at its first path, which is named_modules()'s order (a shared module's subtree, walked again
    # at its later paths, holds no module the first walk of it did not meet)
    modules: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()
    stateful: set[str] = set()
    for path, m in qat.named_modules(remove_duplicate=False):
        if id(m) not in seen:
            seen.add(id(m))
            modules.append((path, m))
        if any(t is not None for t in m._parameters.values()) or any(t is not None for t in m._buffers.values()):
            parts = path.split(".") if path else []
            stateful.update(".".join(parts[:i]) for i in range(len(parts) + 1))
    rank = {p: i for i, (p, _) in enumerate(modules)}
    present = {path for path, _ in out.named_modules()}
    parents: set[str] = set()
    for path, m in modules:
        parent = path.rpartition(".")[0]
        if not path or path in present or parent not in present or path in stateful:
            continue
        set_submodule(out, path, _copy_stateless(m))
        present.update(f"{path}.{p}" if p else path for p, _ in m.named_modules())
        parents.add(parent)
    for parent in parents:  # the QAT model's order among siblings; the converted model's own ones last
        container = out.get_submodule(parent) if parent else out
        prefix = f"{parent}." if parent else ""
        items = sorted(container._modules.items(), key=lambda kv: rank.get(prefix + kv[0], len(rank)))
        container._modules.clear()
        container._modules.update(items)


def _copy_stateless(m: nn.Module) -> nn.Module:
    """A deep copy of stateless module ``m``; a plain ``nn.Identity`` (a fused-away batch norm's slot: one
    per conv of a network) is built new, the same module at a fraction of deepcopy's cost."""
    attrs_ = vars(m)
    if (
        type(m) is nn.Identity
        and attrs_.keys() == _IDENTITY_ATTRS
        and attrs_["_is_full_backward_hook"] is None
        and not any(v for k, v in attrs_.items() if k != "training")  # no hooks, no None buffer slots
    ):
        return nn.Identity().train(m.training)
    return copy.deepcopy(m)


_IDENTITY_ATTRS = vars(nn.Identity()).keys()


def _integer_twin(qat_model: nn.Module) -> nn.Module:
    """convert_fx in the march the model was prepared for (exact validation's twin)."""
    record = qat_model.meta.get(PREPARE_RECORD_KEY) if isinstance(qat_model, torch.fx.GraphModule) else None
    if isinstance(record, PrepareRecord):
        with march_scope(record.march):
            return convert_fx(qat_model)
    return convert_fx(qat_model)


set_twin_builder(_integer_twin)


def _interpolate_view(args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """The ``interpolate`` op a ``nearest_interpolate_codes`` call computes (its arguments are
    ``F.interpolate``'s), or None when they do not bind."""
    from qir.ir.ops.vision import Interpolate

    names = Interpolate.signature  # ("input", "size", "scale_factor", "mode", ...)
    if len(args) > len(names) or not set(kwargs) <= set(names[1:]):
        return None
    bound = {**dict(zip(names[1:], args[1:], strict=False)), **kwargs}
    try:
        return Interpolate(**bound)
    except (TypeError, ValueError):
        return None


def _register_legality_views() -> None:
    """A converted model's ``relu6_codes`` and ``nearest_interpolate_codes`` calls are checked as
    the relu6 and interpolate they compute (the tables' rows for those)."""
    from passes.legality_facts import register_function_view
    from qir.frontend.lookup import qualified_name
    from qir.ir.op import OP_REGISTRY

    relu6 = OP_REGISTRY["relu6"]
    register_function_view(qualified_name(relu6_codes), lambda args, kwargs: relu6())
    register_function_view(qualified_name(nearest_interpolate_codes), _interpolate_view)


_register_legality_views()
