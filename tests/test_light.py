"""debug=light (conf/debug/light.yaml): a language-model experiment thinned to run in well under a minute on a CPU.
Two pairs; lm_patching, lm_grad_x_act, lm_logit_lens and lm_attention read 4 of the model's layers (first, last, two
between) where they would read all; lm_edges keeps every edge with fewer steps, resamples and exact re-patches;
layers given on the command line are kept; an image method is unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest

from runner import app
from runner.results import load
from runner.schema import light_layers
from tests.conftest import make_config


def test_light_layers_are_evenly_spaced_with_the_first_and_last() -> None:
    assert light_layers(30) == [0, 10, 19, 29]
    assert light_layers(18) == [0, 6, 11, 17]
    assert light_layers(6) == [0, 2, 3, 5] and light_layers(2) == [0, 1]


def test_each_lm_method_is_made_light_and_what_is_given_is_kept() -> None:
    patching = make_config("experiment=ioi_smollm2", "debug=light")
    assert patching.light and patching.data.limit == 2
    assert patching.method.lightened(30).patching.layers == [0, 10, 19, 29]
    given = make_config("experiment=ioi_smollm2", "debug=light", "method.patching.layers=[5]").method
    assert given.lightened(30) == given
    edges = make_config("experiment=ioi_edges_smollm2", "debug=light").method.lightened(30).edges
    assert (edges.steps, edges.resamples, edges.top_k) == (2, 20, 10)
    assert edges.fractions == [0.001, 0.01, 0.1, 1.0]  # MIB's curve, one fraction per decade
    mine = make_config("experiment=ioi_edges_smollm2", "debug=light", "method.edges.fractions=[0.5,1.0]").method
    assert mine.lightened(30).edges.fractions == [0.5, 1.0]
    lm = ["model=hf_lm", "data=prompts", "data.file=induction", "debug=light"]
    assert make_config(*lm, "method=lm_logit_lens").method.lightened(30).layers == [-1, 0, 10, 19, 29]
    assert make_config(*lm, "method=lm_grad_x_act").method.lightened(18).layers == [0, 6, 11, 17]
    assert make_config(*lm, "method=lm_attention").method.lightened(18).layers == [0, 6, 11, 17]
    image = make_config("debug=light").method
    assert image.lightened(30) == image


@pytest.mark.slow
def test_a_light_run_reads_the_light_layers_and_records_them(tmp_path: Path) -> None:
    """A six-layer model: the run's table holds layers 0, 2, 3 and 5 only, of two pairs."""
    app.run(make_config("experiment=patching_lm_induction", "debug=light", "model.weights=null",
                        "+model.config.num_hidden_layers=6", "progress=false", "report=false"), tmp_path)  # fmt: skip
    table = load(tmp_path, "lm_patching")
    assert sorted(table.layer.unique()) == [0, 2, 3, 5] and table.sample_id.nunique() == 2
