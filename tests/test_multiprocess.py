"""The multi-controller driver: target and draft in two processes under jax.distributed on
localhost, exchanging through a jitted collective, give AR's greedy output, also as one
continuous batch past max_batch; workers never outlive the LLM, also when one fails."""
import os
import signal
import time
from dataclasses import replace

import numpy as np
import pytest

from ssd_jax import LLM, EngineConfig, SamplingParams
from ssd_jax.config import SpecConfig
from ssd_jax.runtime.pool import WorkerError
from tests.conftest import save_noisy_draft, with_word_tokenizer

PROMPTS = [[5, 9, 11], list(range(20, 39)), [7] * 8]


@pytest.fixture(scope="module")
def paths(tiny_llama, tmp_path_factory):
    path = tmp_path_factory.mktemp("mp_draft")
    save_noisy_draft(tiny_llama[1], path)
    # The draft as an orbax checkpoint, like the shipped one: restoring under jax.distributed
    # in a worker must not wait on the other process.
    from ssd_jax.convert import main as convert
    assert convert([str(path), str(path / "orbax")]) == 0
    # The target with a tokenizer (words "w<id>"), for stop strings.
    target = with_word_tokenizer(tiny_llama[0], tmp_path_factory.mktemp("mp") / "target")
    return str(target), str(path / "orbax")


def _alive(pids):
    out = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            out.append(pid)
        except ProcessLookupError:
            pass
    return out


ENGINE = EngineConfig(max_batch=4, max_seq_len=256, prefill_bucket=16)
SPEC = SpecConfig(k=3, budget=8)


@pytest.fixture(scope="module")
def workers(paths):
    """An LLM with the worker processes, shared by the tests that decode in them."""
    with LLM(paths[0], draft=paths[1], spec=SPEC, progress=False,
             engine=replace(ENGINE, driver="processes")) as llm:
        yield llm


def test_two_process_ssd_equals_ar(paths, workers):
    target, draft = paths
    llm = workers
    p = SamplingParams(max_new_tokens=20, ignore_eos=True)
    want = [o.token_ids for o in llm.generate(PROMPTS, p, mode="ar", chat=False)]
    out = llm.generate(PROMPTS, p, mode="ssd")
    assert [o.token_ids for o in out] == want
    m = out[0].metrics
    assert m.ssd.hit_rate > 0 and m.decode_tok_s > 0
    pids = [proc.pid for proc in llm.pool.procs.values()]
    assert len(_alive(pids)) == 2
    # Penalties on a row: the target worker's rows carry the counts (asked for by the
    # params it receives); the answer is the single-process one.
    pen = [p, SamplingParams(max_new_tokens=20, ignore_eos=True, presence_penalty=0.6,
                             frequency_penalty=0.7, repetition_penalty=1.5), p]
    single = LLM(target, draft=draft, spec=SpecConfig(k=3, budget=8),
                 engine=EngineConfig(max_batch=4, max_seq_len=256, prefill_bucket=16,
                                     driver="single"))
    want = [o.token_ids for o in single.generate(PROMPTS, pen, mode="ar", chat=False)]
    assert want[1] != out[1].token_ids  # the penalties move that row
    assert [o.token_ids for o in llm.generate(PROMPTS, pen, mode="ssd")] == want
    # A stop string in every row: the workers do not see them and decode on, the host
    # cuts each row at the token that completed its string, and the run's metrics (which
    # the workers send at its end) still arrive.
    want = [o.token_ids for o in out]
    stops = [llm.prompts.text(w[4:5]) for w in want]
    cut = llm.generate(PROMPTS, [SamplingParams(max_new_tokens=20, ignore_eos=True,
                                                stop=s) for s in stops], mode="ssd")
    for w, s, o in zip(want, stops, cut):
        keep = next(j for j in range(1, 21) if s in llm.prompts.text(w[:j]))
        assert (o.token_ids, o.finish_reason) == (w[:keep], "stop")
    assert cut[0].metrics.ssd.hit_rate > 0


def _thread_cores(pid: int) -> set[str]:
    """The Cpus_allowed_list of every thread of process `pid`."""
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                out |= {line.split()[1] for line in f if line.startswith("Cpus_allowed_list")}
        except FileNotFoundError:
            pass  # the thread ended meanwhile
    return out


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or len(os.sched_getaffinity(0)) < 2,
                    reason="pinning: Linux with two usable cores")
def test_every_worker_thread_runs_on_its_own_core(workers):
    # numpy's BLAS threads start before a worker pins itself (importing ssd_jax imports numpy):
    # they must be pinned too, or they wake on the other role's core.
    cores = [_thread_cores(proc.pid) for proc in workers.pool.procs.values()]
    assert all(len(c) == 1 for c in cores) and cores[0] != cores[1], cores


