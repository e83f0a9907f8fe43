"""Log-probabilities of emitted tokens (core/logprobs.py through LiveBatch): in AR, SD and SSD,
for greedy and sampled rows joining a running batch, every emitted token's log-probability and
top alternatives equal transformers' log_softmax over the whole text (an independent forward,
no cache, no speculation), and asking for them changes no token."""
import collections

import numpy as np
import pytest

from ssd_jax import LLM, EngineConfig, SamplingParams
from ssd_jax.config import SpecConfig
from ssd_jax.loading import load
from tests.conftest import save_noisy_draft
from tests.oracles import token_logprobs

PROMPTS = [[5, 9, 11], list(range(20, 39)), [7] * 8, [3, 1, 4, 1, 5, 9, 2, 6], [100, 2, 60]]
TOP = 3


@pytest.fixture(scope="module")
def pair(tiny_llama, tmp_path_factory):
    path = tmp_path_factory.mktemp("lp_draft")
    save_noisy_draft(tiny_llama[1], path)
    return load(tiny_llama[0])[0], load(path)[0], tiny_llama[1], str(tiny_llama[0]), str(path)


def _llm(target, draft, rows: int, driver: str = "single") -> LLM:
    return LLM(target, draft=draft, spec=SpecConfig(k=3, budget=8),
               engine=EngineConfig(max_batch=rows, max_seq_len=128, prefill_bucket=16,
                                   driver=driver))


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


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_logprobs_equal_a_plain_forward_and_change_no_token(pair, mode):
    target, draft, hf, _, _ = pair
    llm = _llm(target, draft, rows=2)
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
        ref = token_logprobs(hf, reqs[i][0], toks[i])
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
    target, draft, _, _, _ = pair
    llm = _llm(target, draft, rows=2)
    reqs = [(PROMPTS[i], SamplingParams(max_new_tokens=10, ignore_eos=True, seed=7 + i,
                                        temperature=1.0)) for i in range(3)]
    plain, _ = _drive(llm.core.live("ssd", 2, llm.spec)[0], reqs, logprobs=set())
    asked, _ = _drive(llm.core.live("ssd", 2, llm.spec)[0], reqs, logprobs={0, 1, 2})
    assert asked == plain


@pytest.mark.parametrize("mode", ["ar", "ssd"])
def test_prompt_logprobs_equal_a_plain_forward(pair, mode):
    """A join with prompt_logprobs (the server's echo): position t scores prompt token t + 1,
    the last the first token; the row then decodes as it would have without them."""
    target, draft, hf, _, _ = pair
    llm = _llm(target, draft, rows=2)
    ids, p = PROMPTS[1], SamplingParams(max_new_tokens=8, ignore_eos=True)
    want = llm.generate([ids], p, mode=mode)[0].token_ids
    live, _ = llm.core.live(mode, 2, llm.spec)
    first, lp = live.join(1, ids, p, [], TOP, prompt_logprobs=True)
    T = len(ids)
    assert lp.chosen.shape[:2] == (1, 32) and first == want[0]  # the prefill bucket's length
    ref = token_logprobs(hf, ids[:1], ids[1:] + [first])  # predicts ids[1], ..., first
    for pos, tok in enumerate(ids[1:] + [first]):
        np.testing.assert_allclose(lp.chosen[0, pos], ref[pos, tok], atol=2e-4)
        order = np.argsort(-ref[pos])[:TOP]
        assert list(lp.top_ids[0, pos]) == list(order), pos
        np.testing.assert_allclose(lp.top[0, pos], ref[pos, order], atol=2e-4)
    toks = [first]
    while len(toks) < len(want):
        out, _, _, _ = live.step()
        toks += [int(t) for t in out[1] if t >= 0]
    assert toks[:len(want)] == want


