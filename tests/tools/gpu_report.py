"""Summarise a report written by tests/conftest.py (POLYRL_TEST_REPORT): the failures with their reasons, the tests
that started but never finished (a run cut by its time limit), the slowest, and the counts.

    python3 tests/tools/gpu_report.py REPORT
"""

from __future__ import annotations

import sys
from collections import Counter


def summarise(lines: list[str]) -> str:
    started, finished, failed, times, counts, ended = [], set(), [], [], Counter(), None
    for i, ln in enumerate(lines):
        if ln.startswith("START "):
            started.append(ln[6:].strip())
        elif ln.startswith("END "):
            ended = ln
        elif ln and not ln.startswith(" "):
            outcome, rest = ln.split(" ", 1)
            nodeid, secs = rest.split(" ")[0], rest.rsplit(" ", 1)[-1]
            finished.add(nodeid)
            counts[outcome.lower()] += 1
            times.append((float(secs.rstrip("s")), nodeid))
            if outcome == "FAILED":
                why = [x.strip() for x in lines[i + 1:i + 7] if x.startswith("    ")]
                failed.append(f"FAILED {rest}\n" + "\n".join("    " + w for w in why))
    unfinished = [n for n in dict.fromkeys(started) if n not in finished]
    out = [", ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "no test finished"]
    out += failed
    out += [f"UNFINISHED {n}" for n in unfinished]
    out.append(ended or "the run did not reach its end (cut short?)")
    out.append("slowest: " + ", ".join(f"{n} {t:.0f}s" for t, n in sorted(times, reverse=True)[:8]))
    return "\n".join(out)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(summarise(f.read().splitlines()))
