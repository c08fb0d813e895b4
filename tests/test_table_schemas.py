"""Each table's declared schema (runner/tables.py and the modules that build rows) is what real runs write,
the writer refuses a batch that departs from it, and docs/outputs.md lists the same columns."""

from __future__ import annotations

import re
from pathlib import Path
from unittest import mock

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import runner.app as app
import runner.store.provenance as provenance
from runner.methods.hook_check import HookCheck
from runner.options.registry import METHODS, discover
from runner.store.writer import TableWriter
from runner.tables import ID_FIELDS, SWEEP_PREFIX, SchemaError, declared, full_schema, is_optional
from tests.conftest import make_config

ROOT = Path(__file__).resolve().parents[1]
discover()
for _option in METHODS:  # each method's module declares its tables when it is imported
    _option.load()
TINY = [
    "model._target_=tests.conftest.TinyNet",
    "model.weights=null",
    "data=synthetic",
    "data.shape=[3,32,32]",
    "data.count=2",
    "data.batch_size=2",
    "data.num_classes=5",
    "layers.include=[features.0,features.2]",
    "hooks=[]",
]
# One run per table, together writing every optional column (map, faithfulness, captum_method, rank_correlation).
RUNS = {
    "gradcam": [
        "method=gradcam",
        "method.faithfulness.enabled=true",
        "method.faithfulness.steps=2",
        "hooks=[{kind: forward, layers: [features.2], save_tensors: true}]",
    ],
    "captum": ["method=captum"],
    "patching": [
        "method=patching",
        "method.patching.grid=[2,2]",
        "method.patching.mode=attribution_topk",
        "method.patching.top_k=2",
    ],  # fmt: skip
    "sanity": ["method=sanity", "method.randomize=[fc]"],
    "hook_check": ["method=hook_check"],
    "record": ["method=record", "hooks=[{kind: backward, layers: [features.2]}]"],
    "evaluation": ["method=gradcam", "method.evaluation.metrics=[sparseness,complexity]"],
    "mprt": ["method=mprt", "method.max_steps=2"],
    "cam_vs_patching": ["method=cam_vs_patching", "method.cam_methods=[gradcam]", "method.exact_patching.grid=[2,2]"],
    # A language model: a random-weight GPT-2 saved to a folder, on two pairs (its own config, not TINY's image model).
    "lm_patching": [
        "model=hf_lm",
        "data=prompts",
        "method=lm_patching",
        "target=token_logit_diff",
        "data.batch_size=2",
        "method.patching.sites=[resid_pre,head]",
        "method.patching.layers=[1]",
        "method.patching.mode=attribution_topk",  # writes patch_method's both values and rank_correlation
        "method.patching.top_k=2",
    ],
    "lm_grad_x_act": [
        "model=hf_lm",
        "data=prompts",
        "method=lm_grad_x_act",
        "target=token_logit_diff",
        "method.sites=[resid_pre,head]",
    ],
    "lm_logit_lens": ["model=hf_lm", "data=prompts", "method=lm_logit_lens", "target=token_logit_diff"],
    "lm_attention": ["model=hf_lm", "data=prompts", "method=lm_attention", "target=token_logit_diff"],
    "lm_cache": ["model=hf_lm", "data=prompts", "method=lm_cache", "method.sites=[resid_pre,head,pattern]"],
    "lm_dla": ["model=hf_lm", "data=prompts", "method=lm_dla", "target=token_logit_diff"],
    "lm_edges": [
        "model=hf_lm",
        "data=prompts",
        "method=lm_edges",
        "target=token_logit_diff",
        "method.edges.steps=2",
        "method.edges.top_k=3",
        "method.edges.circuit=[0,5]",
        "method.edges.per_pair=true",
        "method.edges.ablation=mean",
        "method.edges.paths=[{senders: ['a0.*'], receivers: ['a1.h0<q>', logits]}]",
    ],
    "lm_edge_positions": [
        "model=hf_lm",
        "data=prompts",
        "method=lm_edges",
        "target=token_logit_diff",
        "method.edges.mode=eap",
        "method.edges.top_k=2",
        "method.edges.circuit=[0,5]",
        "method.edges.per_pair=true",
        "method.edges.per_position=true",
    ],
    # The shipped induction model on its own text, the experiment made smaller (neither TINY nor prompt pairs).
    "train_sae": ["experiment=train_sae_induction", "method.steps=5", "data.windows=20"],
}
# The command line the first run pretends to have: one swept column of each type.
OVERRIDES = ["seed=3", "method.faithfulness.enabled=true", "+note.lr=0.5", "name=yes", "hydra.run.dir=x"]
SWEPT = [("sweep.seed", pa.int64()), ("sweep.method.faithfulness.enabled", pa.bool_()),
         ("sweep.note.lr", pa.float64()), ("sweep.name", pa.string())]  # fmt: skip


