"""Every Parquet table's columns, declared once: the identifier columns here, each table's own beside the code
that builds its rows, and the writer holds every batch to them.

A table is `ID columns + swept columns + its own columns`, in that order:
  - ID columns (`ID_FIELDS`, added by runner/ids.py): which run, model and method; which sample.
  - swept columns, the open part: one `sweep.<key>` column per command-line override of the job
    (runner/store/provenance.py `swept_columns`), typed bool, int64, double or string as the run used the value.
    Which keys a job has depends on its command line, so they are checked by prefix and type, not by name.
  - the table's own columns, declared with `declare(name, fields)` in the module that builds its rows
    (`CAM_SCHEMA` in runner/methods/cam.py, `HOOKS_SCHEMA` in runner/hooks/spec_hooks.py, ...). A column written only
    under some config (`map` with method.store_maps) is declared with `optional(...)`, naming when.

`conform` turns one batch's host columns into an Arrow table of exactly the declared types: a missing
column, an undeclared one, or one of another type raises `SchemaError` naming the table and the column
(a bug, caught by the tests, never a silent change in the files). The only conversions are lossless ones:
all-null values take the declared type, and integers move to another integer width when every value fits.
(`sample_index`, which methods hand over to place rows, becomes the sample ID columns and is not written.)

Read back with pandas, every integer column is pandas' nullable `Int64` (`pandas_metadata`, kept in each file):
otherwise pandas makes an integer column int64 in a run where it has no null and float64 in one where it has
(`head` of a run with only whole-site cells), and two runs' tables would not line up.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

# The ID columns every table starts with; the swept columns go between RUN_FIELDS and SAMPLE_FIELDS.
RUN_FIELDS = (
    pa.field("run_id", pa.string()),
    pa.field("experiment", pa.string()),
    pa.field("model", pa.string()),  # the model's name or its `_target_`
    pa.field("method", pa.string()),
)
SAMPLE_FIELDS = (
    pa.field("sample", pa.int64()),  # index in the data set; null on a row about a whole batch
    pa.field("sample_id", pa.string()),
    pa.field("label", pa.int64()),  # null when unknown
    pa.field("label_name", pa.string()),  # the data set's name of the label (runner/ids.py `ClassNames`); null: unknown
    pa.field("predicted", pa.int64()),
    pa.field("predicted_name", pa.string()),  # the model's name of the class; null without the model's class names
)
ID_FIELDS = (*RUN_FIELDS, *SAMPLE_FIELDS)
# The sample columns about classes: a table declared with `classes=False` (a language model's, whose samples are
# prompt pairs with no class label) has none of them.
CLASS_FIELDS = frozenset(("label", "label_name", "predicted", "predicted_name"))
# Declared after `layer` in every table that has one: the module's position in model order (`named_modules()`,
# root excluded; null for a name that is not a module), filled in by the writer, so that tables sort
# features.2 before features.10. A table declares `layer`; this column comes with it.
LAYER_INDEX = pa.field("layer_index", pa.int64())
# Declared after `target` in every table that has one: the model's name of that class (null without the model's
# class names), filled in by runner/ids.py. A table declares `target`; this column comes with it.
TARGET_NAME = pa.field("target_name", pa.string())
SWEEP_PREFIX = "sweep."
SWEEP_TYPES = (pa.bool_(), pa.int64(), pa.float64(), pa.string())

WHEN = b"when"  # field metadata of an optional column: the config under which it is written
PANDAS_KEY = b"pandas"  # the schema metadata pandas reads its column types from (pyarrow's `to_pandas`)


@dataclass(frozen=True)
class Presentation:
    """How a table is summarised and drawn, declared with its columns: the console summary at the end of a run and
    the report's summary group by `keys` (beside `layer`) and average `values` (empty: every float column);
    `figures` ("module:function", (frame, by, FiguresConfig) -> [(caption, Figure)]) draws its standard figures;
    `section` ("module:function") writes its report section instead of the standard one. The writer keeps it in the
    run's manifest, so a report reads it without importing the code that declared the table."""

    keys: tuple[str, ...] = ()
    values: tuple[str, ...] = ()
    figures: str | None = None
    section: str | None = None
    shown: tuple[str, ...] = ()  # keys shown even when they hold one value (they say what the number is)

    def as_dict(self) -> dict[str, Any]:
        return {"keys": list(self.keys), "values": list(self.values), "figures": self.figures,
                "section": self.section, "shown": list(self.shown)}  # fmt: skip

    @classmethod
    def from_dict(cls, found: Mapping[str, Any] | None) -> Presentation:
        """The presentation a manifest holds; the plain default (every float column, no figures) when it has none."""
        if not found:
            return cls()
        return cls(tuple(found.get("keys") or ()), tuple(found.get("values") or ()), found.get("figures"),
                   found.get("section"), tuple(found.get("shown") or ()))  # fmt: skip


