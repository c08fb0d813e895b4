"""Evaluation metrics (issue 14): one registered class per metric, computed per (sample, layer, target) on
the CAM family's maps and on the layer's random map, written to the `evaluation` table.

`base` holds the contract (MetricInputs, Metric, METRICS, EvaluationConfig); every other module of this
package registers its metrics when imported (`load_metrics()` imports them all, so a new metric is one module).
"""

from __future__ import annotations

from runner.metrics.base import METRICS, Metric, MetricInputs, build_metrics, load_metrics
from runner.options.metric.evaluation import EvaluationConfig

__all__ = ["METRICS", "EvaluationConfig", "Metric", "MetricInputs", "build_metrics", "load_metrics"]
