"""runner/ranking.py: Spearman's rho with ties (average ranks, as scipy), NaN for a constant map."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import spearmanr

from runner.ranking import average_ranks, spearman, toward_source

TIE_PATTERNS = [
    ([1, 1, 2, 2, 3], [5, 4, 3, 2, 1]),  # pairs of ties on one side
    ([0, 0, 0, 0, 1, 2, 3, 0, 0], [0, 1, 0, 2, 3, 3, 3, 0, 1]),  # a ReLU map: most pixels 0, ties on both sides
    ([3, 3, 3, 1], [1, 2, 3, 4]),  # three-way tie
    ([0.5] * 6 + [1.0] * 3, list(range(9))),  # two blocks of ties
    ([0, 0, 0, 0, 0, 1, 1], [1, 0, 1, 0, 1, 0, 1]),  # both binary
]


@pytest.mark.parametrize(("a", "b"), TIE_PATTERNS)
def test_spearman_equals_scipy_with_ties(a: list[float], b: list[float]) -> None:
    expected = spearmanr(a, b).statistic
    got = spearman(torch.tensor(a, dtype=torch.float32), torch.tensor(b, dtype=torch.float32))
    assert float(got) == pytest.approx(expected, abs=1e-6)
    # Argsort ranks (ties ranked by position) give each pattern another value: the check has teeth.
    ra = torch.tensor(a).argsort(stable=True).argsort().double()
    rb = torch.tensor(b, dtype=torch.float64).argsort(stable=True).argsort().double()
    assert abs(float(torch.corrcoef(torch.stack([ra, rb]))[0, 1]) - expected) > 1e-3


def test_spearman_equals_scipy_on_random_tied_maps() -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        a = torch.relu(torch.randn(49, generator=g)).round(decimals=1)  # ~half zeros, many ties
        b = torch.relu(torch.randn(49, generator=g)).round(decimals=1)
        assert float(spearman(a, b)) == pytest.approx(spearmanr(a.numpy(), b.numpy()).statistic, abs=1e-6)


def test_average_ranks_are_scipys() -> None:
    from scipy.stats import rankdata

    values = torch.tensor([3.0, 1.0, 3.0, 2.0, 1.0, 3.0])
    np.testing.assert_allclose(average_ranks(values).numpy(), rankdata(values.numpy()))


def test_spearman_of_a_constant_map_is_nan() -> None:
    assert torch.isnan(spearman(torch.rand(49, generator=torch.Generator().manual_seed(0)), torch.zeros(49)))
    assert torch.isnan(spearman(torch.ones(5), torch.ones(5)))
    assert torch.isnan(spearman(torch.tensor([1.0, float("nan")]), torch.tensor([1.0, 2.0])))


def test_toward_source_signs_the_move_by_where_the_source_run_is() -> None:
    """Denoising up to a higher clean metric, noising down to a lower corrupted one, and a target where clean is
    below corrupted (kl_to_clean): the furthest move toward the source ranks first; no direction: the size."""
    estimated = torch.tensor([0.5, 2.0, -1.0])
    assert toward_source(estimated, torch.tensor(0.0), torch.tensor(3.0)).argmax() == 1  # source above
    assert toward_source(estimated, torch.tensor(0.0), torch.tensor(-3.0)).argmax() == 2  # source below
    assert torch.equal(toward_source(estimated, torch.tensor(0.0), torch.tensor(0.0)), estimated.abs())
    per_pair = toward_source(estimated[:, None], torch.tensor([0.0, 0.0]), torch.tensor([1.0, -1.0]))  # (3, 2)
    assert per_pair.argmax(0).tolist() == [1, 2]
