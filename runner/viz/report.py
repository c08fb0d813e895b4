"""`runner report DIR [--output FILE]`: one self-contained HTML page for a run or a sweep (DIR/report.html).

The page holds what a reader needs to judge a run without Python: the command and its overrides, the
provenance (package versions, commit, config hash, device), per results table a per-layer summary (layers in
model order, the mean over samples and its 95% bootstrap interval: runner.analysis.summarise) and the table's
standard figures (runner.viz.plots.table_figures), then the run's per-sample pictures, or for a sweep one row per
job with its status and the figures compared across the swept values. Figures are embedded as data URIs and
pictures linked relatively, so the file opens offline in any browser: no script, no font, no remote address.
A run in progress is reported from its committed shards (runner.store.reader.load(partial=True)) and says so.
"""

from __future__ import annotations

import argparse
import base64
import html
import logging
import os
import re
import shlex
import tempfile
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pandas as pd

from runner.errors import RunnerError
from runner.options.registry import resolve
from runner.schema import FigureFormat, FiguresConfig
from runner.store.layout import check_manifests, read_manifest, read_yaml
from runner.store.runs import RunInfo, SweepInfo, find, is_run, run_info
from runner.tables import Presentation
from runner.viz.run_summaries import RUN_SUMMARIES
from runner.viz.summary import is_cell_table

log = logging.getLogger(__name__)

REPORT_NAME = "report.html"
MAX_PICTURES = 24  # per-sample pictures shown in a run's gallery (the rest are counted, not shown)
MAX_SUMMARY_ROWS = 200  # rows of one summary table (mprt's layer x step x similarity can be long)
PICTURE_SUFFIXES = (".png", ".svg", ".jpg", ".jpeg")  # what an <img> shows; a PDF picture is linked instead

# Per table: the columns that label a summary row besides the layer (kept where present), and the measured
# columns summarised (those present with a value). A table not named here: its float columns.
# Id and bookkeeping columns never summarised as values.
NOT_VALUES = {"sample", "label", "predicted", "target", "target_rank", "layer_index", "call", "step", "channel",
              "y", "x", "token", "grid_h", "grid_w", "n_cells", "contrast", "map_height", "map_width"}  # fmt: skip

CSS = """
body { max-width: 1200px; margin: 0 auto; padding: 1em 1.5em; font-family: system-ui, sans-serif;
       color: #222; background: #fff; line-height: 1.4; }
h1 { font-size: 1.6em; } h2 { border-bottom: 1px solid #ccc; padding-bottom: .2em; margin-top: 1.6em; }
code, pre { font-family: ui-monospace, monospace; font-size: .9em; }
pre { background: #f6f6f6; padding: .6em; white-space: pre-wrap; word-break: break-all; }
img { max-width: 100%; height: auto; }
.scroll { overflow-x: auto; max-width: 100%; }
table { border-collapse: collapse; font-size: .85em; margin: .5em 0; }
th, td { border: 1px solid #ddd; padding: .2em .5em; text-align: right; white-space: nowrap; }
th { background: #f0f0f0; white-space: normal; } td.label { text-align: left; }
.status { font-weight: bold; } .complete { color: #1a7f37; } .incomplete { color: #b35900; } .failed { color: #c00; }
.note { background: #fff4e0; border-left: 4px solid #b35900; padding: .4em .8em; }
figure { margin: 1em 0; } figcaption { font-size: .9em; color: #444; }
.gallery { display: flex; flex-wrap: wrap; gap: 1em; }
.gallery figure { flex: 1 1 100%; margin: 0; }
.few { color: #9a9a9a; } p.caption { font-size: .9em; color: #444; margin: .2em 0 .6em; }
"""


@dataclass
class Page:
    """The HTML body being built, section by section, and the table of contents."""

    parts: list[str] = field(default_factory=list)
    contents: list[tuple[str, str]] = field(default_factory=list)  # (anchor, title)

    def add(self, *chunks: str) -> None:
        """Append raw HTML."""
        self.parts.extend(chunks)

    def section(self, title: str, anchor: str) -> None:
        """A second-level heading listed in the contents."""
        self.contents.append((anchor, title))
        self.parts.append(f'<h2 id="{_e(anchor)}">{_e(title)}</h2>')


def _e(value: object) -> str:
    """Text escaped for HTML (quotes too: it also goes into attributes)."""
    return html.escape(str(value), quote=True)


