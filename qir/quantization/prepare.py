"""``prepare_qat_fx``: fuse a copy of the model, choose qconfigs, insert observers.

Flow (docs/tutorial.md, docs/pipelines.md): the model is deep-copied (the tensors that survive
fusion only, :mod:`qir.quantization.borrowed`), traced and fused by the
prepare pipeline's passes before ``insert-observers`` (:func:`build_fused_ir`, even if it was
fused before), functional ops that quantize (``+``, ``torch.cat``, ``*``, ``mean`` ...) become
generated ``FloatFunctional`` modules, functional ops with their own output scale (bilinear
``F.interpolate``, ``torch.sigmoid``, ``x.exp()``, ...) become generated ``qir.nn`` /
``torch.nn`` modules (:mod:`qir.quantization.functional_swap`), and the fused float model is
emitted. Every module's qconfig is resolved on it (:mod:`qir.quantization.qconfig_dict`);
each module with a qconfig whose class is in ``qir.nn.qat.QAT_MODULE_MAP`` gets observers:

* by the ``insert-observers`` pass (passes/insert_observers.py) when every such layer has a
  QAT op and every fake quant a data form: the qconfigs go to the pass as data, the passes
  after it run on the QAT IR, and the QAT model is emitted from it;
* otherwise (and for hybrid models) by replacing each module with
  ``from_float(module, qconfig)``, the whole model at once. ``meta[PREPARE_PATH_KEY]`` says
  which ran and why; both give the same model (tests/quantization/test_prepare_paths.py).

Scale-preserving functional ops (relu, reshape, max pool, ...) stay as they are.

Preparing a model that was itself prepared (calibration, then QAT: seed 003) starts from
the fused float model recorded in it and carries every calibrated scale into the new
fake quants, so QAT starts from the calibrated ranges.

With ``hybrid=True`` (docs/hybrid.md, :mod:`qir.quantization.hybrid`) the modules
``hybrid_dict`` names stay float on the CPU (traced whole, not fused, not swapped), ops
without a quantized form that receive quantized values join them, and generated
QuantStub / DeQuantStub modules mark every CPU/BPU boundary.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch import nn

from backends.common.numerics import scale_denominator
from passes.errors import PassFailure
from passes.insert_observers import InsertObservers, InsertObserversError, fake_quant_text, params_by_role, tensor_key
from passes.insert_observers import uncovered as observer_uncovered
from passes.pipeline import Pipeline
from qir.frontend.convert import gc_paused
from qir.march import March, get_march
from qir.qat_mode import QATMode, get_qat_mode
from qir.quantization.borrowed import with_empty_containers
from qir.quantization.exact_validation import TRACED_WITHOUT_EXAMPLES_KEY
from qir.quantization.exact_validation import install as install_exact_validation
from qir.quantization.fake_quant_ir import fake_quant_spec
from qir.quantization.fake_quantize import FakeQuantize
from qir.quantization.first_inputs import record_first_inputs
from qir.quantization.functional_swap import quantized_values, swap_functionals
from qir.quantization.fuse import ALL_FUNCTIONALS, FusedIR, FuseRecord, build_fused_ir, emit_fused
from qir.quantization.hybrid import HYBRID_KEY, HybridSpec, check_cpu_calls, cpu_modules, place_boundaries
from qir.quantization.integer_grid import bind_integer_grid
from qir.quantization.pipelines import (
    PipelineArg,
    resolve_pipeline,
    run_on_module,
    run_stage_pipeline,
    split_at_observers,
)
from qir.quantization.prepare_checks import check_convertible
from qir.quantization.qat_classes import qat_class_for
from qir.quantization.qconfig import QConfig, get_default_calib_qconfig, get_default_qat_qconfig, qconfig_kind
from qir.quantization.qconfig_dict import QConfigSpec, parse_qconfig_dict
from qir.quantization.shared_calls import call_sites, retie_after_load, split_call_sites, tie_to
from qir.quantization.with_bn import folded_batch_norms
from qir.quantization.wrapped_modules import QATParts, prepare_wrapped_modules, wrapped_qconfigs
from qir.quantization.wrapped_self import follow_training, picklable

__all__ = [
    "PREPARE_BY_PASS",
    "PREPARE_PATH_KEY",
    "PREPARE_RECORD_KEY",
    "PrepareRecord",
    "prepare_qat_fx",
    "qat_class_for",
    "require_march",
]

#: ``GraphModule.meta`` key of the :class:`PrepareRecord`.
PREPARE_RECORD_KEY = "qir.prepare_record"
#: ``GraphModule.meta`` key saying how observers went in: :data:`PREPARE_BY_PASS`, or
#: "module swap: <why the insert-observers pass could not>"
PREPARE_PATH_KEY = "qir.prepare_path"
PREPARE_BY_PASS = "insert-observers pass"


@dataclass
class PrepareRecord:
    """What a prepared model was made from (a later prepare starts from ``float_model``)."""

    float_model: torch.fx.GraphModule
    march: March
    kind: str  # "qat" or "calibration"
    #: the hybrid_dict of a hybrid prepare (None: not hybrid); a later prepare must use the same
    hybrid: HybridSpec | None = None
    #: the CPU modules it resolved to (path -> reason); a later prepare reuses them, since the
    #: float model then also holds generated modules a ``module_type`` entry could match
    cpu: dict[str, str] = field(default_factory=dict)
    #: modules called at several places -> the paths of their QAT modules for calls 2, 3, ...
    #: (the first call keeps the module's path; qir/quantization/shared_calls.py)
    call_sites: dict[str, list[str]] = field(default_factory=dict)
    #: fused module path -> (path, copy) of the batch norm folded into it at the first prepare;
    #: the with_bn QAT mode unfolds it again (qir/quantization/with_bn.py)
    batch_norms: dict[str, tuple[str, nn.Module]] = field(default_factory=dict)
    #: detached copies of the ``example_inputs`` prepare was given (None: none): ``convert_fx``
    #: types the QAT model's IR with them to convert by the ``quantize`` pass
    example_inputs: Any = None


def _detached(example_inputs: Any) -> Any:
    if example_inputs is None:
        return None
    return torch.utils._pytree.tree_map(
        lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v, example_inputs
    )


def require_march(what: str) -> March:
    """The current march, or an error telling how to set one."""
    march = get_march(None)
    if march is None:
        raise RuntimeError(
            f"{what} needs a target march: call qir.march.set_march(qir.march.March.BAYES) (or 'bernoulli2') first"
        )
    return march


def _is_qat(m: nn.Module) -> bool:
    from qir.nn.qat import QATModule

    return any(isinstance(x, QATModule) for x in m.modules())


def _float_qconfig(record: FuseRecord, spec: QConfigSpec) -> Callable[[str, nn.Module], QConfig | None]:
    """The qconfig of a module prepare left float (None for QAT modules and stubs), by its path."""

    def of(path: str, m: nn.Module) -> QConfig | None:
        if _is_qat(m):
            return None
        return spec.resolve(path, record.sources.get(path, []), [record.source_types.get(path), type(m)])

    return of


def _qat_parts() -> QATParts:
    """prepare's QAT classes for the modules of wrapped methods (qir/quantization/wrapped_modules.py)."""
    from qir.nn import qat
    from qir.quantization.stubs import QuantStub

    return QATParts(
        module_base=qat.QATModule,
        quant_stub=lambda qc: qat.QuantStub.from_float(QuantStub(), qc),
        dequant_stub=qat.DeQuantStub,
        kept_float=(qat.QuantStub, qat.DeQuantStub, qat.FloatFunctional),
    )


