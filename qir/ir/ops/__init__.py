"""Built-in op kinds. Importing this package registers them all."""

from qir.ir.ops import activation, attention, core, elementwise, misc, nn, norm, pool, quant, reduce, shape, vision  # noqa: F401