def _anchor(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "section"


# ---- reading what a run left ------------------------------------------------------------------------------------
def figures_config(run_dir: Path | None) -> FiguresConfig:
    """The run's `figures` settings (its .hydra/config.yaml), else the defaults."""
    from omegaconf import OmegaConf

    saved = read_yaml(run_dir / ".hydra" / "config.yaml") if run_dir is not None else None
    chosen = saved.get("figures") if isinstance(saved, dict) else None
    if not isinstance(chosen, dict):
        return FiguresConfig()
    try:
        merged = OmegaConf.merge(OmegaConf.structured(FiguresConfig), chosen)
        return OmegaConf.to_object(merged)  # type: ignore[return-value]
    except Exception:  # a config of another version: the defaults draw the page all the same
        return FiguresConfig()


# The tables a reader of an edges run wants first: the top edges and the graph, the circuits' curve and scores, then
# the checks; every other table after them, by name.
READING_ORDER = ("lm_edges", "lm_circuit_curve", "lm_circuit_scores", "lm_circuit", "lm_circuit_stability",
                 "lm_edge_exact", "lm_edge_calibration", "lm_edge_pair_scores", "lm_edge_pairs")  # fmt: skip


def table_names(directories: Iterable[Path]) -> list[str]:
    """The results tables present in these run directories (their `<table>.parquet` folders), in READING_ORDER,
    the others by name."""
    names = {p.name.removesuffix(".parquet") for d in directories for p in d.glob("*.parquet") if p.is_dir()}
    rank = {name: i for i, name in enumerate(READING_ORDER)}
    return sorted(names, key=lambda name: (rank.get(name, len(rank)), name))


def load_table(directory: Path, table: str) -> tuple[pd.DataFrame | None, str | None]:
    """The table's committed shards under `directory` and the note why it is not the whole run (or None)."""
    from runner.store.reader import load

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            frame = load(directory, table, partial=True)
        except (FileNotFoundError, RunnerError, ValueError) as e:
            return None, str(e)
    notes = [str(w.message) for w in caught if "complete shards only" in str(w.message)]
    return frame, ("; ".join(notes) or None)


def provenance_of(directory: Path) -> dict[str, Any]:
    """What the run stored about itself: the tables' metadata (versions, commit, config, overrides), the manifest's
    config hash, and the device from its log."""
    from runner.store.reader import read_metadata

    found: dict[str, Any] = {}
    for folder in sorted(directory.glob("*.parquet")):
        try:
            found = read_metadata(folder)
            break
        except (IndexError, OSError, ValueError):
            continue  # an empty or unreadable table folder: try the next
    manifest_path = directory / "manifest.json"
    if manifest_path.is_file():
        try:
            manifest = read_manifest(manifest_path)
            found["config_hash"] = manifest.get("config_hash")
            found["num_samples"] = manifest.get("num_samples")
        except RunnerError:
            pass
    for logfile in sorted(directory.glob("*.log")):
        try:
            text = logfile.read_text(errors="replace")
        except OSError:
            continue
        devices = re.findall(r"samples, device (\S+)", text)  # runner.app's "run ...: ... device cpu" line
        if devices:
            found["device"] = devices[-1]
    return found


# ---- summaries --------------------------------------------------------------------------------------------------
def presentation_of(directory: Path, table: str) -> Presentation:
    """How `table` of the run (or sweep) in `directory` is summarised and drawn, as its manifest keeps it (the
    declaration the run wrote: runner.tables.Presentation); the plain default for a table none declares."""
    manifests = [directory / "manifest.json", *sorted(directory.glob("*/manifest.json"))]
    for manifest in manifests:
        if manifest.is_file():
            try:
                found = read_manifest(manifest).get("tables", {}).get(table)
            except RunnerError:
                continue
            if found:
                return Presentation.from_dict(found)
    return Presentation()


def summary_columns(
    table: str, frame: pd.DataFrame, extra_keys: Iterable[str] = (), shown: Presentation | None = None
) -> tuple[list[str], list[str]]:
    """(group columns, value columns) of a table's per-layer summary: the layer first, then its labels."""
    shown = shown or Presentation()
    keys, values = shown.keys, shown.values
    if not values:
        values = tuple(
            c for c in frame.columns
            if pd.api.types.is_float_dtype(frame[c]) and c not in NOT_VALUES and not c.startswith("sweep.")
        )  # fmt: skip
    group = ["layer"] if "layer" in frame.columns else []
    group += [k for k in keys if k in frame.columns and (k in shown.shown or frame[k].nunique(dropna=False) > 1)]
    group += [k for k in extra_keys if k in frame.columns and k not in group]
    group = [k for k in group if not any(_same_partition(frame, k, e) for e in extra_keys if e in frame and e != k)]
    measured = [v for v in values if v in frame.columns and frame[v].notna().any()]
    return group, measured


def _same_partition(frame: pd.DataFrame, a: str, b: str) -> bool:
    """Whether columns `a` and `b` name the same groups of rows (`method` beside a swept `sweep.method`): one of
    them says it all, so the other is not shown."""
    pairs = frame[[a, b]].astype(str).drop_duplicates()
    return len(pairs) == pairs[a].nunique() == pairs[b].nunique()


def summary_frame(
    table: str, frame: pd.DataFrame, extra_keys: Iterable[str] = (), shown: Presentation | None = None
) -> pd.DataFrame:
    """Per layer (model order) and label: for each measured column, n samples, the mean and its 95% interval."""
    from runner.analysis import summarise
    from runner.frames import layers_in_model_order

    group, values = summary_columns(table, frame, extra_keys, shown)
    merged: pd.DataFrame | None = None
    for value in values:
        part = summarise(frame, value, by=group, n_boot=1000)
        part = part.rename(columns={c: f"{value}:{c}" for c in ("n", "mean", "ci_low", "ci_high")})
        merged = part if merged is None else merged.merge(part, on=group, how="outer", sort=False)
    if merged is None:
        return pd.DataFrame(columns=group)
    if "layer" in group:
        rank = {layer: i for i, layer in enumerate(layers_in_model_order(frame))}
        merged = merged.assign(_rank=merged["layer"].map(rank)).sort_values("_rank", kind="stable")
        merged = merged.drop(columns="_rank").reset_index(drop=True)
    return merged


def _number(value: Any) -> str:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return str(value)
    return "–" if number != number else f"{number:.3g}"  # NaN: no value (an interval of one sample)


def summary_html(summary: pd.DataFrame, caption: str = "") -> str:
    """The summary as an HTML table in its own scrolling box: label columns, then the mean over [low, high] per value;
    `caption` (the statistic) above it, intervals of fewer than FEW_SAMPLES samples grey with a note below."""
    from runner.viz.figure_style import FEW_SAMPLES

    group = [c for c in summary.columns if ":" not in c]
    values = list(dict.fromkeys(c.split(":")[0] for c in summary.columns if ":" in c))
    if not values:
        return "<p>No measured column with a value to summarise.</p>"
    head = "".join(f"<th>{_e(c)}</th>" for c in group)
    head += "".join(f"<th>{_e(v)}<br>mean<br>[95% CI]</th>" for v in values) + "<th>n</th>"
    rows = []
    few = False
    for _, row in summary.head(MAX_SUMMARY_ROWS).iterrows():
        cells = "".join(f'<td class="label">{_e(row[c])}</td>' for c in group)
        for v in values:
            mean, low, high, n = (row[f"{v}:{k}"] for k in ("mean", "ci_low", "ci_high", "n"))
            grey = n == n and n < FEW_SAMPLES and low == low
            few |= bool(grey)
            attr = ' class="few"' if grey else ""
            interval = "" if low != low else f"<br><small{attr}>[{_number(low)}, {_number(high)}]</small>"  # narrow
            cells += f"<td>{_number(mean)}{interval}</td>"
        counts = {int(row[f"{v}:n"]) for v in values if row[f"{v}:n"] == row[f"{v}:n"]}
        cells += f"<td>{_e('/'.join(map(str, sorted(counts))))}</td>"
        rows.append(f"<tr>{cells}</tr>")
    more = ""
    if few:
        more += (f'<p class="caption"><span class="few">Grey intervals</span>: fewer than {FEW_SAMPLES} samples;'
                 " a bootstrap interval over so few is rough, read it as a range of the values seen.</p>")  # fmt: skip
    if len(summary) > MAX_SUMMARY_ROWS:
        more += (
            f"<p>The first {MAX_SUMMARY_ROWS} of {len(summary)} rows; the rest are in the table's Parquet files.</p>"
        )
    top = f'<p class="caption">{_e(caption)}</p>' if caption else ""
    return f'{top}<div class="scroll"><table><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table></div>{more}'


def plain_html(frame: pd.DataFrame, caption: str) -> str:
    """A small table as it is (text columns as labels, numbers rounded), with its caption above it."""
    head = "".join(f"<th>{_e(c)}</th>" for c in frame.columns)
    rows = []
    for _, row in frame.head(MAX_SUMMARY_ROWS).iterrows():
        cells = "".join(
            f"<td>{_number(row[c])}</td>" if pd.api.types.is_number(row[c]) else f'<td class="label">{_e(row[c])}</td>'
            for c in frame.columns
        )
        rows.append(f"<tr>{cells}</tr>")
    return (f'<p class="caption">{_e(caption)}</p><div class="scroll"><table><thead><tr>{head}</tr></thead>'
            f"<tbody>{''.join(rows)}</tbody></table></div>")  # fmt: skip


def peak_html(table: str, frame: pd.DataFrame, extra_keys: Iterable[str], shown: Presentation) -> str:
    """A table of cells within a layer (runner.viz.summary.peak_summary): per layer and label, where the mean over
    pairs of each value is largest and smallest, and those means, as an HTML table with its caption."""
    from runner.viz.summary import EFFECT, EFFECT_WORDS, PEAK_WORDS, peak_summary

    group, values = summary_columns(table, frame, extra_keys, shown)
    summary = peak_summary(frame, group, values)
    if summary.empty:
        return "<p>No measured column with a value to summarise.</p>"
    head = "".join(f"<th>{_e(c)}</th>" for c in summary.columns)
    rows = []
    for _, row in summary.head(MAX_SUMMARY_ROWS).iterrows():
        cells = "".join(
            f'<td class="label">{_e(row[c])}</td>' if c in group or c.endswith(" at") else f"<td>{_number(row[c])}</td>"
            for c in summary.columns
        )
        rows.append(f"<tr>{cells}</tr>")
    more = ""
    if len(summary) > MAX_SUMMARY_ROWS:
        more = f"<p>The first {MAX_SUMMARY_ROWS} of {len(summary)} rows; the rest are in the table's Parquet files.</p>"
    words = PEAK_WORDS + (EFFECT_WORDS if f"{EFFECT} max" in summary.columns else "") + " n: the pairs with a value."
    return (f'<p class="caption">{_e(words)}</p><div class="scroll"><table><thead><tr>{head}</tr></thead>'
            f"<tbody>{''.join(rows)}</tbody></table></div>{more}")  # fmt: skip


# ---- figures ----------------------------------------------------------------------------------------------------
def figure_html(
    table: str, frame: pd.DataFrame, by: str | None, figures: FiguresConfig, shown: Presentation | None = None
) -> str:
    """The table's standard figures (runner.viz.plots.table_figures), each embedded as a data URI with its caption."""
    try:
        from runner.viz import plots
    except ImportError:
        return "<p>No figures: runner.viz.plots is not available in this installation.</p>"
    from runner.viz.figure_style import save

    # The page embeds PNG or SVG; a PDF cannot be shown in a browser's <img>, so the page draws PNGs then.
    page_figures = replace(figures, format=FigureFormat.png if figures.format == FigureFormat.pdf else figures.format)
    try:
        drawn = plots.table_figures(
            table, frame, by=by, figures=page_figures, builder=(shown or Presentation()).figures
        )
    except Exception as e:  # a figure that cannot be drawn must not cost the page its tables
        log.warning("report: the figures of table %s could not be drawn: %s", table, e)
        return f"<p>The figures of this table could not be drawn ({_e(type(e).__name__)}: {_e(e)}).</p>"
    if not drawn:
        return ""
    out = []
    with tempfile.TemporaryDirectory(prefix="runner-report-") as tmp:
        for i, (caption, fig) in enumerate(drawn):
            path = save(fig, Path(tmp) / f"{table}-{i}", page_figures)
            mime = "image/svg+xml" if path.suffix == ".svg" else "image/png"
            data = base64.b64encode(path.read_bytes()).decode("ascii")
            out.append(
                f'<figure><img src="data:{mime};base64,{data}" alt="{_e(caption)}">'
                f"<figcaption>{_e(caption)}</figcaption></figure>"
            )
    return "".join(out)


def pictures_html(run_dir: Path, page_dir: Path) -> str:
    """The run's per-sample pictures as a gallery of relative links (the first MAX_PICTURES), or ''."""
    folder = run_dir / "pictures"
    if not folder.is_dir():
        return ""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith("."))
    if not files:
        return ""
    items = []
    for path in files[:MAX_PICTURES]:
        href = Path(os.path.relpath(path, page_dir)).as_posix()
        name = path.relative_to(folder).as_posix()
        if path.suffix.lower() in PICTURE_SUFFIXES:
            items.append(f'<figure><img src="{_e(href)}" alt="{_e(name)}"><figcaption>{_e(name)}</figcaption></figure>')
        else:
            items.append(f'<figure><a href="{_e(href)}">{_e(name)}</a></figure>')
    shown = f"all {len(files)}" if len(files) <= MAX_PICTURES else f"the first {MAX_PICTURES} of {len(files)}"
    return f'<p>{shown} pictures in <code>pictures/</code>.</p><div class="gallery">{"".join(items)}</div>'


