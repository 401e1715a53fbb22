"""Every docs page's "Try it" section run as written: each command of its shell blocks, `python` being this
interpreter, in a fresh directory (the slow tier); a failure shows the command's stdout and stderr. Then each number
the page prints for its bundled experiment is checked against that fresh run, within the tolerance the page states
(the models' weights ship with hookrun, so a fresh run on any CPU differs from the page only by float32 rounding)."""
import os
import re
import shlex
import subprocess
import sys

import numpy as np
import pytest

import hookrun
from tests.helpers import REPO
from tests.test_docs_blocks import SHELL, blocks, commands

TRY_IT = re.compile(r"^## Try it\s*$")


def try_it(page):
    """The shell blocks of a page's "## Try it" section (to the next level-2 heading)."""
    lines = page.read_text().splitlines()
    start = next((i for i, line in enumerate(lines) if TRY_IT.match(line)), None)
    if start is None:
        return []
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return [b for b in blocks(page) if start < b.line <= end and b.lang in SHELL]


PAGES = [p for p in sorted((REPO / "docs").rglob("*.md")) if try_it(p)]


def run_as_written(words, cwd):
    """One command of a block, `python` this interpreter, in cwd; its stdout (a failure shows stdout and stderr)."""
    assert words[0] == "python", f"a Try it command that is not python: {shlex.join(words)}"
    done = subprocess.run([sys.executable, *words[1:]], cwd=cwd, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, (f"{shlex.join(words)} failed (exit {done.returncode}):\n--- stdout:\n"
                                  f"{done.stdout}\n--- stderr:\n{done.stderr}")
    return done.stdout


def rounding(printed: str) -> float:
    """Half a unit of a printed number's last digit: what printing it to that many places may move it."""
    return 0.5 * 10 ** -(len(printed.split(".")[1]) if "." in printed else 0)


def tolerance(text: str) -> float:
    """The tolerance a page states for its numbers: "within ±X" (one statement a page)."""
    found = re.findall(r"within ±([0-9.]+)", text)
    assert len(found) == 1, "the page states its numbers' tolerance once, as 'within ±X'"
    return float(found[0])


def grid_numbers(work):
    """patching.md's numbers: the unablated logit difference and the lowest mean change with one head zeroed."""
    heads = hookrun.open(work / "runs" / "heads").grid()
    change = np.nanmean(heads.scores - heads.source[:, None, None], axis=0)
    return {"unablated": heads.source.mean(), "lowest": -change.min()}


def attribution_numbers(work):
    """attribution.md's numbers: Pearson per cell and over means, the verified estimates' range at the last
    position and the exact change there."""
    cap = hookrun.open(work / "runs" / "atp")
    estimate, exact = cap.read("attribution"), cap.grid()
    verified = estimate.verified()
    last = verified[verified["position"] == verified["position"].max()]
    return {"cell": estimate.corr(exact), "means": estimate.corr(exact, mean=True), "low": last["estimate"].min(),
            "high": last["estimate"].max(), "exact": last["exact"].max()}


def lens_numbers(work):
    """lens.md's numbers: block 0's MLP and attention parts of the DLA and the logit difference, means over the
    prompts."""
    dla = hookrun.open(work / "runs" / "lens").read("lens").dla
    blocks = dla.blocks()
    return {"mlp": blocks.loc[0, "mlp"], "logit": dla.logit.mean(), "attn": blocks.loc[0, "attn"]}


def dictionary_numbers(work):
    """dictionaries.md's numbers: the sae_features run's evaluations, its strongest happy-only and sad-only features
    and the fractions of happy / sad completion words unsteered and with 8 x their decoder rows added."""
    from hookrun.experiments import sae_features

    cap = hookrun.open(work / "runs" / "sae_features")
    ev = cap.read("dictionaries").iloc[0]
    picked = {name: int(row["feature"]) for name, row in sae_features.strongest(sae_features.mood_table(cap)).items()}
    words = sae_features.mood_words(sae_features.steered(work / "runs" / "sae_features" / "steer", picked))
    return {**{k: ev[k] for k in ("l0", "explained_variance", "mse", "dead_features", "ce_clean", "ce_spliced",
                                  "ce_zero", "ce_loss_recovered")}, **picked,
            "happy_0": words.loc[("happy", 0), "happy"], "happy_8": words.loc[("happy", 8), "happy"],
            "sad_0": words.loc[("sad", 0), "sad"], "sad_8": words.loc[("sad", 8), "sad"]}


# each page's numbers: (the text on the page, which number of the fresh run it is)
NUMBERS = {
    "patching.md": (grid_numbers, [("by up to {lowest:.2f} of {unablated:.1f}", ("lowest", "unablated"))]),
    "attribution.md": (attribution_numbers, [
        ("Pearson(AtP, exact) {cell:.2f} per cell", ("cell",)), ("{means:.2f} over the sites' means", ("means",)),
        ("estimate {low:.1f} to {high:.1f} against exact {exact:.1f}", ("low", "high", "exact"))]),
    "dictionaries.md": (dictionary_numbers, [
        ("L0 {l0:.2f}, variance explained {explained_variance:.4f}, MSE {mse:.4f}, {dead_features:.0f} dead features",
         ("l0", "explained_variance", "mse", "dead_features")),
        ("clean {ce_clean:.4f}, with the SAE spliced in {ce_spliced:.4f} and block 1 zeroed {ce_zero:.4f}: CE loss "
         "recovered {ce_loss_recovered:.4f}", ("ce_clean", "ce_spliced", "ce_zero", "ce_loss_recovered")),
        ("decoder row (feature {happy:.0f})", ("happy",)),
        ("(happy words {happy_0:.2f} unsteered, {happy_8:.2f} steered), the sad-only one (feature {sad:.0f}) sad (sad "
         "words {sad_0:.2f}, then {sad_8:.2f})", ("happy_0", "happy_8", "sad", "sad_0", "sad_8"))]),
    "lens.md": (lens_numbers, [("+{mlp:.1f} of {logit:.2f} on average), block 0's attention +{attn:.2f}",
                                ("mlp", "logit", "attn"))]),
}


NUMBER = re.compile(r"-?\d+\.\d+|-?\d+")


def check_printed_block(page, printed: str):
    """A page that shows what its script prints ("A fresh run prints" then a code block): every number of the block
    against the same place of the fresh output, within the page's tolerance."""
    text = page.read_text()
    at = text.find("A fresh run prints")
    if at < 0:
        return
    block = next(b for b in blocks(page) if b.line > text[:at].count("\n") + 1)
    fresh = [line for line in printed.splitlines() if line.strip() and not line.endswith(".png")]
    shown = [line for line in block.text.splitlines() if line.strip()]
    assert len(shown) == len(fresh), f"{block.id}: {len(shown)} lines shown, a fresh run prints {len(fresh)}:\n{printed}"
    tol = tolerance(re.sub(r"\s+", " ", text))
    for said, got in zip(shown, fresh):
        a, b = NUMBER.findall(said), NUMBER.findall(got)
        assert len(a) == len(b) and all(abs(float(x) - float(y)) <= tol + rounding(x) for x, y in zip(a, b)), \
            f"{block.id}: the page shows\n  {said}\na fresh run prints\n  {got}\n(tolerance ±{tol})"


def check_numbers(page, work, printed: str):
    """Each number the page prints for its experiment, against the fresh run in `work` (and its output, `printed`),
    within the page's tolerance."""
    check_printed_block(page, printed)
    if page.name not in NUMBERS:
        return
    measure, said = NUMBERS[page.name]
    text = re.sub(r"\s+", " ", page.read_text())
    tol, fresh = tolerance(text), measure(work)
    for template, keys in said:
        pattern = re.escape(template)
        for key in keys:
            pattern = re.sub(r"\\\{" + key + r":\\\.\d+f\\\}", rf"(?P<{key}>-?\\d+(?:\\.\\d+)?)", pattern)
        m = re.search(pattern, text)
        assert m, f"{page.name}: no {template!r} on the page (the fresh run: {template.format(**fresh)})"
        for key in keys:
            assert abs(float(m[key]) - fresh[key]) <= tol + rounding(m[key]), (
                f"{page.name}: {key} {m[key]} on the page, {fresh[key]:.4f} in a fresh run (tolerance ±{tol}); "
                f"the fresh run prints: {template.format(**fresh)}")


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_try_it_runs_as_written(page, tmp_path):
    printed = [run_as_written(words, tmp_path) for block in try_it(page) for words in commands(block.text)]
    check_numbers(page, tmp_path, printed[0] if printed else "")


@pytest.mark.slow
def test_the_attribution_script_reads_the_neurons_alternative(tmp_path, capsys):
    """docs/attribution.md's third sites alternative (layers x neurons; the heads one runs in its Try it): the
    script prints the largest sites of the wide grid, says the exact grid is over other sites, and draws both."""
    from hookrun.experiments import attribution

    run_as_written(["python", "-m", "hookrun", "+experiment=attribution", "~attribution.sites.positions",
                    "attribution.sites={layers: [transformer.h.0.mlp.act], neurons: all, positions: last}",
                    "hydra.run.dir=runs/neurons"], tmp_path)
    attribution.main([str(tmp_path / "runs" / "neurons")])
    out = capsys.readouterr().out
    estimate = hookrun.open(tmp_path / "runs" / "neurons").read("attribution")
    means = np.nanmean(estimate.change(), axis=0)[0]
    top = np.argsort(-np.abs(means))[:10]
    assert "the 10 largest of 256 sites (layers x 256 neurons)" in out
    shown = re.findall(r"^transformer\.h\.0\.mlp\.act\s+(\d+)\s+(-?[0-9.]+)$", out, re.M)
    assert [int(n) for n, _ in shown[:1]] == [int(top[0])] and abs(float(shown[0][1]) - means[top[0]]) < 1e-3
    assert "not compared: the exact grid is over 5 layers x 8 positions, the estimate over 1 layers x 256 neurons" \
        in out
    assert (tmp_path / "runs" / "neurons" / "plots" / "attribution.png").exists()
