"""Gathers what scripts/gpu_check.sh left in its work directory into one JSON file.

    python scripts/gpu_check_summary.py WORK_DIR OUT_JSON

WORK_DIR holds steps.tsv (name, exit status or skipped / no_time, seconds, log, one step a line),
versions.json, junit_<step>.xml for each pytest step, bench.json, and run_<label>/metrics.jsonl
for each trainer step. Standard library only: it must run where the step that failed was the
install of a package.
"""

from __future__ import annotations

import json
import statistics
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def junit(path: Path) -> dict | None:
    """Counts and the failing tests' names (with the first line of each failure)."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failing, skip_reasons = [], {}
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed" if child.tag == "failure" else "errors"
                message = (child.get("message") or child.text or "").strip().splitlines()
                failing.append({"test": name, "kind": child.tag, "message": message[0][:300] if message else ""})
            elif child.tag == "skipped" and outcome == "passed":
                outcome = "skipped"
                reason = (child.get("message") or "").strip()[:200]
                skip_reasons[reason] = skip_reasons.get(reason, 0) + 1
        counts[outcome] += 1
    return {**counts, "failing": failing, "skip_reasons": skip_reasons}


def training(run_dir: Path) -> dict | None:
    """The loss at the first and last window, and the tokens/s after the first window."""
    path = run_dir / "metrics.jsonl"
    try:
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return None
    steps = [r for r in records if "tokens_per_s" in r]
    if not steps:
        return {"records": len(records)}
    later = steps[1:] or steps
    return {
        "steps": steps[-1].get("step"),
        "first_loss": steps[0].get("loss"),
        "last_loss": steps[-1].get("loss"),
        "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in later),
        "step_time_s_median": statistics.median(r["step_time_s"] for r in later if "step_time_s" in r)
        if any("step_time_s" in r for r in later) else None,
        "peak_mem_bytes": max((r.get("peak_mem_bytes") or 0) for r in steps),
        "validation": [r for r in records if "tokens_per_s" not in r][-1:] or None,
    }


def main(argv: list[str]) -> int:
    work, out = Path(argv[1]), Path(argv[2])
    summary: dict = {"versions": read_json(work / "versions.json"), "steps": {}}
    try:
        lines = (work / "steps.tsv").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        name, status, seconds, log = (line.split("\t") + ["", "", "", ""])[:4]
        entry: dict = {"log": Path(log).name, "seconds": int(seconds or 0)}
        if status in ("skipped", "no_time"):
            entry["status"] = status
        else:
            rc = int(status)
            entry["exit"] = rc
            entry["status"] = "pass" if rc == 0 else "timeout" if rc in (124, 137) else "fail"
        tests = junit(work / f"junit_{name}.xml")
        if tests is not None:
            entry["tests"] = tests
            if entry.get("exit") == 5:  # pytest: nothing collected / everything deselected
                entry["status"] = "no_tests"
        if name.startswith("train_"):
            entry["training"] = training(work / f"run_{name.removeprefix('train_')}")
        summary["steps"][name] = entry
    bench = read_json(work / "bench.json")
    if bench is not None:
        summary["bench"] = bench
    statuses = [e["status"] for e in summary["steps"].values()]
    summary["ok"] = bool(statuses) and all(s in ("pass", "skipped") for s in statuses)
    out.write_text(json.dumps(summary, indent=1))
    for name, e in summary["steps"].items():
        t = e.get("tests")
        counts = f"  {t['passed']} passed, {t['failed']} failed, {t['errors']} errors, {t['skipped']} skipped" if t else ""
        print(f"{name:<20} {e['status']:<8} {e['seconds']:>4}s{counts}")
        for f in (t or {}).get("failing", [])[:20]:
            print(f"    FAILED {f['test']}: {f['message']}")
        if e.get("training"):
            print(f"    training: {e['training']}")
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
