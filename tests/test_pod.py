"""Pods: one jax.distributed job of several processes (started by `python -m ssd_jax.launch`,
as a pod's hosts would start), the target tensor-parallel across processes and the draft on
processes of its own. The oracle is this process's 1-device run; tests/pod_job.py is what
every process of the job runs.

Layouts:
  3 processes x 1 device   target TP-2 across processes 0 and 1, draft on process 2.
  4 processes x 2 devices  target TP-4 across processes 0 and 1; plan_split gives the draft
                           the last whole host (process 3, TP-2), process 2 holds nothing: a
                           spare host in the job, which must follow and end with the rest.
Each job also chooses automatic settings on the pod, returns log-probabilities from its target
(checked against transformers' forward), and, last, serves the OpenAI API from its lead
(tests/pod_job.py --serve), queried with the official client.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from ssd_jax import LLM, EngineConfig, SamplingParams
from ssd_jax.config import SpecConfig
from tests.conftest import save_noisy_draft, with_word_tokenizer
from tests.oracles import token_logprobs
from tests.pod_job import (LOGPROBS, PROMPTS, SAMPLED_SEEDS, SECOND, SERVE_BIAS, SERVE_GREEDY,
                           SERVE_SAMPLED, SERVE_SLOTS)

JOB = str(Path(__file__).with_name("pod_job.py"))
JOB_TIMEOUT_S = 480  # a job took 60-110 s in 12 runs on the 2-core dev VM
ROOT = str(Path(__file__).resolve().parents[1])
GREEDY = SamplingParams(max_new_tokens=20, ignore_eos=True)
SAMPLED = [SamplingParams(max_new_tokens=16, temperature=1.0, seed=s, ignore_eos=True)
           for s in SAMPLED_SEEDS]


@pytest.fixture(scope="module")
def pair(tiny_llama, tmp_path_factory):
    path = tmp_path_factory.mktemp("pod_draft")
    save_noisy_draft(tiny_llama[1], path)
    target = with_word_tokenizer(tiny_llama[0], tmp_path_factory.mktemp("pod") / "target")
    return str(target), str(path)


@pytest.fixture(scope="module")
def oracle(pair, tiny_llama):
    """What one process on one device gives: AR greedy, and sampled SSD for the seeds; and
    transformers' model of the target (`hf`), for log-probabilities."""
    target, draft = pair
    ar = LLM(target, progress=False)
    llm = LLM(target, draft=draft, spec=SpecConfig(k=3, budget=8), progress=False,
              engine=EngineConfig(max_batch=4, max_seq_len=256, prefill_bucket=16,
                                  driver="single"))
    return dict(
        hf=tiny_llama[1], served=_served_oracle(ar, llm),
        ar=[o.token_ids for o in ar.generate(PROMPTS, GREEDY, mode="ar", chat=False)],
        second=[o.token_ids for o in ar.generate(SECOND, GREEDY, mode="ar", chat=False)],
        sampled_ssd=[o.token_ids for o in llm.generate(PROMPTS, SAMPLED, mode="ssd",
                                                       chat=False)])


def _served_oracle(ar: LLM, ssd: LLM) -> dict:
    """What the pod's server must send: greedy texts are offline AR's; the seeded sampled
    request, sent alone to a fresh server, is what a one-device live batch of the same slots
    gives it alone (the same rounds, hence the same speculations and random draws)."""
    greedy = [ar.generate(p, SamplingParams(max_new_tokens=n, ignore_eos=True), mode="ar",
                          chat=False)[0].text for p, n in SERVE_GREEDY]
    p, n = SERVE_GREEDY[1]
    biased = ar.generate(p, SamplingParams(max_new_tokens=n, ignore_eos=True,
                                           logit_bias=SERVE_BIAS), mode="ar", chat=False)[0].text
    assert biased != greedy[1]  # the bias changes the answer
    prompt, n, seed = SERVE_SAMPLED
    ids = ssd.prompts.encode(prompt, chat=False)
    live, _ = ssd.core.live("ssd", SERVE_SLOTS, ssd.spec)
    params = SamplingParams(max_new_tokens=n, temperature=1.0, seed=seed, ignore_eos=True)
    tokens = [live.join(0, ids, params, [])[0]]
    while len(tokens) < n:
        tokens += [int(t) for t in live.step()[0][0] if t >= 0]
    return dict(greedy=greedy, sampled=ssd.prompts.text(tokens[:n]), biased=biased)


