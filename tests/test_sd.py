"""Speculative decoding: greedy SD equals greedy AR token for token; sampled SD follows the
target distribution (exact enumeration on a tiny vocabulary); clear errors."""
import numpy as np
import pytest

from ssd_jax import LLM, EngineConfig, SamplingParams
from ssd_jax.config import SpecConfig
from ssd_jax.loading import load
from tests.conftest import make_hf_model, make_vocab6
from tests.oracles import chi2_pvalue, exact_sequence_probs

ENGINE = EngineConfig(max_batch=4, max_seq_len=256, prefill_bucket=16)


@pytest.fixture(scope="module")
def tiny_target(tiny_llama):
    return load(tiny_llama[0])[0]


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory):
    """A different random model (2 layers, other seed): partial acceptance."""
    path = tmp_path_factory.mktemp("tiny_draft")
    make_hf_model(path, "llama", seed=1, num_hidden_layers=1)
    return load(path)[0]


PROMPTS = [[5, 9, 11], list(range(20, 39)), [7] * 8]


@pytest.mark.parametrize("draft_kind", ["same", "different"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_sd_equals_ar(tiny_target, tiny_draft, draft_kind, batch, k):
    draft = tiny_target if draft_kind == "same" else tiny_draft
    llm = LLM(tiny_target, draft=draft, spec=SpecConfig(k=k), engine=ENGINE)
    p = SamplingParams(max_new_tokens=24, ignore_eos=True)
    ar = llm.generate(PROMPTS[:batch], p, mode="ar")
    sd = llm.generate(PROMPTS[:batch], p, mode="sd")
    for a, s in zip(ar, sd):
        assert s.token_ids == a.token_ids
    hist = np.array(sd[0].metrics.accept_hist)
    if draft_kind == "same":  # the target drafting for itself is always fully accepted
        assert hist[:k].sum() == 0 and hist[k] > 0
    else:
        assert hist[:k].sum() > 0


def test_sd_stop_token_matches_ar(tiny_target, tiny_draft):
    llm = LLM(tiny_target, draft=tiny_draft, spec=SpecConfig(k=3), engine=ENGINE)
    ref = llm.generate([PROMPTS[0]], SamplingParams(max_new_tokens=16, ignore_eos=True),
                       mode="ar")[0].token_ids
    stop = ref[5]
    p = SamplingParams(max_new_tokens=16, stop_token_ids=(stop,), ignore_eos=True)
    ar = llm.generate(PROMPTS, p, mode="ar")
    sd = llm.generate(PROMPTS, p, mode="sd")
    assert [o.token_ids for o in sd] == [o.token_ids for o in ar]
    assert sd[0].finish_reason == "stop" and sd[0].token_ids[-1] == stop
    # The AR rows stop on the device too (a K = 0 round's emitted token once went uncounted,
    # so AR ran to the budget and the host cut the answer): far fewer than 15 steps.
    alone = llm.generate([PROMPTS[0]], p, mode="ar")[0]
    assert alone.token_ids == ar[0].token_ids and alone.metrics.decode_steps <= 8


# ---------------------------------------------------------------- distribution (tiny vocab)

N_OUT = 3


@pytest.fixture(scope="module")
def vocab6(tmp_path_factory):
    """Target and draft over a 6-token vocabulary, sharp enough that rejections happen."""
    tp, dp = tmp_path_factory.mktemp("t6"), tmp_path_factory.mktemp("d6")
    t = make_vocab6(tp)
    make_vocab6(dp, seed=4)
    return load(tp)[0], load(dp)[0], t


def _sd_sample_counts(target, draft, prompt, temperature, top_p, n_samples, bias=(),
                      min_p=0.0):
    llm = LLM(target, draft=draft, spec=SpecConfig(k=2), engine=EngineConfig(
        max_batch=64, max_seq_len=64, prefill_bucket=8, sync_every=4))
    counts = {}
    for start in range(0, n_samples, 64):
        outs = llm.generate([prompt] * 64, [SamplingParams(
            temperature=temperature, top_p=top_p, max_new_tokens=N_OUT, seed=start + i,
            ignore_eos=True, logit_bias=bias, min_p=min_p) for i in range(64)], mode="sd")
        for o in outs:
            key = tuple(o.token_ids[:N_OUT])
            counts[key] = counts.get(key, 0) + 1
    return counts


def test_chi2_helper_rejects_impossible_sequences():
    probs = {(0,): 0.5, (1,): 0.5, (2,): 0.0}
    assert chi2_pvalue({(0,): 500, (1,): 500}, probs) > 0.5
    assert chi2_pvalue({(0,): 500, (1,): 499, (2,): 1}, probs) == 0.0  # pooling would hide it
    assert chi2_pvalue({(0,): 500, (1,): 499, (3,): 1}, probs) == 0.0  # absent from the law
    assert chi2_pvalue([500, 499, 1], [0.5, 0.5, 0.0]) == 0.0  # the array form as strict


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.8, 0.9)])
def test_sampled_sd_matches_target_distribution(vocab6, temperature, top_p):
    target, draft, hf_target = vocab6
    prompt = [1, 2, 3]
    probs = exact_sequence_probs(hf_target, prompt, temperature, top_p, N_OUT)
    counts = _sd_sample_counts(target, draft, prompt, temperature, top_p, 3200)
    assert chi2_pvalue(counts, probs) > 1e-3


