"""The GPU check's command, dry-run on the CPU (tiny shapes, float32): it must keep working
between the runs on a GPU. No figure here means anything; the rows' shape does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from specserve.bench import report
from specserve.bench.gpu import FIELDS

REPO = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run(tmp_path):
    # python3 on PATH is this interpreter (the script calls python3)
    env = {"SPECSERVE_GPU_MODELS": str(tmp_path / "models"),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    done = subprocess.run([str(REPO / "benchmarks" / "gpu_check.sh"), "--dry-run",
                           str(tmp_path / "out")], env=os.environ | env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads((tmp_path / "out" / "gpu.json").read_text())
    assert {"device", "date", "commit", "command", "rows"} <= set(data) and data["dry_run"]
    got = {(r["engine"], r["method"], r["batch"]) for r in data["rows"]}
    assert got == {("specserve", m, b) for m in ("none", "eagle3", "draft_model")
                   for b in (1, 4)} | {("transformers", "none", 1), ("transformers", "none", 4),
                                       ("transformers", "draft_model", 1)}
    for r in data["rows"]:
        assert set(FIELDS) <= set(r) and r["tokens_per_s"] > 0 and r["floor_ms_per_token"] > 0
        assert (r["tau"] is not None) == (r["engine"] == "specserve" and r["method"] != "none")
        assert 1 <= (r["tau"] or 1) <= 5
    table = (tmp_path / "out" / "gpu.md").read_text()
    assert "| specserve | eagle3 | 4 | 1 |" in table and table == report.markdown(data)
    assert "best: " in report.history_line(data)       # what --publish adds to HISTORY.md