# ---- the page ---------------------------------------------------------------------------------------------------
def _status_html(text: str, complete: bool, failed: bool = False) -> str:
    kind = "complete" if complete else "failed" if failed else "incomplete"
    return f'<span class="status {kind}">{_e(text)}</span>'


def _run_status(run: RunInfo) -> str:
    """A run's status as the page words it: complete, running/partial/failed with k of n shards."""
    if run.status == "complete":
        return "complete"
    total = "?" if run.shards_total is None else run.shards_total
    return f"{run.status}, {run.shards_done} of {total} shards complete"


def _definition_list(items: list[tuple[str, str]]) -> str:
    rows = "".join(f'<tr><th>{_e(k)}</th><td class="label">{v}</td></tr>' for k, v in items)
    return f'<div class="scroll"><table>{rows}</table></div>'


def _provenance_html(directory: Path, command: str) -> str:
    found = provenance_of(directory)
    versions = found.get("versions") or {}
    items = [("command", f"<code>{_e(command)}</code>")]
    items += [
        ("commit", _e(found.get("git_commit", "unknown"))),
        ("config hash", _e(found.get("config_hash", "unknown"))),
        ("device", _e(found.get("device", "unknown"))),
        ("run id", _e(found.get("run_id", "unknown"))),
        ("samples", _e(found.get("num_samples", "unknown"))),
    ]
    if versions:
        items.append(("versions", _e(", ".join(f"{k} {v}" for k, v in versions.items()))))
    if found.get("skipped_inputs"):
        items.append(("skipped inputs", _e(", ".join(found["skipped_inputs"]))))
    config = ""
    config_file = directory / ".hydra" / "config.yaml"
    text = config_file.read_text(errors="replace") if config_file.is_file() else found.get("config", "")
    if text:
        config = f"<details><summary>Composed config</summary><pre>{_e(text)}</pre></details>"
    return _definition_list(items) + config