def test_sampled_sd_with_min_p(vocab6):
    target, draft, hf_target = vocab6
    probs = exact_sequence_probs(hf_target, [1, 2, 3], 0.8, 0.95, N_OUT, min_p=0.2)
    counts = _sd_sample_counts(target, draft, [1, 2, 3], 0.8, 0.95, 3200, min_p=0.2)
    assert chi2_pvalue(counts, probs) > 1e-3
    assert chi2_pvalue(counts, exact_sequence_probs(hf_target, [1, 2, 3], 0.8, 0.95,
                                                    N_OUT)) < 1e-3


def test_distribution_test_has_teeth(vocab6, monkeypatch):
    """Plug in a wrong rule (recovery sampled from p instead of the residual): the same test
    must reject it."""
    import ssd_jax.core.verify as verify_mod
    target, draft, hf_target = vocab6
    monkeypatch.setattr(verify_mod, "_recovery_weights",
                        lambda p_k, q_k, s_k, point_mass: p_k)
    import jax
    jax.clear_caches()
    prompt = [1, 2, 3]
    probs = exact_sequence_probs(hf_target, prompt, 1.0, 1.0, N_OUT)
    counts = _sd_sample_counts(target, draft, prompt, 1.0, 1.0, 3200)
    jax.clear_caches()
    assert chi2_pvalue(counts, probs) < 1e-3


# logit_bias on the 6-token vocabulary: token 1 favoured, token 4 banned (-100: the oracle gives
# it probability 0, so a single drawn 4 fails the test outright), token 5 pushed down a little.
BIAS = {1: 1.5, 4: -100.0, 5: -0.7}


def test_sampled_sd_with_logit_bias_follows_the_biased_target(vocab6):
    """The bias moves the target's distribution; the draft proposes without it, so its
    proposals of the banned token must all be rejected, and the output still follows p."""
    target, draft, hf_target = vocab6
    prompt = [1, 2, 3]
    probs = exact_sequence_probs(hf_target, prompt, 0.9, 1.0, N_OUT, bias=BIAS)
    counts = _sd_sample_counts(target, draft, prompt, 0.9, 1.0, 3200, bias=BIAS)
    assert chi2_pvalue(counts, probs) > 1e-3
    assert chi2_pvalue(counts, exact_sequence_probs(hf_target, prompt, 0.9, 1.0, N_OUT)) < 1e-3


