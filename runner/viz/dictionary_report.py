"""The report's sections of method=train_sae's tables (their declarations in runner/methods/train_sae/ name them):
the evaluation as a table with its definitions, the training curve at a few steps, the held-out windows' losses, and
the feature table as a reader scans it on Neuronpedia: a latent's density, its top contexts with the token marked, and
the tokens its decoder direction promotes and suppresses."""

from __future__ import annotations

import html
import math
from typing import Any

import numpy as np
import pandas as pd

from runner.schema import FiguresConfig
from runner.tables import Presentation
from runner.viz.report import Page, plain_html

EVALUATION_COLUMNS = ("site", "layer", "architecture", "width", "k", "fvu", "fvu_without_massive", "massive_positions",
                      "l0", "dead", "dense", "ce_clean", "ce_sae", "ce_zero", "ce_recovered", "train_positions",
                      "heldout_positions", "train_seconds")  # fmt: skip
EVALUATION_WORDS = (
    "On the held-out windows, every position but the BOS: fvu = sum |x - x_hat|^2 / sum |x - mean x|^2,"
    " fvu_without_massive the same without the massive positions (|x| above 10 x the median); l0 = the mean"
    " number of latents that fire per position; dead: latents that fire at no held-out position; dense: at more than"
    " 10% of them; ce_*: the next-token cross-entropy (nats) of the model, with the site replaced by the reconstruction"
    " (no error term), and replaced by zeros; ce_recovered = (ce_zero - ce_sae) / (ce_zero - ce_clean) (SAELens's"
    " ce_loss_score; NaN where zeroing changes nothing). The dictionary is in the run's dictionary/ folder (SAELens's"
    " layout)."
)
CURVE_POINTS = 11  # training steps shown
FEATURES_SHOWN = 24  # latents in the feature table's sample
CONTEXTS_SHOWN = 2  # top contexts shown per latent
TOKENS_SHOWN = 6  # promoted and suppressed tokens shown per latent


def evaluation_section(page: Page, frame: pd.DataFrame, present: list[str], compare: str | None,
                       figures: FiguresConfig, shown: Presentation) -> None:  # fmt: skip
    """train_sae: one row per dictionary (a sweep's jobs: one each, with their swept values first)."""
    columns = [*present, *(c for c in EVALUATION_COLUMNS if c in frame.columns)]
    page.add(plain_html(_counts_as_text(frame[columns]), EVALUATION_WORDS))


def steps_section(page: Page, frame: pd.DataFrame, present: list[str], compare: str | None,
                  figures: FiguresConfig, shown: Presentation) -> None:  # fmt: skip
    """train_sae_steps: the curve at CURVE_POINTS evenly spaced steps (per job of a sweep)."""
    for key, part in frame.groupby(present, sort=False) if present else [((), frame)]:
        steps = part.sort_values("step")
        picked = steps.iloc[np.unique(np.linspace(0, len(steps) - 1, CURVE_POINTS).round().astype(int))]
        columns = [c for c in ("step", "loss", "mse", "fvu", "l0", "aux_loss", "dead", "lr") if c in picked.columns]
        label = f" ({', '.join(map(str, key if isinstance(key, tuple) else (key,)))})" if present else ""
        words = (f"The training curve{label} at {len(picked)} of its {len(steps)} steps, on each step's batch of the"
                 " normalised activations (x' = s x): loss = mse + the auxiliary term (topk: AuxK for dead latents;"
                 " jumprelu: l0_coefficient x the L0); dead: latents that have not fired for method.dead_steps steps.")  # fmt: skip
        page.add(plain_html(_counts_as_text(picked[columns]), words))