def _tables_html(page: Page, directory: Path, tables: list[str], by: list[str], figures: FiguresConfig) -> None:
    """Per table: its summary (extra group columns `by`) and its standard figures compared over `by`."""
    for table in tables:
        page.section(f"Table: {table}", f"table-{_anchor(table)}")
        frame, note = load_table(directory, table)
        if note:
            page.add(f'<p class="note">{_e(note)}</p>')
        if frame is None or frame.empty:
            page.add("<p>No complete rows yet.</p>")
            continue
        page.add(f"<p>{_counts(frame)}</p>")
        present = [c for c in by if c in frame.columns]
        compare = _compare_column(frame, present)
        shown = presentation_of(directory, table)
        if shown.section:  # a table whose declaration names a section of its own
            resolve(shown.section)(page, frame, present, compare, figures, shown)
            continue
        if table.startswith("lm_"):  # language-model tables: the figures first, the tables after
            page.add(figure_html(table, frame, compare, figures, shown))
        if table in RUN_SUMMARIES:
            words, summary = RUN_SUMMARIES[table](frame)
            page.add(plain_html(summary, words))
            continue
        try:
            if is_cell_table(frame.columns):  # a layer's cells (positions, heads): where the effect peaks
                page.add(peak_html(table, frame, present, shown))
            else:
                page.add(summary_html(summary_frame(table, frame, present, shown), SUMMARY_CAPTION))
        except RunnerError as e:
            page.add(f"<p>No summary: {_e(e)}</p>")
        if not table.startswith("lm_"):
            page.add(figure_html(table, frame, compare, figures, shown))


