"""``qir.qconfig``: the seeds' ``horizon.qconfig`` names, defined in :mod:`qir.quantization.qconfig`."""

from qir.quantization.qconfig import (
    QConfig,
    default_calib_8bit_fake_quant_qconfig,
    default_calib_8bit_weight_32bit_out_fake_quant_qconfig,
    default_calib_16bit_fake_quant_qconfig,
    default_qat_8bit_fake_quant_qconfig,
    default_qat_8bit_weight_32bit_out_fake_quant_qconfig,
    default_qat_16bit_fake_quant_qconfig,
    get_default_calib_qconfig,
    get_default_qat_out_qconfig,
    get_default_qat_qconfig,
    qconfig_kind,
)

__all__ = [
    "QConfig",
    "default_calib_16bit_fake_quant_qconfig",
    "default_calib_8bit_fake_quant_qconfig",
    "default_calib_8bit_weight_32bit_out_fake_quant_qconfig",
    "default_qat_16bit_fake_quant_qconfig",
    "default_qat_8bit_fake_quant_qconfig",
    "default_qat_8bit_weight_32bit_out_fake_quant_qconfig",
    "get_default_calib_qconfig",
    "get_default_qat_out_qconfig",
    "get_default_qat_qconfig",
    "qconfig_kind",
]
