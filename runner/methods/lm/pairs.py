"""What a patched metric is read against: each pair's clean and corrupted metric, the flags of the pairs whose
restoration they leave undefined, and each direction's receiving run.

Every patching mode (exact, attribution, and any other that scores cells or edges of the same pairs) reports a
patched metric per pair and direction, and its restoration = (patched - corrupted) / (clean - corrupted): the two
runs' metrics and flags are made once a batch (`pair_metrics`), and the receiving run (`Receiver`) is what a mode
patches into.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from runner.methods.lm.base import TokenPairs
from runner.methods.lm.corruptions import EmbeddingEdit
from runner.methods.patching.rows import small_spans
from runner.options.method.patching import PatchDirection
from runner.targets.tokens import TokenTarget, target_name

log = logging.getLogger(__name__)


def score(target: TokenTarget, logits: torch.Tensor, answers: torch.Tensor, distractors: torch.Tensor,
          clean: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """(N,) the token target's metric of next-token `logits` (N, V) for each row's answer and distractor sets (N, A),
    `clean` (N, V) the clean run's logits (kl_to_clean's reference); the sets and `clean` follow `logits`' device
    (the unembedding may sit on another device than the prompts)."""
    device = logits.device
    return target.score_tokens(logits, answers.to(device), distractors.to(device), clean.to(device))


@dataclass
class PairMetrics:
    """The target, what it reads of each pair, each pair's clean and corrupted metric, and what leaves its
    restoration undefined."""

    target: TokenTarget
    answers: torch.Tensor  # (B, A) token sets padded with -1
    distractors: torch.Tensor  # (B, A)
    clean_logits: torch.Tensor  # (B, V) the clean run's next-token logits (kl_to_clean's reference)
    clean: torch.Tensor  # (B,) the clean run's metric
    corrupted: torch.Tensor  # (B,) the corrupted run's
    reasons: list[str | None]  # per pair, why its restoration is NaN: self_pair, zero_span, or None
    small: list[bool]  # per pair, a span below method.patching.min_span (and no reason above)

    @property
    def name(self) -> str:
        """The target's name: the table's `metric` column."""
        return target_name(self.target)

    def of(self, logits: torch.Tensor) -> torch.Tensor:
        """(B,) the metric of a run of these pairs from its next-token logits (B, V)."""
        return score(self.target, logits, self.answers, self.distractors, self.clean_logits)

    def receiving(self, direction: PatchDirection) -> torch.Tensor:
        """(B,) the metric of the run a direction patches into (denoising: the corrupted run; noising: the clean)."""
        return self.corrupted if direction is PatchDirection.denoising else self.clean

    def source(self, direction: PatchDirection) -> torch.Tensor:
        """(B,) the metric of the run a direction takes its values from."""
        return self.clean if direction is PatchDirection.denoising else self.corrupted

    @property
    def undefined(self) -> torch.Tensor:
        """(B,) bool on the CPU: the pairs whose restoration is NaN (flagged degenerate or small)."""
        return torch.tensor([r is not None or s for r, s in zip(self.reasons, self.small, strict=True)])

    def restoration(self, patched: torch.Tensor) -> torch.Tensor:
        """(C, B) (patched - corrupted) / (clean - corrupted) on the CPU of patched metrics (C, B); NaN for a pair
        flagged degenerate or small."""
        span = (self.clean - self.corrupted).cpu()
        return ((patched.cpu() - self.corrupted.cpu()) / span).masked_fill(self.undefined, float("nan"))


def pair_metrics(
    target: TokenTarget, prompts: TokenPairs, corrupted_ids: torch.Tensor, edit: EmbeddingEdit | None,
    clean_logits: torch.Tensor, corrupted_logits: torch.Tensor, sample_ids: Sequence[str], min_span: float,
    warned: set[str], method: str = "lm_patching", settings: str = "method.patching",
    consequence: str = "restoration is NaN",
) -> PairMetrics:  # fmt: skip
    """The pairs' metrics from the two runs' logits (B, V), and their flags: identical prompts (`prompts.clean` and
    `corrupted_ids`, no embedding `edit`) or an equal metric leave restoration NaN (degenerate), and so does a span
    below `min_span` of the metrics' size (small_span). Warns once per flag per run (`warned` holds the flags
    already warned about, and gains the new ones), naming `method`, its `settings` key and the flag's `consequence`
    for that method."""
    answers, distractors = prompts.answers, prompts.distractors
    m_clean = score(target, clean_logits, answers, distractors, clean_logits)
    m_corrupted = score(target, corrupted_logits, answers, distractors, clean_logits)
    equal = ~torch.isfinite(m_clean - m_corrupted) | (m_clean == m_corrupted)
    same = (prompts.clean == corrupted_ids).all(1).to(equal.device) if edit is None else torch.zeros_like(equal)
    spans = small_spans(m_clean, m_corrupted, min_span).to(equal.device)
    # the three flags in one transfer (on CUDA, one host sync a batch)
    same, equal, spans = torch.stack([same, equal, spans], dim=1).cpu().T.tolist()
    reasons = ["self_pair" if s else "zero_span" if e else None for s, e in zip(same, equal, strict=True)]
    small = [bool(f) and r is None for f, r in zip(spans, reasons, strict=True)]
    for key, flags, text in (
        ("degenerate", [r is not None for r in reasons],
         f"the clean and corrupted prompts (or metrics) are identical: {consequence}"),
        ("small_span", small, f"|clean - corrupted| is below {settings}.min_span={min_span} of"
         f" their size: {consequence} (small_span=True)"),
    ):  # fmt: skip
        if any(flags) and key not in warned:
            warned.add(key)
            ids = [s for s, f in zip(sample_ids, flags, strict=True) if f]
            log.warning("%s: %s (first: %s)", method, text, ", ".join(ids[:5]))
    return PairMetrics(target, answers, distractors, clean_logits, m_clean, m_corrupted, reasons, small)


@dataclass
class Receiver:
    """One direction's receiving run: its prompts, mask, embedding edit, and the source run's site tensors."""

    direction: PatchDirection
    ids: torch.Tensor  # (B, T)
    mask: torch.Tensor  # (B, T)
    edit: EmbeddingEdit | None  # the edit of its embeddings (noise, zero, mean), or None
    sources: dict[str, torch.Tensor]  # site name -> (B, T, ...) the source run's views
    metric: torch.Tensor  # (B,) the receiving run's metric
    corrupted_names: list[str]  # per pair, what the `corrupted_id` column names
