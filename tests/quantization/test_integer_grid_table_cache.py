"""The integer grid's cache of qint16 segmented tables: a lookup equals the interpolation at every code,
the cache is bounded and least-recently-used, and a scale change gives a new table (the grid stays
the converted model, step after step)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from backends.common.lut_segmented import full_table16, lut_int16, lut_int16_apply, method_table16
from backends.common.table16_cache import TABLE16_CACHE, Table16Cache
from qir.ir.types import DType
from qir.march import march_scope
from qir.nn.modules.unary import Pow
from qir.nn.quantized import FloatFunctional
from qir.quantization import (
    DeQuantStub,
    QuantStub,
    convert_fx,
    disable_observer,
    get_default_qat_qconfig,
    prepare_qat_fx,
)
from qir.quantization.integer_grid_functional import table_key

_CODES = torch.arange(-32768, 32768, dtype=torch.int64)


def _softplus_sqrt(x: torch.Tensor) -> torch.Tensor:
    return torch.sqrt(nn.functional.softplus(x))


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize(
    ("fn", "s_in", "s_out", "dt"),
    [
        (torch.tanh, 8 / 32767, 1 / 32767, "qint16"),
        (torch.tanh, 8 / 32767, 1 / 127, "qint8"),
        (torch.exp, 4 / 32767, 55 / 32767, "qint16"),  # saturates at the top
        (_softplus_sqrt, 1e-3, 6e-5, "qint16"),
    ],
)
def test_every_code_of_the_full_table_is_the_interpolation(
    fn: object, s_in: float, s_out: float, dt: str, version: int
) -> None:
    entries = lut_int16(fn, s_in, s_out, dt, measure=False, version=version).entries  # type: ignore[arg-type]
    full = full_table16(entries, dt, version)
    assert full.shape == (65536,) and full.dtype == DType.parse(dt).to_torch()
    assert torch.equal(full, lut_int16_apply(entries, _CODES, dt, version))


@pytest.mark.parametrize("method", ["ceil", "floor"])
def test_the_full_table_of_a_step_function_is_exact(method: str) -> None:
    fn = torch.ceil if method == "ceil" else torch.floor
    entries = method_table16(method, fn, 3e-3, 1 / 100, "qint16", 2)
    assert entries is not None
    full = full_table16(entries, "qint16", 2)
    assert torch.equal(full, lut_int16_apply(entries, _CODES, "qint16", 2))
    want = torch.floor(fn(_CODES.to(torch.float64) * torch.tensor(3e-3, dtype=torch.float32).item()) * 100 + 0.5)
    assert torch.equal(full.to(torch.float64), want.clamp(-32768, 32767))


def test_an_empty_or_malformed_table_has_no_full_table() -> None:
    with pytest.raises(ValueError, match="empty"):
        full_table16(torch.zeros(0, dtype=torch.int32), "qint8", 2)
    with pytest.raises(ValueError, match=r"\(2, n\)"):
        full_table16(torch.zeros(3, 4, dtype=torch.int32), "qint8", 2)


def _table(s_out: float) -> torch.Tensor:
    return lut_int16(torch.tanh, 8 / 32767, s_out, "qint16", measure=False).entries


def test_the_cache_is_bounded_and_least_recently_used_goes_first() -> None:
    full_bytes = 65536 * 2  # a qint16-output table
    cache = Table16Cache(max_bytes=2 * full_bytes)
    q = torch.tensor([-32768, -5, 0, 7, 32767], dtype=torch.int16)
    built: list[float] = []

    def look(s_out: float) -> torch.Tensor:
        def build() -> torch.Tensor:
            built.append(s_out)
            return _table(s_out)

        out = cache.lookup(("tanh", s_out), build, q, DType.qint16, 2)
        assert out is not None
        assert torch.equal(out, lut_int16_apply(_table(s_out), q, "qint16", 2))
        return out

    look(1 / 32767)
    look(2 / 32767)
    look(1 / 32767)  # a hit: now the most recently used
    assert (cache.hits, cache.misses, built) == (1, 2, [1 / 32767, 2 / 32767])
    look(3 / 32767)  # evicts 2 / 32767, the least recently used
    assert len(cache) == 2 and cache.nbytes == 2 * full_bytes
    look(1 / 32767)
    look(2 / 32767)
    assert built == [1 / 32767, 2 / 32767, 3 / 32767, 2 / 32767]
    with cache.disabled():  # builds, neither reads nor writes
        look(1 / 32767)
    assert built[-1] == 1 / 32767 and cache.hits == 2
    cache.lookup(None, lambda: _table(4 / 32767), q, DType.qint16, 2)  # no key: not cached
    assert len(cache) == 2 and cache.misses == 4
    assert cache.lookup(("none",), lambda: None, q, DType.qint16, 2) is None
    cache.clear()
    assert len(cache) == 0 and cache.nbytes == 0
    with pytest.raises(ValueError, match="max_bytes"):
        Table16Cache(max_bytes=-1)


def test_the_key_names_the_function_and_its_attributes() -> None:
    k = table_key(nn.Tanh(), 0.01, 0.02, DType.qint16)
    assert k is not None and k == table_key(nn.Tanh(), 0.01, 0.02, DType.qint16)
    assert k != table_key(nn.Sigmoid(), 0.01, 0.02, DType.qint16)
    assert k != table_key(nn.Tanh(), 0.01, 0.03, DType.qint16)
    assert k != table_key(nn.Tanh(), 0.01, 0.02, DType.qint8)
    assert table_key(Pow(2.0), 0.01, 0.02, DType.qint16) != table_key(Pow(3.0), 0.01, 0.02, DType.qint16)
    assert table_key(nn.ELU(0.0), 1, 1, DType.qint16) != table_key(nn.ELU(-0.0), 1, 1, DType.qint16)
    odd = nn.Tanh()
    odd.gain = torch.tensor(2.0)  # a tensor attribute the key cannot hold: built on every call
    assert table_key(odd, 0.01, 0.02, DType.qint16) is None


class _Net(nn.Module):
    """qint16 codes into a Tanh and a FloatFunctional exp (Bayes segmented tables)."""

    def __init__(self) -> None:
        super().__init__()
        self.quant = QuantStub()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.tanh = nn.Tanh()
        self.ff = FloatFunctional()
        self.dq = DeQuantStub()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(self.quant(x))
        return self.dq(self.ff.add(self.tanh(y), self.ff.exp(y)))


def test_a_scale_change_builds_a_new_table_and_the_grid_stays_the_converted_model() -> None:
    torch.manual_seed(0)
    q16 = get_default_qat_qconfig(dtype="qint16")
    with march_scope("bayes"):
        qat = prepare_qat_fx(_Net(), {"": get_default_qat_qconfig(), "module_name": {"conv": q16}}).train()
    g = torch.Generator().manual_seed(3)
    TABLE16_CACHE.clear()

    def step() -> torch.Tensor:
        x = torch.randn(2, 3, 6, 6, generator=g) * 2
        out = qat(x)
        with march_scope("bayes"):
            assert torch.equal(out, convert_fx(qat)(x)), float((out - convert_fx(qat)(x)).abs().max())
        return x

    step()  # the observers move the scales: the tables of the new scales
    misses = TABLE16_CACHE.misses
    assert misses >= 2 and TABLE16_CACHE.hits == 0
    disable_observer(qat)
    step()  # frozen scales: the first frozen step may still build (its scales are new)
    misses, hits = TABLE16_CACHE.misses, TABLE16_CACHE.hits
    x = step()
    assert (TABLE16_CACHE.misses, TABLE16_CACHE.hits) == (misses, hits + 2)  # tanh and exp: both hits
    out = qat(x)
    fq = qat.conv.activation_post_process
    with torch.no_grad():
        fq.scale.mul_(1.5)  # a scale changed by hand: a new key, a new table
    moved = qat(x)
    assert TABLE16_CACHE.misses == misses + 2
    assert not torch.equal(moved, out)
    with march_scope("bayes"):
        assert torch.equal(moved, convert_fx(qat)(x))
    with TABLE16_CACHE.disabled():
        assert torch.equal(qat(x), moved)
