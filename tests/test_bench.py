"""The bench CLI (CI smoke): every mode plus the transformers peers on a tiny random HF pair,
2 prompts x 16 tokens, through main(); the JSON schema; greedy outputs equal across modes;
prompt suites; bad flags; the HF export of a truncated-vocab draft; the README section."""
import dataclasses
import json
import random
import re

import numpy as np
import pytest

from bench import suites
from bench.cli import main
from tests.conftest import make_hf_model

CELL_KEYS = {"mode", "suite", "k", "budget", "fanout", "c", "backup", "temperature", "top_p",
             "batch", "num_prompts", "decode_tokens", "decode_s", "decode_tok_s", "ttft_ms",
             "tpot_ms", "rounds", "tokens_per_round", "acceptance", "accept_hist", "ssd",
             "warmup_s", "finish", "outputs", "speedup_vs_ar", "matches_ar", "prediction"}
TOP_KEYS = {"schema", "command", "machine", "config", "base", "points", "cells", "calibration",
            "notes", "plots"}


@pytest.fixture(scope="module")
def pair(tiny_llama, tmp_path_factory):
    """Target = tiny Llama; draft = its weights plus noise (acceptance partial: SD and SSD both
    reject, so equal outputs across modes mean something)."""
    from tests.conftest import save_noisy_draft
    path = tmp_path_factory.mktemp("bench_draft")
    save_noisy_draft(tiny_llama[1], path)
    return str(tiny_llama[0]), str(path)