class SchemaError(TypeError):
    """A batch's columns differ from its table's declared schema: a bug in the code that built the rows."""


_DECLARED: dict[str, tuple[pa.Schema, str]] = {}  # table -> (its own columns, the declaring module)
_PRESENTED: dict[str, Presentation] = {}  # table -> how it is summarised and drawn
_CLASSLESS: set[str] = set()  # tables declared without the class columns (CLASS_FIELDS)


def optional(name: str, type_: pa.DataType, when: str) -> pa.Field:
    """A column written only under some config (`when`, e.g. 'method.store_maps=true'), in every batch or none."""
    return pa.field(name, type_, metadata={WHEN: when.encode()})


def is_optional(field: pa.Field) -> bool:
    """Whether a declared column may be absent from a table (see `optional`)."""
    return bool(field.metadata) and WHEN in field.metadata


def declare(
    table: str, fields: Sequence[pa.Field], presentation: Presentation | None = None, classes: bool = True
) -> pa.Schema:
    """Declare `table`'s own columns (after the ID and swept columns), in the order they are written, and how it is
    summarised and drawn. `classes=False`: the table's sample columns are `sample` and `sample_id` only, without the
    class columns (`label`, `predicted` and their names), for samples that have no class (a language model's pairs)."""
    schema = pa.schema(fields)
    if "layer" in schema.names and LAYER_INDEX.name not in schema.names:  # a layer's position comes with its name
        schema = schema.insert(schema.get_field_index("layer") + 1, LAYER_INDEX)
    if "target" in schema.names and TARGET_NAME.name not in schema.names:  # a class index comes with its name
        schema = schema.insert(schema.get_field_index("target") + 1, TARGET_NAME)
    overlap = sorted(set(schema.names) & {f.name for f in ID_FIELDS})
    if overlap or any(n.startswith(SWEEP_PREFIX) for n in schema.names):
        raise SchemaError(f"table '{table}' declares ID or swept columns as its own: {overlap or schema.names}")
    owner = sys._getframe(1).f_globals.get("__name__", "?")  # named in error messages: where to fix a column
    known = _DECLARED.get(table)
    if known is not None and not known[0].equals(schema, check_metadata=True):
        raise SchemaError(f"table '{table}' is declared twice, differently (in {known[1]} and {owner})")
    _DECLARED[table] = (schema, owner)
    _PRESENTED[table] = presentation or Presentation()
    if not classes:
        _CLASSLESS.add(table)
    return schema


def sample_fields(table: str) -> tuple[pa.Field, ...]:
    """The sample ID columns `table` is written with: all of SAMPLE_FIELDS, or without CLASS_FIELDS for a table
    declared with `classes=False`."""
    if table in _CLASSLESS:
        return tuple(f for f in SAMPLE_FIELDS if f.name not in CLASS_FIELDS)
    return SAMPLE_FIELDS


def presentation(table: str) -> Presentation:
    """How a declared table is summarised and drawn (the plain default for one declared without)."""
    return _PRESENTED.get(table, Presentation())


def declared() -> dict[str, pa.Schema]:
    """Every declared table's own columns (the modules that declare them must have been imported)."""
    return {name: schema for name, (schema, _) in _DECLARED.items()}


def own_columns(table: str) -> pa.Schema:
    """`table`'s own declared columns, or SchemaError when no schema is declared for it."""
    if table not in _DECLARED:
        raise SchemaError(
            f"table '{table}' has no declared schema: declare its columns with runner.tables.declare('{table}', ...)"
            f" beside the code that builds its rows (declared: {', '.join(sorted(_DECLARED)) or 'none'})"
        )
    return _DECLARED[table][0]


