"""QAT FloatFunctional: every method's float result goes through the output fake quant."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn

from qir.nn.modules.functional import FLOAT_FUNCTIONAL_METHODS, FunctionalBase
from qir.nn.qat._base import QATModule, make_activation_fq, resolve_qconfig
from qir.quantization.eager_record import functional_call
from qir.quantization.fake_quantize import FakeQuantize
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
    """QAT functional wrapper; ``activation_post_process`` None only for a high-precision ``matmul``."""

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

    @functools.wraps(fn)
    def method(self: FloatFunctional, *args: Any, **kwargs: Any) -> Any:
        # a method call, not a module call: eager recording sees it here (eager_record.py)
        return functional_call(self, fn, args, kwargs)

    return method


for _name in FLOAT_FUNCTIONAL_METHODS:
    setattr(FloatFunctional, _name, _recorded(_name))