def lm_inputs(folder: Path) -> list[str]:
    """model.name and data.file of a random-weight GPT-2 saved in `folder` and two prompt pairs beside it."""
    import json

    from tests.lm_references import build_tiny_lm

    build_tiny_lm("gpt2", seed=0, folder=folder / "model")
    pairs = [{"clean": "t01 t02 t01", "corrupted": "t03 t04 t01", "answer": "t02", "distractor": "t04"}] * 2
    (folder / "pairs.jsonl").write_text("\n".join(json.dumps(p) for p in pairs))
    return [f"model.name={folder / 'model'}", f"data.file={folder / 'pairs.jsonl'}"]


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[tuple[str, pa.Schema]]]:
    """Per table, (run, file schema) of every real run above that wrote it."""
    out: dict[str, list[tuple[str, pa.Schema]]] = {}
    for name, extra in RUNS.items():
        overrides = OVERRIDES if name == "gradcam" else []
        with mock.patch.object(provenance, "hydra_overrides", return_value=overrides):
            if name.startswith("lm_"):
                base = lm_inputs(tmp_path_factory.mktemp("lm"))
            else:
                base = [] if name == "train_sae" else TINY  # train_sae: its experiment's own model and text
            result = app.run(make_config(*base, *extra), tmp_path_factory.mktemp(name))
        for table, folder in result.tables.items():
            out.setdefault(table, []).append((name, pq.read_schema(sorted(folder.glob("part-*.parquet"))[0])))
    return out


def plain(schema: pa.Schema) -> list[tuple[str, pa.DataType]]:
    return [(f.name, f.type) for f in schema]


@pytest.mark.slow
def test_every_declared_schema_is_what_real_runs_write(written: dict[str, list[tuple[str, pa.Schema]]]) -> None:
    assert (
        set(written)
        == set(declared())
        == {"cam", "hooks", "patching", "sanity", "hook_check", "evaluation", "mprt", "cam_vs_patching", "lm_patching"}
        | {"lm_grad_x_act", "lm_logit_lens", "lm_attention", "lm_edges", "lm_circuit", "lm_circuit_curve"}
        | {"lm_circuit_scores", "lm_circuit_stability", "lm_edge_pair_scores", "lm_edge_pairs", "lm_edge_exact"}
        | {"lm_edge_calibration", "lm_dla", "lm_cache", "lm_paths"}
        | {"train_sae", "train_sae_steps", "train_sae_features", "train_sae_windows"}
    )
    for table, files in written.items():
        seen: set[str] = set()
        for run, schema in files:
            swept = [pa.field(n, t) for n, t in SWEPT] if run == "gradcam" else []
            expected = [f for f in full_schema(table, swept) if f.name in schema.names or not is_optional(f)]
            assert plain(schema) == plain(pa.schema(expected)), (table, run)  # names, order and types
            seen |= set(schema.names)
        optional = {f.name for f in full_schema(table) if is_optional(f)}
        assert optional <= seen, f"{table}: no run wrote {optional - seen}"


# ---- the writer enforces the schema ------------------------------------------------------------------------------
def valid_batch(table: str, rows: int = 2) -> dict[str, object]:
    """A batch of `table` with every declared column (optional ones left out), each of its declared type."""
    return {f.name: pa.nulls(rows, f.type) for f in full_schema(table) if not is_optional(f)}


