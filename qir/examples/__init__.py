"""Built-in example models, small enough to train on the CPU in seconds."""

from qir.examples.digits import DigitsNet
from qir.examples.digits_deploy import DeployableDigitsNet

__all__ = ["DeployableDigitsNet", "DigitsNet"]
