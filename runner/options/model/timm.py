"""timm models by name, with timm's pretrained tags, data config and class names."""

from runner.options.registry import MODELS
from runner.schema import ModelConfig

MODELS.option("runner.models.timm_source:TimmSource", name="timm")(ModelConfig)
