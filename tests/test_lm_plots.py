"""The language-model tables' heatmaps (runner/viz/lm_plots.py): the drawn grid is the mean over pairs of the frame,
tokens label the position axis, NaN cells stay NaN, the colour scale is centred at 0; and a CLI run's report holds
them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from runner.schema import FiguresConfig
from runner.viz import lm_plots
from runner.viz.figure_style import pyplot
from tests.conftest import run_cli
from tests.test_report import check_page

TOKENS = {0: ["<bos>", " A", " B", " C"], 1: ["<bos>", " A", " D", " C"]}  # pairs differ at position 2


def patching_frame(directions: tuple[str, ...] = ("denoising",)) -> pd.DataFrame:
    """Two pairs x 2 layers x 4 positions of resid_pre, restoration = layer + position / 10 + pair / 100, and
    (layer 1, position 0) NaN in both pairs."""
    rows = []
    for direction in directions:
        for sample, tokens in TOKENS.items():
            for layer in (0, 1):
                for position, token in enumerate(tokens):
                    value = np.nan if (layer, position) == (1, 0) else -layer + position / 10 + sample / 100
                    rows.append({"sample": sample, "direction": direction, "site": "resid_pre", "layer": layer,
                                 "head": None, "position": position, "token": token, "metric": "token_logit_diff",
                                 "patch_method": "exact", "restoration": value, "small_span": False})  # fmt: skip
    return pd.DataFrame(rows)


def image_of(fig) -> tuple[np.ma.MaskedArray, list[str], object]:  # noqa: ANN001
    """(the heatmap's array, its x tick labels, the image) of the figure's first panel."""
    ax = fig.axes[0]
    image = ax.images[0]
    return image.get_array(), [t.get_text() for t in ax.get_xticklabels()], image


def close(drawn: list) -> None:
    for _, fig in drawn:
        pyplot().close(fig)


def test_layer_position_map_is_the_mean_over_pairs_with_tokens_on_the_axis() -> None:
    frame = patching_frame()
    drawn = lm_plots.lm_patching_figures(frame, None, FiguresConfig())
    assert len(drawn) == 1
    caption, fig = drawn[0]
    array, ticks, image = image_of(fig)
    expected = frame.pivot_table(index="layer", columns="position", values="restoration", aggfunc="mean",
                                 dropna=False).reindex(columns=range(4)).to_numpy()  # fmt: skip
    assert array.shape == (2, 4)
    assert np.allclose(array.filled(np.nan), expected, equal_nan=True)
    assert array.mask[1, 0] and not array.mask[0, 0]  # NaN stays NaN: drawn as a blank (grey) cell
    assert ticks == ["<bos> (0)", "A (1)", "B* (2)", "C (3)"]  # decoded, pair 0's token where the pairs differ
    low, high = image.get_clim()
    assert low == -high and high == pytest.approx(np.nanmax(np.abs(expected)))  # centred at 0
    assert image.get_cmap().name.startswith("RdBu")
    assert "N = 2 pairs" in caption and "first pair's token" in caption and "resid_pre" in caption
    assert len(fig.axes) == 2  # the heatmap and its colour bar
    close(drawn)


def test_noising_draws_the_drop_and_each_direction_has_its_figure() -> None:
    frame = patching_frame(("denoising", "noising"))
    drawn = lm_plots.lm_patching_figures(frame, None, FiguresConfig())
    assert [(c.startswith("Patching (resid_pre, noising"), "drop" in c) for c, _ in drawn] == [
        (False, False),
        (True, True),
    ]
    denoised, _, _ = image_of(drawn[0][1])
    noised, _, _ = image_of(drawn[1][1])
    assert np.allclose(noised.filled(np.nan), 1 - denoised.filled(np.nan), equal_nan=True)
    close(drawn)


def test_pairs_of_different_lengths_align_at_the_last_token() -> None:
    frame = patching_frame()
    short = frame[(frame["sample"] == 1) & (frame["position"] > 0)].assign(position=lambda f: f["position"] - 1)
    frame = pd.concat([frame[frame["sample"] == 0], short])  # pair 1 lacks the BOS: one token shorter
    axis = lm_plots.position_axis(frame)
    slots, note = axis.slots, axis.note
    assert slots["_x"].tolist() == [-3, -2, -1, 0]
    assert slots["label"].tolist() == ["<bos>", "A", "B*", "C"]  # the same roles line up from the end
    assert "aligned at their last token" in note
    caption, fig = lm_plots.lm_patching_figures(frame, None, FiguresConfig())[0]
    array, _, _ = image_of(fig)
    last = frame[(frame["layer"] == 0) & (frame["token"] == " C")]["restoration"].mean()
    assert array[0, -1] == pytest.approx(last)
    assert array[0, 0] == pytest.approx(frame[(frame["sample"] == 0) & (frame["layer"] == 0)]["restoration"].iloc[0])
    assert "aligned at their last token" in caption
    pyplot().close(fig)


def test_where_the_pairs_tokens_differ_the_axis_names_the_roles() -> None:
    """IOI's ABBA and BABA pairs hold IO and S1 in turn at one position: the axis says `IO/S1`, not the first pair's
    name with a star; a position whose tokens differ and that no role names keeps the star."""
    frame = patching_frame()
    frame.loc[(frame["sample"] == 1) & (frame["position"] == 1), "token"] = " E"  # differs, no role names it
    roles = {(0, 2): "IO", (1, 2): "S1", (0, 3): "end", (1, 3): "end"}
    frame = frame.assign(role=[roles.get((s, p)) for s, p in zip(frame["sample"], frame["position"], strict=True)])
    axis = lm_plots.position_axis(frame)
    slots, note = axis.slots, axis.note
    labels = dict(zip(slots["_x"], slots["label"], strict=True))
    assert labels[2] == "IO/S1" and labels[1] == "A*" and labels[3] == "C" and "role" in note


def fact_frame(prompts: dict[int, list[tuple[str, str | None]]]) -> pd.DataFrame:
    """One layer of resid_pre rows per (pair, token), restoration = the pair's number + position / 100."""
    return pd.DataFrame([
        {"sample": sample, "direction": "denoising", "site": "resid_pre", "layer": 0, "head": None, "position": p,
         "token": token, "role": role, "metric": "m", "patch_method": "exact", "restoration": sample + p / 100,
         "small_span": False}
        for sample, tokens in prompts.items() for p, (token, role) in enumerate(tokens)
    ])  # fmt: skip


def test_prompts_of_different_lengths_align_by_role_never_by_a_mixed_position() -> None:
    """Two facts whose subjects differ in length and place: aligned at the last token the axis would read as one
    sentence made of both prompts; by role, each slot holds the same part of each prompt (causal tracing's axis)."""
    frame = fact_frame({
        0: [("The", None), (" Eiff", "subject"), ("el", "subject"), (" Tower", "subject"), (" is", None),
            (" in", "end")],
        1: [(" Paris", "subject"), (" is", None), (" the", None), (" capital", None), (" of", "end")],
    })  # fmt: skip
    axis = lm_plots.position_axis(frame)
    labels = axis.slots["label"].tolist()
    assert labels == ["before subject", "first subject", "inner subject", "last subject", "first after subject",
                      "inner after subject", "last after subject", "end"]  # fmt: skip
    assert axis.title == "role" and "aligned by role" in axis.note
    at = {label: axis.frame[axis.frame["_x"] == x] for x, label in zip(axis.slots["_x"], labels, strict=True)}
    assert at["last subject"][["sample", "token"]].values.tolist() == [[0, " Tower"], [1, " Paris"]]
    assert at["first subject"]["token"].tolist() == [" Eiff"]  # a one-token subject is its last token
    assert at["first after subject"]["token"].tolist() == [" is", " is"]
    assert at["end"]["token"].tolist() == [" in", " of"]
    assert len(axis.frame) == len(frame)  # every row has its slot
    caption, fig = lm_plots.lm_patching_figures(frame, None, FiguresConfig())[0]
    array, ticks, _ = image_of(fig)
    assert ticks == labels and fig.axes[0].get_xlabel() == "role"
    assert array[0, labels.index("inner after subject")] == pytest.approx(1.02)  # pair 1's " the" alone
    assert array[0, labels.index("first after subject")] == pytest.approx((0.04 + 1.01) / 2)  # " is" in both
    pyplot().close(fig)


def test_the_peak_summary_names_role_slots_where_the_figure_aligns_by_role() -> None:
    from runner.viz.summary import peak_summary

    frame = fact_frame({
        0: [("The", None), (" Eiff", "subject"), ("el", "subject"), (" Tower", "subject"), (" is", None),
            (" in", "end")],
        1: [(" Paris", "subject"), (" is", None), (" the", None), (" capital", None), (" of", "end")],
    })  # fmt: skip
    frame["restoration"] = np.where(frame["token"].isin([" Tower", " Paris"]), 0.9, 0.1)  # the subject's last token
    frame.loc[frame["token"] == " the", "restoration"] = -0.5  # pair 1's second token after the subject
    summary = peak_summary(frame, ["site"], ["restoration"]).iloc[0]
    assert summary["restoration max at"] == "last subject" and summary["restoration max"] == pytest.approx(0.9)
    assert summary["restoration min at"] == "inner after subject, 1 of 2 pairs"


def test_pairs_whose_roles_differ_in_order_and_length_draw_one_length() -> None:
    """ABBA and BABA pairs of different lengths: neither the last token nor the roles line them up, so the axis holds
    the most common length's pairs only, and says so."""
    abba = [("<bos>", None), (" Ann", "IO"), (" and", None), (" Bob", "S1"), (" met", None), (" Bob", "S2"),
            (" gave", None), (" to", "end")]  # fmt: skip
    baba = [(" Bob", "S1"), (" and", None), (" Ann", "IO"), (" met", None), (" Bob", "S2"), (" gave", None),
            (" a", None), (" book", None), (" to", "end")]  # fmt: skip
    frame = fact_frame({0: abba, 1: baba, 2: baba})
    axis = lm_plots.position_axis(frame)
    assert set(axis.frame["sample"]) == {1, 2}
    assert axis.slots["_x"].tolist() == list(range(9)) and axis.title == "token (position)"
    assert "drawn are the 2 of 3 pairs of length 9" in axis.note


def test_long_prompts_show_the_last_positions() -> None:
    n = lm_plots.MAX_POSITIONS + 6
    frame = pd.DataFrame({"sample": 0, "direction": "denoising", "site": "attn_out", "layer": 0, "head": None,
                          "position": range(n), "token": [f"t{i}" for i in range(n)], "metric": "m",
                          "patch_method": "exact", "restoration": np.arange(n) / n, "small_span": False})  # fmt: skip
    caption, fig = lm_plots.lm_patching_figures(frame, None, FiguresConfig())[0]
    array, ticks, _ = image_of(fig)
    assert array.shape == (1, lm_plots.MAX_POSITIONS)
    assert ticks == [f"t{i} ({i})" for i in range(6, n)]
    assert np.allclose(array[0], np.arange(6, n) / n)
    assert f"the last {lm_plots.MAX_POSITIONS} of {n} positions" in caption
    pyplot().close(fig)


def head_frame(position_each: bool) -> pd.DataFrame:
    """Two pairs x 2 layers x 3 heads of `head` cells (at every position at once, or at positions 0 and 1);
    layer 1 head 2 has the largest effect."""
    rng = np.random.default_rng(0)
    rows = []
    for sample in (0, 1):
        for layer in (0, 1):
            for head in range(3):
                for position in (0, 1) if position_each else (None,):
                    big = 0.9 if (layer, head, position) in ((1, 2, None), (1, 2, 1)) else 0.0
                    rows.append({"sample": sample, "direction": "denoising", "site": "head", "layer": layer,
                                 "head": head, "position": position, "token": None if position is None else f"x{position}",
                                 "metric": "m", "patch_method": "exact", "small_span": False,
                                 "restoration": big + rng.uniform(-0.1, 0.1)})  # fmt: skip
    return pd.DataFrame(rows)


def test_layer_by_head_map_of_heads_at_every_position() -> None:
    frame = head_frame(False)
    caption, fig = lm_plots.lm_patching_figures(frame, None, FiguresConfig())[0]
    array, ticks, _ = image_of(fig)
    expected = frame.pivot_table(index="layer", columns="head", values="restoration", aggfunc="mean").to_numpy()
    assert np.allclose(array, expected)
    assert ticks == ["0", "1", "2"] and "per layer and head" in caption
    pyplot().close(fig)


def test_heads_at_each_position_draw_the_layer_with_the_largest_effect() -> None:
    frame = head_frame(True)
    drawn = lm_plots.lm_patching_figures(frame, None, FiguresConfig())
    assert len(drawn) == 1  # one head x position map, not one per layer or head
    caption, fig = drawn[0]
    array, ticks, _ = image_of(fig)
    layer1 = frame[frame["layer"] == 1]
    expected = layer1.pivot_table(index="head", columns="position", values="restoration", aggfunc="mean").to_numpy()
    assert np.allclose(array, expected)
    assert ticks == ["x0 (0)", "x1 (1)"] and "layer 1, the layer with the largest |mean| cell" in caption
    close(drawn)


def test_grad_x_act_sums_heads_and_logit_lens_labels_the_embeddings() -> None:
    heads = head_frame(True).rename(columns={"restoration": "value"})
    drawn = lm_plots.lm_grad_x_act_figures(heads, None, FiguresConfig())
    assert len(drawn) == 2  # layer x position summed over heads, layer x head summed over positions
    by_position, _, _ = image_of(drawn[0][1])
    per_pair = heads.groupby(["sample", "layer", "position"])["value"].sum()
    assert np.allclose(by_position, per_pair.groupby(["layer", "position"]).mean().unstack().to_numpy())
    by_head, _, _ = image_of(drawn[1][1])
    per_pair = heads.groupby(["sample", "layer", "head"])["value"].sum()
    assert np.allclose(by_head, per_pair.groupby(["layer", "head"]).mean().unstack().to_numpy())
    scales = {image_of(fig)[2].get_clim() for _, fig in drawn}
    assert len(scales) == 1  # one quantity, one colour scale: the head map's is its sibling's
    close(drawn)
    lens = pd.DataFrame({"sample": 0, "layer": [-1, -1, 0, 0], "position": [0, 1, 0, 1],
                         "token": ["a", "b", "a", "b"], "metric": "m", "value": [0.5, 1.0, 2.0, 3.0]})  # fmt: skip
    caption, fig = lm_plots.lm_logit_lens_figures(lens, None, FiguresConfig())[0]
    array, ticks, image = image_of(fig)
    assert np.allclose(array, [[0.5, 1.0], [2.0, 3.0]]) and ticks == ["a (0)", "b (1)"]
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["emb", "0"]
    assert image.get_clim() == (0.5, 3.0)  # one sign: a sequential scale over the values
    pyplot().close(fig)


def test_a_swept_column_makes_panels_on_one_scale() -> None:
    frame = pd.concat([patching_frame().assign(**{"sweep.seed": s, "restoration": lambda f, s=s: f["restoration"] * s})
                       for s in (1, 2)])  # fmt: skip
    caption, fig = lm_plots.lm_patching_figures(frame, "sweep.seed", FiguresConfig())[0]
    panels = [ax for ax in fig.axes if ax.images]
    assert [ax.get_title().split(":")[0] for ax in panels] == ["seed=1", "seed=2"]
    assert panels[0].images[0].get_clim() == panels[1].images[0].get_clim()
    assert np.allclose(panels[1].images[0].get_array() * 1, 2 * panels[0].images[0].get_array())
    pyplot().close(fig)


PIECES = ["<|endoftext|>", "When", "ĠMary", "Ġand", "ĠJohn", "Ċ", "Ġwent", "Ġto"]  # byte-level BPE pieces


def topk_frame() -> pd.DataFrame:
    """attribution_topk's rows of two pairs of 8 tokens (one length): an attribution row at every (site, layer,
    position) and every head, and exact rows at each pair's 3 top cells only (other cells per pair)."""
    rows = []
    common = {"direction": "denoising", "metric": "token_logit_diff", "small_span": False}
    for sample in (0, 1):
        tops = {(0, 2), (1, 4), (1, 7)} if sample == 0 else {(0, 2), (0, 5), (1, 6)}
        for layer in (0, 1):
            for position, token in enumerate(PIECES):
                estimate = 0.01 * (layer + 1) * (position + 1) + sample / 100
                rows.append({**common, "sample": sample, "site": "resid_pre", "layer": layer, "head": None,
                             "position": position, "token": token, "patch_method": "attribution",
                             "restoration": estimate})  # fmt: skip
                if (layer, position) in tops:
                    rows.append({**common, "sample": sample, "site": "resid_pre", "layer": layer, "head": None,
                                 "position": position, "token": token, "patch_method": "exact",
                                 "restoration": 0.5 + position / 10 + sample})  # fmt: skip
            for head in range(2):
                for method, value in (("attribution", 0.001 * head), ("exact", 0.002 * head)):
                    rows.append({**common, "sample": sample, "site": "head", "layer": layer, "head": head,
                                 "position": None, "token": None, "patch_method": method, "restoration": value})  # fmt: skip
    return pd.DataFrame(rows)


def test_topk_exact_rows_are_drawn_at_the_tables_positions() -> None:
    """The sparse exact rows of attribution_topk: column p of the map is position p of the table, with the table's
    token as its tick; cells no pair re-patched are blank. (A pair's length read from its sparse rows put its
    cells at the wrong places and its tokens on the wrong ticks.)"""
    frame = topk_frame()
    drawn = dict((c.split(":")[0], fig) for c, fig in lm_plots.lm_patching_figures(frame, None, FiguresConfig()))
    fig = drawn["Patching (resid_pre, denoising exact token_logit_diff)"]
    array, ticks, _ = image_of(fig)
    exact = frame[(frame["patch_method"] == "exact") & (frame["site"] == "resid_pre")]
    table = exact.pivot_table(index="layer", columns="position", values="restoration", aggfunc="mean")
    table = table.reindex(index=[0, 1], columns=range(len(PIECES)))  # every position of the prompt
    assert array.shape == (2, len(PIECES))
    assert np.allclose(array.filled(np.nan), table.to_numpy(), equal_nan=True)
    assert (array.mask == table.isna().to_numpy()).all()  # blank exactly where no pair has an exact row
    assert array[0, 2] == pytest.approx(0.5 + 0.2 + 0.5)  # both pairs re-patched (layer 0, position 2)
    tokens = ["<|endoftext|>", "When", "Mary", "and", "John", "⏎", "went", "to"]  # decoded, in the table's order
    assert ticks == [f"{token} ({position})" for position, token in enumerate(tokens)]
    attribution, ticks_too, _ = image_of(drawn["Patching (resid_pre, denoising attribution token_logit_diff)"])
    assert ticks_too == ticks and attribution.shape == array.shape
    close(list(drawn.items()))


def test_the_maps_of_one_direction_share_one_colour_scale_and_title_their_range() -> None:
    frame = topk_frame()
    drawn = lm_plots.lm_patching_figures(frame, None, FiguresConfig())
    assert len(drawn) == 4  # resid_pre and head, attribution and exact
    limits = {image_of(fig)[2].get_clim() for _, fig in drawn}
    top = frame.groupby(["site", "patch_method", "layer", "position", "head"], dropna=False)["restoration"].mean()
    assert limits == {(-top.abs().max(), top.abs().max())}  # one scale, the head maps' too
    for caption, fig in drawn:
        array = image_of(fig)[0]
        title = fig.axes[0].get_title()
        assert title == f"cells {array.min():.3g} to {array.max():.3g}", title  # its own range, for faint maps
        assert "Colour scale shared by the 4 maps" in caption
    close(drawn)


@pytest.mark.parametrize(
    ("piece", "shown"),
    [
        ("ĠAlice", "Alice"),
        ("Alice", "Alice"),
        ("Ċ", "⏎"),
        ("ĊĊ", "⏎⏎"),
        ("Ġ", "␣"),
        ("Ġcafé".replace("é", "Ã©"), "café"),  # a two-byte character as byte-level BPE writes it
        ("▁Paris", "Paris"),  # SentencePiece
        ("<0x0A>", "⏎"),  # SentencePiece's byte fallback
        ("t07", "t07"),
        ("é", "é"),  # not byte-level BPE: as it is
        (None, "?"),
        ("Ġsupercalifragilistic", "supercalifrag…"),
    ],
)
def test_tokens_are_shown_decoded(piece: str | None, shown: str) -> None:
    assert lm_plots.display_token(piece) == shown


def test_logit_lens_cells_show_the_top_token() -> None:
    lens = pd.DataFrame({"sample": [0, 0, 1, 1] * 2, "layer": [-1, -1, -1, -1, 0, 0, 0, 0],
                         "position": [0, 1, 0, 1] * 2, "token": ["ĠA", "ĠB"] * 4, "metric": "m",
                         "value": [0.5, 1.0, 0.5, 1.0, 2.0, 3.0, 2.0, 3.0],
                         "top_token": ["ĠParis", "Ġthe", "ĠParis", "Ġa", "Ċ", "ĠRome", "Ċ", "ĠRome"]})  # fmt: skip
    caption, fig = lm_plots.lm_logit_lens_figures(lens, None, FiguresConfig())[0]
    texts = {(round(t.get_position()[1]), round(t.get_position()[0])): t.get_text() for t in fig.axes[0].texts}
    assert texts == {(0, 0): "Paris", (0, 1): "the\n50%", (1, 0): "⏎", (1, 1): "Rome"}  # (layer row, position)
    assert "top token" in caption
    pyplot().close(fig)


def test_the_per_layer_summary_of_cells_is_the_peak_cell_not_the_mean_over_positions() -> None:
    """One cell carries the whole effect: the summary shows it (1.0 at position 2), where a mean over the layer's
    positions would show 0.25; noising is summarised as the drop, so its max is the strongest effect too."""
    from runner.viz.summary import peak_summary

    rows = []
    for direction in ("denoising", "noising"):
        for sample, tokens in TOKENS.items():
            for position, token in enumerate(tokens):
                carries = position == 2
                restoration = (1.0 if carries else 0.0) if direction == "denoising" else (0.0 if carries else 1.0)
                rows.append({"sample": sample, "direction": direction, "site": "resid_pre", "layer": 0, "head": None,
                             "position": position, "token": token, "metric": "m", "restoration": restoration})  # fmt: skip
        rows.append({"sample": 0, "direction": direction, "site": "head", "layer": 0, "head": 3, "position": None,
                     "token": None, "metric": "m", "restoration": 0.4 if direction == "denoising" else 0.6})  # fmt: skip
    frame = pd.DataFrame(rows)
    summary = peak_summary(frame, ["direction", "site", "metric"], ["restoration"])
    whole = summary[summary["site"] == "resid_pre"].set_index("direction")
    assert whole["effect max"].tolist() == [1.0, 1.0]  # the mean over positions is 0.25
    assert whole["effect max at"].tolist() == ["position 2 (B*)", "position 2 (B*)"]  # the pairs' tokens differ
    assert whole["effect min"].tolist() == [0.0, 0.0] and whole["n"].tolist() == [2, 2]
    heads = summary[summary["site"] == "head"].set_index("direction")
    assert heads["effect max"].tolist() == pytest.approx([0.4, 0.4])
    assert heads["effect max at"].tolist() == ["head 3", "head 3"]


@pytest.mark.slow
def test_report_of_an_lm_patching_run_shows_the_heatmaps(tmp_path: Path) -> None:
    from runner.viz.report import write_report

    done = run_cli("model=hf_lm", "data=prompts", "data.file=induction", "method=lm_patching",
                   "target=token_logit_diff", "debug=tiny", f"hydra.run.dir={tmp_path}")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "lm_patching (" in done.stderr and "per layer: the peak cells" in done.stderr  # the console's summary
    assert "restoration max at" in done.stderr  # denoising only: the restoration itself
    source, text = check_page(write_report(tmp_path))
    table = source.split('id="table-lm-patching"', 1)[1].split("<h2", 1)[0]
    for site in ("resid_pre", "attn_out", "mlp_out"):
        assert f"Patching ({site}, denoising exact token_logit_diff): mean over pairs" in table
    assert "per layer and head" in table  # the head cells at every position
    assert table.count('<img src="data:image/png;base64,') == 4
    assert "restoration max at" in table and "restoration min" in table  # the peak cells, not a mean over positions


def test_a_dictionarys_latents_are_drawn_as_the_latents_with_the_largest_effects() -> None:
    """100 latents patched at 4 positions: the map has TOP_LATENTS rows, among them the latents with a large effect,
    its axis names latents, and the caption says how many were left out."""
    strong = {7: 0.9, 63: -0.7}  # latent -> its effect at position 2 (others: small)
    rows = []
    for sample, tokens in TOKENS.items():
        for latent in range(100):
            for position, token in enumerate(tokens):
                value = strong.get(latent, latent / 1e4) if position == 2 else 0.0
                rows.append({"sample": sample, "direction": "denoising", "site": "latent", "layer": 3,
                             "head": latent, "position": position, "token": token, "metric": "token_logit_diff",
                             "patch_method": "exact", "restoration": value, "small_span": False})  # fmt: skip
    drawn = lm_plots.lm_patching_figures(pd.DataFrame(rows), None, FiguresConfig())
    caption, fig = drawn[0]
    array, _, _ = image_of(fig)
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert array.shape == (lm_plots.TOP_LATENTS, 4)
    assert {"7", "63"} <= set(labels) and "0" not in labels  # the strong ones kept, the weakest left out
    assert fig.axes[0].get_ylabel().startswith("latent")
    assert f"the {lm_plots.TOP_LATENTS} latents of 100 with the largest effects" in caption
    close(drawn)
