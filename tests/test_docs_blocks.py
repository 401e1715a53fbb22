"""Every code block of README.md and docs/**/*.md parsed or run, so the docs cannot rot (the rules: docs/contributing.md):
YAML and JSON parsed; Python run page by page in a directory that holds the runs the docs open (a fragment is
compiled); `python -m hookrun` lines parsed by Hydra's override parser, composed and checked without a model (a
fragment: parsed only); and a YAML syntax error in a config file one message with its file, line and column."""
import importlib.util
import json
import os
import re
import shlex
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.helpers import REPO, make_cfg, run_cli, run_here

PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>```+|~~~+)\s*(?P<lang>[\w+-]*)")
FRAGMENT = re.compile(r"^\s*<!--\s*fragment\b.*-->\s*$")  # on the last non-blank line before the opening fence
RUN_DIR = "outputs/2026-11-22/10-00-00"  # the run and the sweep the docs' examples open
SWEEP_DIR = "multirun/2026-11-22/10-05-00"


@dataclass
class Block:
    """One fenced code block: its page, the line of its opening fence, language, text and fragment marker."""

    page: Path
    line: int
    lang: str
    text: str
    fragment: bool

    @property
    def id(self):
        return f"{self.page.relative_to(REPO)}:{self.line}"


def blocks(page: Path):
    """The fenced blocks of a markdown page, dedented (a block inside a list or an admonition too)."""
    lines = page.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(m["fence"]):
            j += 1
        before = next((x for x in reversed(lines[:i]) if x.strip()), "")
        found.append(Block(page, i + 1, m["lang"].lower(), textwrap.dedent("\n".join(lines[i + 1:j])),
                           bool(FRAGMENT.match(before))))
        i = j + 1
    return found


ALL = [b for page in PAGES for b in blocks(page)]
SHELL = ("bash", "sh", "shell", "console")


def of(*langs):
    return [pytest.param(b, id=b.id) for b in ALL if b.lang in langs]


def commands(text: str):
    """Each command of a shell block as its words: `\\` continuations joined, comments dropped."""
    joined = re.sub(r"\\\n", " ", text)
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        while words:  # `a && b`: both
            cut = words.index("&&") if "&&" in words else len(words)
            yield words[:cut]
            words = words[cut + 1:]


def hookrun_args(words):
    """(module, overrides, config dir) of `python -m hookrun[.x] ...`, or None for another command."""
    if words[:2] != ["python", "-m"] or len(words) < 3 or not words[2].startswith("hookrun"):
        return None
    module, rest, overrides, config_dir = words[2], words[3:], [], None
    while rest:
        word = rest.pop(0)
        if word in ("--config-dir", "-cd"):
            config_dir = rest.pop(0)
        elif word.startswith("-"):
            continue
        else:
            overrides.append(word)
    return module, overrides, config_dir


def test_the_blocks_are_found():
    """The scan sees the docs' blocks, fragments and all (a broken fence regex would pass every test below)."""
    langs = [b.lang for b in ALL]
    assert langs.count("yaml") >= 15 and langs.count("python") >= 20 and langs.count("bash") >= 30
    assert any(b.fragment for b in ALL) and not all(b.fragment for b in ALL if b.lang == "python")


@pytest.mark.parametrize("block", of("yaml", "yml"))
def test_yaml_blocks_parse(block):
    """Every YAML block is YAML (a fragment too: it is pasted into an experiment)."""
    yaml.safe_load(re.sub(r"^# @package .*$", "", block.text, flags=re.M))


@pytest.mark.parametrize("block", of("json"))
def test_json_blocks_parse(block):
    if not block.fragment:
        json.loads(block.text)


@pytest.fixture(scope="module")
def docs_world(tmp_path_factory):
    """A directory holding the run and the sweep the docs open: conv_fmaps at RUN_DIR, its sweep over
    layers=conv1,pool1 at SWEEP_DIR."""
    root = tmp_path_factory.mktemp("docs_world")
    run_here(root / RUN_DIR, "+experiment=conv_fmaps")
    run_cli("-m", "+experiment=conv_fmaps", "layers=conv1,pool1", f"hydra.sweep.dir={root / SWEEP_DIR}")
    return root


def notebook(page) -> bool:
    """A page that is a jupytext notebook (its front matter says so): tests/test_api.py executes it on a kernel."""
    return page.read_text().startswith("---\n") and "jupytext:" in page.read_text().split("\n---", 1)[0]


@pytest.mark.parametrize("page", [pytest.param(p, id=str(p.relative_to(REPO)))
                                  for p in PAGES if any(b.lang == "python" for b in blocks(p)) and not notebook(p)])
@pytest.mark.slow
def test_python_blocks_run(page, docs_world, monkeypatch):
    """A page's Python blocks run in order in one namespace (a block may use an earlier block's names), in the
    directory holding the docs' run and sweep; a fragment is compiled only."""
    monkeypatch.chdir(docs_world)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    namespace = {"__name__": "__docs__"}
    for block in (b for b in blocks(page) if b.lang == "python"):
        code = compile(block.text, block.id, "exec")  # a SyntaxError names the page and line
        if not block.fragment:
            try:
                exec(code, namespace)
            except Exception as err:  # noqa: BLE001 - say which block
                raise AssertionError(f"{block.id}: {type(err).__name__}: {err} (mark it <!-- fragment --> if it "
                                     "shows calls on a run the test does not have)") from err
    import matplotlib.pyplot as plt

    plt.close("all")


@pytest.mark.parametrize("block", of(*SHELL))
def test_shell_blocks_parse_and_check(block, tmp_path, monkeypatch):
    """`python -m hookrun ...` lines: overrides parsed by Hydra; unless a fragment, each composes (a sweep's first
    job) and passes the checks that need no model; `python -m hookrun.x` names a module; `python FILE` a file."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from hookrun.__main__ import open_block
    from hookrun.engine.checks import check

    monkeypatch.chdir(tmp_path)
    for words in commands(block.text):
        if words[:1] == ["python"] and len(words) > 1 and words[1].endswith(".py"):
            assert (REPO / words[1]).is_file(), f"{block.id}: no file {words[1]}"
        args = hookrun_args(words)
        if args is None:
            continue
        module, overrides, config_dir = args
        assert importlib.util.find_spec(module) is not None, f"{block.id}: no module {module}"
        if module != "hookrun":
            continue
        overrides = [open_block(o) for o in overrides]  # as the CLI reads a block given whole (KEY={...})
        parsed = OverridesParser.create().parse_overrides(overrides)  # raises on a malformed override
        if block.fragment or config_dir or any("hydra.searchpath" in o for o in overrides):
            continue
        first = [f"{o.get_key_element()}={next(iter(o.sweep_string_iterator()))}" if o.is_sweep_override()
                 else o.input_line for o in parsed if not o.key_or_group.startswith("hydra")]
        problems = check(make_cfg(first)).problems
        assert not problems, f"{block.id}: {' '.join(words)}:\n" + "\n".join(problems)


def test_config_yaml_commented_example_parses():
    """The packaged config.yaml's commented metrics/patching example parses once uncommented."""
    lines = (REPO / "conf" / "config.yaml").read_text().splitlines()
    start = next(i for i, x in enumerate(lines) if x.startswith("# metrics:"))
    stop = next((i for i in range(start, len(lines)) if not lines[i].startswith("#")), len(lines))
    example = yaml.safe_load("\n".join(x[2:] for x in lines[start:stop]))
    assert example["patching"]["sites"] == {"layers": "${layers}", "positions": "all"}


BROKEN = """# @package _global_
defaults:
  - conv_fmaps
patching:
  sites: {layers: ${layers}, positions: all}
"""


@pytest.mark.slow
def test_yaml_syntax_error_is_one_message(tmp_path):
    """An experiment with `${...}` unquoted in a flow mapping: exit 2, one line naming file:line:column and the
    quoting, no traceback."""
    (tmp_path / "my_conf" / "experiment").mkdir(parents=True)
    (tmp_path / "my_conf" / "experiment" / "bad.yaml").write_text(BROKEN)
    proc = run_cli("--config-dir", "my_conf", "+experiment=bad", cwd=tmp_path, check=False)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 2, proc.stderr
    assert "my_conf/experiment/bad.yaml:5:20: YAML syntax error: expected ',' or '}', but got '{'" in proc.stderr
    assert "'${layers}'" in proc.stderr


def test_yaml_syntax_error_found_through_defaults(tmp_path):
    """A broken file an experiment inherits (its defaults list) is found too, and the hint is left out where the
    line holds no interpolation."""
    from hookrun.config.schema import conf_dir
    from hookrun.config.yamlcheck import yaml_problems

    exp = tmp_path / "experiment"
    exp.mkdir()
    (exp / "mine.yaml").write_text("# @package _global_\ndefaults:\n  - base\n  - /model: tiny\nseed: 1\n")
    (exp / "base.yaml").write_text("seed: 1\nhooks: [a, b\n")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "tiny.yaml").write_text("_target_: x\n  width: 3\n")
    problems = sorted(yaml_problems(["+experiment=mine"], [str(tmp_path)], "config", [conf_dir()]))
    assert len(problems) == 2
    assert problems[0].startswith(f"{exp / 'base.yaml'}:3:1: YAML syntax error: expected ',' or ']'")
    assert problems[1].startswith(f"{tmp_path / 'model' / 'tiny.yaml'}:2:8: YAML syntax error: mapping values "
                                  "are not allowed here")
    assert all("quoted" not in p for p in problems)
    assert yaml_problems(["+experiment=conv_fmaps", "layers=conv1,pool1"], [], "config", [conf_dir()]) == []


COUNT_PLUGIN = '''
def pytest_collection_finish(session):
    cuda = sum(any("CUDA" in str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif"))
               for item in session.items)
    print(f"HOOKRUN_COUNT {len(session.items)} {cuda}")
'''


@pytest.mark.slow
def test_readme_and_install_figures(tmp_path):
    """The README's test count is within 10% of what `pytest --collect-only` counts, and install.md's number of
    tests that need CUDA is the number of collected tests with a `needs CUDA` skipif mark."""
    import subprocess
    import sys

    (tmp_path / "hookrun_count_plugin.py").write_text(COUNT_PLUGIN)
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", "-m", "slow or not slow",
                           "-p", "hookrun_count_plugin"], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    total, cuda = map(int, re.search(r"HOOKRUN_COUNT (\d+) (\d+)", proc.stdout).groups())
    readme = int(re.search(r"The suite \(about (\d+) tests", (REPO / "README.md").read_text())[1])
    assert abs(readme - total) <= 0.1 * total, f"README.md says about {readme} tests; pytest collects {total}"
    install = int(re.search(r"(\d+) of its tests need CUDA", (REPO / "docs" / "install.md").read_text())[1])
    assert install == cuda and cuda >= 3, f"docs/install.md says {install} tests need CUDA; {cuda} are marked"
