"""Evaluation metrics: one class per metric, computed per (sample, layer, target) on the CAM family's maps and on
the layer's random map, written to the `evaluation` table. `base` holds the contract (MetricInputs, Metric); each
metric's option module (runner/options/metric/<name>.py) registers its class and its settings' schema."""

from runner.metrics.base import Metric, MetricInputs, build_metrics, load_metrics
from runner.options.metric.evaluation import EvaluationConfig

__all__ = ["EvaluationConfig", "Metric", "MetricInputs", "build_metrics", "load_metrics"]
