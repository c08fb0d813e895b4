"""Targets: what score a method differentiates for the class it explains (the `target` config group).

`method.target` chooses WHICH class each sample is explained for; the run's target says WHAT SCORE of the model's
output stands for that class: its logit (the default), its probability, a logit difference, a segmentation
region's sum, ... Each target is an option module in runner/options/target/ naming its implementation here."""

from runner.targets.base import Target, build_target

__all__ = ["Target", "build_target"]