def full_schema(table: str, sweep: Sequence[pa.Field] = ()) -> pa.Schema:
    """The whole table as written: ID columns, the given swept columns, its own columns (optional ones too)."""
    return pa.schema([*RUN_FIELDS, *sweep, *sample_fields(table), *own_columns(table)])


def conform(table: str, columns: Mapping[str, Any]) -> pa.Table:
    """One batch's host columns (numpy, lists, Arrow arrays) as an Arrow table of `table`'s declared schema.

    Raises SchemaError naming the table and column for a missing, undeclared or mistyped column.
    """
    own = own_columns(table)
    where = _DECLARED[table][1]
    samples = sample_fields(table)
    expected = {f.name: f for f in (*RUN_FIELDS, *samples, *own)}
    if len(samples) < len(SAMPLE_FIELDS):  # runner/ids.py adds the class columns to every batch; this table has none
        columns = {n: v for n, v in columns.items() if n not in CLASS_FIELDS}
    extra = [n for n in columns if n not in expected and not n.startswith(SWEEP_PREFIX)]
    if extra:
        raise SchemaError(
            f"table '{table}': column(s) {', '.join(map(repr, extra))} are not declared; add them to the table's"
            f" schema in {where} (and to README.md's Outputs section), or stop writing them"
        )
    missing = [n for n, f in expected.items() if n not in columns and not is_optional(f)]
    if missing:
        raise SchemaError(f"table '{table}': declared column(s) {', '.join(map(repr, missing))} are missing ({where})")
    arrays = {n: _array(table, n, v, None, where) for n, v in columns.items() if n.startswith(SWEEP_PREFIX)}
    for field in (*RUN_FIELDS, *samples, *own):
        if field.name in columns:
            arrays[field.name] = _array(table, field.name, columns[field.name], field, where)
    order = [*(f.name for f in RUN_FIELDS), *(n for n in columns if n.startswith(SWEEP_PREFIX))]
    order += [f.name for f in (*samples, *own) if f.name in arrays]
    # Plain fields in the file: the `when` notes belong to the declaration, not to the data.
    return pa.Table.from_arrays([arrays[n] for n in order], schema=pa.schema([(n, arrays[n].type) for n in order]))


def _array(table: str, name: str, value: Any, field: pa.Field | None, where: str) -> pa.Array:
    """`value` as an Arrow array of the field's type (None: a swept column, one of SWEEP_TYPES)."""
    array = value if isinstance(value, (pa.Array, pa.ChunkedArray)) else pa.array(value)
    if field is None:
        if array.type not in SWEEP_TYPES:
            raise SchemaError(
                f"table '{table}': swept column '{name}' is {array.type}; swept columns are"
                f" {', '.join(map(str, SWEEP_TYPES))} (runner/store/provenance.py swept_columns)"
            )
        return array
    if array.type == field.type:
        return array
    lossless = pa.types.is_null(array.type) or (pa.types.is_integer(array.type) and pa.types.is_integer(field.type))
    if lossless:
        try:
            return array.cast(field.type, safe=True)  # safe: an integer that does not fit raises
        except pa.ArrowInvalid as e:
            raise SchemaError(f"table '{table}': column '{name}' does not fit its declared {field.type}: {e}") from None
    raise SchemaError(
        f"table '{table}': column '{name}' is {array.type}, declared {field.type} ({where}); convert it where the rows"
        " are built, or change the declaration (and README.md's Outputs section) if the new type is intended"
    )


def pandas_metadata(schema: pa.Schema) -> dict[bytes, bytes]:
    """The schema metadata that makes pandas read each integer column as its nullable `Int64`, whether or not the
    file holds a null there, so that a column's pandas type is the same in every run (the other columns as pandas
    reads them by default)."""
    columns = [
        {"name": f.name, "field_name": f.name, "pandas_type": str(f.type), "numpy_type": pandas_integer(f.type),
         "metadata": None}
        for f in schema
        if pandas_integer(f.type)
    ]  # fmt: skip
    return {PANDAS_KEY: json.dumps({"index_columns": [], "column_indexes": [], "columns": columns}).encode()}


def pandas_integer(type_: pa.DataType) -> str | None:
    """The name of pandas' nullable integer type for an Arrow integer type (`Int64` for int64), else None."""
    if not pa.types.is_integer(type_):
        return None
    return f"{'UInt' if pa.types.is_unsigned_integer(type_) else 'Int'}{type_.bit_width}"