def _counts(frame: pd.DataFrame) -> str:
    """'N rows; S samples; L layers, listed in model order', each part only where the table has it."""
    parts = [f"{len(frame)} rows"]
    samples = frame["sample"].nunique() if "sample" in frame.columns else 0
    layers = frame["layer"].nunique() if "layer" in frame.columns else 0
    if samples:
        parts.append(f"{samples} samples")
    if layers:
        parts.append(f"{layers} layers, listed in model order")
    return "; ".join(parts) + "."


SUMMARY_CAPTION = (
    "Per layer in model order: the mean over samples of each column, its 95% bootstrap interval in brackets;"
    " n: the samples each mean is over."
)


def patching_section(
    page: Page,
    frame: pd.DataFrame,
    present: list[str],
    compare: str | None,
    figures: FiguresConfig,
    shown: Presentation,
) -> None:
    """The patching table's section (its declaration names it), one summary and one figure per direction, both of
    the same statistic
    (plots.patching_effects: the whole layer's or the strongest unit's restoration, or drop where noising), and
    the pairs left out of the means counted."""
    if "restoration" not in frame.columns:  # no restoration to summarise: the standard section
        page.add(summary_html(summary_frame("patching", frame, present, shown), SUMMARY_CAPTION))
        page.add(figure_html("patching", frame, compare, figures, shown))
        return
    from runner.viz.plots import effect_words, left_out_pairs, patching_effects

    for why, n in left_out_pairs(frame).items():
        if n:
            page.add(f'<p class="note">{n} {_e(why)} left out of the means below (restoration NaN).</p>')
    keep = [c for c in (*present, compare) if c]
    effects = patching_effects(frame, keep)
    for direction, part in effects.groupby("direction", sort=False) if "direction" in effects else [(None, effects)]:
        units = part["unit"].dropna().unique().tolist() if "unit" in part.columns else []
        words = effect_words(direction, units[0] if len(units) == 1 else None)
        label = "drop" if direction == "noising" else "restoration"
        caption = (f"{(direction or 'patching').capitalize()}: per layer in model order, the mean over pairs of {words}, its 95%"
                   " bootstrap interval in brackets; n: the pairs each mean is over.")  # fmt: skip
        try:
            summary = summary_frame("patching", part, present, shown)
            summary.columns = [c.replace("effect:", f"{label}:", 1) for c in summary.columns]
            page.add(summary_html(summary, caption))
        except RunnerError as e:
            page.add(f"<p>No summary: {_e(e)}</p>")
        rows = frame if direction is None else frame[frame["direction"] == direction]
        page.add(figure_html("patching", rows, compare, figures, shown))


