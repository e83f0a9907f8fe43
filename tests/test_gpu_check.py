"""bench/gpu_check.sh --dry-run: the one-shot accelerator check, on CPU with tiny sizes and the
kernel interpreted, so the script that a lent GPU runs cannot rot unseen. One run (~1.5 min on
two cores, `make test-slow`) shared by the assertions; plus the prediction arithmetic against
hand-worked values (default run)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import step_costs

ROOT = Path(__file__).resolve().parents[1]
FILES = {"log.txt", "tests.txt", "kernels.md", "exactness.md", "physics.md", "predictions.md",
         "summary.json", "status.txt"}
PARTS = ("tests", "kernels", "exactness", "physics", "predict")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    return proc, out


# The dry run (~70 s on two cores) is in `make test-slow`: the default run had grown past 20
# minutes. The prediction arithmetic below stays in the default run.
@pytest.mark.slow
def test_dry_run_passes_and_writes_every_file(dry_run):
    proc, out = dry_run
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    # The device tool brings back at most 8 files, none deeper than 2 folders: exactly these.
    assert {p.name for p in out.iterdir()} == FILES
    status = dict(line.split(" ", 1) for line in (out / "status.txt").read_text().splitlines())
    assert set(status) == set(PARTS) and all(s.startswith("rc=0 ") for s in status.values())


@pytest.mark.slow
def test_parts_report_what_they_checked(dry_run):
    _, out = dry_run
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["parts"]) == set(PARTS)
    assert "passed" in summary["tests"] and "failed" not in summary["tests"]
    assert "INTERPRETED" in summary["kernels"]["meta"]["header"]
    assert {r["T"] for r in summary["kernels"]["rows"]} == {1, 8}
    assert all(r["max_err"] < 1e-4 for r in summary["kernels"]["rows"])

    ex = summary["exactness"]
    assert ex["ok"]
    for row in ex["speculation"]:
        assert row["sd_equals_ar"] and row["ssd_equals_ar"] and row["ar"] == row["ssd"]
        assert len(row["ar"]) == row["batch"] and row["tokens"] == 12 * row["batch"]
        assert 0 < row["ssd_hits"] < row["ssd_rounds"]  # SSD both hit and missed: not vacuous
    assert ex["backends"]["greedy_near_ties"] and set(ex["backends"]["cases"]) == {"decode", "tree"}
    assert "**equal**" in (out / "exactness.md").read_text()

    models = summary["physics"]["models"]
    assert [m["model"] for m in models] == list(step_costs.SHAPES)
    for m in models:
        assert not m.get("error") and m["decode_ms"] > 0
        assert set(m["score_ms"]) == {"1", "4"} and set(m["rows_ms"]) == {"1", "2"}
    table = (out / "physics.md").read_text()
    assert "DRY RUN" in table and "llama-3.1-8b" in table

    pred = {(r["mode"], r["hit_rate"]): r for r in summary["predictions"]["rows"]}
    assert set(pred) == {("AR", None), ("SD", None), ("SSD", 0.5), ("SSD", 0.8), ("SSD", 0.9)}
    assert pred["AR", None]["tok_s"] == pytest.approx(1e3 / models[0]["decode_ms"])
    # The predictions use physics' costs: verification is the target scoring K+1 = 5 tokens,
    # extrapolated from the dry run's T = 1, 4 (a line through both, T=1 no dearer than T=4).
    s1, s4 = models[0]["score_ms"]["1"], models[0]["score_ms"]["4"]
    assert pred["SD", None]["verify_ms"] == pytest.approx(s4 + (s4 - min(s1, s4)) / 3)
    assert all(r["tok_s"] > 0 for r in pred.values())
    assert "CPU-measured inputs" in (out / "predictions.md").read_text()


def test_interpolation_lowers_a_noisy_point_above_a_later_one():
    assert step_costs.interpolate({1: 2.0, 4: 5.0}, 5) == pytest.approx(6.0)
    assert step_costs.interpolate({1: 2.0, 2: 3.0, 4: 5.0}, 3) == pytest.approx(4.0)
    # CI's dry run once timed T=1 at 2.43 ms and T=4 at 0.415 ms: a line through both put
    # scoring 5 tokens at -0.26 ms. T=1 is lowered to T=4's cost: flat, never below zero.
    assert step_costs.interpolate({1: 2.43, 4: 0.415}, 5) == pytest.approx(0.415)
    assert step_costs.interpolate({1: 1.0, 2: 3.0, 4: 2.0}, 3) == pytest.approx(2.0)


def test_acceptance_from_tokens_per_round():
    # a = 0.5, K = 2: E = 1 + a + a^2 = 1.75 (geometric accept lengths 0, 1, 2).
    assert step_costs.acceptance_from_tokens(1.75, 2) == pytest.approx(0.5)
    assert step_costs.acceptance_from_tokens(3.66, 4) == pytest.approx(0.8424, abs=1e-3)
    with pytest.raises(ValueError, match="impossible at K=4"):
        step_costs.acceptance_from_tokens(5.5, 4)


def test_predict_by_hand():
    """Target: decode 10 ms, score T ms = 10 + 2(T-1); draft: decode 2 ms, score T = 2 + T.
    K=2, a=0.5 -> E=1.75, M=6. SD round = verify(3) 14 + 2 draft steps 4 = 18 ms.
    SSD: build = glue 2 (one token: the rest is known, ssd_jax/core/glue.py) + 2 x score(6) 8
    = 18 ms = 1.29 verifies; at p=1 a round costs max(1, 1.29) verifies = 18 ms."""
    target = dict(decode_ms=10.0, score_ms={1: 10.0, 2: 12.0, 4: 16.0, 8: 24.0})
    draft = dict(decode_ms=2.0, score_ms={1: 3.0, 4: 6.0, 8: 10.0})
    rows = {(r["mode"], r["hit_rate"]): r for r in
            step_costs.predict(target, draft, k=2, accept=0.5, hit_rates=[1.0, 0.0])}
    assert rows["AR", None]["tok_s"] == pytest.approx(100.0)
    assert rows["SD", None]["tok_s"] == pytest.approx(1.75 / 0.018)
    assert rows["SSD", 1.0]["tok_s"] == pytest.approx(1.75 / 0.018)
    assert rows["SSD", 1.0]["build_ms"] == pytest.approx(18.0)
    # p=0: every round pays verify + the 2-step backup (4 ms) -> 18 ms.
    assert rows["SSD", 0.0]["tok_s"] == pytest.approx(1.75 / 0.018)
