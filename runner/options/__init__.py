"""The options: each config group's option modules (runner/options/<group>/) and the registry they join."""