def write(tmp_path: Path, table: str, *batches: dict[str, object]) -> pa.Table:
    writer = TableWriter(tmp_path / f"{table}.parquet" / "part-000000.parquet", {"run": 1}, table)
    for columns in batches:
        writer.write(columns)
    writer.commit()
    return pq.read_table(writer.path)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: c.pop("passed"), r"table 'hook_check': declared column\(s\) 'passed' are missing"),
        (lambda c: c.pop("sample"), r"table 'hook_check': declared column\(s\) 'sample' are missing"),
        (lambda c: c.update(tolerance=[1.0, 1.0]), r"table 'hook_check': column\(s\) 'tolerance' are not declared"),
        (lambda c: c.update(max_abs_diff=np.zeros(2)), r"table 'hook_check': column 'max_abs_diff' is double, declared float"),
        (lambda c: c.update(passed=np.zeros(2, np.float32)), r"column 'passed' is float, declared bool"),
        (lambda c: c.update(call=np.array([0, 2**40])), r"column 'call' does not fit its declared int32"),
        (lambda c: c.update(label=["a", "b"]), r"column 'label' is string, declared int64"),
        (lambda c: c.update({"sweep.x": [[1], [2]]}), r"swept column 'sweep.x' is list<item: int64>"),
    ],
)  # fmt: skip
def test_the_writer_refuses_a_missing_extra_or_mistyped_column(tmp_path: Path, change, message: str) -> None:  # noqa: ANN001
    columns = valid_batch("hook_check")
    change(columns)
    with pytest.raises(SchemaError, match=message):
        write(tmp_path, "hook_check", columns)


def test_the_writer_casts_only_losslessly_and_keeps_the_declared_order(tmp_path: Path) -> None:
    columns = valid_batch("hook_check")
    columns["call"] = np.array([0, 1])  # int64 values that fit the declared int32
    columns["predicted_name"] = [None, None]  # all null: takes the declared string
    columns["sweep.seed"] = [3, 3]
    table = write(tmp_path, "hook_check", dict(reversed(columns.items())))
    assert table.schema.field("call").type == pa.int32() and table.column("call").to_pylist() == [0, 1]
    assert table.schema.field("predicted_name").type == pa.string()
    assert table.schema.names == [f.name for f in full_schema("hook_check", [pa.field("sweep.seed", pa.int64())])]


def test_language_model_tables_have_no_class_columns(tmp_path: Path) -> None:
    classes = {"label", "label_name", "predicted", "predicted_name"}
    for table in declared():
        names = set(full_schema(table).names)
        # a pair has no class label, and its prediction is a token, not a class; a window of text (train_sae) neither
        if table.startswith(("lm_", "train_sae")):
            assert not names & classes and {"sample", "sample_id"} <= names, table
        else:
            assert classes <= names, table
    columns = {**valid_batch("lm_edges"), **{n: [None, None] for n in classes}}  # as runner/ids.py hands them over
    written = write(tmp_path, "lm_edges", columns)
    assert written.schema.names == [f.name for f in full_schema("lm_edges") if not is_optional(f)]


def test_optional_columns_are_in_every_batch_or_none(tmp_path: Path) -> None:
    first = {**valid_batch("patching"), "rank_correlation": np.zeros(2, np.float32)}
    with pytest.raises(SchemaError, match="table 'patching': a batch's columns differ .* in rank_correlation"):
        write(tmp_path, "patching", first, valid_batch("patching"))


def lm_cells(heads: list[int | None], positions: list[int | None]) -> dict[str, object]:
    """An `lm_patching` batch of one row per (head, position) given, the other columns null."""
    columns = valid_batch("lm_patching", len(heads))
    columns.update(sample=list(range(len(heads))), layer=[0] * len(heads), head=heads, position=positions)
    columns.update(restoration=np.linspace(0, 1, len(heads), dtype=np.float32))
    return columns


