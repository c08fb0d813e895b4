"""Option modules: each defines its config dataclass and registers it (runner/options/registry.py)."""