def _compare_column(frame: pd.DataFrame, present: list[str]) -> str | None:
    """The one column figures compare lines by: the swept column that varies, or a joined one for several."""
    if not present:
        return None
    if len(present) == 1:
        return present[0]
    joined = ", ".join(c.removeprefix("sweep.") for c in present)
    frame[joined] = frame[present].astype(str).agg(", ".join, axis=1)  # one label per combination of swept values
    return joined


def _document(title: str, page: Page) -> str:
    contents = "".join(f'<li><a href="#{_e(a)}">{_e(t)}</a></li>' for a, t in page.contents)
    return (
        "<!DOCTYPE html>\n"
        f'<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width,'
        f' initial-scale=1"><title>{_e(title)}</title><style>{CSS}</style></head><body>'
        f"<h1>{_e(title)}</h1>{page.parts[0] if page.parts else ''}"
        f"<nav><ul>{contents}</ul></nav>{''.join(page.parts[1:])}</body></html>\n"
    )


def run_report(directory: Path, page_dir: Path) -> str:
    """The HTML page of one run directory."""
    run = run_info(directory)
    page = Page()
    complete = run.status == "complete"
    header = f"<p>Status: {_status_html(_run_status(run), complete, run.status in ('failed', 'refused', 'damaged'))}"
    if run.error:
        header += f" ({_e(run.error)})"
    header += "</p>"
    if not complete:
        header += (
            f'<p class="note">This run is not complete ({_e(_run_status(run))}): the tables and figures below show'
            f" the complete shards only. Resume: <code>{_e(run.resume_command)}</code></p>"
        )
    page.add(header)
    page.section("Command and provenance", "provenance")
    # the command that reproduces this run in this folder (the overrides name none when Hydra chose it)
    named = any(o.split("=", 1)[0].lstrip("+") == "hydra.run.dir" for o in run.overrides)
    command = shlex.join(["runner", *run.overrides, *([] if named else [f"hydra.run.dir={run.path}"])])
    overrides = "".join(f"<li><code>{_e(o)}</code></li>" for o in run.overrides) or "<li>(none)</li>"
    page.add(f"<p>Overrides:</p><ul>{overrides}</ul>", _provenance_html(directory, command))
    tables = table_names([directory])
    if not tables:
        page.add("<p>No results table yet.</p>")
    _tables_html(page, directory, tables, [], figures_config(directory))
    gallery = pictures_html(directory, page_dir)
    if gallery:
        page.section("Pictures", "pictures")
        page.add(gallery)
    return _document(f"Run {run.experiment}: {directory.name}", page)


