"""`runner report DIR`: one self-contained HTML page of a run or a sweep; `report=true` writes it at the end."""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from html.parser import HTMLParser
from pathlib import Path

import pytest

from runner import app
from runner.commands.cli import main as cli_main
from runner.errors import RunnerError
from runner.viz.report import MAX_PICTURES, write_report
from tests.conftest import make_config, run_cli

TINY = [
    "model._target_=tests.conftest.TinyNet",
    "model.weights=null",
    "data=synthetic",
    "data.shape=[3,16,16]",
    "data.num_classes=5",
    "data.batch_size=2",
    "layers.include=[features.0,features.2]",
]
NO_HOOKS = [*TINY, "hooks=[]"]  # the default experiment's hooks name EfficientNet layers
VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


class Checked(HTMLParser):
    """Parses a page, checking every non-void tag opened is closed in order; collects text and references."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.errors: list[str] = []
        self.references: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.references += [v for k, v in attrs if k in ("src", "href") and v is not None]
        if tag not in VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.references += [v for k, v in attrs if k in ("src", "href") and v is not None]

    def handle_endtag(self, tag: str) -> None:
        if tag in VOID:
            return
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes <{self.stack[-1] if self.stack else 'nothing'}>")
            return
        self.stack.pop()

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def check_page(page: Path) -> tuple[str, str]:
    """(html, visible text) of a valid, self-contained page: tags balanced, references local and existing."""
    source = page.read_text(encoding="utf-8")
    parser = Checked()
    parser.feed(source)
    parser.close()
    assert not parser.errors, parser.errors[:5]
    assert parser.stack == [], f"never closed: {parser.stack}"
    assert source.startswith("<!DOCTYPE html>")
    assert "http://" not in source and "https://" not in source  # no CDN, no font, no remote image
    assert "<script" not in source.lower()
    for ref in parser.references:
        if ref.startswith(("data:", "#")):
            continue
        assert (page.parent / ref).is_file(), f"{ref} does not exist next to {page}"
    return source, " ".join(parser.text)


@pytest.fixture(scope="module")
def cam_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished CLI run with report=true: Grad-CAM with faithfulness, a hooks table and pictures."""
    out = tmp_path_factory.mktemp("report") / "cam"
    done = run_cli(
        *TINY, "data.count=4", "method.pictures=true", "method.faithfulness.enabled=true", "method.faithfulness.steps=4",
        "hooks=[{kind: forward, layers: [features.2]}]", "report=true", f"hydra.run.dir={out}",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return out


@pytest.mark.slow
def test_report_true_writes_a_valid_page_of_the_run(cam_run: Path) -> None:
    page = cam_run / "report.html"
    assert page.is_file()  # written by the run itself (report=true)
    source, text = check_page(page)
    for table in ("cam", "hooks"):
        assert f'<h2 id="table-{table}">Table: {table}</h2>' in source
    for layer in ("features.0", "features.2"):
        assert layer in text
    assert "complete" in text and "not complete" not in text
    assert "report=true" in text  # the command's overrides
    assert "torch" in text and "config hash" in text and "device" in text  # provenance
    assert "<details>" in source  # the composed config, collapsed
    assert "deletion_auc" in text and "95% CI" in text  # the cam table's summary columns
    cam = source.split('id="table-cam"', 1)[1].split("<h2", 1)[0]
    assert cam.count('<img src="data:image/png;base64,') >= 1  # plots.table_figures' figures, embedded
    assert cam.count("<figcaption>") == cam.count("<img ")  # each with its caption
    pictures = sorted((cam_run / "pictures").iterdir())
    assert pictures, "the run drew no pictures"
    assert f'src="pictures/{pictures[0].name}"' in source  # the gallery links the run's own files
    assert len(pictures) <= MAX_PICTURES


@pytest.mark.slow
def test_layers_are_listed_in_model_order(cam_run: Path) -> None:
    source = (cam_run / "report.html").read_text()
    cam = source.split('id="table-cam"', 1)[1].split("<h2", 1)[0]
    assert cam.index("features.0</td>") < cam.index("features.2</td>")


@pytest.mark.slow
def test_report_of_a_patching_run(tmp_path: Path) -> None:
    app.run(make_config(*NO_HOOKS, "data.count=2", "method=patching", "method.patching.grid=[2,2]"), tmp_path)
    page = write_report(tmp_path, tmp_path / "elsewhere" / "page.html")
    source, text = check_page(page)
    assert 'id="table-patching"' in source and "restoration" in text
    assert "features.0" in text and "features.2" in text


@pytest.mark.slow
def test_patching_table_and_figure_show_one_statistic_and_count_what_is_left_out(tmp_path: Path) -> None:
    """The summary and the figure both hold the best cell's restoration per pair (the table was the mean over
    cells, the figure the best cell's); a small_span pair is left out of both and counted; noising is the drop."""
    import pandas as pd

    from runner.viz.plots import patching_effects
    from runner.viz.report import summary_frame

    config = make_config(*NO_HOOKS, "data.count=4", "method=patching", "method.patching.grid=[2,2]",
                         "method.patching.directions=[denoising,noising]", "method.patching.min_span=0")  # fmt: skip
    app.run(config, tmp_path)
    part = tmp_path / "patching.parquet" / "part-000000.parquet"
    frame = pd.read_parquet(part)
    small = frame["sample"] == 0  # as the run writes a pair below min_span: flagged, restoration NaN
    frame.loc[small, "small_span"] = True
    frame.loc[small, "restoration"] = float("nan")
    frame.to_parquet(part)
    source, text = check_page(write_report(tmp_path))
    assert "2 pairs with small_span" in text  # sample 0 in each direction
    assert "the best cell's restoration" in text and "the most damaging cell's drop, 1 - restoration" in text
    effects = patching_effects(frame)
    denoising = effects[effects["direction"] == "denoising"]
    expected = denoising.groupby("layer")["effect"].mean()  # over the 3 pairs left: the best cell of each
    shown = summary_frame("patching", denoising).set_index("layer")["effect:mean"]
    for layer in ("features.0", "features.2"):
        assert shown[layer] == pytest.approx(expected[layer])
        assert f"{shown[layer]:.3g}</td>" in source.replace("<br>", "</td>").replace("<small", "</td><small")
    assert shown["features.0"] != pytest.approx(frame[frame["direction"] == "denoising"].groupby("layer")
                                                ["restoration"].mean()["features.0"])  # fmt: skip
    assert (summary_frame("patching", denoising)["effect:n"] == 3).all()


@pytest.mark.slow
def test_intervals_of_fewer_than_five_samples_are_grey_with_a_note(cam_run: Path) -> None:
    source, text = check_page(cam_run / "report.html")  # 4 samples
    assert '<small class="few">[' in source and "fewer than 5 samples" in text


def test_report_of_a_run_in_progress_says_so(tmp_path: Path) -> None:
    app.run(make_config(*NO_HOOKS, "data.count=8", "output.shard_batches=1"), tmp_path)  # 4 shards
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    del manifest["shards"]["3"]
    manifest["complete"] = False
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    (tmp_path / "cam.parquet" / "part-000003.parquet").unlink()
    source, text = check_page(write_report(tmp_path))
    assert "not complete" in text and "3 of 4 shards" in text
    assert "complete shards only" in text
    assert 'id="table-cam"' in source and "features.2" in text  # what is complete is shown


@pytest.mark.slow
def test_sweep_report_has_one_row_per_job(tmp_path: Path) -> None:
    done = run_cli(
        "-m", *NO_HOOKS, "data.count=2", "method.pictures=false", "method=gradcam,layercam", "method.target=predicted,topk",
        "method.top_k=2", "report=true", f"hydra.sweep.dir={tmp_path}",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert all((job / "report.html").is_file() for job in tmp_path.glob("[0-3]"))  # report=true: each job's page
    assert (tmp_path / "report.html").is_file()  # and the sweep's, refreshed by each job
    (tmp_path / "report.html").unlink()
    with redirect_stdout(io.StringIO()):
        assert cli_main(["report", str(tmp_path)]) == 0
    source, text = check_page(tmp_path / "report.html")
    jobs = source.split('id="jobs"', 1)[1].split("</table>", 1)[0]
    assert jobs.count("<tr>") == 1 + 4  # the header and one row per job
    assert jobs.count("status complete") == 4
    assert jobs.count('report.html">') == 4  # each row links its job's own page
    assert "4 of 4 jobs complete" in text
    assert "method=layercam method.target=topk" in text  # each job named by what sets it apart
    assert "sweep.method" in text and "sweep.method.target" in text  # the summary compares the swept values
    cam = source.split('id="table-cam"', 1)[1]
    assert "<th>sweep.method</th>" in cam and "<th>method</th>" not in cam  # the same column once, not twice
    provenance = source.split('id="provenance"', 1)[1].split('id="jobs"', 1)[0]
    assert "The sweep's config (multirun.yaml)" in provenance and str(tmp_path) in provenance
    assert "one per job: see the jobs table" in provenance  # not job 0's config hash and run id as the sweep's
    for job in ("0", "1", "2", "3"):
        run_id = json.loads((tmp_path / job / "manifest.json").read_text()).get("run_id")
        assert run_id is None or run_id in jobs  # each job's own, in its row
    assert 'id="table-cam"' in source and "features.0" in text and "features.2" in text


def test_report_failure_does_not_fail_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    def broken(*args: object, **kwargs: object) -> Path:
        raise ValueError("drawing failed")

    monkeypatch.setattr("runner.viz.report.write_report", broken)
    with caplog.at_level(logging.WARNING, logger="runner.viz.report"):
        result = app.run(make_config(*NO_HOOKS, "data.count=2", "report=true"), tmp_path)
    assert (result.tables["cam"] / "part-000000.parquet").is_file()
    assert not (tmp_path / "report.html").exists()
    assert "could not write the report" in caplog.text and "drawing failed" in caplog.text


def test_report_of_a_missing_folder_is_one_line_and_exit_2(tmp_path: Path) -> None:
    err = io.StringIO()
    with redirect_stderr(err):
        assert cli_main(["report", "/nonexistent"]) == 2
    assert err.getvalue().count("\n") == 1 and "/nonexistent" in err.getvalue()
    with pytest.raises(RunnerError, match="neither a run folder"):
        write_report(tmp_path)  # an empty folder: neither a run nor a sweep


BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def screenshot(page: Path, shot: Path, browser: str, profile: Path) -> None:
    """`page` rendered by a headless browser at 1280 px wide into `shot` (PNG), offline, with a fresh profile."""
    subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}",
         "--hide-scrollbars", f"--screenshot={shot}", "--window-size=1280,4000", page.resolve().as_uri()],
        capture_output=True, timeout=120, check=False,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.process
