"""qir: a compiler-style quantization toolkit for PyTorch (Horizon BPU: Bernoulli2, Bayes)."""

__version__ = "0.1.0"