def test_generate_past_max_batch_is_one_continuous_batch_in_the_workers(paths, workers):
    """More rows than max_batch decode as one continuous batch in the worker processes
    (runtime/pool_live.py; SSD's sides in two workers, AR in the target's). In one SSD call,
    greedy rows (one ended by a stop token, one by a stop string) give one process's AR
    answer alone, and seeded sampled rows with log-probabilities what they give alone in one
    process; AR takes fewer steps than consecutive batches. The workers outlive the live
    batches (an ordinary run follows), not a worker's death."""
    target, draft = paths
    llm = workers
    prompts = PROMPTS + [[3, 1, 4, 1, 5, 9, 2, 6], [100, 2, 60]]
    lengths = [12, 5, 20, 9, 15]
    single = LLM(target, draft=draft, spec=SPEC, progress=False,
                 engine=replace(ENGINE, driver="single"))
    greedy = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lengths]
    alone = [single.generate([t], p, mode="ar", chat=False)[0].token_ids
             for t, p in zip(prompts, greedy)]
    stop_tok, stop_str = alone[2][6], single.prompts.text(alone[3][3:4])
    greedy[2] = SamplingParams(max_new_tokens=20, stop_token_ids=[stop_tok])
    greedy[3] = SamplingParams(max_new_tokens=9, ignore_eos=True, stop=stop_str)
    cut = next(j for j in range(1, 10) if stop_str in single.prompts.text(alone[3][:j]))
    want = alone[:2] + [alone[2][:alone[2].index(stop_tok) + 1], alone[3][:cut], alone[4]]
    assert llm.core.continuous(greedy, [[]] * 5)
    got = llm.generate(prompts, greedy, mode="ar", chat=False)
    assert [o.token_ids for o in got] == want
    assert [o.finish_reason for o in got][2:] == ["stop", "stop", "length"]
    m = got[0].metrics
    assert m.batch == 5 and all(o.metrics is m for o in got)
    # Consecutive batches of 4 would take the longest row's steps in each.
    assert m.decode_steps < max(len(w) for w in want[:4]) - 1 + len(want[4]) - 1
    # SSD, rows 1 and 4 sampled (seeded, with log-probabilities) beside the greedy ones.
    mixed = list(greedy)
    for i in (1, 4):
        mixed[i] = SamplingParams(max_new_tokens=lengths[i], ignore_eos=True, temperature=1.0,
                                  seed=i, logprobs=2)
    sampled = {i: single.generate([prompts[i]], mixed[i], mode="ssd", chat=False)[0]
               for i in (1, 4)}
    got = llm.generate(prompts, mixed, mode="ssd", chat=False)
    for i, o in enumerate(got):
        if i in sampled:
            assert o.token_ids == sampled[i].token_ids
            for x, y in zip(sampled[i].logprobs, o.logprobs, strict=True):
                assert x.keys() == y.keys()
                assert np.allclose([x[t] for t in x], [y[t] for t in x], atol=1e-5)
        else:
            assert o.token_ids == want[i], i
    assert got[0].metrics.ssd.hit_rate > 0
    plain = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lengths[:3]]
    out = llm.generate(prompts[:3], plain, mode="ssd", chat=False)
    assert [o.token_ids for o in out] == alone[:3]
    # A worker that dies mid-batch is an error within seconds, not a hang (the other waits
    # in a collective), and takes the pool down with it.
    live, _ = llm.core.live("ssd", 4, SPEC, driver="processes")
    live.join(0, prompts[0], greedy[0], [])
    pids = [proc.pid for proc in llm.pool.procs.values()]
    os.kill(llm.pool.procs["draft"].pid, signal.SIGKILL)
    llm.pool.procs["draft"].wait(timeout=10)
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match="the draft worker exited"):
        live.step()
    assert time.monotonic() - t0 < 30
    assert llm.pool.procs == {} and _alive(pids) == []


def test_two_processes_with_two_devices_each_equal_one_device_ar(paths):
    """The pod layout in miniature: each side is a process with its own 2-device mesh (the
    target tensor-parallel over its two), exchanging through the processes' lead devices."""
    target, draft = paths
    p = SamplingParams(max_new_tokens=20, ignore_eos=True)
    want = [o.token_ids for o in LLM(target).generate(PROMPTS, p, mode="ar", chat=False)]
    llm = LLM(target, draft=draft, spec=SpecConfig(k=3, budget=8),
              engine=EngineConfig(max_batch=4, max_seq_len=256, prefill_bucket=16,
                                  driver="processes", worker_devices=2))
    with llm:
        for mode in ("ssd", "sd", "ar"):
            got = [o.token_ids for o in llm.generate(PROMPTS, p, mode=mode, chat=False)]
            assert got == want, mode
        # intermediate size 160: the target splits it over its two devices
        assert llm.pool.layout["target"] == {"devices": 2, "mlp_columns_per_device": 80}
        assert llm.pool.layout["draft"]["devices"] == 2


def test_worker_failure_is_reported_and_cleaned_up(paths, tmp_path):
    bad = tmp_path / "missing"
    llm = LLM(paths[0], draft=paths[1], spec=SpecConfig(k=2),
              engine=EngineConfig(max_batch=2, max_seq_len=128, prefill_bucket=16,
                                  driver="processes"))
    llm.paths = (paths[0], str(bad))  # the workers will fail to load the draft
    with pytest.raises(WorkerError, match="not found"):
        llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4), mode="ssd")
    assert llm.pool.procs == {}


def test_processes_driver_needs_paths(tiny_llama):
    from ssd_jax.loading import load
    model = load(tiny_llama[0])[0]
    llm = LLM(model, draft=model, engine=EngineConfig(driver="processes", prefill_bucket=16))
    with pytest.raises(ValueError, match="needs the target and draft given by name or path"):
        llm.generate([[1, 2]], SamplingParams(max_new_tokens=2), mode="ssd")