def test_logit_bias_test_has_teeth(vocab6, monkeypatch):
    """Verification that ignores the bias (the prefill's first token still has it): the same
    test rejects the output."""
    import jax
    import ssd_jax.core.target as target_mod
    target, draft, hf_target = vocab6
    unbiased = target_mod.target_logits
    monkeypatch.setattr(target_mod, "target_logits", lambda logits, req, *rest: unbiased(
        logits, req._replace(sampling=req.sampling._replace(bias=req.sampling.bias * 0)),
        *rest))
    jax.clear_caches()
    probs = exact_sequence_probs(hf_target, [1, 2, 3], 0.9, 1.0, N_OUT, bias=BIAS)
    counts = _sd_sample_counts(target, draft, [1, 2, 3], 0.9, 1.0, 3200, bias=BIAS)
    jax.clear_caches()
    assert chi2_pvalue(counts, probs) < 1e-3


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_greedy_with_logit_bias_equals_a_biased_transformers_loop(tiny_llama, tiny_target,
                                                                  tiny_draft, mode):
    """Greedy decoding of argmax(logits + bias), against transformers' forward step by step
    with the bias added: a favoured token that is not the model's choice, and a banned one
    that is."""
    import torch
    hf = tiny_llama[1]
    prompt, n = PROMPTS[1], 12
    with torch.no_grad():
        plain = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    plain = plain[0, len(prompt):].tolist()
    bias = {plain[0]: -100.0, 17: 4.0}
    ids = list(prompt)
    for _ in range(n):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].double()
        for t, v in bias.items():
            logits[t] += v
        ids.append(int(logits.argmax()))
    want = ids[len(prompt):]
    assert want != plain and plain[0] not in want
    llm = LLM(tiny_target, draft=tiny_draft, spec=SpecConfig(k=3, budget=8), engine=ENGINE)
    out = llm.generate([prompt, PROMPTS[0]], [
        SamplingParams(max_new_tokens=n, ignore_eos=True, logit_bias=bias),
        SamplingParams(max_new_tokens=n, ignore_eos=True)], mode=mode)
    assert out[0].token_ids == want
    assert out[1].token_ids == llm.generate([PROMPTS[0]], SamplingParams(
        max_new_tokens=n, ignore_eos=True), mode="ar")[0].token_ids  # its neighbour: unbiased


def test_sampled_sd_with_min_tokens_follows_the_target(vocab6):
    """min_tokens=2 with stop id 2: the first two tokens are never 2 (the target's law with 2
    masked there), the third may be; the draft holds 2 back too (speculation.steer)."""
    target, draft, hf_target = vocab6
    llm = LLM(target, draft=draft, spec=SpecConfig(k=2), engine=EngineConfig(
        max_batch=64, max_seq_len=64, prefill_bucket=8, sync_every=4))
    counts = {}
    for start in range(0, 3200, 64):
        for o in llm.generate([[1, 2, 3]] * 64, [SamplingParams(
                temperature=1.0, max_new_tokens=N_OUT, seed=start + i, ignore_eos=True,
                stop_token_ids=(2,), min_tokens=2) for i in range(64)], mode="sd"):
            counts[tuple(o.token_ids)] = counts.get(tuple(o.token_ids), 0) + 1
    probs = exact_sequence_probs(hf_target, [1, 2, 3], 1.0, 1.0, N_OUT, no_stop=([2], 2))
    assert chi2_pvalue(counts, probs) > 1e-3
    assert any(k[2] == 2 for k in counts)  # the third token may stop


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_greedy_min_tokens_equals_a_masked_transformers_loop(tiny_llama, tiny_target,
                                                             tiny_draft, mode):
    """A stop id that greedy would emit second: with min_tokens=5 it is masked for the first
    five tokens, then may end the answer (transformers' forward, step by step)."""
    import torch
    hf = tiny_llama[1]
    prompt, n = PROMPTS[2], 16
    with torch.no_grad():
        plain = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    stop = plain[0, len(prompt) + 1].item()
    ids = list(prompt)
    for j in range(1, n + 1):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].double()
        if j <= 5:
            logits[stop] = -np.inf
        ids.append(int(logits.argmax()))
        if ids[-1] == stop:
            break
    want = ids[len(prompt):]
    assert stop not in want[:5] and len(want) > 2
    llm = LLM(tiny_target, draft=tiny_draft, spec=SpecConfig(k=3, budget=8), engine=ENGINE)
    out = llm.generate([prompt], SamplingParams(max_new_tokens=n, ignore_eos=True,
                                                stop_token_ids=(stop,), min_tokens=5), mode=mode)
    assert out[0].token_ids == want


