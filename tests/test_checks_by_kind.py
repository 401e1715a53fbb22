"""The checks by kind (hookrun.config.checks): numbers, names and roles, each written once for every block."""
import math

import pytest

from hookrun.config.checks import HUGE, check_differ, check_names, check_number, check_unique


@pytest.mark.parametrize("value, said", [(math.nan, "not a finite number"), (math.inf, "not a finite number"),
                                         (-math.inf, "not a finite number"),
                                         (0, "too small"), (-3, "too small"), (10 ** 12, "too large"),
                                         (2.5, "not an integer"), (True, "not a number"), ("16", "not a number"),
                                         (None, "null")])
def test_a_count_refuses_every_kind_of_bad_number(value, said):
    (line,) = check_number("circuit.steps", value, whole=True, low=1, high=HUGE, fix="e.g. 16")
    assert line.startswith(f"circuit.steps: {value!r} " if value is not None else "circuit.steps: null")
    assert said in line and "give an integer in [1, 1_000_000_000] (e.g. 16)" in line


def test_a_count_in_range_passes():
    assert check_number("circuit.steps", 16, whole=True, low=1, high=HUGE) == []
    assert check_number("circuit.steps", HUGE, whole=True, low=1, high=HUGE) == []


def test_open_and_closed_ends():
    assert check_number("b", 0.0, low=0, high=1, open_low=True, open_high=True)[0].startswith("b: 0.0 is too small")
    assert check_number("b", 1.0, low=0, high=1, open_low=True, open_high=True)[0].endswith("give a number in (0, 1)")
    assert check_number("b", 0.0, low=0, high=1) == [] and check_number("b", 1, low=0, high=1) == []
    assert check_number("b", 0.5, low=0, high=1, open_low=True, open_high=True) == []
    assert check_number("t", 0, low=0, open_low=True) == ["t: 0 is too small; give a number > 0"]


def test_null_means_off_only_where_said():
    assert check_number("clip", None, low=0, null="off") == []
    assert check_number("clip", math.nan, low=0, null="off") == [
        "clip: nan is not a finite number (NaN passes every comparison, inf every bound); give a number >= 0 or null "
        "(off)"]


def test_names_hookrun_makes_are_refused_and_each_name_once():
    problems = check_names("circuit.circuits", ["full", "mine", "top_3", "random_2_1", "topx", "mine"],
                           reserved=("full", "empty"), patterns=("top_N", "random_N", "random_N_N"))
    assert [p.split(":")[0] for p in problems] == ["circuit.circuits.full", "circuit.circuits.top_3",
                                                   "circuit.circuits.random_2_1", "circuit.circuits"]
    assert "rename it (e.g. my_full)" in problems[0] and "'mine' is given twice" in problems[3]


def test_a_list_with_a_value_twice():
    assert check_unique("circuit.select.top_n", [2, 2, 3], "size") == [
        "circuit.select.top_n: [2, 2, 3] lists 2 twice; give each size once"]
    assert check_unique("circuit.select.top_n", [2, 3], "size") == []


def test_roles_that_must_differ():
    assert check_differ("circuit.source", "clean", "circuit.target", "clean", "every score is 0", "set x") == [
        "circuit.target: 'clean' is also circuit.source: every score is 0; set x"]
    assert check_differ("circuit.source", "clean", "circuit.target", "corrupt", "", "") == []
    assert check_differ("circuit.source", None, "circuit.target", None, "", "") == []
