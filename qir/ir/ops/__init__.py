"""Built-in op kinds. Importing this package registers them all."""

from qir.ir.ops import (  # noqa: F401
    activation,
    attention,
    core,
    elementwise,
    integer,
    integer_elementwise,
    integer_functional,
    integer_math,
    integer_pool,
    integer_resize,
    integer_stubs,
    misc,
    nn,
    norm,
    pool,
    qat,
    quant,
    reduce,
    shape,
    vision,
)
