"""The torch front end: ``trace`` a module into the IR, ``emit`` an IR graph back to torch."""

from qir.frontend.convert import MODULE_ORDER_KEY, trace
from qir.frontend.emit import emit
from qir.frontend.tracer import QirTracer, TraceError

__all__ = ["MODULE_ORDER_KEY", "QirTracer", "TraceError", "emit", "trace"]
