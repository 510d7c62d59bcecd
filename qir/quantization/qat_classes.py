"""Which ``qir.nn.qat`` class replaces a float module (shared by prepare, hybrid placement and
functional swapping, which prepare builds on)."""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

__all__ = ["optional_qat_class", "qat_class_for"]


def qat_class_for(m: nn.Module, mapping: Mapping[type, type] | None = None) -> type | None:
    """The QAT class of ``m``: exact type first, then its base classes (eager fused variants)."""
    if mapping is None:
        from qir.nn.qat import QAT_MODULE_MAP

        mapping = QAT_MODULE_MAP
    for cls in type(m).__mro__:
        if cls in mapping:
            return mapping[cls]
        if cls is nn.Module:
            break
    return optional_qat_class(f"{type(m).__module__}.{type(m).__qualname__}")


#: optional libraries' module classes (qualified name and public spelling) -> qir's QAT class,
#: matched by name: torchvision stays an optional dependency and is never imported here
_OPTIONAL_QAT_CLASSES = {
    "torchvision.ops.roi_align.RoIAlign": "RoIAlign",
    "torchvision.ops.RoIAlign": "RoIAlign",
    "torchvision.ops.poolers.MultiScaleRoIAlign": "MultiScaleRoIAlign",
    "torchvision.ops.MultiScaleRoIAlign": "MultiScaleRoIAlign",
    "torchvision.models.detection.anchor_utils.AnchorGenerator": "AnchorGenerator",
    "torchvision.models.detection.rpn.AnchorGenerator": "AnchorGenerator",
}


def optional_qat_class(name: str) -> type | None:
    """The ``qir.nn.qat`` class for an optional library's module class named ``name``, or None."""
    attr = _OPTIONAL_QAT_CLASSES.get(name)
    if attr is None:
        return None
    from qir.nn import qat

    cls: type = getattr(qat, attr)
    return cls
