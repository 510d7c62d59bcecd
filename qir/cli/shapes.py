"""``--input-shape 1,3,224,224``: parsing and example inputs."""

from __future__ import annotations

import torch

from qir.cli.errors import UserError

MAX_INPUT_ELEMENTS = 2**28
"""Largest example input ``--input-shape`` may ask for: refused before anything is allocated."""


def parse_shape(text: str) -> tuple[int, ...]:
    """``"1,3,224,224"`` (or ``1x3x224x224``) -> ``(1, 3, 224, 224)``; UserError naming the option otherwise."""
    parts = [p.strip() for p in text.replace("x", ",").replace("X", ",").split(",")]
    try:
        # every field a plain decimal (no empty field, sign, exponent or 5,000-digit number)
        dims = tuple(int(p) if p.isdigit() and len(p) <= 12 else int("?") for p in parts)
    except ValueError:
        dims = ()
    if not dims or any(d <= 0 for d in dims):
        raise UserError(
            f"--input-shape {text!r} is not a shape: give positive integers separated by commas, "
            "e.g. --input-shape 1,3,224,224"
        )
    numel = 1
    for d in dims:
        numel *= d
    if numel > MAX_INPUT_ELEMENTS:
        raise UserError(
            f"--input-shape {text!r} has {numel:,} elements, more than the limit of "
            f"{MAX_INPUT_ELEMENTS:,} (1 GiB of float32); give the model's real input shape"
        )
    return dims


def shapes_from(args_shapes: list[str] | None, what: str) -> list[tuple[int, ...]]:
    if not args_shapes:
        raise UserError(
            f"{what} needs the model's input shape: add --input-shape N,C,H,W "
            "(repeat it for each input of a model with several)"
        )
    return [parse_shape(s) for s in args_shapes]


def example_inputs(shapes: list[tuple[int, ...]], seed: int = 0) -> list[torch.Tensor]:
    """Random normal tensors of the given shapes (seeded: runs are reproducible)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in shapes]
