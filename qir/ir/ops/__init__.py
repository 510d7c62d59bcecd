"""Built-in op kinds. Importing this package registers them all."""

from qir.ir.ops import (  # noqa: F401
    activation,
    attention,
    core,
    elementwise,
    integer,
    misc,
    nn,
    norm,
    pool,
    quant,
    reduce,
    shape,
    vision,
)