def _launch(processes: int, devices: int, *job_args: str, compile_cache: Path | None = None
            ) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [ROOT, *filter(None, [os.environ.get("PYTHONPATH")])]))
    if compile_cache is not None:  # ssd_jax's own (bounded) cache there, not the test run's
        env.pop("JAX_COMPILATION_CACHE_DIR", None)
        env["SSD_JAX_COMPILE_CACHE"] = str(compile_cache)
    env.pop("SSD_JAX_PEER_TIMEOUT_S", None)  # the default, 20 s: what a user gets
    env.pop("XLA_FLAGS", None)
    cmd = [sys.executable, "-m", "ssd_jax.launch", "--processes", str(processes),
           "--devices-per-process", str(devices), "--", sys.executable, JOB, *job_args]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def _run_job(pair, tmp_path, processes, devices, mesh, compile_cache=None) -> dict:
    out = tmp_path / "out.json"
    proc = _launch(processes, devices, *pair, str(out), "--mesh", mesh, "--sampled", "--serve",
                   "--auto", "--cache-dir", str(tmp_path / "cache"), compile_cache=compile_cache)
    try:
        log, _ = proc.communicate(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the pod job did not end in {JOB_TIMEOUT_S} s; every thread of every "
                    f"process, where it waited:\n{_stacks_and_kill(proc)}")
    assert proc.returncode == 0, log[-4000:]
    return json.loads(out.read_text())


def _stacks_and_kill(proc: subprocess.Popen) -> str:
    """A hung job: each process prints its threads' stacks (tests/pod_job.py registers
    faulthandler on SIGUSR1), then the job is killed; returns the end of its output."""
    import signal
    launcher = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
    for pid in launcher.read_text().split() if launcher.exists() else []:
        try:
            os.kill(int(pid), signal.SIGUSR1)
        except ProcessLookupError:
            pass
    time.sleep(5)
    proc.kill()  # its processes die with it (die_with_parent)
    log, _ = proc.communicate()
    return log[-20000:]


def _check(got: dict, oracle: dict) -> None:
    for mode in ("ssd", "sd", "ar"):
        assert got[mode] == oracle["ar"], mode
    assert got["second"] == oracle["second"]
    assert got["second_compiles"] == 0  # a second batch of the same shapes reuses programs
    assert got["sampled_ssd"] == oracle["sampled_ssd"]
    assert got["continuous"] == oracle["ar"] + oracle["second"]  # 6 rows, 4 slots
    # Automatic settings: step costs measured by both groups on their meshes, K chosen.
    assert got["auto"] == oracle["ar"]
    assert got["auto_settings"]["automatic"] and got["auto_settings"]["k"] >= 1
    served = got["served"]
    assert served["greedy"] == oracle["served"]["greedy"]
    assert served["sampled"] == oracle["served"]["sampled"]
    assert served["biased"] == oracle["served"]["biased"]  # logit_bias crossed to the followers
    assert served["stopped"]  # the server's shutdown stopped its decode thread
    _check_logprobs(got, oracle)


