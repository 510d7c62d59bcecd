"""Accuracy debugging: find where a quantized model departs from the float one, and fix it.

- :func:`featuremap_similarity`: per-layer agreement of two models (float, calibration,
  QAT, converted; a compiled artifact's final output), as a table, JSON and a plot.
- :func:`layer_sensitivity`: the output error when only one layer is quantized, and when
  only it stays float, ranked.
- :func:`auto_int16`: the fewest layers to promote to qint16 (where the march allows) for a
  similarity target; returns the qconfig dict for ``prepare_qat_fx``.
- :func:`check_qconfig`: shared modules, unfused patterns, float fallbacks and qconfigs the
  march refuses, before training.
- :func:`find_bad_case`: the inputs with the largest float-vs-quantized difference.

The plugin keeps such tools in ``horizon_plugin_pytorch.utils.quant_profiler``; qir's
``qir.utils`` sits below ``qir.quantization`` (prepare uses its fx helpers), so they live
here. docs/debugging.md walks through an accuracy drop with them.
"""

from qir.quantization.debug.bad_case import BadCase, find_bad_case
from qir.quantization.debug.metrics import cosine, max_abs, relative_l2, sqnr_db
from qir.quantization.debug.mixed_precision import MixedPrecisionResult, auto_int16
from qir.quantization.debug.qconfig_check import Finding, QConfigReport, check_qconfig
from qir.quantization.debug.sensitivity import LayerSensitivity, SensitivityReport, layer_sensitivity
from qir.quantization.debug.similarity import LayerSimilarity, SimilarityReport, featuremap_similarity

__all__ = [
    "BadCase",
    "Finding",
    "LayerSensitivity",
    "LayerSimilarity",
    "MixedPrecisionResult",
    "QConfigReport",
    "SensitivityReport",
    "SimilarityReport",
    "auto_int16",
    "check_qconfig",
    "cosine",
    "featuremap_similarity",
    "find_bad_case",
    "layer_sensitivity",
    "max_abs",
    "relative_l2",
    "sqnr_db",
]
