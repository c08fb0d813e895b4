"""runner/chunks.py: forwards over many inputs in chunks give what one forward gives, in forwards of `chunk`."""

from __future__ import annotations

import pytest
import torch

from runner.chunks import chunked_forward, indices, spans, target_scores
from runner.runtime import Runtime
from runner.schema import Precision
from tests.conftest import TinyNet

CPU = Runtime(torch.device("cpu"), Precision.fp32)


def test_spans_cover_the_range_in_order() -> None:
    assert [list(s) for s in spans(7, 3)] == [[0, 1, 2], [3, 4, 5], [6]]
    assert list(spans(0, 4)) == []
    with pytest.raises(ValueError, match="chunk"):
        list(spans(3, 0))


def test_chunked_forward_equals_one_forward_in_forwards_of_chunk() -> None:
    torch.manual_seed(0)
    model = TinyNet().eval()
    sizes: list[int] = []
    model.register_forward_hook(lambda _m, inputs, _o: sizes.append(inputs[0].shape[0]))
    x = torch.randn(7, 3, 8, 8)
    with torch.no_grad():
        whole = model(x)  # (7, K)
    target = torch.tensor([0, 1, 0, 1, 1, 0, 1])
    sizes.clear()
    torch.testing.assert_close(chunked_forward(model, x, 3, CPU), whole)
    assert sizes == [3, 3, 1]
    # Inputs built per chunk (here: the i-th input doubled), reduced to the target's probability or logit.
    built = chunked_forward(model, lambda s: 2 * x[indices(s, x.device)], 4, CPU, target_scores(target), total=7)
    with torch.no_grad():
        twice = model(2 * x)
    torch.testing.assert_close(built, twice.softmax(1).gather(1, target[:, None])[:, 0])
    logit = chunked_forward(model, x, 2, CPU, target_scores(target, probability=False))
    torch.testing.assert_close(logit, whole.gather(1, target[:, None])[:, 0])
    with pytest.raises(ValueError, match="total"):
        chunked_forward(model, lambda s: x, 2, CPU)
