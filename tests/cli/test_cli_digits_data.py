"""The digits shipped with qir: the demo needs no scikit-learn."""

from __future__ import annotations

import sys

import pytest
import torch

from qir.examples.digits_data import DATA_FILE, digits_split, load_digits_arrays


def test_shipped_digits_load_without_sklearn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "sklearn", None)  # any import of it would now fail
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    assert DATA_FILE.is_file() and (DATA_FILE.parent / "LICENSE-digits.txt").is_file()
    images, labels = load_digits_arrays()
    assert images.shape == (1797, 8, 8) and int(images.max()) == 16 and int(images.min()) == 0
    assert sorted(set(labels.tolist())) == list(range(10))
    x_tr, y_tr, x_te, y_te = digits_split()
    assert x_tr.shape == (1348, 1, 8, 8) and x_te.shape == (449, 1, 8, 8)
    assert len(y_tr) == 1348 and len(y_te) == 449
    # multiples of 1/32 in [-0.5, 0.5]: exact at the demo's QuantStub scale 1/128
    assert torch.equal(x_tr * 32, torch.round(x_tr * 32)) and float(x_tr.abs().max()) <= 0.5


def test_same_data_as_sklearn() -> None:
    datasets = pytest.importorskip("sklearn.datasets")
    d = datasets.load_digits()
    images, labels = load_digits_arrays()
    assert (images == d.images).all() and (labels == d.target).all()
