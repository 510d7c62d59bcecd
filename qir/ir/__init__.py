"""The typed quantization IR: types, ops, graphs, verifier, interpreter, text form."""

from qir.ir import ops  # noqa: F401  (registers built-in ops)
from qir.ir.call_targets import register_call_method, register_call_target
from qir.ir.graph import Argument, Graph, Node, Value
from qir.ir.interpreter import Interpreter, UnboundModuleError, check_bound, run_graph, unbound_modules
from qir.ir.op import (
    OP_REGISTRY,
    CannotInfer,
    Commutative,
    Elementwise,
    HasWeight,
    IRError,
    ModuleOp,
    MovesCodes,
    Op,
    Opaque,
    Pure,
    Quantization,
    ReadsShape,
    Ref,
    SameDtypeOperands,
    ShapePreserving,
    Trait,
    Transparent,
    get_op_class,
    register_op,
)
from qir.ir.parser import ParseError, parse_graph
from qir.ir.printer import print_graph
from qir.ir.stand_ins import StandInError
from qir.ir.types import DType, ObjectType, QuantSpec, ScalarType, SequenceType, TensorType, Type, type_of
from qir.ir.verifier import VerifyError, verify

__all__ = [
    "OP_REGISTRY",
    "Argument",
    "CannotInfer",
    "Commutative",
    "DType",
    "Elementwise",
    "Graph",
    "HasWeight",
    "IRError",
    "Interpreter",
    "ModuleOp",
    "MovesCodes",
    "Node",
    "ObjectType",
    "Op",
    "Opaque",
    "Pure",
    "Quantization",
    "SameDtypeOperands",
    "QuantSpec",
    "ReadsShape",
    "Ref",
    "ScalarType",
    "SequenceType",
    "ShapePreserving",
    "StandInError",
    "TensorType",
    "Trait",
    "Transparent",
    "Type",
    "UnboundModuleError",
    "Value",
    "VerifyError",
    "check_bound",
    "get_op_class",
    "register_call_method",
    "register_call_target",
    "register_op",
    "run_graph",
    "type_of",
    "unbound_modules",
    "verify",
    "ParseError",
    "parse_graph",
    "print_graph",
]