def _check_logprobs(got: dict, oracle: dict) -> None:
    """The pod's log-probabilities, offline and served, against transformers' forward."""
    hf = oracle["hf"]
    for prompt, kw, plps in zip(PROMPTS, LOGPROBS, got["prompt_logprobs"]):
        if kw.get("prompt_logprobs") is None:
            assert plps is None
            continue
        ref = token_logprobs(hf, prompt[:1], prompt[1:])
        assert len(plps) == len(prompt) and plps[0] is None
        for pos, (tok, pairs) in enumerate(zip(prompt[1:], plps[1:])):
            top = [int(t) for t in np.argsort(-ref[pos])[:kw["prompt_logprobs"]]]
            assert sorted(t for t, _ in pairs) == sorted(set(top) | {tok}), pos
            np.testing.assert_allclose([v for _, v in pairs], ref[pos, [t for t, _ in pairs]],
                                       atol=2e-4)
    for prompt, kw, (tokens, lps) in zip(PROMPTS, LOGPROBS, got["logprobs"]):
        assert len(tokens) == kw["max_new_tokens"]
        if kw.get("logprobs") is None:
            assert lps is None
            continue
        if kw.get("temperature", 0) == 0:
            assert tokens == oracle["ar"][PROMPTS.index(prompt)][:len(tokens)]
        ref = token_logprobs(hf, prompt, tokens)
        assert len(lps) == len(tokens)
        for pos, (tok, pairs) in enumerate(zip(tokens, lps)):
            top = [int(t) for t in np.argsort(-ref[pos])[:kw["logprobs"]]]
            assert sorted(t for t, _ in pairs) == sorted(set(top) | {tok}), pos
            np.testing.assert_allclose([v for _, v in pairs], ref[pos, [t for t, _ in pairs]],
                                       atol=2e-4)
    served = got["served"]["logprobs"]
    prompt, n = SERVE_GREEDY[0]
    assert served["text"] == oracle["served"]["greedy"][0]
    words = lambda text: [int(w[1:]) for w in text.split()]  # noqa: E731 ("w<id>" tokens)
    tokens = words(served["text"])
    ref = token_logprobs(hf, words(prompt), tokens)
    assert len(tokens) == n == len(served["chosen"])
    np.testing.assert_allclose(served["chosen"], ref[np.arange(n), tokens], atol=2e-4)
    np.testing.assert_allclose(served["top"], -np.sort(-ref, axis=1)[:, :2], atol=2e-4)
    # echo, max_tokens 1: the prompt's tokens (the first has none), then the first answer token.
    echo, ids = got["served"]["echo"], words(prompt)
    assert echo["chosen"][0] is None and echo["top"][0] is None
    scored = ids[1:] + tokens[:1]
    ref = token_logprobs(hf, ids[:1], scored)
    assert len(echo["chosen"]) == len(ids) + 1
    np.testing.assert_allclose(echo["chosen"][1:], ref[np.arange(len(scored)), scored], atol=2e-4)
    # A prompt token outside the top 2 is a third entry, below them.
    np.testing.assert_allclose([t[:2] for t in echo["top"][1:]], -np.sort(-ref, axis=1)[:, :2],
                               atol=2e-4)


def test_three_processes_target_tp2_across_two(pair, oracle, tmp_path):
    got = _run_job(pair, tmp_path, 3, 1, "2,1", compile_cache=tmp_path / "xla")
    assert got["pod"].splitlines() == [
        "process 0 (target group lead): target TP-2 shards [0]",
        "process 1 (target group): target TP-2 shards [1]",
        "process 2 (draft group): draft TP-1 shards [0]"]
    _check(got, oracle)
    # The draft group's programs are in the compilation cache: JAX writes from process 0
    # only, so process 2, the draft group's first, writes them itself (SSD's cache build
    # runs in the draft group alone).
    names = [p.name for p in (tmp_path / "xla").iterdir()]
    assert any(n.startswith("jit_build_cache-") and n.endswith("-cache") for n in names), names


@pytest.mark.slow  # 1.5 min; the three-process layout above runs the same job by default
def test_four_processes_two_devices_target_tp4_draft_tp2(pair, oracle, tmp_path):
    got = _run_job(pair, tmp_path, 4, 2, "4,2")
    assert got["pod"].splitlines() == [
        "process 0 (target group lead): target TP-4 shards [0, 1]",
        "process 1 (target group): target TP-4 shards [2, 3]",
        "process 2 (idle group): no devices in either mesh",
        "process 3 (draft group): draft TP-2 shards [0, 1]"]
    _check(got, oracle)


