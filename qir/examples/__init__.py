"""Built-in example models, small enough to train on the CPU in seconds."""

from qir.examples.digits import DigitsNet

__all__ = ["DigitsNet"]