def _called_modules(gm: torch.fx.GraphModule) -> list[str]:
    """Module paths the graph calls (call_module) or whose methods it calls (FloatFunctional)."""
    paths: list[str] = []
    for n in gm.graph.nodes:
        if n.op == "call_module":
            paths.append(str(n.target))
        elif n.op == "get_attr" and isinstance(_get(gm, str(n.target)), nn.Module):
            paths.append(str(n.target))
    return list(dict.fromkeys(paths))


def _get(gm: nn.Module, path: str) -> Any:
    obj: Any = gm
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def set_submodule(root: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, leaf = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    parent._modules[leaf] = module


def _key_map(path: str, float_mod: nn.Module, qat_mod: nn.Module) -> dict[str, str]:
    """Float key -> QAT key for one swapped module (``conv.weight`` -> ``weight``)."""
    qat_keys = set(qat_mod.state_dict())
    out: dict[str, str] = {}
    prefix = f"{path}." if path else ""
    for k in float_mod.state_dict():
        if k in qat_keys:
            continue
        short = k.split(".", 1)[1] if "." in k else k
        if short in qat_keys:
            out[prefix + k] = prefix + short
    return out


def check_kinds(chosen: Mapping[str, QConfig]) -> str:
    """The one qconfig kind of ``chosen``; a clear error when calibration and QAT mix."""
    by_kind: dict[str, tuple[str, QConfig]] = {}
    for path, qc in chosen.items():
        if qc.activation is None and qc.weight is None:
            continue
        by_kind.setdefault(qconfig_kind(qc), (path, qc))
    if len(by_kind) > 1:
        (p1, q1), (p2, q2) = by_kind["qat"], by_kind["calibration"]
        raise ValueError(
            "calibration and QAT qconfigs cannot be mixed in one prepare: "
            f"module '{p1 or '<root>'}' has a QAT qconfig ({q1.activation!r}), module '{p2 or '<root>'}' has a "
            f"calibration qconfig ({q2.activation!r}); prepare with calibration qconfigs only, run calibration, "
            "then call prepare_qat_fx again on the calibrated model with QAT qconfigs"
        )
    return next(iter(by_kind), "qat")


Plan = list[tuple[str, nn.Module, type, QConfig]]


def _plan(gm: torch.fx.GraphModule, record: FuseRecord, spec: QConfigSpec, keep_float: Collection[str] = ()) -> Plan:
    """``(path, float module, QAT class, qconfig)`` of every quantizable called module outside
    ``keep_float`` whose qconfig is not None, in call order."""
    plan: Plan = []
    for path in _called_modules(gm):
        if path in keep_float:
            continue
        m = gm.get_submodule(path)
        cls = qat_class_for(m)
        if cls is None:
            continue
        names = record.sources.get(path, [])
        types: list[Any] = [type(m)]
        if path in record.source_types:
            types.insert(0, record.source_types[path])
        if path in record.generated:
            types.insert(0, record.generated[path])
        qc = spec.resolve(path, names, types)
        if qc is None:
            continue
        plan.append((path, m, cls, qc))
    return plan


def _swap(
    gm: torch.fx.GraphModule, record: FuseRecord, plan: Plan, sites: Mapping[str, list[str]]
) -> dict[str, QConfig]:
    """Replace every planned module by its QAT class (module swapping).

    A module called at several places gets one QAT module per call site (``sites``, already
    pointed at by the graph), tied to the first (:mod:`qir.quantization.shared_calls`).
    Returns the qconfig of every swapped module and call site."""
    chosen: dict[str, QConfig] = {}
    shared: dict[tuple[int, tuple[int, ...], tuple[int, ...]], nn.Parameter] = {}
    for path, m, cls, qc in plan:
        qat = cls.from_float(m, qc)  # type: ignore[attr-defined]
        _tie_shared_parameters(m, qat, shared)
        record.remap.key_map.update(_key_map(path, m, qat))
        set_submodule(gm, path, qat)
        chosen[path] = qc
        for site in sites.get(path, []):
            clone = cls.from_float(m, qc)  # type: ignore[attr-defined]
            tie_to(clone, qat)
            set_submodule(gm, site, clone)
            chosen[site] = qc
    if sites:
        gm.recompile()
        gm.register_load_state_dict_post_hook(retie_after_load)
    return chosen


def _observer_options(plan: Plan, sites: Mapping[str, list[str]]) -> tuple[InsertObservers | None, str]:
    """``insert-observers`` with the plan's qconfigs as plain data, or ``(None, why not)`` when a
    qconfig's fake quant has no data form (a learnable scale, a user observer)."""

    texts: dict[str, int] = {}  # fake quant text -> its index in the options
    pairs: dict[int, tuple[int | None, int | None]] = {}  # by qconfig identity: a model shares a few
    entries: list[tuple[str, int | None, int | None]] = []
    for path, _, _, qc in plan:
        if id(qc) not in pairs:
            pair: list[int | None] = []
            for what, factory in (("activation", qc.activation), ("weight", qc.weight)):
                if factory is None:
                    pair.append(None)
                    continue
                try:
                    text = fake_quant_text(fake_quant_spec(factory(), f"qconfig of '{path}' {what}"))
                except NotImplementedError as e:
                    return None, str(e)
                pair.append(texts.setdefault(text, len(texts)))
            pairs[id(qc)] = (pair[0], pair[1])
        entries.append((path, *pairs[id(qc)]))
    call_sites = tuple((p, tuple(s)) for p, s in sites.items())
    return InsertObservers(fake_quants=tuple(texts), qconfigs=tuple(entries), call_sites=call_sites), ""


def _observe_by_pass(
    fused: FusedIR,
    plan: Plan,
    sites: Mapping[str, list[str]],
    after: Pipeline,
    verify: bool,
) -> tuple[torch.fx.GraphModule | None, str]:
    """The QAT model emitted from the fused IR after ``insert-observers`` (and the passes after
    it), or ``(None, why not)`` when the pass does not cover every planned module."""
    resolved, why = _observer_options(plan, sites)
    if resolved is None:
        return None, why
    bad = observer_uncovered(fused.graph, {scope for scope, _, _ in resolved.qconfigs})
    if bad:
        node, reason = bad[0]
        return None, f"the insert-observers pass does not cover %{node}: {reason}"
    try:
        # in place: the fused float model is emitted already, and a refusal falls back to swapping it
        result = run_stage_pipeline(fused.graph, Pipeline((resolved, *after.passes)), "prepare", verify, inplace=True)
    except PassFailure as e:
        if e.pass_ is resolved and isinstance(e.__cause__, InsertObserversError):
            return None, str(e.__cause__)
        raise
    gm = emit_fused(fused, result.graph)
    for path, m, _, _ in plan:
        fused.record.remap.key_map.update(_key_map(path, m, gm.get_submodule(path)))
    for path, names in sites.items():
        owner = gm.get_submodule(path)
        for site in names:
            tie_to(gm.get_submodule(site), owner)
            # last among its siblings, in call order, as module swapping adds the call sites
            parent, _, leaf = site.rpartition(".")
            children = gm.get_submodule(parent)._modules
            children[leaf] = children.pop(leaf)
    if sites:
        gm.register_load_state_dict_post_hook(retie_after_load)
    return gm, ""


def _float_record(gm: torch.fx.GraphModule, plan: Plan) -> torch.fx.GraphModule:
    """The deep copy of the fused float model ``gm`` that the :class:`PrepareRecord` keeps.

    The float modules ``plan`` names are taken over instead of copied: the QAT model gets new
    modules in their place either way (module swapping's ``from_float`` copies their tensors; the
    ``insert-observers`` path emits a new model), so after this ``gm`` is the only other holder of
    them, and it lets go of them or is dropped. One copy of the weights instead of two. A planned
    module ``gm`` holds elsewhere too (at a second path, or one of its tensors in another module)
    is copied as before, so the record never shares state with the model that trains."""
    planned = {id(m): m for _, m, _, _ in plan}
    outside: set[int] = set()  # modules and tensors reachable without entering a planned module
    hits: dict[int, int] = {}  # planned module -> the number of places the tree holds it

    def walk(mod: nn.Module) -> None:
        outside.update(id(t) for t in (*mod._parameters.values(), *mod._buffers.values()) if t is not None)
        for child in mod._modules.values():
            if child is None:
                continue
            if id(child) in planned:
                hits[id(child)] = hits.get(id(child), 0) + 1
            elif id(child) not in outside:
                outside.add(id(child))
                walk(child)

    walk(gm)
    memo: dict[int, Any] = {}
    for key, m in planned.items():
        if hits.get(key) != 1:
            continue
        inner = [id(x) for x in m.modules()] + [id(t) for t in (*m.parameters(), *m.buffers())]
        if not any(i in outside for i in inner):
            memo[key] = m
    return copy.deepcopy(gm, with_empty_containers(gm, memo))


def _tie_shared_parameters(
    float_mod: nn.Module, qat: nn.Module, shared: dict[tuple[int, tuple[int, ...], tuple[int, ...]], nn.Parameter]
) -> None:
    """Keep weights shared: a float tensor two swapped modules hold (a conv called at two sites,
    one of which fused with an add into a ConvAdd) becomes one QAT Parameter they both hold.

    ``from_float`` copies tensors so that the user's model is never aliased; within the prepared
    copy, sharing must survive or the copies train apart."""
    qat_params = dict(qat.named_parameters(remove_duplicate=False))
    for qname, ft in params_by_role(float_mod, qat_params).items():
        mine = qat_params[qname]
        if mine.shape != ft.shape:
            continue
        owner = shared.setdefault(tensor_key(ft), mine)
        if owner is not mine:
            parent, _, leaf = qname.rpartition(".")
            setattr(qat.get_submodule(parent) if parent else qat, leaf, owner)


_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def check_shared_batch_norms(gm: torch.fx.GraphModule, keep_float: Collection[str] = ()) -> None:
    """Refuse a batch norm left unfolded behind a conv called at several places.

    Fusion folds a batch norm into the conv's weight; a conv shared by call sites followed by
    *different* batch norms (one per FPN level), or by a batch norm after some calls only,
    has no one folded weight, and the batch norm
    alone has no quantized form, so convert would fail later with advice that does not help.
    """
    sites = call_sites(gm)
    for n in gm.graph.nodes:
        if n.op != "call_module" or str(n.target) in keep_float:
            continue
        if not isinstance(gm.get_submodule(str(n.target)), _BATCH_NORMS) or not n.args:
            continue
        src = n.args[0]
        if not isinstance(src, torch.fx.Node) or src.op != "call_module":
            continue
        conv = str(src.target)
        calls = sites.get(conv, [])
        if len(calls) < 2:
            continue
        norms = [str(u.target) for c in calls for u in c.users if u.op == "call_module"]
        raise ValueError(
            f"module '{conv}' is called at {len(calls)} places, and what follows its calls "
            f"({', '.join(repr(b) for b in dict.fromkeys(norms))}) is not one batch norm module after every call: "
            "a batch norm folds into the conv's weight, "
            f"so '{n.target}' cannot fold into a weight the other call sites share, and a batch norm alone has "
            "no quantized form. Give each call site its own conv (copy.deepcopy), or share one batch norm "
            "module with the conv; eager mode's fuse_conv_shared_modules copies the conv per batch norm as "
            "the plugin does"
        )


def _carry_scales(src: nn.Module, dst: nn.Module) -> None:
    """Start ``dst``'s fake quants from ``src``'s (calibrated) scales; copy other matching state."""
    src_fq = {n: m for n, m in src.named_modules() if isinstance(m, FakeQuantize)}
    fq_prefixes = tuple(f"{n}." for n, m in dst.named_modules() if isinstance(m, FakeQuantize))
    src_sd, dst_sd = src.state_dict(), dst.state_dict()
    plain = {
        k: v for k, v in src_sd.items() if k in dst_sd and not k.startswith(fq_prefixes) and dst_sd[k].shape == v.shape
    }
    with torch.no_grad():
        for k, v in plain.items():
            dst_sd[k].copy_(v)
        for name, fq in dst.named_modules():
            old = src_fq.get(name)
            if not isinstance(fq, FakeQuantize) or old is None or fq.has_fixed_scale or old.scale.numel() == 0:
                continue
            if fq.ch_axis != old.ch_axis:
                continue
            # the same range in fq's dtype (a qint8 calibration may start a qint16 QAT fake quant)
            amax = old.scale.detach() * scale_denominator(old.dtype)
            fq.start_from_scale(amax / scale_denominator(fq.dtype), amax)


def _stub_qconfig(spec: QConfigSpec, kind: str) -> QConfig:
    """The qconfig of generated QuantStubs whose consumers have no activation fake quant."""
    g = spec.global_qconfig
    if isinstance(g, QConfig) and g.activation is not None and qconfig_kind(g) == kind:
        return g
    return get_default_calib_qconfig() if kind == "calibration" else get_default_qat_qconfig()


def _prepare_float(
    model: nn.Module,
    qconfig_dict: Mapping[str, Any] | None,
    example_inputs: Any,
    march: March,
    hybrid: HybridSpec | None = None,
    cpu: Mapping[str, str] | None = None,
    pipeline: PipelineArg | None = None,
    batch_norms: Mapping[str, tuple[str, nn.Module]] | None = None,
) -> torch.fx.GraphModule:
    if cpu is None:
        cpu = cpu_modules(model, hybrid) if hybrid is not None else {}
    swapped: dict[str, Any] = {}
    before, observe, after = split_at_observers(resolve_pipeline("prepare", pipeline))
    if observe.qconfigs or observe.call_sites or observe.fake_quants:
        raise ValueError(
            f"the prepare pipeline's {observe} has options of its own, but prepare_qat_fx resolves them from the "
            "qconfigs (qconfig_dict, .qconfig attributes): write plain insert-observers in pipeline=, and change "
            "a layer's fake quants with a pass after it (docs/passes.md)"
        )
    fused = build_fused_ir(
        model,
        example_inputs,
        functionals=ALL_FUNCTIONALS,
        keep_whole=frozenset(cpu),
        prepare_objects=lambda g: swapped.update(swap_functionals(g, inputs_quantized=hybrid is not None)),
        pipeline=before,
        # hybrid: float values may go to the BPU through generated QuantStubs, so every call counts
        quantized_values=None if hybrid is not None else quantized_values,
    )
    gm, record = emit_fused(fused), fused.record
    check_cpu_calls(gm, cpu)
    check_shared_batch_norms(gm, cpu)
    for path, target in swapped.items():
        record.generated[path] = target
        record.sources[path] = [path]
    spec = parse_qconfig_dict(qconfig_dict, record.qconfig_attrs)
    plan = _plan(gm, record, spec, keep_float=cpu)
    float_copy = _float_record(gm, plan)
    kind = check_kinds({p: qc for p, _, _, qc in plan})  # before any module is swapped or observed
    # every call site of a module called at several places gets its own output observer
    sites = split_call_sites(gm, [p for p, _, _, _ in plan])
    chosen = {p: qc for p, _, _, qc in plan} | {s: qc for p, _, _, qc in plan for s in sites.get(p, [])}
    # a hybrid model's CPU modules are not in the plan: the pass leaves them float, as swapping does
    qat, why = _observe_by_pass(fused, plan, sites, after, example_inputs is not None)
    if qat is not None:
        gm, path = qat, PREPARE_BY_PASS
    else:
        _swap(gm, record, plan, sites)
        path = f"module swap: {why}"
        if len(after):  # the passes after insert-observers run on the swapped model's IR
            emitted, _ = run_on_module(gm, after, example_inputs)
            if emitted is not None:
                emitted.meta.update(gm.meta)
                gm = emitted
    if hybrid is None:  # a hybrid model's wrapped calls run on the CPU, float (docs/hybrid.md)
        prepare_wrapped_modules(
            gm,
            fused.root,
            # read only when the model has a wrapped call
            itertools.chain(_called_modules(gm), (n for names in record.sources.values() for n in names)),
            lambda path, t: spec.resolve(path, (), (t,)),
            lambda path, m, qat: record.remap.key_map.update(_key_map(path, m, qat)),
            _qat_parts(),
        )
        wrapped = wrapped_qconfigs(gm)
        if wrapped:  # they may not mix calibration and QAT either (the graph's modules were checked above)
            kind = check_kinds(chosen | wrapped)
    if hybrid is not None:
        gm.meta[HYBRID_KEY] = place_boundaries(gm, cpu, chosen, _stub_qconfig(spec, kind))
    if batch_norms is None:  # the first prepare: the traced deep copy of the user's model still has them
        batch_norms = folded_batch_norms(fused.root, record.sources, copies=False)
        if fused.borrowed is not None:  # they hold the user's statistics: copies of those, not of the modules
            for _, bn in batch_norms.values():
                fused.borrowed.own_module(bn)
    picklable(float_copy)  # torch.save of the prepared model pickles it
    gm.meta[PREPARE_RECORD_KEY] = PrepareRecord(
        float_model=float_copy,
        march=march,
        kind=kind,
        hybrid=hybrid,
        cpu=dict(cpu),
        call_sites=sites,
        batch_norms=dict(batch_norms),
        example_inputs=_detached(example_inputs),
    )
    gm.meta[PREPARE_PATH_KEY] = path
    gm.meta[TRACED_WITHOUT_EXAMPLES_KEY] = example_inputs is None
    if example_inputs is None:  # convert_fx types the QAT IR with the first call's inputs instead
        record_first_inputs(gm)
    # a hybrid model places float modules on the CPU behind generated stubs instead
    check_convertible(gm, record.owners, None if hybrid is not None else _float_qconfig(record, spec), march.value)
    gm.train(model.training)
    follow_training(gm)
    bind_integer_grid(gm, march.value)
    return install_exact_validation(gm)


def _hybrid_spec(hybrid: bool, hybrid_dict: Mapping[str, Any] | None) -> HybridSpec | None:
    spec = HybridSpec.parse(hybrid_dict)  # validates even when unused
    if hybrid_dict is not None and not hybrid:
        raise ValueError(
            "hybrid_dict is read only by hybrid preparation: pass prepare_qat_fx(..., hybrid=True, "
            "hybrid_dict=...) to run those modules on the CPU, or drop hybrid_dict"
        )
    return spec if hybrid else None


def _same_hybrid(record: PrepareRecord, hybrid: HybridSpec | None) -> None:
    """A re-prepare must place modules as the first prepare did: fusion and boundaries were fixed then."""
    old = record.hybrid
    if (old is None and hybrid is None) or (old is not None and hybrid is not None and old.same_as(hybrid)):
        return

    def show(h: HybridSpec | None) -> str:
        return f"hybrid=True, hybrid_dict={h}" if h is not None else "hybrid=False"

    raise ValueError(
        f"the model was prepared with {show(old)} but this prepare_qat_fx call has {show(hybrid)}; the CPU/BPU "
        "placement decides fusion and the generated stubs when the float model is first prepared, so calibration "
        f"and QAT must agree: pass {show(old)} here, or prepare the float model again with the new placement"
    )


# Like tracing, these build many small objects; a paused cyclic GC keeps the cost linear in model
# size (benchmarks/pipeline_cost.py: 1.13x growth per node from 500 to 2,500 blocks with it, 1.00x without).
@gc_paused()
def prepare_qat_fx(
    model: nn.Module,
    qconfig_dict: Mapping[str, Any] | None = None,
    example_inputs: Any = None,
    hybrid: bool = False,
    hybrid_dict: Mapping[str, Any] | None = None,
    pipeline: PipelineArg | None = None,
) -> torch.fx.GraphModule:
    """A QAT (or calibration) GraphModule built from a deep copy of ``model``.

    ``qconfig_dict``: see :mod:`qir.quantization.qconfig_dict` (``""``, ``module_type``,
    ``module_name``); without it, ``.qconfig`` attributes (``model.qconfig``) decide.
    ``example_inputs`` types the traced graph (optional). A model returned by an earlier
    ``prepare_qat_fx`` (e.g. after calibration) is re-prepared from its float model with
    its calibrated scales carried over. The input model is never modified.

    ``hybrid=True``: CPU/BPU heterogeneous preparation; ``hybrid_dict`` (``{"module_name":
    [paths], "module_type": [classes]}``) names the modules that stay float on the CPU
    (docs/hybrid.md). The placement is in ``qir.quantization.hybrid_placement(result)``.

    ``pipeline``: the IR passes run on the traced float model before QAT modules are
    swapped in (pipeline text, a ``passes.Pipeline`` or a list of passes); default
    ``qir.quantization.default_pipeline("prepare")``. Re-preparing a calibrated model runs
    it again on the recorded float model, so its passes should be idempotent
    (docs/pipelines.md).
    """
    resolved = resolve_pipeline("prepare", pipeline)  # a bad pipeline fails before any work
    spec = _hybrid_spec(hybrid, hybrid_dict)
    march = require_march("prepare_qat_fx")
    if _is_qat(model):
        record = model.meta.get(PREPARE_RECORD_KEY) if isinstance(model, torch.fx.GraphModule) else None
        if not isinstance(record, PrepareRecord):
            raise ValueError(
                f"{type(model).__name__} already holds QAT modules but was not made by prepare_qat_fx; "
                "prepare the float model instead"
            )
        _same_hybrid(record, spec)
        if example_inputs is None:
            # the first prepare's example inputs, or the arguments of the prepared model's first call
            # (qir/quantization/first_inputs.py): real inputs type the IR, never guessed shapes
            example_inputs = record.example_inputs
        new = _prepare_float(
            record.float_model, qconfig_dict, example_inputs, march, spec, record.cpu, resolved, record.batch_norms
        )
        _carry_scales(model, new)
        new.train(model.training)
        return _apply_qat_mode(new)
    return _apply_qat_mode(_prepare_float(model, qconfig_dict, example_inputs, march, spec, pipeline=resolved))


def _apply_qat_mode(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """In the with_bn QAT mode, keep the folded batch norms in the QAT convs (after scales were carried)."""
    from qir.nn.qat import keep_batch_norms

    record = gm.meta[PREPARE_RECORD_KEY]
    if get_qat_mode() is QATMode.WithBN and record.kind == "qat":
        keep_batch_norms(gm, record.batch_norms, record.call_sites)
    return gm
