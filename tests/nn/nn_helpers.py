"""Shared helpers of the module-library tests: random codes, QAT -> quantized round trips."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from backends.common import numerics
from qir.nn import QAT_MODULE_MAP, QUANTIZED_MODULE_MAP
from qir.quantization import FakeQuantize, QConfig, disable_observer, get_default_qat_qconfig

#: QAT qconfig whose activation observers take the current batch (deterministic scales in tests).
QC8 = get_default_qat_qconfig(activation_qkwargs={"averaging_constant": 1.0})
QC16 = get_default_qat_qconfig(dtype="qint16", activation_qkwargs={"averaging_constant": 1.0})


def codes(
    shape: Sequence[int], scale: float, gen: torch.Generator, dtype: str = "qint8"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random integer codes over the whole range and the float values they represent."""
    lo, hi = numerics.qrange(dtype)
    q = torch.randint(lo, hi + 1, tuple(shape), generator=gen, dtype=torch.int64)
    q = numerics.saturate(q, dtype)
    return q, numerics.dequantize(q, torch.tensor([scale]))


class RoundTrip:
    """A float module taken to QAT (one observing pass, then frozen) and to its quantized module."""

    def __init__(
        self,
        float_mod: nn.Module,
        shapes: Sequence[Sequence[int]],
        scales: Sequence[float],
        qconfig: QConfig = QC8,
        march: str = "bayes",
        seed: int = 0,
        in_dtype: str = "qint8",
        call: Callable[..., torch.Tensor] | None = None,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        pairs = [codes(s, sc, gen, in_dtype) for s, sc in zip(shapes, scales, strict=True)]
        self.q_in = [p[0] for p in pairs]
        self.f_in = [p[1] for p in pairs]
        self.qat = QAT_MODULE_MAP[type(float_mod)].from_float(float_mod, qconfig)  # type: ignore[attr-defined]
        self.call = call or (lambda m, *xs: m(*xs))
        self.qat.eval()
        self.call(self.qat, *self.f_in)
        disable_observer(self.qat)
        self.qat_out = self.call(self.qat, *self.f_in)
        qcls: Any = QUANTIZED_MODULE_MAP[type(self.qat)]
        self.quant = qcls.from_qat(self.qat, [torch.tensor([s]) for s in scales], march)
        self.q_out = self.call(self.quant, *self.q_in)

    @property
    def fq(self) -> FakeQuantize | None:
        fq = getattr(self.qat, "activation_post_process", None)
        return fq if isinstance(fq, FakeQuantize) else None

    def qat_codes(self) -> torch.Tensor:
        """The QAT output as integer codes at the quantized module's output scale."""
        fq = self.fq
        if fq is None:  # scale-preserving: the output is on the input grid
            return numerics.quantize(self.qat_out, self.quant.scale, "qint32")
        return numerics.quantize(self.qat_out, fq.scale, fq.dtype)

    def max_lsb(self) -> int:
        return int((self.q_out.to(torch.int64) - self.qat_codes().to(torch.int64)).abs().max())


def storages(mod: nn.Module) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in [*mod.parameters(), *mod.buffers()] if t.numel()}
