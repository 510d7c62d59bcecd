"""``--calib-data``: calibration batches from a .npy / .npz file or a folder of images.

* ``.npy``: one array of samples for a one-input model, shaped ``(N, *input_shape[1:])``.
* ``.npz``: one such array per model input, in the file's order.
* a folder: image files (png, jpg, jpeg, bmp, gif, webp), sorted by name, resized to the
  input's H x W, 1 channel -> grayscale, 3 -> RGB, pixel values / 255 (range [0, 1]); for
  any other preprocessing, save the prepared array as .npy. Needs Pillow.

Batches take the batch size of ``--input-shape`` (its first number).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from qir.cli.errors import UserError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")


def _check(path: Path, arr: np.ndarray, shape: tuple[int, ...], which: str) -> np.ndarray:
    if arr.ndim == len(shape) - 1:
        arr = arr[None]  # one sample
    if arr.ndim != len(shape) or tuple(arr.shape[1:]) != tuple(shape[1:]):
        want = "(N, " + ", ".join(str(d) for d in shape[1:]) + ")"
        raise UserError(
            f"--calib-data '{path}'{which}: array of shape {tuple(arr.shape)} does not match "
            f"--input-shape {','.join(map(str, shape))}: expected {want}"
        )
    if not np.issubdtype(arr.dtype, np.number):
        raise UserError(f"--calib-data '{path}'{which}: dtype {arr.dtype} is not numeric")
    return arr


def _load_arrays(path: Path, shapes: list[tuple[int, ...]]) -> list[np.ndarray]:
    try:
        loaded = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise UserError(f"--calib-data '{path}' cannot be read as a numpy file: {e}") from None
    if isinstance(loaded, np.ndarray):
        arrays = [loaded]
    else:
        arrays = [loaded[k] for k in loaded.files]
    if len(arrays) != len(shapes):
        raise UserError(
            f"--calib-data '{path}' holds {len(arrays)} array(s) for a model with {len(shapes)} "
            "input(s): give one array per input (an .npz for several)"
        )
    return [
        _check(path, a, s, f" (array {i})" if len(arrays) > 1 else "")
        for i, (a, s) in enumerate(zip(arrays, shapes, strict=True))
    ]


def _load_images(folder: Path, shapes: list[tuple[int, ...]]) -> list[np.ndarray]:
    if len(shapes) != 1 or len(shapes[0]) != 4 or shapes[0][1] not in (1, 3):
        raise UserError(
            f"--calib-data folder '{folder}': images calibrate one input of shape N,1,H,W or N,3,H,W; "
            "for other models save the samples as .npy / .npz"
        )
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise UserError(f"--calib-data folder '{folder}' has no image files ({', '.join(IMAGE_SUFFIXES)})")
    try:
        from PIL import Image
    except ImportError:
        raise UserError(
            f"--calib-data folder '{folder}': reading images needs Pillow (pip install pillow), "
            "or save the samples as a .npy file"
        ) from None
    _, c, h, w = shapes[0]
    out = []
    for f in files:
        try:
            with Image.open(f) as src:
                im = src.convert("L" if c == 1 else "RGB").resize((w, h), Image.Resampling.BILINEAR)
                a = np.asarray(im, dtype=np.float32) / 255.0
        except OSError as e:
            raise UserError(f"--calib-data: cannot read image '{f}': {e}") from None
        out.append(a[None] if c == 1 else a.transpose(2, 0, 1))
    return [np.stack(out)]


def calibration_batches(path: str, shapes: list[tuple[int, ...]], steps: int) -> list[list[torch.Tensor]]:
    """Up to ``steps`` batches, each a list with one tensor per input."""
    p = Path(path)
    if p.is_dir():
        arrays = _load_images(p, shapes)
    elif p.is_file():
        arrays = _load_arrays(p, shapes)
    else:
        raise UserError(f"--calib-data '{p}' does not exist (give a .npy / .npz file or a folder of images)")
    n = min(len(a) for a in arrays)
    bs = shapes[0][0]
    count = min(steps, math.ceil(n / bs))
    return [
        [torch.from_numpy(np.ascontiguousarray(a[i * bs : (i + 1) * bs])).float() for a in arrays] for i in range(count)
    ]


def random_batches(shapes: list[tuple[int, ...]], steps: int, seed: int = 0) -> list[list[torch.Tensor]]:
    """Standard-normal batches: scales from them only fit inputs of about that range."""
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=g) for s in shapes] for _ in range(steps)]
