"""The summary of a run's report names the failures with their reasons and the tests a cut run left unfinished."""

from gpu_report import summarise


def test_a_cut_run_names_its_failures_and_what_was_running():
    lines = ["START t.py::a", "START t.py::b", "PASSED t.py::a 3.0s", "START t.py::c",
             "FAILED t.py::c 12.5s", "    E   assert 1 == 2", "    t.py:9: AssertionError", "START t.py::d"]
    out = summarise(lines)
    assert out.splitlines()[0] == "1 failed, 1 passed"
    assert "FAILED t.py::c 12.5s\n    E   assert 1 == 2" in out
    assert "UNFINISHED t.py::b" in out and "UNFINISHED t.py::d" in out and "UNFINISHED t.py::a" not in out
    assert "did not reach its end" in out and out.splitlines()[-1].startswith("slowest: t.py::c 12s")


def test_a_finished_run_gives_its_end_line():
    out = summarise(["START t.py::a", "SKIPPED t.py::a (setup) 0.0s", "    needs 2 GPUs", "END exit status 0"])
    assert out.splitlines()[0] == "1 skipped" and "END exit status 0" in out and "UNFINISHED" not in out
