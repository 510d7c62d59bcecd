"""scikit-learn's digits as a small MNIST stand-in: 8x8 images upsampled to 1x28x28, normalised to [-1, 1]."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def digits_tensors(
    seed: int = 0, test_fraction: float = 0.25
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x_train, y_train, x_test, y_test)`` with a fixed shuffled split."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0  # 0..1
    x = F.interpolate(x, size=(28, 28), mode="bilinear", align_corners=False)
    x = (x - 0.5) / 0.5  # transforms.Normalize((0.5,), (0.5,))
    y = torch.tensor(d.target, dtype=torch.int64)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(y) * test_fraction)
    test, train = perm[:n_test], perm[n_test:]
    return x[train], y[train], x[test], y[test]


def loader(x: torch.Tensor, y: torch.Tensor, batch_size: int, shuffle: bool) -> torch.utils.data.DataLoader:
    ds = torch.utils.data.TensorDataset(x, y)
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.DataLoader(ds, batch_size=batch_size, shuffle=shuffle, generator=g)
