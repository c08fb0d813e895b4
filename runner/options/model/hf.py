"""Hugging Face image classifiers (AutoModelForImageClassification) from the local cache or a folder, with their image processor and id2label."""

from runner.options.registry import MODELS
from runner.schema import ModelConfig

MODELS.option("runner.models.hf:HuggingFaceSource", name="hf")(ModelConfig)
