"""Fuzzed overrides, drawn from the schema's fields with valid and invalid values alike, either run or fail with the
clear-error path (Hydra's or the schema's one message, which the CLI exits 2 with)."""

from __future__ import annotations

import pytest
from hydra.errors import ConfigCompositionException
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf.errors import OmegaConfBaseException

import runner.app as app
from runner.errors import RunnerError
from tests.conftest import make_config
from tests.test_robustness import TINY

pytestmark = pytest.mark.slow  # the fast tier does not import this module (hypothesis takes 1.2 s to import)

# Overrides drawn from the schema's fields, with valid and invalid values alike.
OVERRIDES = st.fixed_dictionaries(
    {},
    optional={
        "data.batch_size": st.sampled_from(["0", "-1", "1", "3", "x"]),
        "data.count": st.sampled_from(["0", "1", "5"]),
        "data.limit": st.sampled_from(["null", "0", "2"]),
        "precision": st.sampled_from(["fp32", "bf16", "fp16"]),
        "method": st.sampled_from(["gradcam", "layercam", "eigencam", "record", "hook_check", "patching", "sanity"]),
        "method.target": st.sampled_from(["predicted", "label", "fixed", "topk", "best"]),
        "method.top_k": st.sampled_from(["0", "2", "9"]),
        "method.class_ids": st.sampled_from(["[]", "[1]", "[1,2]", "[99]"]),
        "layers.include": st.sampled_from(["[features.0]", "[fc]", "[Conv2d]", "[nope]", "[features.*:ReLU]", "[]"]),
        "hooks": st.sampled_from(
            ["[]", "[{kind: tensor}]", "[{kind: pre, action: clamp}]", "[{kind: backward, action: zero}]"]
        ),
        "device": st.sampled_from(["cpu", "auto", "tpu"]),
        "output.shard_batches": st.sampled_from(["0", "1"]),
    },
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(overrides=OVERRIDES)
def test_fuzzed_overrides_run_or_fail_clearly(tmp_path_factory: pytest.TempPathFactory, overrides: dict) -> None:
    out = tmp_path_factory.mktemp("fuzz")
    args = [*TINY, *(f"{k}={v}" for k, v in overrides.items())]
    try:
        config = make_config(*args)
    except (ConfigCompositionException, OmegaConfBaseException, RunnerError):
        return  # Hydra's or the schema's one-message error: the CLI exits 2 with it
    try:
        app.run(config, out)
    except RunnerError:
        return
