"""The 1,797 real 8x8 handwritten digits, shipped with qir (``qir/examples/data/digits.csv.gz``).

The file is scikit-learn's copy of the UCI digits (license: ``data/LICENSE-digits.txt``);
shipping it (57 KB) lets ``qir demo`` run without scikit-learn installed. When the file
is missing (an install that left package data out), scikit-learn's ``load_digits`` is
used if it is installed.

    x_train, y_train, x_test, y_test = digits_split()   # (N, 1, 8, 8) float in [-0.5, 0.5]
"""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import torch

__all__ = ["DATA_FILE", "digits_split", "load_digits_arrays"]

DATA_FILE = Path(__file__).with_name("data") / "digits.csv.gz"


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """``(images, labels)``: uint8 pixels 0..16 of shape (1797, 8, 8) and int64 labels 0..9."""
    if DATA_FILE.is_file():
        with gzip.open(DATA_FILE, "rt") as f:
            table = np.loadtxt(f, delimiter=",", dtype=np.int64)
        return table[:, :64].reshape(-1, 8, 8).astype(np.uint8), table[:, 64]
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise FileNotFoundError(
            f"the digits data file {DATA_FILE} is missing and scikit-learn is not installed; reinstall qir "
            "(pip install -e .) or pip install scikit-learn"
        ) from None
    d = load_digits()
    return d.images.astype(np.uint8), d.target.astype(np.int64)


def digits_split(
    seed: int = 0, test_fraction: float = 0.25
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x_train, y_train, x_test, y_test)``: a fixed shuffled split, images (N, 1, 8, 8).

    Pixels p in 0..16 become p/16 - 0.5, in [-0.5, 0.5]: multiples of 1/32, so a
    ``QuantStub(scale=1/128)`` quantizes them without error (codes -64..64).
    """
    images, labels = load_digits_arrays()
    x = torch.from_numpy(images.astype(np.float32)).unsqueeze(1) / 16.0 - 0.5
    y = torch.from_numpy(labels)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(y) * test_fraction)
    test, train = perm[:n_test], perm[n_test:]
    return x[train], y[train], x[test], y[test]
