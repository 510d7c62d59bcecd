"""Eager mode: ``fuse_known_modules`` (for ``torch.quantization.fuse_modules``), ``prepare_qat``, ``convert``.

Eager fusion returns modules that print like the seeds' (``ConvReLU2d((0): Conv2d, (1): ReLU())``):
the same :mod:`qir.nn.intrinsic` classes, with the children stored under ``"0"`` / ``"1"``
(``conv`` / ``relu`` stay readable as attributes). Batch norms are folded into the conv.

``prepare_qat`` swaps modules by class, honouring ``.qconfig`` attributes propagated from
parents to children; ``convert`` needs each module's input scales: it fx-traces the QAT model
once (QAT modules as leaves) to learn which module feeds which, or, for a model fx cannot
trace, reads what the QAT model's forwards recorded (:mod:`qir.quantization.eager_record`).

A prepared model's instance ``forward`` (:class:`ExactForward`) makes what it computes what it
deploys: in validation state it runs its eager ``convert``, and in QAT state its conv / linear /
average pool modules train on the integer grid, bound from the recorded forwards
(:mod:`qir.quantization.eager_grid`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.fx
from torch import nn

from passes.absorb_bn import fold_batch_norm
from qir.frontend.lookup import stub_classes, tables
from qir.march import march_scope
from qir.nn.intrinsic.fused import FUSED_CLASSES, FusedModule
from qir.qat_mode import QATMode, get_qat_mode
from qir.quantization import eager_record
from qir.quantization.convert import ConvertError, _convert_modules, _is_qat_module
from qir.quantization.eager_grid import bind_eager_grid
from qir.quantization.eval_observers import note_forward
from qir.quantization.exact_validation import EAGER_FLAG, exact_twin, forget_failure
from qir.quantization.fuse import trace_fx
from qir.quantization.integer_grid import unbind_all
from qir.quantization.prepare import check_kinds, qat_class_for, require_march, set_submodule
from qir.quantization.qconfig import QConfig, as_qir_qconfig
from qir.quantization.shared_calls import call_sites
from qir.quantization.wrapped_modules import hidden_in_wrapped_calls

__all__ = ["convert", "fuse_known_modules", "positional", "prepare_qat"]

_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose2d, nn.Linear)
_BNS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
_ACTS: dict[type, str] = {nn.ReLU: "relu", nn.ReLU6: "relu6"}
_ALIASES = {"conv": "0", "relu": "1"}


class _Positional:
    """Mixin: children live under ``"0"`` / ``"1"`` (eager printout and keys); ``conv`` /
    ``relu`` remain attributes."""

    _modules: dict[str, nn.Module]

    def __getattr__(self, name: str) -> Any:
        alias = _ALIASES.get(name)
        if alias is not None and alias in self.__dict__.get("_modules", {}):
            return self.__dict__["_modules"][alias]
        return super().__getattr__(name)  # type: ignore[misc]

    def to_standard(self) -> FusedModule:
        """The plain :mod:`qir.nn.intrinsic` module (children named ``conv`` / ``relu``)."""
        base = next(c for c in type(self).__mro__ if c in _STANDARD)
        conv = self._modules["0"]
        relu = self._modules.get("1")
        m = base(conv, relu)
        m.train(getattr(self, "training", True))
        return m


_STANDARD: set[type] = set(FUSED_CLASSES.values())
_POSITIONAL: dict[type, type] = {}


def _make_positional() -> None:
    for cls in FUSED_CLASSES.values():
        name = cls.__name__
        # same class name (the printout says ConvReLU2d); importable here under it for pickling
        pos: type = type(
            name,
            (_Positional, cls),
            {
                "__module__": __name__,
                "__qualname__": f"_eager.{name}",
                "__doc__": f"{cls.__doc__} Eager layout: children '0', '1'.",
            },
        )
        _POSITIONAL[cls] = pos
        _EAGER_NS[name] = pos


class _Namespace:
    """Holds the eager classes so ``__qualname__`` ``_eager.ConvReLU2d`` resolves for pickle."""


_EAGER_NS: dict[str, type] = {}
_eager = _Namespace()
_make_positional()
for _n, _c in _EAGER_NS.items():
    setattr(_eager, _n, _c)


def positional(m: FusedModule) -> FusedModule:
    """``m`` with its children re-keyed ``"0"``/``"1"`` (the eager layout)."""
    cls = _POSITIONAL[type(m)]
    new: Any = object.__new__(cls)
    nn.Module.__init__(new)
    new._modules["0"] = m.conv
    if "relu" in m._modules:
        new._modules["1"] = m.relu
    new.train(m.training)
    return new  # type: ignore[no-any-return]


def _fold(conv: nn.Module, bn: nn.Module) -> nn.Module:
    """A copy of ``conv`` with ``bn`` (running statistics) folded in."""
    op_cls = tables().for_module(conv)
    assert op_cls is not None
    op: Any = op_cls.from_module(conv)
    c: Any = conv
    b: Any = bn
    w, bias = fold_batch_norm(
        op,
        c.weight,
        c.bias,
        b.running_mean,
        b.running_var,
        b.weight if b.affine else None,
        b.bias if b.affine else None,
        float(b.eps),
    )
    new: Any = copy.deepcopy(conv)
    new.weight = nn.Parameter(w.to(c.weight.dtype), requires_grad=bool(c.weight.requires_grad))
    new.bias = nn.Parameter(bias.to(c.weight.dtype), requires_grad=True)
    return new  # type: ignore[no-any-return]


def _is_float_functional(m: nn.Module) -> bool:
    from qir.frontend.lookup import float_functional_classes

    return isinstance(m, float_functional_classes())


def fuse_known_modules(
    mod_list: Sequence[nn.Module],
    is_qat: bool = False,
    additional_fuser_method_mapping: Mapping[tuple[type, ...], Callable[..., nn.Module]] | None = None,
) -> list[nn.Module]:
    """``fuser_func`` for ``torch.quantization.fuse_modules``: fuse ``[conv, bn?, add?, relu?]``.

    ``conv`` is a Conv1d/2d/3d, ConvTranspose2d or Linear; ``bn`` a batch norm (folded with its
    running statistics, in QAT too, as the seeds do); ``add`` a ``FloatFunctional`` (qir's or
    torch's) that the forward calls as ``add(conv_branch, other)``; ``relu`` a ReLU / ReLU6.
    Returns a list as long as ``mod_list`` with ``Identity()`` everywhere but one place: the
    first without an add, and the ``FloatFunctional``'s place with one (as the plugin does): the
    forward's ``self.conv(x)`` then passes ``x`` through and ``self.add.add(x, other)`` computes
    ``act(conv(x) + other)``. ``additional_fuser_method_mapping`` maps type tuples to
    ``fn(is_qat, *mods)``.
    """
    mods = list(mod_list)
    types = tuple(type(m) for m in mods)
    if additional_fuser_method_mapping and types in additional_fuser_method_mapping:
        custom = additional_fuser_method_mapping[types](is_qat, *mods)
        return [custom] + [nn.Identity() for _ in mods[1:]]
    supported = (
        "supported sequences are conv, conv+bn, conv+relu(6), conv+bn+relu(6), conv(+bn)+add, conv(+bn)+add+relu(6) "
        "(conv: Conv1d/2d/3d, ConvTranspose2d or Linear; add: a FloatFunctional the forward calls as "
        "add(conv_output, other))"
    )
    if not mods or not isinstance(mods[0], _CONVS):
        raise ValueError(
            f"fuse_known_modules cannot fuse {[t.__name__ for t in types]}: the first module must be one of "
            f"{', '.join(c.__name__ for c in _CONVS)}; {supported}"
        )
    conv: nn.Module = mods[0]
    rest = mods[1:]
    if rest and isinstance(rest[0], _BNS):
        conv = _fold(conv, rest[0])
        rest = rest[1:]
    add_at = None
    if rest and _is_float_functional(rest[0]):
        add_at = len(mods) - len(rest)
        rest = rest[1:]
    act = None
    relu: nn.Module | None = None
    if rest and type(rest[0]) in _ACTS:
        act, relu = _ACTS[type(rest[0])], rest[0]
        rest = rest[1:]
    if rest:
        raise ValueError(f"fuse_known_modules cannot fuse {[t.__name__ for t in types]}: {supported}")
    if act is None and add_at is None:
        fused: nn.Module = conv
    else:
        fused = positional(FUSED_CLASSES[(type(conv), add_at is not None, act)](conv, relu))
    fused.train(mods[0].training)
    qconfig = getattr(mods[-1], "qconfig", None)
    if qconfig is not None:
        fused.qconfig = qconfig  # type: ignore[assignment]
    at = 0 if add_at is None else add_at
    out: list[nn.Module] = [nn.Identity() for _ in mods]
    for m in out:
        m.train(mods[0].training)
    out[at] = fused
    return out


# ---------------------------------------------------------------------------------------------
# prepare_qat


def _standard(m: nn.Module) -> nn.Module:
    return m.to_standard() if isinstance(m, _Positional) else m


def prepare_qat(model: nn.Module, mapping: Mapping[type, type] | None = None, inplace: bool = False) -> nn.Module:
    """Swap the modules of ``model`` (a copy unless ``inplace``) for their QAT classes.

    A module's qconfig is its ``.qconfig`` or its nearest ancestor's (as torch's
    ``propagate_qconfig_``); modules without one, and modules whose ``.qconfig`` was set to ``None``
    (and what they hold), stay float. ``mapping`` defaults to
    ``qir.nn.qat.QAT_MODULE_MAP``.
    """
    march = require_march("prepare_qat")
    if get_qat_mode() is not QATMode.FuseBN:
        raise NotImplementedError(
            f"prepare_qat (eager mode) in the {get_qat_mode().value} QAT mode: eager fusion folds the batch norm "
            "at fuse_known_modules, so only fuse_bn is implemented here; use prepare_qat_fx for with_bn, or "
            "set_qat_mode('fuse_bn')"
        )
    if not inplace:
        model = copy.deepcopy(model)
    plan: list[tuple[str, nn.Module, type, QConfig]] = []
    stubs = stub_classes()

    def visit(m: nn.Module, path: str, qc: QConfig | None) -> None:
        for name, child in m.named_children():
            child_path = f"{path}.{name}" if path else name
            # a torch.quantization.QConfig of qir factories converts
            own = as_qir_qconfig(getattr(child, "qconfig", None), f"module '{child_path}'.qconfig")
            # ``child.qconfig = None`` keeps it and what it holds float, as torch's propagate_qconfig_
            # and prepare_qat_fx read it; a stub's constructor sets None, which inherits
            explicit_none = own is None and "qconfig" in child.__dict__ and not isinstance(child, stubs)
            cqc = None if explicit_none else own if own is not None else qc
            cls = qat_class_for(child, mapping)
            if cls is not None and cqc is not None:
                plan.append((child_path, child, cls, cqc))
            else:
                visit(child, child_path, cqc)

    visit(model, "", as_qir_qconfig(getattr(model, "qconfig", None), "model.qconfig"))
    check_kinds({p: qc for p, _, _, qc in plan})
    for path, m, cls, qc in plan:
        set_submodule(model, path, cls.from_float(_standard(m), qc))  # type: ignore[attr-defined]
    _refuse_shared_observers(model, [path for path, _, _, _ in plan])
    # forwards record which module feeds which: convert needs no fx trace (eager_record.py)
    eager_record.install(model, [path for path, _, _, _ in plan])
    model.forward = ExactForward(model, march.value)  # type: ignore[method-assign]
    return model


class ExactForward:
    """The instance ``forward`` of an eager QAT model: in validation state (every fake quant in
    VALIDATION) it runs the model's integer twin, the eager :func:`convert` of its current state
    (built on first use, rebuilt when a parameter, buffer or submodule changes;
    :mod:`qir.quantization.exact_validation`), so QAT validation equals the converted model bit for
    bit. Otherwise it is the class's ``forward``, after which the integer-grid bindings are
    refreshed when the forward recorded a new call site. An instance attribute, not a subclass, so
    the model keeps its class and pickles; ``set_exact_validation(model, False)`` /
    ``set_integer_grid(model, False)`` turn the two off."""

    def __init__(self, model: nn.Module, march: str) -> None:
        self.model = model
        self.march = march  # the twin is converted for the march the model was prepared for
        setattr(self, EAGER_FLAG, True)
        #: train on the integer grid, bound from the recorded forwards (eager_grid.py)
        self.integer_grid = True
        self.bound_version = -1

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        m = self.model
        note_forward(m)
        twin = exact_twin(m, self._twin) if getattr(self, EAGER_FLAG) else None
        if twin is not None:
            with torch.no_grad():
                return twin(*args, **kwargs)
        before = m.__dict__.get(eager_record.VERSION, 0)
        out = type(m).forward(m, *args, **kwargs)
        version = m.__dict__.get(eager_record.VERSION, 0)
        if version != before:
            forget_failure(m)  # a model that could not convert before this forward recorded may now
        if self.integer_grid and version != self.bound_version:
            bind_eager_grid(m, self.march)  # the next forwards run on the grid
            self.bound_version = version
        return out

    def set_integer_grid(self, enabled: bool) -> None:
        """Train on the integer grid (bound now, from the records so far) or on float fake quant."""
        self.integer_grid = bool(enabled)
        if enabled:
            bind_eager_grid(self.model, self.march)
            self.bound_version = self.model.__dict__.get(eager_record.VERSION, 0)
        else:
            unbind_all(self.model)

    def _twin(self, model: nn.Module) -> nn.Module:
        with march_scope(self.march):
            return convert(model, inplace=False)


def _convert_recorded(model: nn.Module, march: Any, mapping: Mapping[type, type] | None) -> nn.Module:
    eager_record.convert_recorded(model, march, mapping, ConvertError)
    _drop_exact_forward(model)
    model.eval()
    return model


def _drop_exact_forward(model: nn.Module) -> None:
    if isinstance(model.__dict__.get("forward"), ExactForward):
        del model.__dict__["forward"]


def _refuse_shared_observers(model: nn.Module, paths: Sequence[str]) -> None:
    """Refuse a module with its own output observer that the forward calls at several places.

    Eager mode runs the user's forward, which calls the one module object at every place, so
    the module would keep one observer for all its calls and quantize each with the widest
    call's range (and its converted form has one input scale). fx mode gives each call site
    its own observer (shared_calls.py); here the model is traced once to find such modules.
    A model fx cannot trace is checked by its first forward instead (eager_record.py)."""
    observed = [p for p in paths if eager_record.has_own_observer(model.get_submodule(p))]
    if not observed:
        return
    try:
        gm = torch.fx.GraphModule(model, trace_fx(model))  # shares model's submodules
    except Exception:  # untraceable: its recorded forwards check it (eager_record.py)
        return
    sites = call_sites(gm)
    for path in observed:
        if len(sites.get(path, [])) > 1:
            raise ValueError(eager_record.shared_observer_message(model.get_submodule(path), path, len(sites[path])))


# ---------------------------------------------------------------------------------------------
# convert


def convert(model: nn.Module, mapping: Mapping[type, type] | None = None, inplace: bool = False) -> nn.Module:
    """Swap the QAT modules of ``model`` (a copy unless ``inplace``) for quantized ones.

    The module structure and ``forward`` stay the user's. Input scales come from one fx trace
    of the model when it traces; a model fx cannot trace (data-dependent control flow, ...) is
    converted from what its forwards recorded since ``prepare_qat`` (``eager_record.py``: run
    it at least once, e.g. a calibration or training step, before converting).
    """
    march = require_march("convert")
    if not inplace:
        model = copy.deepcopy(model)
    try:
        fx_graph = trace_fx(model)
    except Exception as e:
        if eager_record.has_records(model):
            return _convert_recorded(model, march, mapping)
        raise ConvertError(
            f"convert learns each module's input scales from one fx trace of {type(model).__name__} or from its "
            f"recorded forwards, and it has neither: {e}\nRun the prepare_qat model once (a calibration or "
            "training step) before convert, or decorate the untraceable code with qir.utils.fx_helper.wrap"
        ) from e
    # fx_wrap means nothing to an eager forward: a wrapped method is Python like the rest, and the
    # QAT modules it calls are converted from the recorded forwards (the trace does not see them)
    hidden = hidden_in_wrapped_calls(fx_graph, model, _is_qat_module)
    if hidden:
        if eager_record.has_records(model):
            return _convert_recorded(model, march, mapping)
        method, paths = next(iter(hidden.items()))
        raise ConvertError(
            f"wrapped method {method} calls the QAT module(s) {', '.join(repr(p) for p in paths)}, which the fx trace "
            "of the eager model does not see, so convert learns their input scales from the model's recorded "
            "forwards, and it has none: run the prepare_qat model once (a calibration or training step) before "
            "convert"
        )
    gm = torch.fx.GraphModule(model, fx_graph)  # shares model's submodules
    _convert_modules(model, gm, march, mapping, eager=True)
    eager_record.uninstall(model)
    _drop_exact_forward(model)
    model.eval()
    return model