def sweep_report(sweep: SweepInfo, page_dir: Path) -> str:
    """The HTML page of a sweep directory: its jobs and their status, then the tables compared across jobs."""
    page = Page()
    complete = sum(job.status == "complete" for job in sweep.jobs)
    total = sweep.jobs_total if sweep.jobs_total is not None else len(sweep.jobs)
    failed = any(job.status in ("failed", "refused", "damaged") for job in sweep.jobs)
    header = f"<p>Status: {_status_html(f'{complete} of {total} jobs complete', complete == total, failed)}</p>"
    if complete < total:
        header += '<p class="note">Not every job is complete: the tables and figures show the complete shards only.</p>'
    page.add(header)
    page.section("Command and provenance", "provenance")
    command = shlex.join(["runner", "-m", *sweep.overrides])
    found = {job.path: provenance_of(job.path) for job in sweep.jobs}
    page.add(_sweep_provenance_html(sweep, command, list(found.values())))
    page.section("Jobs", "jobs")
    shared = set.intersection(*(set(job.overrides) for job in sweep.jobs)) if sweep.jobs else set()
    tables = table_names(job.path for job in sweep.jobs)
    head = "<th>job</th><th>overrides</th><th>status</th><th>config hash</th><th>run id</th>"
    head += "".join(f"<th>{_e(t)} rows</th>" for t in tables)
    rows = []
    for job in sweep.jobs:
        own = " ".join(o for o in job.overrides if o not in shared)
        name = _e(job.path.name)
        if (job.path / REPORT_NAME).is_file():  # a job's own report (report=true): linked relatively
            name = f'<a href="{_e(Path(os.path.relpath(job.path / REPORT_NAME, page_dir)).as_posix())}">{name}</a>'
        status = _status_html(
            _run_status(job), job.status == "complete", job.status in ("failed", "refused", "damaged")
        )
        counts = "".join(f"<td>{job.tables.get(t, 0)}</td>" for t in tables)
        ids = "".join(
            f'<td class="label">{_e(found[job.path].get(k, "unknown"))}</td>' for k in ("config_hash", "run_id")
        )
        rows.append(f'<tr><td class="label">{name}</td><td class="label"><code>{_e(own)}</code></td>'
                    f"<td class=\"label\">{status}</td>{ids}{counts}</tr>")  # fmt: skip
    page.add(f'<div class="scroll"><table><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table></div>')
    swept = _swept_columns(sweep, tables)
    if swept:
        page.add(f"<p>Compared across: {_e(', '.join(swept))}.</p>")
    _tables_html(page, sweep.path, tables, swept, figures_config(sweep.jobs[0].path if sweep.jobs else None))
    return _document(f"Sweep: {sweep.path.name}", page)


