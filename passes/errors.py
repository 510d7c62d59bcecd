"""Errors of the pass layer: bad pipeline text, and a pass that failed while running."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from qir.ir.op import IRError

if TYPE_CHECKING:
    from passes.base import Pass
    from qir.ir.graph import Graph
    from qir.ir.verifier import VerifyError


class PipelineError(ValueError):
    """A pipeline string or pass spec is wrong: syntax, unknown pass, unknown option, bad value.

    Raised before any pass runs, so the graph is never touched.
    """


class PassFailure(IRError):
    """A pass raised while running. The message names the pass, its options and the passes
    that ran before it; ``__cause__`` is the original exception.

    ``graph`` is the graph as the pass left it (a copy unless the run was ``inplace``), for
    post-mortem inspection.
    """

    def __init__(
        self,
        message: str,
        pass_: Pass,
        index: int,
        previous: Sequence[Pass],
        graph: Graph,
    ) -> None:
        super().__init__(message)
        self.pass_ = pass_
        self.index = index
        self.previous = tuple(previous)
        self.graph = graph


class PassVerificationFailure(PassFailure):
    """A pass returned normally but left a graph that does not verify; the pass is the culprit."""

    def __init__(
        self,
        message: str,
        pass_: Pass,
        index: int,
        previous: Sequence[Pass],
        graph: Graph,
        error: VerifyError,
    ) -> None:
        super().__init__(message, pass_, index, previous, graph)
        self.error = error
