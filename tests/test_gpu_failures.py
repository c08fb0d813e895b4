"""GPU-path failures that the CPU can show (issue 12): each test fails without its fix."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from runner import app
from tests.conftest import make_config

VGG_TINY = ["model=vgg16", "model.weights=null", "data=synthetic", "data.count=2", "data.shape=[3,32,32]",
            "data.batch_size=2", "layers.include=[features.2]", "method=patching", "method.patching.grid=[2,2]", "method.target=fixed", "method.class_ids=[1]",
            "method.pictures=false", "progress=false", "hooks=[]"]  # fmt: skip


def test_bf16_cell_patching_through_the_cone_runs_and_matches_fp32(tmp_path: Path) -> None:
    """The cone recomputation (VGG's chain of local ops) runs under autocast as the forward does: bf16 used to
    fail with "Input type (c10::BFloat16) and bias type (float)"."""
    tables = {}
    for precision in ("fp32", "bf16"):
        result = app.run(make_config(*VGG_TINY, f"precision={precision}"), tmp_path / precision)
        tables[precision] = pd.read_parquet(result.tables["patching"]).sort_values(["sample", "y", "x"])
    fp32, bf16 = tables["fp32"], tables["bf16"]
    assert len(bf16) == len(fp32) == 2 * 4
    assert (bf16["target"].to_numpy() == 1).all()
    scale = fp32["patched"].abs().max()
    assert scale > 0
    assert abs(bf16["patched"].to_numpy() - fp32["patched"].to_numpy()).max() <= 0.05 * scale
