"""`method=lm_patching`'s schema: activation patching of a causal language model's named sites (layer x position,
layer x head) between the clean and corrupted prompt of each pair, in one or both directions."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar, Optional

from runner.errors import RunnerError
from runner.options.method.patching import PatchDirection, PatchMode
from runner.options.registry import LM_FAMILY, METHODS
from runner.schema import MethodConfig, light_layers
from runner.site_kinds import SiteSelection


class LmCorruption(str, Enum):
    pair = "pair"  # the pair's own corrupted prompt
    resample = "resample"  # another pair's clean prompt of the same token length (chosen with `seed`)
    noise = "noise"  # the clean prompt, its embeddings on `span` plus Gaussian noise of std x the embeddings' std
    zero = "zero"  # the clean prompt, its embeddings on `span` replaced by zeros
    mean = "mean"  # the clean prompt, its embeddings on `span` replaced by their mean over the data set's tokens


SUBJECT_SPAN = "subject"  # corruption.span: each pair's subject tokens (the data's per-pair `subject`)


def _is_span(span: Any) -> bool:
    """[start, end) of two ints with 0 <= start < end."""
    if isinstance(span, str) or not isinstance(span, Sequence) or len(span) != 2:
        return False
    return all(isinstance(v, int) and not isinstance(v, bool) for v in span) and 0 <= span[0] < span[1]


class HeadPositions(str, Enum):
    all = "all"  # a head's output at every position at once: one cell per (layer, head)
    each = "each"  # one cell per (layer, head, position)


@dataclass
class LmCorruptionConfig:
    kind: LmCorruption = LmCorruption.pair
    std: float = 3.0  # noise: in standard deviations of the embedding output's entries (Meng et al. 2022: 3)
    # noise, zero, mean: the token positions edited, [start, end) counted as the table's positions (BOS = 0);
    # `subject`: each pair's own subject tokens (its `subject` in the data); null: every position but a leading BOS
    span: Optional[Any] = None  # noqa: UP045 (OmegaConf: a list of two ints or the word subject)
    seed: int = 0  # noise: the noise; resample: which pair of the same length each pair takes its prompt from


@dataclass
class LmPatchingConfig:
    sites: list[str] = field(default_factory=lambda: ["resid_pre", "attn_out", "mlp_out", "head"])
    layers: Optional[list[int]] = None  # null: every layer  # noqa: UP045 (OmegaConf)
    head_positions: HeadPositions = HeadPositions.all  # per-head sites (head, q, k, v)
    directions: list[PatchDirection] = field(default_factory=lambda: [PatchDirection.denoising])
    corruption: LmCorruptionConfig = field(default_factory=LmCorruptionConfig)
    # Patched variants per forward (each a copy of the batch's pairs); null: automatic (~32 rows on CPU; on CUDA
    # sized from free memory, runner.chunk_sizing).
    chunk: Optional[int] = None  # noqa: UP045 (OmegaConf)
    # A pair whose |clean - corrupted| is below min_span x max(|clean|, |corrupted|) is flagged small_span and its
    # restoration is NaN (as for vision).
    min_span: float = 0.05
    # exact: every cell patched; attribution: every cell's first-order estimate from one forward and one backward
    # per direction; attribution_topk: the estimates, then each pair's top_k cells per site patched exactly.
    mode: PatchMode = PatchMode.exact
    top_k: int = 16  # attribution_topk: cells per (pair, direction, site) patched exactly

    # Run the positions before a chunk's first patched one once per receiving run, and reuse their keys and values
    # (the causal mask leaves them unchanged): equal within float rounding, fewer positions per variant.
    reuse_prefix: bool = True

    SPEED_KEYS: ClassVar[tuple[str, ...]] = ("chunk", "reuse_prefix")


@METHODS.option("runner.methods.lm_patching.method:LmPatching", tables=("lm_patching",), family=LM_FAMILY)
@dataclass
class LmPatchingMethodConfig(MethodConfig):
    """`method=lm_patching`: what is patched sits under `method.patching`; the metric is the run's `target`
    (target=token_logit_diff, token_prob_diff, answer_logprob or kl_to_clean)."""

    name: str = "lm_patching"
    patching: LmPatchingConfig = field(default_factory=LmPatchingConfig)

    def lightened(self, layers: int) -> LmPatchingMethodConfig:
        if self.patching.layers is not None:
            return self
        return dataclasses.replace(self, patching=dataclasses.replace(self.patching, layers=light_layers(layers)))

    def selection(self) -> SiteSelection:
        p = self.patching
        return SiteSelection("method.patching", tuple(p.sites), None if p.layers is None else tuple(p.layers))

    def check(self) -> list[str]:
        bad = super().check()
        p = self.patching
        if p.chunk is not None and p.chunk < 1:
            bad.append(f"method.patching.chunk={p.chunk}")
        if p.top_k < 1:
            bad.append(f"method.patching.top_k={p.top_k}")
        if not p.directions or len(set(p.directions)) != len(p.directions):
            raise RunnerError("method.patching.directions: each of denoising, noising at most once, at least one.")
        check_corruption(p.corruption, p.min_span, "method.patching")
        return bad


def check_corruption(c: LmCorruptionConfig, min_span: float, key: str) -> None:
    """RunnerError for a corruption (under `key`.corruption) or a min_span out of range."""
    if not math.isfinite(c.std) or c.std < 0 or not math.isfinite(min_span) or min_span < 0:
        raise RunnerError(
            f"Out of range: {key}.corruption.std={c.std} (finite, >= 0), {key}.min_span={min_span} (finite, >= 0)."
        )
    if c.span is not None and c.kind in (LmCorruption.pair, LmCorruption.resample):
        raise RunnerError(
            f"{key}.corruption.span={c.span} is read by the corruptions that edit the clean prompt's embeddings (noise,"
            f" zero, mean); kind={c.kind.value} replaces the whole prompt and would leave it unused. Drop the span, or"
            " choose one of those kinds."
        )
    if c.span is not None and c.span != SUBJECT_SPAN and not _is_span(c.span):
        raise RunnerError(
            f"{key}.corruption.span={c.span}: [start, end) with 0 <= start < end, or subject (each pair's own"
            " subject tokens)."
        )
