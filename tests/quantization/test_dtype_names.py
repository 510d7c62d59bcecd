"""A fake quant's dtype compares equal to the plugin's dtype strings, as users' code branches on it."""

from __future__ import annotations

import torch

from qir.dtype import qint8, qint16
from qir.ir.types import DType
from qir.quantization import get_default_qat_qconfig


def test_fake_quant_dtype_equals_the_plugin_string() -> None:
    fq = get_default_qat_qconfig(dtype="qint16").activation()
    assert fq.dtype == qint16 and fq.dtype == "qint16" and "qint16" == fq.dtype
    assert fq.dtype != qint8 and not (fq.dtype == "qint8")
    w = get_default_qat_qconfig().weight()
    assert w.dtype == qint8 and w.dtype != "qint16"
    # the branch a user writes: it must take the qint16 side
    assert (16 if fq.dtype == qint16 else 8) == 16


def test_equal_only_to_its_name_and_hash_consistent() -> None:
    for d in DType:
        assert d == d.name and hash(d) == hash(d.name)
        assert d != d.value or d.value == d.name
        assert all(d != other for other in DType if other is not d)
    # a dict keyed by the enum answers the plugin's string, one entry per dtype
    table = {d: d.qrange for d in (DType.qint8, DType.qint16)}
    assert table[qint16] == (-32768, 32767)
    assert DType.float32 != torch.float32 and DType.qint8 != 8