def test_page_renders_in_headless_chromium(cam_run: Path, tmp_path: Path) -> None:
    """The page in a real browser: not blank, and nothing wider than the 1280 px window (no sideways scrolling:
    the right edge is the page's background)."""
    browser = next((shutil.which(b) for b in BROWSERS if shutil.which(b)), None)
    if browser is None:
        if os.environ.get("RUNNER_REQUIRE_BROWSER"):  # CI (.ci/run) installs one: its absence is a failure there
            pytest.fail("RUNNER_REQUIRE_BROWSER is set but no chromium, chromium-browser or google-chrome is on PATH")
        pytest.skip("no chromium, chromium-browser or google-chrome on PATH (docs/testing.md says how to install one)")
    shot = tmp_path / "shot.png"
    screenshot(cam_run / "report.html", shot, browser, tmp_path / "profile")
    assert shot.is_file(), "chromium wrote no screenshot"
    from PIL import Image

    image = Image.open(shot).convert("RGB")
    assert image.size[0] == 1280
    colours = image.getcolors(maxcolors=1 << 20)
    assert colours is None or len(colours) > 100  # None: more colours than counted; a few: a blank or text page
    right = image.crop((1270, 0, 1280, image.size[1])).getcolors()  # the body's margin: 1248 px centred
    assert right is not None and len(right) == 1, "something is wider than the page"


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["png", "svg", "pdf"])
def test_figures_are_embedded_with_their_captions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str) -> None:
    """Each figure of plots.table_figures is in the page as a data URI (a PDF run's figures as PNG), captioned."""
    import types

    from runner.viz.figure_style import pyplot

    seen: list[tuple[str, str | None, str]] = []

    def table_figures(
        table: str, frame: object, by: str | None = None, figures: object = None, builder: str | None = None
    ) -> list:
        seen.append((table, by, figures.format.value))  # type: ignore[union-attr]
        assert builder == "runner.viz.plots:cam_figures"  # the cam table's declared figures, read from its manifest
        fig, ax = pyplot().subplots()
        ax.plot([0, 1], [1, 0])
        return [(f"The {table} figure.", fig)]

    import runner.viz

    fake = types.SimpleNamespace(table_figures=table_figures)
    monkeypatch.setitem(sys.modules, "runner.viz.plots", fake)
    monkeypatch.setattr(
        runner.viz, "plots", fake, raising=False
    )  # `from runner.viz import plots` reads the attribute first
    app.run(make_config(*NO_HOOKS, "data.count=2", f"figures.format={fmt}"), tmp_path)
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text(f"figures: {{format: {fmt}, dpi: 40}}\n")  # what the CLI saves
    source, text = check_page(write_report(tmp_path))
    assert seen == [("cam", None, "png" if fmt == "pdf" else fmt)]
    assert f'src="data:image/{"svg+xml" if fmt == "svg" else "png"};base64,' in source
    assert "The cam figure." in text
