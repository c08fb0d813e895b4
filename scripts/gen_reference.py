"""Write docs/reference/*.md from the code: the registered methods, every config group's options and their
fields, every declared table's columns, and the language-model families that have site adapters. `--check` writes
nothing and exits 1 naming the stale files.

    python scripts/gen_reference.py            # (re)write docs/reference/methods.md, options.md, tables.md, families.md
    python scripts/gen_reference.py --check    # exit 1 if a committed file differs from what the code gives

All access to the registries is in `collect()`: the rest of the script only formats what it returns.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import inspect
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "reference"


@dataclass
class Option:
    """One option of a config group: its name, the class that implements it, and its schema (None: shared)."""

    name: str
    implementation: Any
    schema: type | None
    settings: list[str] = field(default_factory=list)  # for metrics: the names of their fields in the shared schema


@dataclass
class Collected:
    """What the reference is made of, read from the registries and the declared schemas."""

    groups: dict[str, tuple[type | None, list[Option]]]  # group -> (the schema its options share, its options)
    run_config: type  # the root of the config tree (runner/schema.py RunConfig)
    id_fields: list[Any]  # pyarrow fields every table starts with
    sweep_prefix: str
    tables: dict[str, tuple[Any, str]]  # table -> (its own pyarrow schema, the module that declares it)
    optional_when: Callable[[Any], str | None]  # a column's config under which it is written; None: always
    left_out: dict[str, list[str]]  # table -> the ID columns it is written without (runner/tables.py `classes=False`)
    families: dict[str, Any]  # model_type -> its site adapter (runner.models.lm_sites.Architecture)
    real_weights: dict[str, list[str]]  # model_type -> the model.name values with real weights offline


def collect() -> Collected:
    """Every registry and declared schema the reference lists. The one place that knows where they live."""
    import runner.tables as tables
    from runner.models.lm_sites import ARCHITECTURES, FAMILIES
    from runner.options.metric.evaluation import EvaluationConfig
    from runner.options.registry import POINTS
    from runner.schema import DataConfig, MethodConfig, ModelConfig, RunConfig, TargetConfig

    metric_fields = [f.name for f in dataclasses.fields(EvaluationConfig)]
    shared = {"model": ModelConfig, "data": DataConfig, "target": TargetConfig, "method": MethodConfig}
    groups: dict[str, tuple[type | None, list[Option]]] = {
        group: (base, [Option(o.name, o.load(), None if o.schema is base else o.schema) for o in POINTS[group]])
        for group, base in shared.items()
    }
    groups["method.evaluation.metrics"] = (
        EvaluationConfig,
        [
            Option(o.name, o.load(), o.schema, [f for f in metric_fields if metric_settings(o.name, f)])
            for o in POINTS["metric"]
        ],
    )
    for option in POINTS["method"]:  # every method's tables are declared once its module is imported
        option.load()

    def when(column: Any) -> str | None:
        return column.metadata[tables.WHEN].decode() if tables.is_optional(column) else None

    # the module that declares each table: the one holding its schema object (`X_SCHEMA = declare(...)`)
    modules = [m for name, m in sorted(sys.modules.items()) if name.startswith("runner.")]
    owners = {
        table: next(m.__name__ for m in modules if any(v is schema for v in vars(m).values()))
        for table, schema in tables.declared().items()
    }
    return Collected(
        groups=groups,
        run_config=RunConfig,
        id_fields=[*tables.RUN_FIELDS, *tables.SAMPLE_FIELDS],
        sweep_prefix=tables.SWEEP_PREFIX,
        tables={name: (schema, owners[name]) for name, schema in tables.declared().items()},
        optional_when=when,
        left_out={
            name: [f.name for f in tables.SAMPLE_FIELDS if f not in tables.sample_fields(name)]
            for name in tables.declared()
        },
        families={model_type: ARCHITECTURES[family] for model_type, family in sorted(FAMILIES.items())},
        real_weights=_real_weights(),
    )


def _real_weights() -> dict[str, list[str]]:
    """model_type -> the model.name values whose trained weights need no download: the shipped induction model and
    the packaged models (runner/options/model/hf_lm.py)."""
    import json

    from runner.models.hf_lm import shipped_folder
    from runner.options.model.hf_lm import PACKAGED_LMS, SHIPPED_LM

    found: dict[str, list[str]] = {}
    shipped = json.loads((shipped_folder() / "config.json").read_text())["model_type"]
    found.setdefault(shipped, []).append(f"`{SHIPPED_LM}` (shipped)")
    for name, packaged in PACKAGED_LMS.items():
        found.setdefault(packaged.model_type, []).append(f"`{name}` ({packaged.title}, {packaged.distribution})")
    return found


def metric_settings(metric: str, setting: str) -> bool:
    """Whether a field of the flat evaluation config belongs to `metric` (fields are prefixed by their metric)."""
    prefixes = {"region_perturbation": "region_", "pointing_game": "pointing_"}
    return setting.startswith(prefixes.get(metric, metric + "_"))


# ---- reading the source: comments beside fields and columns ------------------------------------------------------
FIELD_LINE = re.compile(r"^\s*(\w+)\s*:\s*[^=#]+(?:=[^#]*)?(?:#\s*(.*))?$")
# A comment line that heads a group of fields ("ROAD (Rong et al. 2022; ...)") rather than describing the next one.
SECTION = re.compile(r"^[A-Za-z][\w /-]{0,40} \([^)]*\)(:.*)?$|: no settings")


def clean_comment(text: str) -> str:
    """A comment without lint directives (`noqa: X (why)`, `type: ignore[...]`, `fmt: skip`)."""
    text = re.sub(r"#?\s*noqa(: [A-Z0-9, ]+)?(\s*\([^)]*\))?", "", text)
    text = re.sub(r"type: ignore(\[[^\]]*\])?|fmt: skip", "", text)
    return " ".join(text.split()).strip(" ;")


def field_comments(cls: type) -> dict[str, str]:
    """{field: its comment} from the class's source and its bases': the comment on the field's line, else the
    comment lines just above it."""
    found: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            lines = inspect.getsource(klass).splitlines()
        except (OSError, TypeError):
            continue
        above: list[str] = []
        for line in lines[1:]:
            stripped = line.strip()
            if stripped.startswith("#"):
                text = stripped.lstrip("# ")
                above = [] if SECTION.search(text) else [*above, text]
                continue
            match = FIELD_LINE.match(line)
            if match and match.group(1) in {f.name for f in dataclasses.fields(klass)}:
                text = clean_comment(match.group(2) or " ".join(above))
                if text:
                    found[match.group(1)] = text
            above = []
    return found


COLUMN_LINE = re.compile(r"""(?:pa\.field|optional)\(\s*["'](\w+)["'].*#\s*(.*)$""")


SHARED_FIELDS = "runner.methods.lm.cells"  # the columns several tables declare from one list (PAIR_TEXT_FIELDS)


def column_comments(module: str) -> dict[str, str]:
    """{column: its comment} from the declaring module's source: the comment on a `pa.field("name", ...)` line."""
    source = inspect.getsource(sys.modules[module])
    return {m.group(1): clean_comment(m.group(2)) for m in map(COLUMN_LINE.search, source.splitlines()) if m}


def outputs_descriptions() -> dict[str, dict[str, str]]:
    """{table: {column: description}} from docs/outputs.md's hand-written lists: the parenthesis right after a
    backticked column name in the table's bullet (tests/test_table_schemas.py keeps those lists complete)."""
    text = (ROOT / "docs" / "outputs.md").read_text()
    found: dict[str, dict[str, str]] = {}
    for bullet in re.findall(r"^- (`\w+`.*?)(?=^- |^\s*$)", text, flags=re.M | re.S):
        bullet = " ".join(bullet.split())
        table = re.match(r"`(\w+)`", bullet).group(1)  # type: ignore[union-attr]
        for match in re.finditer(r"`(\w+)` \(", bullet):
            depth, end = 1, match.end()
            while depth and end < len(bullet):
                depth += {"(": 1, ")": -1}.get(bullet[end], 0)
                end += 1
            found.setdefault(table, {}).setdefault(match.group(1), bullet[match.end() : end - 1])
    return found


# Columns that `runner.tables.declare` adds or that several tables share through helpers (no comment beside them).
SHARED_COLUMNS = {
    "run_id": "the run's identifier (as in `runner ls` and the metadata)",
    "experiment": "the experiment's name (`name`)",
    "method": "the method's option name",
    "sample_id": "photo name or file path",
    "predicted": "the model's top-1 class",
    "layer": "dotted module name",
    "target_rank": "0 for the top target; k-1 for the k-th with method.target=topk",
    "probability": "the target's softmax probability",
    "map_height": "the map's height at the layer's resolution",
    "map_width": "the map's width at the layer's resolution",
    "corrupted_id": "the corrupted twin's sample id",
    "direction": "denoising (clean into corrupted) or noising (corrupted into clean)",
    "metric": "what is measured (patching: logit, prob, logit_diff; evaluation: a metric's name)",
    "grid_h": "rows of the layer's cell grid",
    "grid_w": "columns of the layer's cell grid",
    "degenerate_reason": "empty, or the comma-joined reasons for `degenerate`",
    "inner_method": "the CAM method whose maps are compared",
    "cam_method": "the CAM method of this row's maps",
    "layer_index": "the module's position in model order, as `runner layers` numbers it (sort by it, not by name)",
    "module_type": "the module's class name",
    "call": "0, 1, ... for a module called several times per forward",
    "target": "the class explained (index)",
    "target_name": "the model's name of `target`; null without the model's class names",
    "degenerate": "the map is constant or not finite at the layer's resolution: its metrics are NaN",
    "mean": "per-sample mean",
    "std": "per-sample standard deviation",
    "min": "per-sample minimum",
    "max": "per-sample maximum",
    "l2_norm": "per-sample L2 norm",
    "frac_zero": "per-sample fraction of exact zeros",
    "nonfinite": "a NaN or inf in the tensor",
}


def shared_description(column: str) -> str:
    """A shared column's description; a prefixed statistic (`cam_mean`) says what it is of."""
    if column in SHARED_COLUMNS:
        return SHARED_COLUMNS[column]
    prefix, _, rest = column.partition("_")
    if rest in SHARED_COLUMNS and prefix in ("cam",):
        return f"{SHARED_COLUMNS[rest]} of the map"
    return ""


# ---- formatting ---------------------------------------------------------------------------------------------------
HEADER = "<!-- Generated by scripts/gen_reference.py from the code (`make docs`); do not edit by hand. -->\n\n"


def cell(text: object) -> str:
    """Text fit for one Markdown table cell."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def type_name(annotation: object) -> str:
    """A field's annotation as written in the source (`Optional[int]`), without module prefixes."""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", repr(annotation))
    return re.sub(r"\b(typing|runner\.\w+)\.", "", str(text))


def default_of(f: dataclasses.Field) -> str:
    """A field's default as a config would write it."""
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "(required)"
    if value == "???":  # OmegaConf's MISSING: a group whose option the defaults list chooses
        return "(the chosen option's)"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if dataclasses.is_dataclass(value):
        return f"({type(value).__name__})"
    if isinstance(value, enum.Enum):
        return f"`{value.value}`"
    if isinstance(value, list) and len(value) > 8:
        return f"`[{', '.join(map(str, value[:3]))}, ..., {value[-1]}]` ({len(value)} values)"
    return "`null`" if value is None else f"`{value!r}`".replace("'", "")


def fields_table(cls: type, names: list[str] | None = None, skip: set[str] = frozenset()) -> list[str]:
    """A Markdown table of a dataclass's fields (or the named ones): field, type, default, the comment beside it."""
    comments = field_comments(cls)
    rows = ["| field | type | default | description |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        if (names is not None and f.name not in names) or f.name in skip:
            continue
        rows.append(
            f"| `{f.name}` | `{cell(type_name(f.type))}` | {cell(default_of(f))} | {cell(comments.get(f.name, ''))} |"
        )
    return rows if len(rows) > 2 else ["(no fields of its own)"]


def first_paragraph(obj: object) -> str:
    """The first paragraph of an object's docstring, on one line; empty without one."""
    doc = inspect.getdoc(obj) or ""
    return " ".join(doc.split("\n\n")[0].split())


def own_doc(cls: type) -> str:
    """The first paragraph of a class's own docstring (not a base class's), else of its module's."""
    doc = cls.__dict__.get("__doc__") or sys.modules[cls.__module__].__doc__ or ""
    return " ".join(inspect.cleandoc(doc).split("\n\n")[0].split())


def qualified(obj: object) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"  # type: ignore[attr-defined]


def render_methods(c: Collected) -> str:
    base, options = c.groups["method"]
    out = [HEADER + "# Methods", "", "Every option of `method=` (runner.methods' registry), with its implementation's",
           "docstring. Their settings: [options.md](options.md#method). Definitions and sources: [../methods.md](../methods.md).", ""]  # fmt: skip
    for option in sorted(options, key=lambda o: o.name):
        out += [f"## `{option.name}`", "", f"`{qualified(option.implementation)}`, config `{qualified(option.schema)}`,"
                f" table `{getattr(option.implementation, 'table', '')}`.", ""]  # fmt: skip
        out += [own_doc(option.implementation) or "(no docstring)", ""]
    return "\n".join(out)


def render_options(c: Collected) -> str:
    out = [HEADER + "# Options", "",
           "Every config group's options and their fields, from the schemas (defaults are the schema's; an option's",
           "YAML in `conf/` may set others, and `runner --cfg job ...` prints what a run composes).", "",
           "## The run (`RunConfig`)", ""]  # fmt: skip
    out += fields_table(c.run_config) + [""]
    nested = {f.name: f.default_factory().__class__ for f in dataclasses.fields(c.run_config)
              if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory())}  # fmt: skip
    hooks = [f for f in dataclasses.fields(c.run_config) if f.name == "hooks"]
    for name, cls in nested.items():
        if name in c.groups:
            continue
        out += [f"### `{name}` (`{cls.__name__}`)", ""] + fields_table(cls) + [""]
    if hooks:
        from runner.schema import HookSpec  # the element type of `hooks`, which is a list

        out += ["### `hooks[]` (`HookSpec`)", ""] + fields_table(HookSpec) + [""]
    for group, (shared, options) in c.groups.items():
        out += [f"## `{group}`", ""]
        if group == "model":
            out += ["Every model source shares one schema (`model.source` picks the source; null: inferred).", ""]
            out += fields_table(shared) + ["", "| source | implementation | description |", "|---|---|---|"]
            out += [f"| `{o.name}` | `{qualified(o.implementation)}` | {cell(own_doc(o.implementation))} |"
                    for o in sorted(options, key=lambda o: o.name)]  # fmt: skip
            out += [""]
        elif group == "method.evaluation.metrics":
            out += [
                "Metrics share one flat schema (`method.evaluation.*`); each setting is prefixed by its metric.",
                "",
            ]
            shared_names = [
                f.name for f in dataclasses.fields(shared) if not any(f.name in o.settings for o in options)
            ]
            out += fields_table(shared, shared_names) + [""]
            for o in sorted(options, key=lambda o: o.name):
                out += [f"### `{o.name}`", "", first_paragraph(o.implementation) or "(no docstring)", ""]
                out += (fields_table(shared, o.settings) if o.settings else ["(no settings)"]) + [""]
        else:
            out += [f"Shared by every option (`{shared.__name__}`):", ""] + fields_table(shared) + [""]
            base = {f.name for f in dataclasses.fields(shared)}
            for o in sorted(options, key=lambda o: o.name):
                out += [f"### `{group}={o.name}` (`{o.schema.__name__}`)", ""]
                out += fields_table(o.schema, skip=base) + [""]
    return "\n".join(out)


def render_tables(c: Collected) -> str:
    out = [HEADER + "# Tables", "",
           "Every table starts with the identifier columns, then one `sweep.<key>` column per command-line override",
           "(typed bool, int64, double or string), then its own columns. Declared in `runner/tables.py` and beside the",
           "code that builds each table's rows; the writer refuses a batch that departs from them. More:",
           "[../outputs.md](../outputs.md).", "", "## Identifier columns", "",
           "| column | type | description |", "|---|---|---|"]  # fmt: skip
    ids = column_comments("runner.tables")
    out += [f"| `{f.name}` | `{f.type}` | {cell(ids.get(f.name) or shared_description(f.name))} |" for f in c.id_fields]
    out += [
        f"| `{c.sweep_prefix}<key>` | bool, int64, double or string | one per command-line override of the job |",
        "",
    ]
    written = outputs_descriptions()
    for table, (schema, owner) in sorted(c.tables.items()):
        shared = column_comments(SHARED_FIELDS) if "PAIR_TEXT_FIELDS" in inspect.getsource(sys.modules[owner]) else {}
        comments = {**written.get(table, {}), **shared, **column_comments(owner)}
        left_out = c.left_out[table]
        without = f" Without the class columns ({', '.join(f'`{n}`' for n in left_out)})." if left_out else ""
        out += [f"## `{table}`", "", f"Declared in `{owner}`.{without}", "", "| column | type | description |",
                "|---|---|---|"]  # fmt: skip
        for column in schema:
            text = comments.get(column.name) or shared_description(column.name)
            when = c.optional_when(column)
            if when:
                text = f"{text} (only with `{when}`)".strip()
            out.append(f"| `{column.name}` | `{column.type}` | {cell(text)} |")
        out.append("")
    return "\n".join(out)


def render_families(c: Collected) -> str:
    out = [HEADER + "# Language-model families", "",
           "The Hugging Face `model_type`s (config.json) that have a site adapter (`runner/models/lm_sites.py`), and",
           "what each adapter says of the family: module paths are from a block, except the blocks, the final norm and",
           "the embedding (from the model). `attn_out` and `mlp_out` are what each branch adds onto the residual",
           "stream; `resid_mid` is the stream where the MLP's branch reads it (the input of the module named), written",
           "into the attention's branch output. Sites: [../language_models.md](../language_models.md#sites).",
           "`real weights offline`: the `model.name` values whose trained weights run with no download (the others run",
           "on a folder or cached hub id of the user's, or on random weights from a config: `model.weights=null`).", "",
           "| model_type | real weights offline | adapter | blocks | `attn_out` | `mlp_out` | `resid_mid` |"
           " `head` (input of) | `q`, `k`, `v` | final norm | embedding | final logits | refused |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip

    def doc(fn: Any) -> str:
        return (fn.__doc__ or "").strip().splitlines()[0]

    for model_type, a in c.families.items():
        if a.mid_norm is None:
            mid = "none (attention and MLP in parallel)"
        elif doc(a.parallel) != "never":
            mid = f"`{a.mid_norm}`; none where {doc(a.parallel)}"
        else:
            mid = f"`{a.mid_norm}`"
        qkv = ", ".join(f"`{q}`" for q in a.qkv) if isinstance(a.qkv, tuple) else f"`{a.qkv}` ({a.fused_layout})"
        if a.kv_heads is not {f.name: f.default for f in dataclasses.fields(a)}["kv_heads"]:
            qkv += f"; key-value heads: {doc(a.kv_heads)}"
        real = "; ".join(c.real_weights.get(model_type, [])) or "none"
        cells = [f"`{model_type}`", real, a.family, f"`{a.blocks}`", f"`{a.attn_branch or a.attn}`",
                 f"`{a.mlp_branch or a.mlp}`", mid, f"`{a.out_proj}`", qkv, f"`{a.final_norm}`",
                 f"`{a.embed}`", doc(a.logit_softcap), doc(a.refuse)]  # fmt: skip
        if a.mlp_rows:
            cells[5] += " (on the positions flattened, viewed back)"
        if doc(a.mutated) != "none":
            cells[5] += f"; changed in place by the block afterwards, kept as a copy: {doc(a.mutated)}"
        out.append("| " + " | ".join(cell(x) for x in cells) + " |")
    out += ["", "Fused q/k/v layouts: gpt2 = q | k | v in equal thirds; neox = per head, q k v; gqa = q | k | v with q",
            "of the query heads and k, v of the key-value heads; grouped = per key-value head, the query heads that share",
            "it, then its k, then its v (Falcon's three forms: one key-value head, one per query head, or",
            "config.num_kv_heads). Mixtral's and Qwen2/3-MoE's `mlp` is the sparse MoE",
            "block (its output: what the block adds); OPT has no MLP module, its `mlp_out` is `fc2`'s output. Gemma's",
            "embedding module multiplies its rows by sqrt(hidden_size): the embedding corruptions edit its output, and",
            "the noise's std is measured on it.", ""]  # fmt: skip
    return "\n".join(out)


def example_diff(example: Path) -> str:
    """An example extension (docs/examples/extending/NAME/, laid out as the checkout) as the diff that adds it: every
    file a new one, nothing else changed."""
    out = []
    for file in sorted(p for p in example.rglob("*") if p.is_file()):
        path = file.relative_to(example).as_posix()
        lines = file.read_text().splitlines()
        out += [f"diff --git a/{path} b/{path}", "new file mode 100644", "--- /dev/null", f"+++ b/{path}",
                f"@@ -0,0 +1,{len(lines)} @@"] + [f"+{line}" for line in lines]  # fmt: skip
    return "\n".join(out)


EXAMPLE_BLOCK = re.compile(r"(<!-- example: (\w+) -->\n).*?(<!-- end of example -->)", re.S)


def render_extending(text: str) -> str:
    """docs/extending.md with each `<!-- example: NAME -->` block filled with that example's diff."""
    examples = ROOT / "docs" / "examples" / "extending"
    return EXAMPLE_BLOCK.sub(
        lambda m: f"{m.group(1)}```diff\n{example_diff(examples / m.group(2))}\n```\n{m.group(3)}", text
    )


def render() -> dict[Path, str]:
    """{file: its contents} for every generated reference file (and docs/extending.md's example diffs)."""
    collected = collect()
    pages = {
        "methods.md": render_methods,
        "options.md": render_options,
        "tables.md": render_tables,
        "families.md": render_families,
    }
    out = {REFERENCE / name: make(collected).rstrip("\n") + "\n" for name, make in pages.items()}
    extending = ROOT / "docs" / "extending.md"
    out[extending] = render_extending(extending.read_text())
    return out


def stale(pages: dict[Path, str]) -> list[Path]:
    """The generated files whose committed contents differ from `pages` (or that are missing)."""
    return [path for path, text in pages.items() if not path.is_file() or path.read_text() != text]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 naming the stale files")
    args = parser.parse_args(argv)
    pages = render()
    old = stale(pages)
    if args.check:
        for path in old:
            print(f"stale: {path.relative_to(ROOT)} (run: python scripts/gen_reference.py)", file=sys.stderr)
        return 1 if old else 0
    REFERENCE.mkdir(parents=True, exist_ok=True)
    for path in old:
        path.write_text(pages[path])
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # the checkout's runner, not an installed one
    sys.exit(main())
