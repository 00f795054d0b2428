"""The comparisons that sit near their tolerance: reads what a suite run under
``SLSAM_TEST_MARGINS=<folder>`` recorded (tests/tolerance.py) and lists, per place in the
tests, the largest share of its tolerance a comparison used.

    SLSAM_TEST_MARGINS=/tmp/m .venv/bin/python -m pytest -n 2 --dist loadfile
    .venv/bin/python tests/margins.py /tmp/m [/tmp/m2 ...]

A share under 0.1 leaves the room tests/tolerance.py asks for; one between 0.1 and 1
passed near its line; one above 1 failed the comparison (which a test may have wanted:
``assert not torch.allclose(...)``), and one between 1 and 10 is near the line from the
other side. Several folders (runs under other kernels) are read as one.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def read(folders: list[str]) -> dict[str, dict]:
    sites: dict[str, dict] = {}
    for folder in folders:
        for path in sorted(Path(folder).glob("margins-*.jsonl")):
            for line in path.read_text().splitlines():
                row = json.loads(line)
                site = sites.setdefault(row["site"], {"kind": row["kind"], "shares": [],
                                                      "tests": set()})  # fmt: skip
                site["shares"].append(row["share"])
                site["tests"].add(row["test"])
    return sites


def main(folders: list[str]) -> int:
    sites = read(folders)
    near = []
    for name, site in sites.items():
        if name.startswith("tests/test_tolerance.py"):  # the rule's own tests, at the line
            continue
        passing = [s for s in site["shares"] if s <= 1]
        failing = [s for s in site["shares"] if s > 1]
        worst_pass = max(passing, default=0.0)
        closest_fail = min(failing, default=float("inf"))
        if worst_pass > 0.1 or closest_fail < 10:
            near.append((name, site["kind"], worst_pass, closest_fail, len(site["shares"])))
    print(f"{len(sites)} places compared within a tolerance; {len(near)} near their line:")
    for name, kind, worst, closest, n in sorted(near, key=lambda r: -r[2]):
        print(f"  {name:55s} {kind:12s} used {worst:8.3g}  closest miss {closest:8.3g}  ({n})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