def _biased_masked_loop(hf, prompt, n, bias, stop, hold) -> tuple[list[int], int]:
    """Greedy decoding with `bias` added and `stop` masked for the first `hold` tokens,
    transformers' forward step by step, ending at `stop`; and how many times from the second
    token on the model's choice there, before the mask, was the stop (what an unsteered draft
    proposes and verification rejects)."""
    import torch
    ids, wanted = list(prompt), 0
    for j in range(1, n + 1):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].double()
        for t, v in bias.items():
            logits[t] += v
        if stop is not None and j <= hold:
            wanted += j > 1 and int(logits.argmax()) == stop
            logits[stop] = -np.inf
        ids.append(int(logits.argmax()))
        if ids[-1] == stop:
            break
    return ids[len(prompt):], wanted


@pytest.mark.parametrize("mode", ["sd", "ssd"])
@pytest.mark.parametrize("what", ["logit_bias", "min_tokens"])
def test_drafts_follow_the_targets_bias_and_min_tokens(tiny_llama, tiny_target, mode, what):
    """The draft proposes from logits biased and masked as the target's are at each position
    (speculation.steer: SD's drafting, SSD's glue, tree and backup): with the target as its
    own draft every draft is accepted under a logit bias, or under a min_tokens hold on a
    stop id the model wants, SSD's speculations after the first hit, and the answer is still
    the transformers loop's. Without the steering the draft proposes the banned token or the
    held-back stop, and they are rejected."""
    import torch
    hf = tiny_llama[1]
    prompt, n, hold = PROMPTS[1], 20, 12
    with torch.no_grad():
        plain = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    plain = plain[0, len(prompt):].tolist()
    if what == "logit_bias":
        bias, stop = {plain[0]: -100.0, 17: 4.0}, None
        want, _ = _biased_masked_loop(hf, prompt, n, bias, None, hold)
    else:  # a stop id the held-back answer keeps wanting after its first token
        bias = {}
        stop, want = next((t, w) for t in dict.fromkeys(plain)
                          for w, wanted in [_biased_masked_loop(hf, prompt, n, {}, t, hold)]
                          if wanted > 1)
        assert len(want) > hold
    assert want != plain
    llm = LLM(tiny_target, draft=tiny_target, spec=SpecConfig(k=3, budget=8), engine=ENGINE)
    out = llm.generate([prompt], SamplingParams(
        max_new_tokens=n, ignore_eos=True, logit_bias=bias,
        stop_token_ids=() if stop is None else (stop,), min_tokens=hold), mode=mode)[0]
    assert out.token_ids == want
    assert out.metrics.acceptance == 1.0
    if mode == "ssd":
        st = out.metrics.ssd
        assert st.hits == st.rounds - 1  # the first round's speculation is the backup's


def test_bad_spec_errors(tiny_target, tiny_draft, tmp_path):
    with pytest.raises(ValueError, match="K=0 is invalid"):
        SpecConfig(k=0)
    llm = LLM(tiny_target, draft=tiny_draft, spec=SpecConfig(k=8),
              engine=EngineConfig(max_seq_len=40, prefill_bucket=8))
    with pytest.raises(ValueError, match="K=8 needs K\\+1=9 slots of cache slack"):
        llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=34), mode="sd")
    other = tmp_path / "other"
    make_hf_model(other, "llama", vocab_size=96)
    with pytest.raises(ValueError, match="draft vocabulary \\(96\\) differs"):
        LLM(tiny_target, draft=load(other)[0], engine=ENGINE)
    with pytest.raises(ValueError, match="needs a draft model"):
        LLM(tiny_target, engine=ENGINE).generate([[1, 2]], mode="sd")
