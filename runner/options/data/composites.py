"""A localisation benchmark built from the embedded photos: one photo in a quadrant of a 2x2 composite, its cell as the mask."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from runner.errors import RunnerError, suggest
from runner.options.data.images import ImageDataConfig
from runner.options.registry import DATA

# ImageNet-1k class of each photo the embedded EfficientNet-Lite0 names at top-1 on its own and in the grid.
# Checked on the photo, its centre square, and that square on the mean colour in each of the four cells (all top-1):
# chelsea 285 Egyptian cat (0.39-0.80), motorcycle 665 moped (0.11-0.56), camera 872 tripod (0.80-0.96). coffee is
# left out: espresso (967) alone, but "cup" (968) in two of the four cells.
COMPOSITE_CLASSES = {"chelsea": 285, "motorcycle": 665, "camera": 872}


# ---- the built-in benchmark ---------------------------------------------------------------------------------------
class CompositeLayout(str, Enum):
    """What fills a composite's other three cells."""

    grid = "grid"  # the other photos: the map must find the explained class among other objects
    background = "background"  # the mean colour: only the position changes


@DATA.option("runner.data.composites:composites_source")
@dataclass
class CompositesConfig(ImageDataConfig):
    name: str = "composites"
    photos: list[str] = field(default_factory=lambda: list(COMPOSITE_CLASSES))  # the photos explained
    # background: the model's top-1 is the label on all 12 default composites; grid: the other photos compete
    # (the cat outscores the others there), a harder test of the explained class's map
    layout: CompositeLayout = CompositeLayout.background

    def check(self) -> list[str]:
        bad = super().check()
        if not self.photos:
            bad.append(f"data.photos={list(self.photos)} (at least one of {', '.join(COMPOSITE_CLASSES)})")
        for name in self.photos:
            if name not in COMPOSITE_CLASSES:
                raise RunnerError(
                    f"data.photos: '{name}' has no class the embedded model names reliably.{suggest(name, list(COMPOSITE_CLASSES))}"
                    f" Composites use: {', '.join(COMPOSITE_CLASSES)}."
                )
        return bad
