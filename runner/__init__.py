"""runner: a Hydra-configured interpretability experiment runner for PyTorch."""

__version__ = "0.1.0"
