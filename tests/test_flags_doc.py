"""docs/flags.md is generated from the config and must be current."""

from __future__ import annotations

import dataclasses
import difflib

from polyrl import flags_doc
from polyrl.cli import COMMANDS
from polyrl.config import _flag, _sections


def test_docs_flags_md_is_current():
    with open(flags_doc.DEFAULT_OUT) as fh:
        on_disk = fh.read()
    fresh = flags_doc.render()
    if on_disk != fresh:
        diff = "".join(list(difflib.unified_diff(on_disk.splitlines(True), fresh.splitlines(True), "docs/flags.md",
                                                 "generated"))[:40])
        raise AssertionError(f"docs/flags.md is not current; regenerate it with `{flags_doc.REGENERATE}`\n{diff}")


def test_every_flag_of_every_command_is_in_the_reference():
    text = flags_doc.render()
    for section, cls in _sections():
        for f in dataclasses.fields(cls):
            cmds = [c for c, (_, secs, only) in COMMANDS.items() if section in secs and (only is None or f"{section}.{f.name}" in only)]
            if cmds:
                rows = [line for line in text.splitlines() if line.startswith(f"| `{_flag(f)}")]
                assert any(f"| {', '.join(cmds)} |" in row for row in rows), (_flag(f), rows)  # --api-key: two sections
    serve_rows = [line for line in text.splitlines() if line.startswith("| `--rollout-batch-size`")]
    assert serve_rows and "serve" not in serve_rows[0]  # polyrl serve does not take it


def test_the_script_writes_the_file(tmp_path, capsys):
    out = tmp_path / "flags.md"
    assert flags_doc.main(["--out", str(out)]) == 0
    assert out.read_text() == flags_doc.render() and str(out) in capsys.readouterr().out
