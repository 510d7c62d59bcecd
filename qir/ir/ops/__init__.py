"""Built-in op kinds. Importing this package registers them all."""

from qir.ir.ops import core, elementwise, nn  # noqa: F401
