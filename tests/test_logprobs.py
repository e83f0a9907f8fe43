"""Log-probabilities of emitted tokens (core/logprobs.py through LiveBatch): in AR, SD and SSD,
for greedy and sampled rows joining a running batch, every emitted token's log-probability and
top alternatives equal transformers' log_softmax over the whole text (an independent forward,
no cache, no speculation), and asking for them changes no token."""
import collections

import numpy as np
import pytest
import torch

from ssd_jax import LLM, EngineConfig, SamplingParams
from ssd_jax.config import SpecConfig
from ssd_jax.loading import load
from tests.conftest import save_noisy_draft

PROMPTS = [[5, 9, 11], list(range(20, 39)), [7] * 8, [3, 1, 4, 1, 5, 9, 2, 6], [100, 2, 60]]
TOP = 3


@pytest.fixture(scope="module")
def pair(tiny_llama, tmp_path_factory):
    path = tmp_path_factory.mktemp("lp_draft")
    save_noisy_draft(tiny_llama[1], path)
    return load(tiny_llama[0])[0], load(path)[0], tiny_llama[1]


def _drive(live, requests, logprobs):
    """Requests into 2 slots, joining as rows free up; per request its tokens and, for the
    indices in `logprobs`, (chosen, top ids, top) per token."""
    pending = collections.deque(enumerate(requests))
    active, toks, lps = {}, {}, collections.defaultdict(list)
    while pending or active:
        for slot in live.free_slots():
            if not pending or slot in active:
                continue
            i, (ids, params) = pending.popleft()
            first, lp = live.join(slot, ids, params, [], TOP if i in logprobs else None)
            toks[i], active[slot] = [first], i
            if lp is not None:
                lps[i].append((lp.chosen[0, 0], lp.top_ids[0, 0], lp.top[0, 0]))
        want = any(i in logprobs for i in active.values())
        out, _, _, lp = live.step(TOP if want else None)
        assert (lp is None) == (not want)
        for slot, i in list(active.items()):
            n = requests[i][1].max_new_tokens
            at = [j for j, t in enumerate(out[slot]) if t >= 0][:n - len(toks[i])]
            toks[i] += [int(out[slot][j]) for j in at]
            if i in logprobs:
                lps[i] += [(lp.chosen[slot, j], lp.top_ids[slot, j], lp.top[slot, j])
                           for j in at]
            if len(toks[i]) >= n:
                live.leave(slot)
                del active[slot]
    return [toks[i] for i in range(len(requests))], lps


def _oracle(hf, prompt, tokens):
    """transformers' log_softmax at the positions that predicted each token."""
    ids = torch.tensor([prompt + tokens[:-1]])
    with torch.no_grad():
        logits = hf(ids).logits[0, len(prompt) - 1:].double()
    return torch.log_softmax(logits, -1).numpy()


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_logprobs_equal_a_plain_forward_and_change_no_token(pair, mode):
    target, draft, hf = pair
    llm = LLM(target, draft=draft, spec=SpecConfig(k=3, budget=8),
              engine=EngineConfig(max_batch=2, max_seq_len=128, prefill_bucket=16,
                                  driver="single"))
    reqs = [(PROMPTS[i], SamplingParams(max_new_tokens=n, ignore_eos=True, seed=i,
                                        temperature=t))
            for i, (n, t) in enumerate([(12, 0.0), (7, 1.0), (15, 0.0), (9, 0.7), (10, 0.0)])]
    want = [llm.generate([ids], p, mode=mode)[0].token_ids for ids, p in reqs]
    live, _ = llm.core.live(mode, 2, llm.spec)
    # Requests 0, 1, 3 ask; 2 and 4 do not, and decode beside them in logprobs rounds.
    toks, lps = _drive(live, reqs, logprobs={0, 1, 3})
    greedy = [i for i, (_, p) in enumerate(reqs) if p.temperature == 0]
    assert [toks[i] for i in greedy] == [want[i] for i in greedy]
    for i in (0, 1, 3):
        ref = _oracle(hf, reqs[i][0], toks[i])
        assert len(lps[i]) == len(toks[i])
        for pos, (tok, (chosen, top_ids, top)) in enumerate(zip(toks[i], lps[i])):
            np.testing.assert_allclose(chosen, ref[pos, tok], atol=2e-4)
            order = np.argsort(-ref[pos])[:TOP]
            assert list(top_ids) == list(order), (i, pos)
            np.testing.assert_allclose(top, ref[pos, order], atol=2e-4)
            if reqs[i][1].temperature == 0:
                assert top_ids[0] == tok  # greedy emits the most likely token


def test_sampled_tokens_are_the_same_with_or_without_logprobs(pair):
    """Logprob rounds run other programs: the draws, hence the sampled tokens, must not move."""
    target, draft, _ = pair
    llm = LLM(target, draft=draft, spec=SpecConfig(k=3, budget=8),
              engine=EngineConfig(max_batch=2, max_seq_len=128, prefill_bucket=16,
                                  driver="single"))
    reqs = [(PROMPTS[i], SamplingParams(max_new_tokens=10, ignore_eos=True, seed=7 + i,
                                        temperature=1.0)) for i in range(3)]
    plain, _ = _drive(llm.core.live("ssd", 2, llm.spec)[0], reqs, logprobs=set())
    asked, _ = _drive(llm.core.live("ssd", 2, llm.spec)[0], reqs, logprobs={0, 1, 2})
    assert asked == plain
