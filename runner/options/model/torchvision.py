"""torchvision's classification models by name, with their weights enums' ImageNet class names and preprocessing."""

from runner.options.registry import MODELS
from runner.schema import ModelConfig

MODELS.option("runner.models.torchvision_zoo:TorchvisionSource", name="torchvision")(ModelConfig)
