"""Any nn.Module by its import path: `model._target_: my_pkg.MyNet`, called with `model.kwargs`."""

from runner.options.registry import MODELS
from runner.schema import ModelConfig

MODELS.option("runner.models.target:TargetSource", name="target")(ModelConfig)