@pytest.fixture(scope="module")
def run(pair, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_out")
    argv = ["--mode", "all", "--target", pair[0], "--draft", pair[1], "--suite", "chat",
            "--num-prompts", "2", "--output-len", "16", "--k", "3", "--peers",
            "--driver", "single", "--no-progress", "--json", str(out / "r.json"),
            "--out", str(out)]
    assert main(argv) == 0
    return json.loads((out / "r.json").read_text()), out


def test_json_schema_and_greedy_equality(run):
    res, _ = run
    assert TOP_KEYS <= set(res) and res["schema"] == "ssd-bench/1"
    modes = {c["mode"] for c in res["cells"]}
    assert modes == {"ar", "sd", "ssd", "hf-ar", "hf-assisted"}
    for c in res["cells"]:
        assert CELL_KEYS <= set(c), CELL_KEYS - set(c)
        assert c["num_prompts"] == 2 and c["decode_tokens"] == 2 * 15
        assert c["decode_tok_s"] > 0 and all(len(o) == 16 for o in c["outputs"])
    ar = next(c for c in res["cells"] if c["mode"] == "ar")["outputs"]
    for c in res["cells"]:
        assert c["outputs"] == ar, c["mode"]  # greedy: every engine emits the target's tokens
    sd = next(c for c in res["cells"] if c["mode"] == "sd")
    ssd = next(c for c in res["cells"] if c["mode"] == "ssd")
    assert 0 < sum(sd["accept_hist"]) <= sd["rounds"]
    assert sd["accept_hist"][-1] < sum(sd["accept_hist"])  # the noisy draft was rejected
    assert 0.0 <= ssd["ssd"]["hit_rate"] <= 1.0 and len(ssd["ssd"]["accept_hist_hit"]) == 4
    assert ssd["prediction"] is not None and ssd["prediction"]["thm7_speedup"] > 0


def test_peers_equal_ar_up_to_the_answers_end():
    """transformers' cells (stop_ids) equal AR up to AR's first stop token, where the answer
    ends: past it, with EOS ignored, our AR emits the stop token and goes on while
    transformers' min_new_tokens bans it. Our own modes are held to the whole output."""
    from bench.results import annotate
    base = dict(suite="code", temperature=0.0, batch=1, num_prompts=2, decode_tok_s=1.0,
                k=None, budget=None, fanout=None, c=None, backup=None, top_p=1.0)
    ar = dict(base, mode="ar", outputs=[[5, 6, 2, 7], [5, 6, 7, 8]])
    past_end = [[5, 6, 9, 9], [5, 6, 7, 8]]  # row 0 departs at AR's stop token (2)
    before_end = [[5, 4, 2, 7], [5, 6, 7, 9]]  # departs before it; row 1 has none
    cells = [ar, dict(base, mode="hf-ar", outputs=past_end, stop_ids=[2, 3]),
             dict(base, mode="hf-assisted", outputs=before_end, stop_ids=[2]),
             dict(base, mode="sd", outputs=past_end)]
    annotate(dict(cells=cells))
    assert [c["matches_ar"] for c in cells[1:]] == [[2, 2], [0, 2], [1, 2]]


def test_plots_and_readme_section(run, tmp_path):
    res, out = run
    for name in res["plots"]:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "tok_s_by_suite.png" in res["plots"] and "accept_hist.png" in res["plots"]
    readme = tmp_path / "README.md"
    readme.write_text("# Title\n\n<!-- ssd-bench:begin -->\nold\n<!-- ssd-bench:end -->\ntail\n")
    assert main(["report", str(out / "r.json"), "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith("# Title") and text.endswith("tail\n") and "old" not in text
    ar = next(c for c in res["cells"] if c["mode"] == "ar")
    assert f"{ar['decode_tok_s']:.1f}" in text and "transformers assisted" in text


def test_runs_on_different_suites_report_as_one(run, tmp_path, capsys):
    """`ssd-bench report a.json b.json --out DIR`: two runs of one command on other suites
    (here the chat run and a copy relabelled code) are one set of results, AR references and
    tables per suite; runs that could not have been one run are refused in one line."""
    import copy
    res, _ = run
    assert res["machine"]["cpu_model"]
    other = copy.deepcopy(res)
    other["config"]["suites"], other["machine"]["date"] = ["code"], "2999-01-01 00:00"
    other["machine"]["commit"] = "abc1234"
    # the peers ran with the chat run only (as the add-on cells ran on code only in bench-real)
    other["cells"] = [dict(c, suite="code") for c in other["cells"]
                      if not c["mode"].startswith("hf-")]
    a, b, out, readme = (tmp_path / n for n in ("a.json", "b.json", "ab", "README.md"))
    a.write_text(json.dumps(res))
    b.write_text(json.dumps(other))
    assert main(["report", str(a), str(b), "--out", str(out), "--readme", str(readme)]) == 0
    merged = json.loads((out / "bench.json").read_text())
    assert merged["config"]["suites"] == ["chat", "code"]
    assert len(merged["cells"]) == len(res["cells"]) + len(other["cells"])
    assert all(c["matches_ar"] in (None, [2, 2]) for c in merged["cells"])
    assert merged["machine"]["date"].endswith("to 2999-01-01 00:00")
    assert merged["notes"][0].startswith("Merged from 2 runs")
    assert "code at abc1234" in merged["notes"][1]  # the runs' commits, where they differ
    assert "transformers AR; transformers assisted ran on chat only." in merged["notes"]
    assert "tok_s_by_suite.png" in merged["plots"] and (out / "results.md").exists()
    text = readme.read_text()
    assert "| chat |" in text and "| code |" in text
    for change, needle in (
            (lambda r: r["machine"].update(cpu_model="Another CPU"), "ran on another machine"),
            (lambda r: r["config"].update(output_len=32), "ran with other settings"),
            (lambda r: r["config"].update(suites=["chat"]), "suite chat is in both")):
        bad = copy.deepcopy(other)
        change(bad)
        b.write_text(json.dumps(bad))
        assert main(["report", str(a), str(b)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and needle in err, err


def test_automatic_k_with_a_grid_sweep_beside_it(pair, tmp_path, monkeypatch):
    """--k auto: SD and SSD cells carry the engine's choice (K, M, its prediction) and make the
    summary; the K x M grid's cells sit beside them; greedy outputs stay the target's. Timed
    interleaved (--interleave): every cell still gets all its prompts."""
    import ssd_jax.autotune as autotune
    monkeypatch.setattr(autotune, "store_path", lambda cache_dir=None: tmp_path / "tune.json")
    argv = ["--mode", "all", "--target", pair[0], "--draft", pair[1], "--suite", "code",
            "--num-prompts", "2", "--output-len", "12", "--k", "auto", "--grid",
            "--sweep-k", "1,2", "--sweep-budget", "2,6", "--driver", "single", "--no-progress",
            "--interleave", "--json", str(tmp_path / "r.json")]
    assert main(argv) == 0
    res = json.loads((tmp_path / "r.json").read_text())
    auto = [c for c in res["cells"] if c.get("automatic")]
    assert {c["mode"] for c in auto} == {"sd", "ssd"}
    for c in auto:
        assert c["k"] >= 1 and c["settings"]["predicted_tok_s"] > 0
        assert c["predicted_tok_s"] == c["settings"]["predicted_tok_s"]
    # AR (measuring step costs, as it is prepared first) and the grid's cells have the
    # model's prediction too, made before they were timed.
    assert all(c["predicted_tok_s"] > 0 for c in res["cells"])
    grid = {(c["k"], c["budget"]) for c in res["cells"] if c["mode"] == "ssd"
            and not c.get("automatic")}
    assert grid == {(1, 2), (1, 6), (2, 6)}  # (2, 2) has fewer branches than K+1: skipped
    ar = next(c for c in res["cells"] if c["mode"] == "ar")["outputs"]
    assert all(c["outputs"] == ar for c in res["cells"])
    from bench.results import is_base
    base = [c for c in res["cells"] if is_base(c, res["base"])]
    assert sorted(c["mode"] for c in base) == ["ar", "sd", "ssd"]
    assert res["config"]["interleaved"] and all(c["num_prompts"] == 2 for c in res["cells"])


def test_ar_fallback_cells_decode_with_ar_where_predicted_faster(pair, tmp_path, monkeypatch):
    """--k auto --ar-fallback: every automatic cell is pinned to its choice and left to the
    engine's fallback call by call; where the model predicts that choice below AR (SD with a
    draft as large as its target) its answers run AR, it says how many, its prediction is
    AR's, and its outputs are AR's."""
    import ssd_jax.autotune as autotune
    monkeypatch.setattr(autotune, "store_path", lambda cache_dir=None: tmp_path / "tune.json")
    # Step costs as this pair's would be on an idle machine (a draft step costs a target
    # step; scoring costs grow with the tokens scored), for every entry the run reads: timed
    # at start-up under a loaded test run they once put SD above AR.
    fixed = autotune.StepCosts({t: 0.01 * t for t in autotune.TARGET_TOKENS},
                               {t: 0.01 * t for t in autotune.DRAFT_TOKENS})
    monkeypatch.setattr(autotune.TuneStore, "costs", lambda self, key: fixed)
    argv = ["--mode", "all", "--target", pair[0], "--draft", pair[1], "--suite", "code",
            "--num-prompts", "2", "--output-len", "12", "--k", "auto", "--ar-fallback",
            "--driver", "single", "--no-progress", "--no-phases",
            "--json", str(tmp_path / "r.json")]
    assert main(argv) == 0
    res = json.loads((tmp_path / "r.json").read_text())
    ar = next(c for c in res["cells"] if c["mode"] == "ar")["outputs"]
    assert all(c["outputs"] == ar for c in res["cells"])
    sd = next(c for c in res["cells"] if c["mode"] == "sd")
    assert sd["settings"]["predicted"]["ar"] > sd["settings"]["predicted"]["sd"]
    assert sd["ar_fallback_answers"] == 2 and sd["k"] is not None
    assert sd["rounds"] == 0 and sd["accept_hist"] is None  # no call speculated
    assert [c["mode"] for c in sd["ar_fallback_calls"]] == ["ar", "ar"]
    assert all(c["predicted"]["ar"] > c["predicted"]["sd"] for c in sd["ar_fallback_calls"])
    assert sd["predicted_tok_s"] == sd["settings"]["predicted"]["ar"]
    said = (f"(--ar-fallback, K={sd['k']}): the engine decoded 2 of 2 answers with AR "
            "(in order: 2 AR)")
    assert any(said in n for n in res["notes"])
    for c in res["cells"]:  # every automatic cell may fall back
        assert (c.get("ar_fallback_answers") is None) == (c["mode"] == "ar")


def test_a_lone_sd_run_on_cpu_says_it_had_every_core(pair, tmp_path, capsys):
    """`--mode sd` alone (driver auto) runs in one process on every core, where --mode all
    pins the target to one: the run says so, in its notes and on stderr, with the flag that
    times it like an SSD run."""
    argv = ["--mode", "sd", "--target", pair[0], "--draft", pair[1], "--suite", "chat",
            "--num-prompts", "1", "--output-len", "4", "--k", "2", "--no-progress",
            "--no-phases", "--json", str(tmp_path / "r.json")]
    assert main(argv) == 0
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["config"]["driver"] == "single"
    said = [n for n in res["notes"] if "--driver processes" in n]
    assert len(said) == 1 and said[0].startswith("SD ran in the bench's own process")
    assert said[0] in capsys.readouterr().err


def test_a_fallback_cell_keeps_each_call_as_it_ran():
    """A cell that may fall back (pinned K) mixes AR calls with speculative ones: it adds up
    every call's tokens and seconds, the speculative calls' rounds alone (acceptance, phases),
    and keeps each call as it ran."""
    from types import SimpleNamespace
    from bench import measure
    from ssd_jax.core.metrics import RunMetrics
    point = measure.Point(k=3, budget=None, fanout=None, c=None, backup=None,
                          temperature=0.0, top_p=1.0, batch=1, ar_fallback=True)
    agg = measure.Agg(point, "processes")
    calls = [RunMetrics("sd", 1, decode_s=1.0, new_tokens=13, decode_steps=4, verify_s=0.6,
                        draft_s=0.4, accept_hist=[1, 0, 1, 2], k=3),
             RunMetrics("sd", 1, decode_s=1.0, new_tokens=9, decode_steps=4, verify_s=0.5,
                        draft_s=0.5, accept_hist=[2, 1, 0, 1], k=3),
             RunMetrics("ar", 1, decode_s=2.0, new_tokens=13, decode_steps=12,
                        settings=dict(ar_fallback=True))]
    for i, m in enumerate(calls):
        agg.add([i], [SimpleNamespace(metrics=m, token_ids=[1, 2], finish_reason="length")])
    cell = agg.cell("sd", "chat", 0.0)
    assert cell["ar_fallback_answers"] == 1 and cell["num_prompts"] == 3
    assert [(c["mode"], c["k"]) for c in cell["ar_fallback_calls"]] == [
        ("sd", 3), ("sd", 3), ("ar", 0)]
    assert cell["decode_tokens"] == 12 + 8 + 12 and cell["decode_s"] == 4.0
    assert cell["accept_hist"] == [3, 1, 1, 3] and cell["rounds"] == 8
    assert cell["phases"]["t_verify"] == pytest.approx(1.1 / 8)
    assert cell["phases"]["t_draft"] == pytest.approx(0.9 / 8)
    from bench.cli import _runs
    assert _runs(cell["ar_fallback_calls"]) == "2 SD, 1 AR"  # the note's order of calls


def test_interleaved_cells_take_turns(monkeypatch):
    """--interleave: every cell is prepared (probed, pinned, compiled) before any is timed, then
    batch j of every cell runs before batch j+1 of any, the first cell rotating."""
    from bench import measure
    calls = []

    class Agg:
        def __init__(self, name):
            self.name = name

        def cell(self, mode, suite, warm_s):
            return dict(cell=self.name)

    def prepare(self, mode, suite, point, ids):
        calls.append(("prepare", mode))
        return measure.Pending(mode, suite, point, ids, [None] * len(ids), Agg(mode), 0.0)

    monkeypatch.setattr(measure.Cells, "prepare", prepare)
    monkeypatch.setattr(measure.Cells, "_batch", lambda self, mode, point, ids, params, rows,
                        agg, bar=None: calls.append((mode, rows)))
    cells = measure.Cells(None, out_len=4, seed=0, ignore_eos=True, progress=False)
    point = measure.Point(k=None, budget=None, fanout=None, c=None, backup=None,
                          temperature=0.0, top_p=1.0, batch=1)
    out = cells.run_interleaved([(m, "code", point, [[1], [2], [3]]) for m in ("ar", "sd", "ssd")])
    assert out == [dict(cell="ar"), dict(cell="sd"), dict(cell="ssd")]
    assert calls[:3] == [("prepare", "ar"), ("prepare", "sd"), ("prepare", "ssd")]
    assert calls[3:] == [("ar", [0]), ("sd", [0]), ("ssd", [0]),
                         ("sd", [1]), ("ssd", [1]), ("ar", [1]),
                         ("ssd", [2]), ("ar", [2]), ("sd", [2])]


def test_probe_runs_again_where_it_moved_the_choice(monkeypatch):
    """k=auto: a probe that moves the engine's choice is run again at the new choice (what
    a probe teaches at one cell carries to another only roughly), each time on what the
    engine forgot first, until the choice holds or PROBES probes ran; the step costs'
    multiples are restarted once, before the first. In one process (the single driver) the
    probe's phases are timed, so its rounds teach those multiples; worker processes always
    time them."""
    from bench import measure
    point = measure.Point(k=None, budget=None, fanout=None, c=None, backup=None,
                          temperature=0.0, top_p=1.0, batch=1)
    at = lambda k, m: dataclasses.replace(point, k=k, budget=m)

    class Core:
        def forget_acceptance(self):
            calls.append("forget")

        def forget_timings(self, mode, rows, sampled):
            calls.append(("timings", mode, rows, sampled))

    class LLM:
        core = Core()

        def __init__(self, driver):
            self.driver = lambda mode: driver

        def generate(self, ids, params, mode, chat, spec, sync_phases):
            calls.append((spec.k, spec.budget, len(ids)))
            timed.add(sync_phases)

    for driver in ("single", "processes"):
        calls, timed, queue = [], set(), [at(3, 10)] * 2
        monkeypatch.setattr(measure.Cells, "pin", lambda self, mode, p: (queue.pop(0), None))
        measure.Cells(LLM(driver), out_len=4, seed=0, ignore_eos=True,
                      progress=False).probe("sd", point, [[1]], [None])
        assert timed == {driver == "single"}
    for choices, probed in (
            ([at(3, 10), at(3, 10)], [(3, 10)]),  # the choice held: one probe
            ([at(4, 8), at(3, 10), at(3, 10)], [(4, 8), (3, 10)]),
            ([at(4, 8), at(3, 10), at(4, 8), at(3, 10)], [(4, 8), (3, 10), (4, 8)])):
        calls, queue = [], list(choices)
        monkeypatch.setattr(measure.Cells, "pin", lambda self, mode, p: (queue.pop(0), None))
        cells = measure.Cells(LLM("processes"), out_len=4, seed=0, ignore_eos=True,
                              progress=False)
        cells.probe("ssd", point, [[1], [2]], [None, None])
        want = [("timings", "ssd", 1, False)]  # once: every probe's answers teach them
        want += [x for km in probed for x in ("forget", (*km, 1), (*km, 1))]
        assert calls == want and len(probed) <= measure.PROBES


@pytest.mark.parametrize("driver", ["processes", "single"])
def test_ar_step_costs_are_measured_before_the_warm_up_that_teaches_them(driver):
    """An AR cell measures the target's step costs (where none are stored) and restarts
    their multiples before its warm-up answer, so that answer teaches their decode-time
    multiple before the cell's prediction; measured after it, the prediction was start-up
    timing alone. The warm-up is a whole answer in one process too (LLM.warmup's first
    chunk teaches nothing)."""
    from bench import measure
    point = measure.Point(k=None, budget=None, fanout=None, c=None, backup=None,
                          temperature=0.0, top_p=1.0, batch=1)
    calls = []

    class Core:
        def ar_prediction(self, rows, measure=False, sampled=False):
            calls.append(("costs", rows, measure))
            return 4.0

        def forget_timings(self, mode, rows, sampled):
            calls.append(("timings", mode, rows, sampled))

    class LLM:
        core = Core()

        def driver(self, mode):
            return driver

        def shapes(self, ids, params, **kw):
            return len(ids)

        def generate(self, ids, params, mode, chat, spec):
            calls.append(("answer", mode, len(ids)))

        def warmup(self, ids, params, mode, chat, spec):
            calls.append(("first chunk", mode, len(ids)))

    cells = measure.Cells(LLM(), out_len=4, seed=0, ignore_eos=True, progress=False)
    pending = cells.prepare("ar", "code", point, [[1], [2]])
    assert calls == [("costs", 1, True), ("timings", "ar", 1, False), ("answer", "ar", 1),
                     ("costs", 1, True)]
    assert pending.agg.predicted == 4.0


# ------------------------------------------------------------------ suites
@pytest.mark.parametrize("name", suites.SUITES)
def test_suites_are_deterministic_and_large(name):
    a, b = suites.pool(name, seed=3), suites.pool(name, seed=3)
    assert len(a) >= 64 and [p.text for p in a] == [p.text for p in b]
    assert len({p.text for p in a}) == len(a)
    assert [p.text for p in suites.load_suite(name, 5, seed=3)] == [p.text for p in a[:5]]
    assert [p.text for p in suites.pool(name, seed=4)] != [p.text for p in a]


def test_code_suite_uses_only_held_out_modules():
    from ssd_jax.distill.prompts import is_training_module
    mods = {p.source.split(".")[0] for p in suites.pool("code")}
    assert len(mods) > 20 and not any(is_training_module(m) for m in mods)
    for name in ("os", "json", "ast", "heapq", "uuid"):  # the fallback rule is the same rule
        assert suites._is_training_module(name) == is_training_module(name)


def test_hand_written_prompts_are_not_training_templates():
    from ssd_jax.distill import prompts as train
    words = {"topic": train.TOPICS, "topic2": train.TOPICS, "audience": train.AUDIENCES,
             "thing": train.THINGS, "skill": train.SKILLS, "food": train.FOODS,
             "product": train.PRODUCTS, "game": train.GAMES, "place": train.PLACES,
             "plural": [p for p, _ in train.PLURALS_VERBS],
             "verb": [v for _, v in train.PLURALS_VERBS]}
    alt = {k: "(" + "|".join(map(re.escape, v)) + ")" for k, v in words.items()}
    pats = [re.compile("^" + re.sub(r"\\\{(\w+)\\\}", lambda m: alt[m.group(1)], re.escape(t))
                       + "$") for t in train.INSTRUCTION_TEMPLATES]
    assert any(p.match(train.instruction_prompt(random.Random(0))) for p in pats)  # teeth
    for text in suites.INSTRUCTIONS + suites.CHAT + train.HELD_OUT_INSTRUCTIONS:
        assert not any(p.match(text) for p in pats), text
    assert not set(suites.INSTRUCTIONS + suites.CHAT) & set(train.HELD_OUT_INSTRUCTIONS)
    num = {k: r"(-?\d+)" for k in "abcdep"}
    math_pats = [re.compile("^" + re.sub(r"\\\{(\w+)\\\}", lambda m: num.get(
        m.group(1), "(" + "|".join(train.ITEMS) + ")"), re.escape(t)) + "$")
        for t in train.MATH_TEMPLATES]
    assert any(p.match(train.math_prompt(random.Random(0))) for p in math_pats)  # teeth
    for p in suites.pool("math"):
        assert not any(m.match(p.text) for m in math_pats), p.text


def test_math_answers():
    """Re-derive two templates' answers from the text alone."""
    checked = 0
    for p in suites.pool("math", seed=0):
        m = re.match(r"\w+ bakes (\d+) muffins .* sells (\d+) .* after (\d+) days", p.text)
        if m:
            a, b, c = map(int, m.groups())
            assert int(p.answer) == (a - b) * c
            checked += 1
        m = re.match(r"There are (\d+) red, (\d+) blue and (\d+) green", p.text)
        if m:
            r, b, g = map(int, m.groups())
            assert int(p.answer) == r + 3 * b + g
            checked += 1
    assert checked >= 5


# ------------------------------------------------------------------ bad flags
@pytest.mark.parametrize("argv, needle", [
    (["--suite", "poetry"],
     "--suite 'poetry' is not a suite: use one or more of code, math, instructions, chat, or all"),
    (["--k", "3", "--ar-fallback"], "use it with --k auto"),
    (["--k", "0"], "K=0 is invalid: lookahead must be >= 1"),
    (["--k", "four"], "'four' is not a lookahead: give an integer or auto"),
    (["--grid", "--sweep-k", "2"], "--grid needs both --sweep-k and --sweep-budget"),
    (["--k", "4", "--budget", "3"], "budget 3 is smaller than K+1=5"),
    (["--target-devices", "64", "--draft-devices", "64"], "lower the split"),
    (["--sweep-k", "2,x"], "comma-separated list"),
    (["--target-devices", "0"], "--target-devices 0 is invalid"),
    (["--batch", "4", "--num-prompts", "2"], "batch 4 is larger than --num-prompts 2"),
    (["--suite", "code", "--extras-suite", "math"], "--extras-suite 'math' is not a suite of"),
])
def test_bad_flags_exit_2_with_one_line(argv, needle, capsys):
    assert main(argv + ["--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and err.startswith("ssd-bench: error:")


def test_suite_lists_take_all_and_keep_the_run_order():
    """--suite and --extras-suite share one parser: "all", the run's order, one bad name."""
    from argparse import Namespace

    from bench.checks import BenchError, extras_suites, suite_names
    assert suite_names("all", suites.SUITES, "--suite") == list(suites.SUITES)
    assert suite_names(" chat, code ", suites.SUITES, "--suite") == ["code", "chat"]
    run = ["code", "chat"]
    assert extras_suites(Namespace(extras_suite=None), run) == run
    assert extras_suites(Namespace(extras_suite="all"), run) == run
    assert extras_suites(Namespace(extras_suite="chat"), run) == ["chat"]
    with pytest.raises(BenchError, match="'math' is not a suite of this run"):
        extras_suites(Namespace(extras_suite="code,math"), run)


def test_a_mode_timed_on_some_suites_has_no_all_suites_rate():
    """--extras-suite: the all-cores and peer cells run on some suites; the summary's "all" row
    pools every suite, so those modes show none there rather than one suite's rate."""
    from bench.results import summary_table

    def cell(mode, suite, tok_s):
        return dict(mode=mode, suite=suite, decode_tokens=100, decode_s=100 / tok_s, k=None,
                    budget=None, fanout=None, c=None, backup=None, temperature=0.0, top_p=1.0,
                    batch=1)
    base = dict(k=None, budget=None, fanout=None, c=None, backup=None, temperature=0.0,
                top_p=1.0, batch=1)
    cells = [cell("ar", "code", 2.0), cell("ar", "chat", 2.0), cell("ar-all", "code", 3.0)]
    lines = summary_table(dict(base=base, cells=cells)).splitlines()[2:]
    rows = {r[0]: r[1:] for r in ([x.strip() for x in line.strip("|").split("|")]
                                  for line in lines)}
    assert rows == {"code": ["2.0", "3.0"], "chat": ["2.0", "–"], "all": ["2.0", "–"]}


# ------------------------------------------------------------------ HF export
def test_exported_truncated_vocab_draft_proposes_like_ours(tmp_path):
    """A draft over 32 of 128 target tokens (+ OOV): transformers' greedy continuation of the
    exported directory equals DraftModel's, token for token, and its logits agree inside the
    draft vocabulary and are the dtype minimum outside it."""
    import jax
    import jax.numpy as jnp
    import torch
    from bench.export_hf import export, load_hf
    from ssd_jax.draft_vocab import DraftModel, VocabMap
    from ssd_jax.loading import load
    from ssd_jax.models import KVCache, causal_mask

    make_hf_model(tmp_path / "d", "llama", seed=2, vocab_size=33)
    model = load(tmp_path / "d")[0]
    ids = np.random.default_rng(0).choice(128, 32, replace=False)
    vocab = VocabMap.from_target_ids(ids, 128)
    ours = DraftModel(model, vocab)

    P = 16  # pad to one length: a causal model's logits at i do not see positions > i

    @jax.jit
    def padded_logits(x):
        return ours(x, jnp.arange(P)[None], KVCache.zeros(model.config, 1, 8),
                    jnp.zeros((1,), jnp.int32), causal_mask(1, P))[0][0]

    def logits(seq):
        return np.asarray(padded_logits(jnp.asarray([seq + [0] * (P - len(seq))])))[:len(seq)]

    outside = [t for t in range(128) if t not in set(ids.tolist())]
    prompt = [5, outside[0], 11, outside[1], 7]  # tokens outside the draft vocab enter as OOV
    seq = list(prompt)
    for _ in range(10):
        seq.append(int(np.argmax(logits(seq)[-1])))
    hf = load_hf(export(model, tmp_path / "hf", vocab=vocab))
    with torch.no_grad():
        got = hf.generate(torch.tensor([prompt]), max_new_tokens=10, min_new_tokens=10,
                          do_sample=False, pad_token_id=0)[0].tolist()
        ref = hf(torch.tensor([seq[:-1]])).logits[0].numpy()
    assert got == seq
    mine = logits(seq[:-1])
    inside = np.isfinite(mine)
    assert inside.sum() == 32 * len(seq[:-1])
    np.testing.assert_allclose(ref[inside], mine[inside], atol=1e-4)
    assert (ref[~inside] == np.finfo(np.float32).min).all()


# ------------------------------------------------------------------ batched decode throughput
def test_decode_throughput_smoke(tiny_llama, tmp_path, capsys):
    from bench.decode_throughput import main as throughput
    out = tmp_path / "t.json"
    assert throughput(["--model", str(tiny_llama[0]), "--batch", "1,3", "--cache", "16",
                       "--repeats", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 3]
    assert all(r["step_ms"] > 0 and abs(r["tok_s"] - 1e3 * r["batch"] / r["step_ms"]) < 1e-6
               for r in rows)
    assert "| 3 |" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        throughput(["--batch", "1,x"])
    assert e.value.code == 2


def test_a_c_sweep_beside_a_given_k_times_each_c_once_and_apart_from_the_base():
    """--k 2 --sweep-c 0.5,1: the base runs the engine's C=1, so the sweep adds C=0.5 alone,
    and the summary's base row is the base cell, not the pool of every C."""
    from bench.checks import validate
    from bench.cli import parser
    from bench.results import is_base
    args = parser().parse_args(["--mode", "ssd", "--temperature", "0.7", "--k", "2",
                                "--sweep-c", "0.5,1"])
    _, points = validate(args)
    assert [p.c for p in points] == [1.0, 0.5]
    base = dataclasses.asdict(points[0])
    cell = lambda c: dict(base, mode="ssd", c=c)  # noqa: E731
    assert is_base(cell(1.0), base) and not is_base(cell(0.5), base)


def test_a_context_too_short_and_bad_results_files_are_one_line(pair, tmp_path, capsys):
    """--max-seq-len below a prompt's needs, and `report` on a file that is not results: one
    line in the bench's own terms, exit 2 (both were tracebacks)."""
    assert main(["--mode", "ar", "--target", pair[0], "--suite", "chat", "--num-prompts", "1",
                 "--output-len", "16", "--max-seq-len", "8", "--driver", "single",
                 "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("ssd-bench: error: prompt (") and "raise --max-seq-len" in err[-1]
    for text in ("{", "{}"):
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        assert main(["report", str(bad)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "is not ssd-bench results" in err


# ------------------------------------------------------------------ continuous vs consecutive
def test_continuous_batch_budgets_and_flags():
    from bench.continuous_batch import budgets, main as continuous
    assert budgets(5, 10, 50) == [10, 30, 50, 40, 20]  # short and long rows mixed
    for argv in (["--max-tokens", "9,2"], ["--max-tokens", "x"], ["--mode", "sd"]):
        with pytest.raises(SystemExit) as e:
            continuous(argv)
        assert e.value.code == 2


@pytest.mark.slow  # ~50 s: SmolLM2 loaded and compiled both ways
def test_continuous_batch_smoke(tmp_path, capsys):
    from bench.continuous_batch import main as continuous
    out = tmp_path / "c.json"
    assert continuous(["--prompts", "3", "--max-batch", "2", "--max-tokens", "2,6",
                       "--repeats", "1", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["budgets"] == [2, 6, 4] and 3 <= got["tokens"] <= 12
    assert set(got["rows"]) == {"continuous", "consecutive"} and got["speedup"] > 0
    assert "| continuous |" in capsys.readouterr().out


# ------------------------------------------------------------------ sampling settings and acceptance
def test_steering_acceptance_flags():
    from bench.steering_acceptance import main as steering
    for argv in (["--k", "0"], ["--pair", "nope"], ["--ban", "0"]):
        with pytest.raises(SystemExit) as e:
            steering(argv)
        assert e.value.code == 2


def test_steering_acceptance_bans_the_most_used_tokens():
    from bench.steering_acceptance import banned
    assert banned([[5, 5, 7, 9], [7, 5, 3]], 2) == {5: -100.0, 7: -100.0}


@pytest.mark.slow  # ~60 s: SmolLM2 and its draft, five SD runs
def test_steering_acceptance_smoke(tmp_path):
    from bench.steering_acceptance import main as steering
    out = tmp_path / "p.json"
    assert steering(["--k", "2", "--max-tokens", "8", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    rows = got["rows"]
    assert [r["setting"] for r in rows] == [
        "none", "repetition 1.1", "presence + frequency 0.5",
        "logit_bias: 4 most used tokens banned", "min_tokens=8"]
    assert all(1.0 <= r["tokens_per_round"] <= 3.0 for r in rows)
    assert len(got["banned"]) == 4 and rows[-1]["answer_tokens"] == [8] * 4
