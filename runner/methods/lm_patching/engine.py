"""The cells of exact, batched activation patching: every (site, layer, position or head) a run patches. The hooks
that keep and patch them are runner/hooks/sites.py."""

from __future__ import annotations

from collections.abc import Sequence

from runner.hooks.sites import Cell
from runner.models.lm_sites import LanguageModelLayout
from runner.site_kinds import PER_HEAD


def cells_of(layout: LanguageModelLayout, sites: Sequence[str], layers: Sequence[int], positions: int,
             each_head_position: bool) -> list[Cell]:  # fmt: skip
    """Every cell to patch: per site and layer, each position (per-head sites: each head, at all positions at once
    or at each position)."""
    cells = []
    for kind in sites:
        for layer in layers:
            if kind in PER_HEAD:
                heads = layout.site(kind, layer).heads
                for head in range(heads):
                    if each_head_position:
                        cells += [Cell(kind, layer, p, head) for p in range(positions)]
                    else:
                        cells.append(Cell(kind, layer, None, head))
            else:
                cells += [Cell(kind, layer, p, None) for p in range(positions)]
    return cells
