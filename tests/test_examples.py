"""The examples run as a user runs them (from the repository root, on the bundled zoo)."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_offline_example_runs_and_reports_acceptance(method):
    out = subprocess.run([sys.executable, "examples/offline_spec_decode.py", "--method", method,
                          "--max-tokens", "8"], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "def fibonacci(n):" in out.stdout and "mean acceptance length" in out.stdout


def test_vllms_examples_run_with_the_bundled_zoo():
    out = subprocess.run([sys.executable, "examples/vllm_examples.py"], cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    for line in ("offline eagle:", "ngram from yaml:", "serve draft_model:", "serve suffix:",
                 "serve mtp:", "serve medusa:", "all examples ran"):
        assert line in out.stdout
