"""Shared plumbing of the QAT modules: qconfig lookup and fake-quant construction."""

from __future__ import annotations

from typing import Any, ClassVar

from torch import nn

from qir.quantization.fake_quantize import FakeQuantize
from qir.quantization.qconfig import QConfig, as_qir_qconfig

__all__ = ["QATModule", "fake_quant_state_names", "make_activation_fq", "make_weight_fq", "resolve_qconfig"]


def resolve_qconfig(mod: nn.Module, qconfig: QConfig | None, what: str) -> QConfig:
    """``qconfig`` if given, else ``mod.qconfig``; raises naming ``what`` when neither is set."""
    qc = qconfig if qconfig is not None else getattr(mod, "qconfig", None)
    if qc is None:
        raise ValueError(
            f"{what}.from_float needs a qconfig: pass qconfig= or set {type(mod).__name__}.qconfig "
            "(e.g. qir.quantization.get_default_qat_qconfig())"
        )
    out = as_qir_qconfig(qc, f"{what}: qconfig")
    assert out is not None
    return out


def _check_fq(fq: Any, what: str, field: str) -> FakeQuantize:
    if not isinstance(fq, FakeQuantize):
        raise TypeError(
            f"{what}: qconfig.{field} must build a qir FakeQuantize, got {type(fq).__name__}; "
            "use FakeQuantize.with_args(...)"
        )
    return fq


def make_activation_fq(qconfig: QConfig, what: str, required: bool) -> FakeQuantize | None:
    """The output fake quant from ``qconfig.activation`` (``None`` allowed unless ``required``)."""
    if qconfig.activation is None:
        if required:
            raise ValueError(
                f"{what} needs an output fake quant but qconfig.activation is None; only conv, linear and "
                "FloatFunctional.matmul support a high-precision (qint32) output"
            )
        return None
    return _check_fq(qconfig.activation(), what, "activation")


def make_weight_fq(qconfig: QConfig, what: str, ch_axis: int) -> FakeQuantize:
    """The weight fake quant from ``qconfig.weight``, per channel along ``ch_axis`` when per-channel."""
    if qconfig.weight is None:
        raise ValueError(f"{what} needs qconfig.weight (a weight fake quant factory), got None")
    fq = qconfig.weight(ch_axis=ch_axis) if ch_axis != 0 else qconfig.weight()
    return _check_fq(fq, what, "weight")


class QATModule(nn.Module):
    """Marker base of qir's QAT modules.

    ``activation_post_process`` is the output fake quant, or ``None`` when the module
    preserves its input's scale (ReLU, max pool, nearest resize, ...) or emits a
    high-precision output. ``scale_preserving`` is the class-level fact, ``is_scale_preserving``
    the per-instance one.
    """

    scale_preserving: ClassVar[bool] = False
    activation_post_process: FakeQuantize | None

    @property
    def is_scale_preserving(self) -> bool:
        """True when the output keeps the input's scale (per instance: nearest vs bilinear resize)."""
        return self.scale_preserving

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        # A high-precision output (get_default_qat_out_qconfig) has no output fake quant; the
        # calibration model it is loaded from had one. Its keys are not unexpected: the layer no
        # longer has them, as prepare_qat_fx(calibrated_model) leaves them behind. Any other key
        # under the name stays an error.
        if getattr(self, "activation_post_process", False) is None and not self.is_scale_preserving:
            dropped = {f"{prefix}activation_post_process.{k}" for k in fake_quant_state_names()}
            unexpected_keys[:] = [k for k in unexpected_keys if k not in dropped]


def fake_quant_state_names() -> frozenset[str]:
    """The state-dict keys (relative to it) an output fake quant of any qconfig can hold: its scale
    and zero point, its observer's range and scale, and every observer class's statistics (a
    calibration percentile's histogram)."""
    from qir.quantization.observer import _ALL_STATISTICS, ObserverBase

    # read at each load: an observer class defined later adds its statistics
    observer = (*ObserverBase._sized_buffers, *sorted(_ALL_STATISTICS))
    return frozenset({"scale", "zero_point", *(f"observer.{b}" for b in observer)})
