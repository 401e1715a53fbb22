"""The module tables of docs/reference/layout.md, made from the modules' docstrings (tests/test_layout_page.py checks
that the page holds what this makes).

    python docs/layout.py          # rewrite the tables between the page's markers

Each row is a file with the first sentence of its docstring (a YAML file: of its leading comment). A module without
a docstring is an error naming it: give it one, then run this again.
"""
import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "reference" / "layout.md"
START = "<!-- module tables: made by docs/layout.py from the docstrings; edit those, then run python docs/layout.py -->"
END = "<!-- end of the module tables -->"
FOLDERS = {  # top-level folder -> what its heading says
    "hookrun": "the package",
    "conf": "the Hydra configs (the package hookrun.conf in the wheel)",
    "experiments": "the bundled experiments' models and analysis scripts (hookrun.experiments in the wheel)",
    "benchmarks": "the benchmarks (docs/benchmarks.md)",
}
SENTENCE_END = re.compile(r"(?<=\S[.?!])\s+")  # not " . " (a quoted token)


def first_sentence(text: str) -> str:
    """The first sentence of a docstring's (or comment's) first paragraph, its lines joined."""
    paragraph = " ".join(line.strip() for line in text.strip().split("\n\n")[0].splitlines())
    return SENTENCE_END.split(paragraph, 1)[0]


def summary(path: Path) -> str:
    """What `path` is for: the first sentence of its module docstring, or of a YAML file's leading comment."""
    if path.suffix == ".py":
        text = ast.get_docstring(ast.parse(path.read_text(), str(path)))
    else:
        comments = []
        for line in path.read_text().splitlines():
            if not line.startswith("#"):
                break
            if line.startswith("#   "):  # an example command: the paragraph above it is the summary
                break
            if not line.startswith("# @package"):
                comments.append(line.lstrip("#").strip())
        text = "\n".join(comments)
    if not text:
        what = "module docstring" if path.suffix == ".py" else "leading comment"
        shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        raise ValueError(f"{shown} has no {what}: give it one saying what it is for, then run "
                         f"python docs/layout.py")
    return first_sentence(text)


def _files(folder: Path) -> list:
    """The .py files of `folder` and its packages (a package's __init__.py first, then its modules, then its
    subpackages), and conf/'s YAML; no caches."""
    own = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in (".py", ".yaml"))
    own.sort(key=lambda p: p.name != "__init__.py")
    subs = sorted(p for p in folder.iterdir() if p.is_dir() and p.name != "__pycache__"
                  and any(q.suffix in (".py", ".yaml") for q in p.rglob("*")))
    return own + [f for sub in subs for f in _files(sub)]


def _cell(text: str) -> str:
    """`text` in a table cell: a | outside code spans escaped (inside one, the table ignores it and shows a \\)."""
    parts = text.split("`")
    return "`".join(p if i % 2 else p.replace("|", "\\|") for i, p in enumerate(parts))


def rows(root: Path = ROOT) -> list:
    """(path, what it is for) for every module of the top-level folders, and the data files the scripts ship with."""
    found = []
    for name in FOLDERS:
        for path in _files(root / name):
            rel = path.relative_to(root).as_posix()
            found.append((rel[: -len("__init__.py")] if path.name == "__init__.py" else rel, summary(path)))
        if name == "experiments":
            files = ", ".join(p.name for p in sorted((root / name / "data").iterdir()) if p.is_file())
            found.append((f"{name}/data/", f"the data files the experiments read (pkg://hookrun.experiments/data/"
                                           f"NAME): {files}"))
    return found


def tables(root: Path = ROOT) -> str:
    """The generated part of the page: a table per top-level folder."""
    out, found = [], rows(root)
    for name, what in FOLDERS.items():
        out += [f"### `{name}/`: {what}", "", "| path | what it is for |", "|---|---|"]
        out += [f"| `{path}` | {_cell(text)} |" for path, text in found if path.split("/")[0] == name]
        out.append("")
    return "\n".join(out)


def update(text: str, root: Path = ROOT) -> str:
    """`text` (the page) with the part between START and END made anew."""
    if text.count(START) != 1 or text.count(END) != 1:
        raise ValueError(f"the page needs the markers {START!r} and {END!r} once each")
    head, rest = text.split(START)
    _, tail = rest.split(END)
    return f"{head}{START}\n\n{tables(root)}\n{END}{tail}"


if __name__ == "__main__":
    page = Path(sys.argv[1]) if len(sys.argv) > 1 else PAGE
    page.write_text(update(page.read_text()))
    print(f"wrote the module tables of {page}")
