"""The code layout page (docs/reference/layout.md) lists what docs/layout.py makes from the modules' docstrings, so
it cannot drift from the code (like the config tables, tests/test_config_table.py)."""
import importlib.util
import re

import pytest

from tests.helpers import REPO

PAGE = "docs/reference/layout.md"
spec = importlib.util.spec_from_file_location("docs_layout", REPO / "docs" / "layout.py")
layout = importlib.util.module_from_spec(spec)
spec.loader.exec_module(layout)


def test_the_page_holds_the_tables_the_generator_makes():
    text = (REPO / PAGE).read_text()
    assert layout.update(text) == text, f"the module tables of {PAGE} differ from the modules: run python docs/layout.py"


def test_every_module_is_listed_and_every_listed_path_exists():
    """Checked on the page itself, apart from the generator: each .py of hookrun/, conf/ and experiments/ (a
    package by its folder) has a row, and each row's path exists."""
    listed = set(re.findall(r"^\| `([^`]+)` \|", (REPO / PAGE).read_text(), re.M))
    modules = {p.relative_to(REPO).as_posix() for top in ("hookrun", "conf", "experiments")
               for p in (REPO / top).rglob("*.py") if "__pycache__" not in p.parts}
    expected = {m[: -len("__init__.py")] if m.endswith("/__init__.py") else m for m in modules}
    assert {"hookrun/engine/", "hookrun/methods/patching.py", "hookrun/config/registry.py", "conf/",
            "experiments/steer.py", "conf/experiment/conv_fmaps.yaml"} <= listed
    assert sorted(expected - listed) == [], f"modules missing from {PAGE}: run python docs/layout.py"
    assert sorted(p for p in listed if not (REPO / p).exists()) == [], f"{PAGE} lists paths that are gone"


def test_a_row_is_the_first_sentence_of_the_docstring(tmp_path):
    assert layout.summary(REPO / "hookrun" / "store" / "lock.py") == \
        "One writer per store: a lock held for a run's whole life, on a local disk or an object store."
    assert layout.summary(REPO / "hookrun" / "engine" / "preflight.py") == \
        "Does the data fit the model, and the config what the model produces?"  # lines joined, cut at the sentence
    assert layout.first_sentence('Words "a . b ." here: x.y and e. More.\n\nNext paragraph.') == \
        'Words "a . b ." here: x.y and e.'
    yaml = tmp_path / "x.yaml"
    yaml.write_text("# @package _global_\n# A config: what it\n# does. More.\n#   python -m hookrun\nkey: 1\n")
    assert layout.summary(yaml) == "A config: what it does."


def test_a_module_without_a_docstring_is_named(tmp_path):
    (tmp_path / "bare.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match=r"bare.py has no module docstring: give it one saying what it is for"):
        layout.summary(tmp_path / "bare.py")