def test_two_runs_tables_have_the_declared_types_and_merge(tmp_path: Path) -> None:
    """A run of whole-site cells (head all null) and one of head cells at every position (position all null) read
    back with the same column types, by pandas and by the store's reader, so one frame holds both."""
    from runner.store.reader import read_part

    whole = write(tmp_path / "whole", "lm_patching", lm_cells([None, None, None], [0, 1, 2]))
    heads = write(tmp_path / "heads", "lm_patching", lm_cells([0, 1], [None, None]))
    runs = [pd.read_parquet(tmp_path / run / "lm_patching.parquet") for run in ("whole", "heads")]
    assert str(runs[0]["head"].dtype) == str(runs[1]["head"].dtype) == "Int64"
    assert str(runs[0]["position"].dtype) == str(runs[1]["position"].dtype) == "Int64"
    assert runs[0].dtypes.equals(runs[1].dtypes)  # every column, not only these two
    merged = pd.concat(runs, ignore_index=True)
    assert merged.dtypes.equals(runs[0].dtypes)
    assert merged["head"].tolist()[3:] == [0, 1] and merged["position"].tolist()[:3] == [0, 1, 2]
    keys = ["sample", "layer", "head", "position"]
    joined = runs[0].merge(runs[1], on=keys, how="outer", suffixes=("_whole", "_heads"))
    assert len(joined) == 5 and joined["head"].isna().sum() == 3
    # A file written without the types in its metadata (an older run): the store's reader gives the same types.
    pq.write_table(whole.replace_schema_metadata(None), tmp_path / "old.parquet")
    assert read_part(tmp_path / "old.parquet").dtypes.equals(runs[0].dtypes)
    assert read_part(tmp_path / "heads" / "lm_patching.parquet" / "part-000000.parquet").dtypes.equals(runs[1].dtypes)
    assert heads.schema.field("head").type == pa.int64()  # the file holds the declared Arrow type as before


def test_a_table_without_a_declared_schema_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SchemaError, match="table 'nowhere' has no declared schema"):
        write(tmp_path, "nowhere", {"run_id": ["x"]})


def test_an_undeclared_column_fails_a_real_run_and_leaves_no_table(tmp_path: Path) -> None:
    original = HookCheck.run_batch

    def with_extra_column(self, model, batch, session):  # noqa: ANN001, ANN202
        output = original(self, model, batch, session)
        output.tables["hook_check"]["extra"] = output.tables["hook_check"]["passed"]
        return output

    with (
        mock.patch.object(HookCheck, "run_batch", with_extra_column),
        pytest.raises(SchemaError, match="'extra' are not declared"),
    ):
        app.run(make_config(*TINY, "method=hook_check"), tmp_path)
    assert not list(tmp_path.rglob("*.parquet"))


# ---- docs/outputs.md's column lists -------------------------------------------------------------------------------
def outside_parentheses(text: str) -> str:
    """`text` without its parenthesised parts (nested ones too)."""
    depth, kept = 0, []
    for char in text:
        depth += char == "("
        if depth == 0:
            kept.append(char)
        depth -= char == ")" and depth > 0
    return "".join(kept)


def documented_columns() -> tuple[list[str], dict[str, list[str]]]:
    """(the ID columns, {table: its own columns}) as docs/outputs.md's Tables section lists them: backticked names
    outside parentheses, in the paragraph on identifier columns and in one bullet per table."""
    text = (ROOT / "docs" / "outputs.md").read_text()
    section = text[text.index("\n## Tables\n") :]
    section = section[: section.index("\n## ", 1)]
    ids = section[section.index("identifier columns") : section.index("then its own columns")]
    tables = {}
    for bullet in re.findall(r"^- (`\w+`.*?)(?=^- |^\s*$)", section, flags=re.M | re.S):
        names = re.findall(r"`([^`]+)`", outside_parentheses(bullet))
        tables[names[0]] = names[1:]
    return re.findall(r"`([^`]+)`", outside_parentheses(ids)), tables


def test_docs_list_each_tables_declared_columns() -> None:
    ids, tables = documented_columns()
    assert [c for c in ids if not c.startswith(SWEEP_PREFIX)] == [f.name for f in ID_FIELDS]
    assert [c for c in ids if c.startswith(SWEEP_PREFIX)] == ["sweep.<key>"]  # the open part is documented
    assert set(tables) == set(declared())
    for table, columns in tables.items():
        assert len(columns) == len(set(columns)), f"docs/outputs.md lists a {table} column twice"
        assert set(columns) == set(declared()[table].names), (
            f"{table}: docs/outputs.md only {set(columns) - set(declared()[table].names)},"
            f" schema only {set(declared()[table].names) - set(columns)}"
        )
