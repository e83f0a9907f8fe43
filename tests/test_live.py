"""Continuous batching (core/live.py): rows that join a running batch at round boundaries give
exactly what they give alone: greedy equals offline generate in AR, SD and SSD, also through
`generate` past max_batch (continuous.py); sampled SSD rows follow the target distribution
(with teeth)."""
import collections

import jax
import numpy as np
import pytest

from ssd_jax import LLM, EngineConfig, SamplingParams
from ssd_jax.config import SpecConfig
from ssd_jax.loading import load
from tests.conftest import drive_live as drive
from tests.conftest import make_vocab6, save_noisy_draft
from tests.oracles import chi2_pvalue, exact_sequence_probs

PROMPTS = [[5, 9, 11], list(range(20, 39)), [7] * 8, [3, 1, 4, 1, 5, 9, 2, 6], [100, 2, 60]]


@pytest.fixture(scope="module")
def pair(tiny_llama, tmp_path_factory):
    path = tmp_path_factory.mktemp("live_draft")
    save_noisy_draft(tiny_llama[1], path)
    return load(tiny_llama[0])[0], load(path)[0]


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_joining_rows_equal_offline_greedy(pair, mode):
    target, draft = pair
    llm = LLM(target, draft=draft, spec=SpecConfig(k=3, budget=8),
              engine=EngineConfig(max_batch=4, max_seq_len=128, prefill_bucket=16,
                                  driver="single"))
    lengths = [12, 5, 20, 9, 15, 7, 11]
    reqs = [(PROMPTS[i % len(PROMPTS)], SamplingParams(max_new_tokens=n, ignore_eos=True))
            for i, n in enumerate(lengths)]
    want = [llm.generate([ids], p, mode="ar")[0].token_ids for ids, p in reqs]
    live, _ = llm.core.live(mode, 3, llm.spec)  # 3 slots for 7 requests: rows join mid-batch
    assert drive(live, reqs, 3) == want


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_generate_past_max_batch_is_one_continuous_batch(pair, mode):
    """More rows than max_batch in one generate call decode in one live batch of max_batch
    slots (ssd_jax/continuous.py): greedy rows (one ended by a stop token) give AR's answer
    alone; seeded sampled rows with log-probabilities, one with its prompt's, give what they
    give alone (keys are per row and position)."""
    target, draft = pair
    llm = LLM(target, draft=draft, spec=SpecConfig(k=3, budget=8), progress=False,
              engine=EngineConfig(max_batch=2, max_seq_len=128, prefill_bucket=16,
                                  driver="single"))
    lengths = [12, 5, 20, 9, 15]
    greedy = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lengths]
    alone = [llm.generate([t], p, mode="ar")[0].token_ids for t, p in zip(PROMPTS, greedy)]
    greedy[2] = SamplingParams(max_new_tokens=20, stop_token_ids=[alone[2][6]])
    want = alone[:2] + [alone[2][:alone[2].index(alone[2][6]) + 1]] + alone[3:]
    got = llm.generate(PROMPTS, greedy, mode=mode)
    assert [o.token_ids for o in got] == want
    assert got[2].finish_reason == "stop"
    m = got[0].metrics
    assert m.batch == 5 and all(o.metrics is m for o in got)
    if mode == "ar":
        # Rows join as others end: fewer steps than consecutive batches' 11 + 19 + 14 = 44.
        assert m.decode_steps < 44
    sampled = [SamplingParams(max_new_tokens=n, ignore_eos=True, temperature=1.0, seed=i,
                              logprobs=2, prompt_logprobs=1 if i == 1 else None)
               for i, n in enumerate(lengths)]
    alone = [llm.generate([t], p, mode=mode)[0] for t, p in zip(PROMPTS, sampled)]
    got = llm.generate(PROMPTS, sampled, mode=mode)
    assert [o.token_ids for o in got] == [o.token_ids for o in alone]
    for a, g in zip(alone, got):
        for x, y in zip(a.logprobs + (a.prompt_logprobs or [])[1:],
                        g.logprobs + (g.prompt_logprobs or [])[1:]):
            assert x.keys() == y.keys()
            assert np.allclose([x[t] for t in x], [y[t] for t in x], atol=1e-5)
    assert got[1].prompt_logprobs[0] is None and len(got[1].prompt_logprobs) == len(PROMPTS[1])


@pytest.fixture(scope="module")
def vocab6(tmp_path_factory):
    tp, dp, noisy = (tmp_path_factory.mktemp(n) for n in ("t6l", "d6l", "d6ln"))
    t = make_vocab6(tp)
    save_noisy_draft(t, dp, scale=0.05, seed=5)
    save_noisy_draft(t, noisy, scale=0.3, seed=5)
    return load(tp)[0], load(dp)[0], load(noisy)[0], t


def _live_counts(target, draft, n_samples):
    llm = LLM(target, draft=draft, spec=SpecConfig(k=1, budget=4),
              engine=EngineConfig(max_batch=16, max_seq_len=64, prefill_bucket=8,
                                  driver="single"))
    live, _ = llm.core.live("ssd", 16, llm.spec)
    reqs = [([1, 2, 3], SamplingParams(temperature=1.0, max_new_tokens=4, ignore_eos=True,
                                       seed=i)) for i in range(n_samples)]
    return collections.Counter(tuple(t) for t in drive(live, reqs, 16))


def test_sampled_rows_joining_mid_batch_follow_the_target(vocab6):
    target, draft, _, hf = vocab6
    probs = exact_sequence_probs(hf, [1, 2, 3], 1.0, 1.0, 4)
    assert chi2_pvalue(_live_counts(target, draft, 3200), probs) > 1e-3


def test_live_distribution_test_has_teeth(vocab6, monkeypatch):
    import ssd_jax.core.verify as verify_mod
    target, _, noisy, hf = vocab6
    monkeypatch.setattr(verify_mod, "_recovery_weights", lambda p_k, q_k, s_k, pm: p_k)
    jax.clear_caches()
    probs = exact_sequence_probs(hf, [1, 2, 3], 1.0, 1.0, 4)
    counts = _live_counts(target, noisy, 3200)
    jax.clear_caches()
    assert chi2_pvalue(counts, probs) < 1e-3