def windows_section(page: Page, frame: pd.DataFrame, present: list[str], compare: str | None,
                    figures: FiguresConfig, shown: Presentation) -> None:  # fmt: skip
    """train_sae_windows: the windows of each part, and the held-out ones' mean losses."""
    group = [*present, "split"]
    values = [c for c in ("ce_clean", "ce_sae", "ce_zero", "mse", "l0") if c in frame.columns]
    summary = frame.groupby(group, sort=False).agg(windows=("split", "size"), **{v: (v, "mean") for v in values})
    words = ("Windows by part; for the held-out ones the mean over windows of each window's CE (its predictions after"
             " the BOS), of its mean |x - x_hat|^2 and of its L0. Training windows have no values.")  # fmt: skip
    page.add(plain_html(summary.reset_index(), words))


def features_section(page: Page, frame: pd.DataFrame, present: list[str], compare: str | None,
                     figures: FiguresConfig, shown: Presentation) -> None:  # fmt: skip
    """train_sae_features: counts, then FEATURES_SHOWN live latents spread over the density ranking, each with its top
    contexts and the tokens its decoder direction promotes and suppresses."""
    for key, part in frame.groupby(present, sort=False) if present else [((), frame)]:
        live = part[~part["dead"].astype(bool)].sort_values("density", ascending=False)
        label = f" ({', '.join(map(str, key if isinstance(key, tuple) else (key,)))})" if present else ""
        page.add(f"<p>{len(part)} latents{html.escape(label)}: {len(live)} fire on the held-out windows,"
                 f" {int(part['dead'].sum())} dead, {int(part['dense'].sum())} dense (density above 0.1).</p>")  # fmt: skip
        if live.empty:
            continue
        picked = live.iloc[np.unique(np.linspace(0, len(live) - 1, min(FEATURES_SHOWN, len(live))).round().astype(int))]
        page.add(_features_html(picked, len(live)))


def _features_html(picked: pd.DataFrame, live: int) -> str:
    """The latents as a table whose context cells wrap."""
    head = "".join(f"<th>{name}</th>" for name in ("latent", "density", "mean f", "top contexts (f)", "promotes",
                                                    "suppresses"))  # fmt: skip
    rows = []
    for _, row in picked.iterrows():
        contexts = "<br>".join(
            f"{html.escape(str(text))} <small>({_number(value)})</small>"
            for text, value in list(zip(_listed(row["top_contexts"]), _listed(row["top_activations"]), strict=False))[
                :CONTEXTS_SHOWN
            ]
        )
        cells = [str(int(row["latent"])), _number(row["density"]), _number(row["mean_activation"])]
        cells += [contexts, _tokens(row["promoted"]), _tokens(row["suppressed"])]
        rows.append("<tr>" + "".join(
            f'<td class="label" style="white-space: normal">{cell}</td>' if i >= 3 else f"<td>{cell}</td>"
            for i, cell in enumerate(cells)
        ) + "</tr>")  # fmt: skip
    words = (f"{len(picked)} of the {live} latents that fire, spread from the densest to the rarest: density (the share"
             " of held-out positions where f > 0), the mean f where it fires, its top held-out contexts with the token"
             " marked «...», and the tokens of largest and smallest W_dec[i] @ W_U^T (the unembedding, no final norm)."
             " Every latent is in the table's Parquet files.")  # fmt: skip
    return (f'<p class="caption">{html.escape(words)}</p><div class="scroll"><table><thead><tr>{head}</tr></thead>'
            f"<tbody>{''.join(rows)}</tbody></table></div>")  # fmt: skip


def _counts_as_text(frame: pd.DataFrame) -> pd.DataFrame:
    """Integer columns as text (plain_html rounds numbers to 3 digits: 7,200 positions would read 7.2e+03)."""
    shown = frame.reset_index(drop=True).copy()
    for column in shown.columns:
        if pd.api.types.is_integer_dtype(shown[column]):
            shown[column] = [("" if pd.isna(v) else str(int(v))) for v in shown[column]]
    return shown


def _listed(value: Any) -> list[Any]:
    return [] if value is None else list(value)


def _tokens(value: Any) -> str:
    return html.escape(" ".join(repr(str(t)) for t in _listed(value)[:TOKENS_SHOWN]))


def _number(value: Any) -> str:
    number = float(value)
    return "–" if math.isnan(number) else f"{number:.3g}"