def _sweep_provenance_html(sweep: SweepInfo, command: str, found: list[dict[str, Any]]) -> str:
    """The sweep's own provenance: its command, and per item the value its jobs share, or that they differ (each
    job's config hash and run id are in the jobs table); the sweep's multirun.yaml, folded."""

    def shared(key: str, show: Any = str) -> str:
        values = list(dict.fromkeys(show(f[key]) for f in found if f.get(key) is not None))
        if not values:
            return "unknown"
        return _e(values[0]) if len(values) == 1 else _e(f"differs between jobs: {'; '.join(values)}")

    versions = lambda v: ", ".join(f"{k} {x}" for k, x in v.items())  # noqa: E731 - one use
    items = [
        ("command", f"<code>{_e(command)}</code>"),
        ("folder", f"<code>{_e(sweep.path)}</code>"),
        ("jobs", _e(len(sweep.jobs))),
        ("commit", shared("git_commit")),
        ("device", shared("device")),
        ("samples per job", shared("num_samples")),
        ("versions", shared("versions", versions)),
        ("config hash, run id", "one per job: see the jobs table"),
    ]
    import yaml  # PyYAML, Hydra's own dependency

    saved = read_yaml(sweep.path / "multirun.yaml")
    # Its own settings, not Hydra's (launcher, help texts with remote addresses): the jobs' configs are theirs.
    text = (
        yaml.safe_dump({k: v for k, v in saved.items() if k != "hydra"}, sort_keys=False)
        if isinstance(saved, dict)
        else ""
    )
    config = f"<details><summary>The sweep's config (multirun.yaml)</summary><pre>{_e(text)}</pre></details>"
    return _definition_list(items) + (config if text else "")


def _swept_columns(sweep: SweepInfo, tables: list[str]) -> list[str]:
    """The `sweep.<key>` columns whose value differs between the jobs (from their overrides, no table read)."""
    varying: list[str] = []
    for job in sweep.jobs:
        for override in job.overrides:
            key, sep, _ = override.partition("=")
            column = f"sweep.{key.lstrip('+~')}"
            if sep and column not in varying and len({_value(j, key) for j in sweep.jobs}) > 1:
                varying.append(column)
    return varying


def _value(job: RunInfo, key: str) -> str | None:
    return next((o.partition("=")[2] for o in job.overrides if o.partition("=")[0] == key), None)


def write_report(directory: str | Path, output: str | Path | None = None) -> Path:
    """Write the report of the run or sweep in `directory` to `output` (default DIR/report.html); return its path."""
    directory = Path(directory)
    if not directory.is_dir():
        raise RunnerError(f"{directory} is not a directory: `runner report DIR` needs a run or sweep folder.")
    target = Path(output) if output is not None else directory / REPORT_NAME
    page_dir = target.resolve().parent
    # A damaged manifest is one line: the page would report the run's shards as lost (`runner ls` says what to do).
    if (directory / "multirun.yaml").is_file():
        sweeps = [item for item in find(directory) if isinstance(item, SweepInfo) and item.path == directory]
        for job in sweeps[0].jobs:
            check_manifests(job.path)
        text = sweep_report(sweeps[0], page_dir)
    elif is_run(directory):
        check_manifests(directory)
        text = run_report(directory, page_dir)
    else:
        raise RunnerError(
            f"{directory} is neither a run folder (.hydra/ or manifest.json) nor a sweep folder (multirun.yaml):"
            " give `runner report` the folder a run or sweep wrote (`runner ls` lists them)."
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")  # replaced at once: a reader never sees half a page
    try:
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(target)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise RunnerError(f"Cannot write the report to {target} ({e.strerror or e}).") from None
    return target


def write_after_run(directory: Path) -> None:
    """`report: true`: the run's report, and its sweep's when it is a sweep's job; a failure only warns."""
    targets = [directory]
    if (directory.parent / "multirun.yaml").is_file():
        targets.append(directory.parent)
    for target in targets:
        try:
            path = write_report(target)
            log.info("report: %s", path)
        except Exception as e:  # the results are committed: a report that cannot be drawn must not fail the run
            log.warning("report=true: could not write the report of %s (%s: %s); the results are intact. Try"
                        " `runner report %s`.", target, type(e).__name__, e, target)  # fmt: skip


def main(argv: list[str]) -> int:
    """`runner report DIR [--output FILE]`."""
    parser = argparse.ArgumentParser(
        prog="runner report", description="One self-contained HTML page of a run or a sweep (DIR/report.html)."
    )
    parser.add_argument("dir", help="a run folder or a sweep folder (multirun.yaml)")
    parser.add_argument("--output", "-o", default=None, help="where to write the page (default: DIR/report.html)")
    args = parser.parse_args(argv)
    print(write_report(Path(args.dir), args.output))
    return 0
