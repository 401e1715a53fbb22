"""The docs' config reference tables are the ones hookrun.config.table makes from the schema (CI runs this)."""
import dataclasses

from hookrun.config import table
from hookrun.config.schema import schema_field
from tests.helpers import REPO


REFERENCE = "docs/reference/config.md"


def test_reference_tables_are_made_from_the_schema():
    text = (REPO / REFERENCE).read_text()
    assert text.count("<!-- config table: ") == len(table.TABLES)
    assert table.update(text) == text, f"the config tables of {REFERENCE} differ from the schema's: run " \
                                       f"python -m hookrun.config.table {REFERENCE}"


def test_every_key_in_a_table_has_help_text():
    for schema, _ in table.TABLES.values():
        for f in dataclasses.fields(schema):
            expanded = schema_field(schema, f.name) and not f.metadata["own_table"]
            assert expanded or f.metadata["help"], f"{schema.__name__}.{f.name} has no help text"


def test_a_table_row_shows_default_choices_and_escaped_help():
    rows = table.table("config").splitlines()
    assert rows[:2] == ["| key | default | meaning |", "|---|---|---|"]
    assert "| `store.codec` | `lz4` | one of `none`, `lz4`, `zstd`, `blosclz`, `lz4hc`, `zlib`: compression, all " \
           "through blosc |" in rows
    assert "| `model` | required | `{_target_: any.importable.Class_or_factory, **kwargs}` |" in rows
    assert "| `data.targets` | `[]` | fields that go to the loss, not the model |" in rows
    assert any(r.startswith("| `data.inputs` | `{}` |") and "normal\\|uniform\\|randint" in r for r in rows)
    assert any(r.startswith("| `data.text` | its own table |") for r in rows)