def _check_offline(out, reqs, hf):
    for o, (ids, p) in zip(out, reqs):
        if p.prompt_logprobs is None:
            assert o.prompt_logprobs is None
        else:
            assert len(o.prompt_logprobs) == len(ids) and o.prompt_logprobs[0] is None
            _check_entries(o.prompt_logprobs[1:], ids[1:], token_logprobs(hf, ids[:1], ids[1:]),
                           p.prompt_logprobs)
        if p.logprobs is None:
            assert o.logprobs is None
        else:
            assert len(o.logprobs) == len(o.token_ids)
            _check_entries(o.logprobs, o.token_ids, token_logprobs(hf, ids, o.token_ids),
                           p.logprobs)


def _check_entries(entries, tokens, ref, n):
    """{id: logprob} per token: the token and the n most likely, as the oracle `ref` has them."""
    for pos, (tok, lp) in enumerate(zip(tokens, entries)):
        order = [int(t) for t in np.argsort(-ref[pos])[:n]]
        assert set(lp) == set(order) | {tok}, pos
        for t, v in lp.items():
            np.testing.assert_allclose(v, ref[pos, t], atol=2e-4)


OFFLINE = [(PROMPTS[0], dict(max_new_tokens=12, logprobs=2, prompt_logprobs=1)),
           (PROMPTS[1], dict(max_new_tokens=9, temperature=1.0, seed=3, logprobs=0)),
           (PROMPTS[2], dict(max_new_tokens=10)),
           (PROMPTS[3], dict(max_new_tokens=6, temperature=0.7, seed=5, prompt_logprobs=3))]


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_generate_returns_logprobs_of_a_plain_forward(pair, mode):
    """SamplingParams.logprobs and prompt_logprobs offline, rows asking and not asking in one
    batch; asking moves no token, greedy or sampled."""
    target, draft, hf, _, _ = pair
    llm = _llm(target, draft, rows=4)
    reqs = [(ids, SamplingParams(ignore_eos=True, **kw)) for ids, kw in OFFLINE]
    out = llm.generate([ids for ids, _ in reqs], [p for _, p in reqs], mode=mode)
    plain = llm.generate([ids for ids, _ in reqs],
                         [SamplingParams(ignore_eos=True, **{**kw, "logprobs": None,
                                                             "prompt_logprobs": None})
                          for _, kw in OFFLINE], mode=mode)
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]
    _check_offline(out, reqs, hf)


def test_generate_logprobs_from_a_target_worker_process(pair):
    """The worker-process driver: the target's log-probabilities cross the process pipe."""
    _, _, hf, target, draft = pair
    reqs = [(ids, SamplingParams(ignore_eos=True, **kw)) for ids, kw in OFFLINE]
    with _llm(target, draft, rows=4, driver="processes") as llm:
        out = llm.generate([ids for ids, _ in reqs], [p for _, p in reqs], mode="ssd")
    _check_offline(out, reqs, hf)


def test_logprobs_out_of_range_is_one_clear_error():
    with pytest.raises(ValueError, match="logprobs=21 is invalid"):
        SamplingParams(logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs=-1 is invalid"):
        SamplingParams(prompt_logprobs=-1)


def test_blockwise_logprobs_equal_one_pass():
    """A prompt's log-probabilities a block of positions at a time (T not a multiple of the
    block: padded, then cut) equal one pass over all positions."""
    import jax
    import jax.numpy as jnp
    from ssd_jax.core.logprobs import blockwise_token_logprobs
    from ssd_jax.core.logprobs import token_logprobs as one_pass
    kx, kw, kt = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (2, 12, 8))
    w = jax.random.normal(kw, (8, 30))
    tokens = jax.random.randint(kt, (2, 12), 0, 30)
    want = one_pass(x @ w, tokens, 4)
    for block in (5, 12, 64):
        got = blockwise_token_logprobs(lambda h: h @ w, x, tokens, 4, block=block)
        for g, v in zip(got, want):
            assert g.shape == v.shape
            np.testing.assert_allclose(np.asarray(g), np.asarray(v), rtol=1e-6, atol=1e-6)
        assert jnp.array_equal(got.top_ids, want.top_ids)
