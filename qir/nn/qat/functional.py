"""QAT FloatFunctional: every method's float result goes through the output fake quant."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, ClassVar

from torch import nn

from qir.nn.modules.functional import FLOAT_FUNCTIONAL_METHODS, FunctionalBase, scalar_call
from qir.nn.modules.traced_calls import record_method_calls
from qir.nn.qat._base import QATModule, make_activation_fq, resolve_qconfig
from qir.quantization.eager_grid import CALLED_METHODS
from qir.quantization.eager_record import functional_call
from qir.quantization.fake_quantize import FakeQuantize
from qir.quantization.integer_grid_functional import GRID_METHODS, functional_forward, refusal
from qir.quantization.qconfig import QConfig

__all__ = ["FloatFunctional"]


def _float_functional_types() -> tuple[type, ...]:
    from qir.nn.modules.functional import FloatFunctional as Ours

    found: list[type] = [Ours]
    try:
        from torch.ao.nn.quantized import FloatFunctional as Torchs

        found.append(Torchs)
    except ImportError:  # torch built without the ao namespace
        pass
    return tuple(found)


class FloatFunctional(QATModule, FunctionalBase):
    """QAT functional wrapper; ``activation_post_process`` None only for a high-precision ``matmul``.

    Every method trains on the integer grid (qir.quantization.integer_grid_functional) when the call
    site's inputs carry known scales, in fx-prepared and eager models; ``ceil`` / ``floor`` of qint16
    codes, which have no integer form, stay float fake quantization."""

    #: as many grid inputs as the call site has tensor operands (qir.quantization.integer_grid)
    grid_inputs: ClassVar[int] = -1
    grid_methods: ClassVar[frozenset[str]] = GRID_METHODS
    #: why a call site cannot train on the grid (methods called, input fake quants), or None
    grid_refusal = staticmethod(refusal)

    def __init__(self, activation_post_process: FakeQuantize | None, qconfig: QConfig | None = None) -> None:
        super().__init__()
        self.activation_post_process = activation_post_process
        self.qconfig = qconfig

    @classmethod
    def from_float(cls, mod: nn.Module, qconfig: QConfig | None = None) -> FloatFunctional:
        """From ``qir.nn.quantized.FloatFunctional`` or ``torch.ao.nn.quantized.FloatFunctional``."""
        if not isinstance(mod, _float_functional_types()):
            raise TypeError(
                f"FloatFunctional.from_float takes qir's or torch's FloatFunctional, got {type(mod).__name__}"
            )
        qc = resolve_qconfig(mod, qconfig, cls.__name__)
        new = cls(make_activation_fq(qc, cls.__name__, required=False), qc)
        new.train(mod.training)
        return new


def _recorded(name: str) -> Callable[..., Any]:
    fn = getattr(FunctionalBase, name)

    def grid_or_float(self: FloatFunctional, *args: Any, **kwargs: Any) -> Any:
        grid = functional_forward(self, name, args, kwargs)  # None unless bound
        return fn(self, *args, **kwargs) if grid is None else grid

    @functools.wraps(fn)
    def method(self: FloatFunctional, *args: Any, **kwargs: Any) -> Any:
        # add(x, 2.0) trains as add_scalar(x, 2.0), as it converts; a number no scalar method fits is
        # refused (the float model runs it; no quantized form would match it)
        scalar = scalar_call(name, args, kwargs)
        if scalar is not None:
            return getattr(self, scalar[0])(scalar[1], scalar[2])
        # the methods called, for the eager grid binding (an eager model has no graph to read them from)
        self.__dict__.setdefault(CALLED_METHODS, set()).add(name)
        # a method call, not a module call: eager recording sees it here (eager_record.py), on
        # the grid or not, so eager convert learns its input scales either way
        return functional_call(self, grid_or_float, args, kwargs)

    return method


for _name in FLOAT_FUNCTIONAL_METHODS:
    setattr(FloatFunctional, _name, _recorded(_name))
# fx re-tracing a prepared graph (torch.load) keeps ``ff.add(x, y)`` one call, which convert_fx reads
record_method_calls(FloatFunctional, FLOAT_FUNCTIONAL_METHODS)
