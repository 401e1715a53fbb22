"""The config reference's tables, made from the schema: each key's default, allowed values and help text.

    python -m hookrun.config.table                             # print every table
    python -m hookrun.config.table docs/reference/config.md    # rewrite the tables there, between their markers

In a markdown file a table stands between `<!-- config table: NAME -->` and `<!-- end of config table -->`;
tests/test_config_table.py fails when one in docs/reference/config.md differs from what this module makes.
"""
from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path
from typing import List

from omegaconf import MISSING

from hookrun.config.schema import HookConfig, TextConfig, run_schema, schema_field

TABLES = {"config": (run_schema(), ""), "hooks": (HookConfig, "hooks.NAME."), "data.text": (TextConfig, "data.text.")}
MARKED = re.compile(r"(<!-- config table: (\S+) -->\n)(.*?)(<!-- end of config table -->)", re.S)


def table(name: str) -> str:
    """The markdown table of TABLES[name]: a row per key, a typed block's keys in rows of their own."""
    schema, prefix = TABLES[name]
    return "\n".join(["| key | default | meaning |", "|---|---|---|", *_rows(schema, prefix)]) + "\n"


def _rows(schema: type, prefix: str) -> List[str]:
    rows = []
    for f in dataclasses.fields(schema):
        typed, meta = schema_field(schema, f.name), f.metadata
        if typed and not meta["own_table"]:
            rows += _rows(typed, f"{prefix}{f.name}.")
            continue
        help_text = meta["help"].replace("|", "\\|")
        choices = f"one of {', '.join(f'`{c}`' for c in meta['choices'])}: " if meta["choices"] else ""
        rows.append(f"| `{prefix}{f.name}` | {_default(f)} | {choices}{help_text} |")
    return rows


def _default(f: dataclasses.Field) -> str:
    """A field's default as YAML writes it: `null`, `true`, `[]`; required for none, the table's name for a block."""
    if f.metadata["own_table"]:
        return "its own table"
    value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    if value is MISSING:
        return "required"
    if value is None or isinstance(value, (bool, list, dict)):
        return f"`{json.dumps(value)}`"  # null, true, false, [], {}
    return f"`{value}`"


def update(text: str) -> str:
    """`text` (a markdown page) with every marked table made anew."""
    return MARKED.sub(lambda m: m.group(1) + table(m.group(2)) + m.group(4), text)


def main(argv: List[str]) -> None:
    if argv:
        path = Path(argv[0])
        path.write_text(update(path.read_text()))
    else:
        print("\n".join(f"{name}:\n{table(name)}" for name in TABLES))


if __name__ == "__main__":
    main(sys.argv[1:])