@pytest.mark.slow  # 1.5 min, most of it the 40 s wait
def test_a_target_that_loads_long_after_the_draft(pair, oracle, tmp_path):
    """The target group loads its model 40 s after the draft group has loaded its own and
    started the first round. The groups' link is opened at start-up, when both are there:
    opened in the first round, gloo gave up on the late group after 30 s (the pinned server
    on the real pair died so)."""
    out = tmp_path / "out.json"
    proc = _launch(2, 1, *pair, str(out), "--mesh", "1,1", "--slow-target-load", "40")
    try:
        log, _ = proc.communicate(timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the pod job did not end in {JOB_TIMEOUT_S} s:\n{_stacks_and_kill(proc)}")
    assert proc.returncode == 0, log[-4000:]
    assert json.loads(out.read_text())["ssd"] == oracle["ar"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by the launcher) counts as gone
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("victim,group", [
    (1, "target"), pytest.param(2, "draft", marks=pytest.mark.slow)])  # 40 s each
def test_a_dead_process_ends_the_job_with_its_name(pair, tmp_path, victim, group):
    """Kill one process mid-generation: every other one exits by itself within 60 s (the
    launcher kills nobody) with a line naming the dead process."""
    proc = _launch(3, 1, *pair, str(tmp_path / "out.json"), "--mesh", "2,1", "--long")
    pids, lines = {}, []
    deadline = time.monotonic() + 600
    for line in proc.stdout:  # until the lead has finished a batch: decoding is under way
        lines.append(line)
        if m := re.match(r"\[(\d)\] pid (\d+) is process (\d)", line):
            pids[int(m.group(3))] = int(m.group(2))
        if "round of requests done" in line or time.monotonic() > deadline:
            break
    assert len(pids) == 3, "".join(lines[-40:])
    os.kill(pids[victim], 9)
    killed = time.monotonic()
    rest, _ = proc.communicate(timeout=120)
    took = time.monotonic() - killed
    log = "".join(lines) + rest
    assert took < 60, log[-3000:]
    assert "did not stop within" not in log  # each survivor ended by itself
    survivors = [p for p in range(3) if p != victim]
    for p in survivors:
        said = [ln for ln in log.splitlines() if ln.startswith(f"[{p}] ssd_jax: ")]
        assert said and f"process {victim} ({group} group" in said[-1], log[-3000:]
    assert not [p for p, pid in pids.items() if _alive(pid)]
    assert proc.returncode != 0


def test_pinned_processes_get_their_own_cores():
    """--pin: each process of the job runs on its own share of the launcher's cores (the CPU
    server's SSD overlaps drafting with verification only so), and a job with more processes
    than cores is refused in one line."""
    from ssd_jax.launch import core_shares
    assert core_shares([0, 1], 2) == [[0], [1]]
    assert core_shares([2, 3, 4, 5, 6], 2) == [[2, 3], [4, 5]]  # equal shares, one left over
    with pytest.raises(ValueError, match="3 processes but 2 usable cores"):
        core_shares([0, 1], 3)
    usable = sorted(os.sched_getaffinity(0))
    show = "import os; print(sorted(os.sched_getaffinity(0)))"
    out = subprocess.run([sys.executable, "-m", "ssd_jax.launch", "--processes", "2", "--pin",
                          "--", sys.executable, "-c", show],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    got = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert got == {f"[{i}]": str(c) for i, c in enumerate(core_shares(usable, 2))}
    refused = subprocess.run([sys.executable, "-m", "ssd_jax.launch", "--processes",
                              str(len(usable) + 1), "--pin", "--", "true"],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.strip().splitlines()[-1].startswith("ssd_jax.launch: error: --pin: ")
