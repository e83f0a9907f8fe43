"""Presence, frequency and repetition penalties (SamplingParams, OpenAI's and vLLM's): the
target's logits at each verified position are penalised by the tokens before it, the drafts
of the same round included. Greedy AR, SD and SSD equal a transformers loop that applies the
rules token by token (tests/oracles.penalised_logits); sampled SD and SSD follow the penalised
target's law (with teeth); rows joining a live batch get what offline generate gives."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ssd_jax import LLM, EngineConfig, SamplingParams
from ssd_jax.config import SpecConfig
from ssd_jax.loading import load
from ssd_jax.sampling import penalize
from tests.conftest import drive_live, make_vocab6, save_noisy_draft
from tests.oracles import chi2_pvalue, exact_sequence_probs, penalised_logits

PENALTIES = dict(presence_penalty=0.6, frequency_penalty=0.7, repetition_penalty=1.5)
PEN = (0.6, 0.7, 1.5)  # the same, in the oracle's order
N_OUT = 4  # with K = 2 a round verifies positions that count the round's own drafts


def test_penalize_equals_a_token_by_token_loop():
    rng = np.random.default_rng(0)
    B, S, V = 3, 2, 11
    logits = rng.normal(size=(B, S, V)).astype(np.float32) * 3
    answers = [[[], [4]], [[1, 1], [1, 1, 7]], [[2], [2, 9]]]  # per row, per position
    prompts = [[4, 5], [], [0, 9, 9]]
    settings = [(0.5, 0.25, 1.3), (-0.4, 1.2, 0.8), (0.0, 0.0, 1.0)]
    counts = np.zeros((B, S, V), np.int32)
    in_prompt = np.zeros((B, V), bool)
    for b in range(B):
        in_prompt[b, prompts[b]] = True
        for s in range(S):
            np.add.at(counts[b, s], answers[b][s], 1)
    got = penalize(jnp.asarray(logits), jnp.asarray(counts), jnp.asarray(in_prompt),
                   *(jnp.asarray([x[i] for x in settings], jnp.float32) for i in range(3)))
    want = np.array([[penalised_logits(logits[b, s], prompts[b], answers[b][s], *settings[b])
                      for s in range(S)] for b in range(B)])
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)
    assert np.array_equal(np.asarray(got)[2], logits[2])  # off: bit for bit


def test_bad_penalties_name_the_fix():
    with pytest.raises(ValueError, match=r"presence_penalty=2.5 is invalid: it must lie in "
                                         r"\[-2, 2\]"):
        SamplingParams(presence_penalty=2.5)
    with pytest.raises(ValueError, match=r"frequency_penalty='1' is invalid"):
        SamplingParams(frequency_penalty="1")
    with pytest.raises(ValueError, match="repetition_penalty=0 is invalid: give a finite value "
                                         "> 0"):
        SamplingParams(repetition_penalty=0)
    assert not SamplingParams().penalized and SamplingParams(repetition_penalty=1.1).penalized


@pytest.fixture(scope="module")
def pair(tiny_llama, tmp_path_factory):
    path = tmp_path_factory.mktemp("pen_draft")
    save_noisy_draft(tiny_llama[1], path)
    return load(tiny_llama[0])[0], load(path)[0]


def _greedy_loop(hf, prompt, n, presence, frequency, repetition) -> list[int]:
    import torch
    ids = list(prompt)
    for _ in range(n):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].double().numpy()
        ids.append(int(np.argmax(penalised_logits(logits, prompt, ids[len(prompt):], presence,
                                                  frequency, repetition))))
    return ids[len(prompt):]


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_greedy_penalties_equal_a_transformers_loop(tiny_llama, pair, mode):
    """The plain greedy answer repeats tokens; the penalised one must not be it, and its
    unpenalised neighbour in the batch must be untouched."""
    hf = tiny_llama[1]
    prompt, other, n = list(range(20, 39)), [5, 9, 11], 16
    plain = _greedy_loop(hf, prompt, n, 0.0, 0.0, 1.0)
    want = _greedy_loop(hf, prompt, n, *PEN)
    assert len(set(plain)) < n and want != plain
    llm = LLM(pair[0], draft=pair[1], spec=SpecConfig(k=3, budget=8),
              engine=EngineConfig(max_batch=4, max_seq_len=128, prefill_bucket=16))
    out = llm.generate([prompt, other], [
        SamplingParams(max_new_tokens=n, ignore_eos=True, **PENALTIES),
        SamplingParams(max_new_tokens=n, ignore_eos=True)], mode=mode)
    assert out[0].token_ids == want
    assert out[1].token_ids == _greedy_loop(hf, other, n, 0.0, 0.0, 1.0)


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_drafts_follow_the_targets_penalties(tiny_llama, pair, mode):
    """The draft proposes from logits penalised as the target's are at each position
    (speculation.steer: SD's drafting, SSD's glue, tree and backup): with the target as its
    own draft every draft is accepted, penalties and all (without: 0.05 in SD), SSD's
    speculations after the first hit, and the answer is still the transformers loop's."""
    hf = tiny_llama[1]
    prompt, n = list(range(20, 39)), 24
    llm = LLM(pair[0], draft=pair[0], spec=SpecConfig(k=3, budget=8),
              engine=EngineConfig(max_batch=4, max_seq_len=128, prefill_bucket=16))
    out = llm.generate([prompt], SamplingParams(max_new_tokens=n, ignore_eos=True,
                                                **PENALTIES), mode=mode)[0]
    assert out.token_ids == _greedy_loop(hf, prompt, n, *PEN)
    assert out.metrics.acceptance == 1.0
    if mode == "ssd":
        st = out.metrics.ssd
        assert st.hits == st.rounds - 1  # the first round's speculation is the backup's


def test_penalty_counts_in_the_drafts_columns():
    import jax.numpy as jnp
    from ssd_jax.draft_vocab import SameVocab, VocabMap
    counts = jnp.asarray([[0, 3, 1, 0, 2]])
    vm = VocabMap.from_target_ids([4, 1, 2], 5)  # draft columns: 4, 1, 2, then OOV
    assert vm.draft_columns(counts).tolist() == [[2, 3, 1, 0]]
    assert vm.draft_columns(counts > 0).tolist() == [[True, True, True, False]]
    assert SameVocab(5).draft_columns(counts) is counts


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_live_rows_with_penalties_equal_offline(tiny_llama, pair, mode):
    """A live batch always carries the counts: penalised and plain requests joining mid-batch
    give what each gives alone."""
    hf = tiny_llama[1]
    llm = LLM(pair[0], draft=pair[1], spec=SpecConfig(k=3, budget=8),
              engine=EngineConfig(max_batch=4, max_seq_len=128, prefill_bucket=16,
                                  driver="single"))
    prompts = [list(range(20, 39)), [5, 9, 11], [7] * 8, [3, 1, 4, 1, 5]]
    reqs = [(p, SamplingParams(max_new_tokens=n, ignore_eos=True,
                               **(PENALTIES if i % 2 == 0 else {})))
            for i, (p, n) in enumerate(zip(prompts, [12, 5, 9, 7]))]
    live, _ = llm.core.live(mode, 2, llm.spec)
    got = drive_live(live, reqs, 2)
    want = [_greedy_loop(hf, p, s.max_new_tokens, *(PEN if i % 2 == 0 else (0.0, 0.0, 1.0)))
            for i, (p, s) in enumerate(reqs)]
    assert got == want


# ---------------------------------------------------------------- distribution (6 tokens)

@pytest.fixture(scope="module")
def vocab6(tmp_path_factory):
    tp, dp = tmp_path_factory.mktemp("t6p"), tmp_path_factory.mktemp("d6p")
    t = make_vocab6(tp)
    save_noisy_draft(t, dp, scale=0.05, seed=5)
    return load(tp)[0], load(dp)[0], t


def _counts(target, draft, mode, spec, n_samples=3200):
    llm = LLM(target, draft=draft, spec=spec, engine=EngineConfig(
        max_batch=64, max_seq_len=64, prefill_bucket=8, sync_every=4))
    counts = {}
    for start in range(0, n_samples, 64):
        for o in llm.generate([[1, 2, 3]] * 64, [SamplingParams(
                temperature=1.0, max_new_tokens=N_OUT, seed=start + i, ignore_eos=True,
                **PENALTIES) for i in range(64)], mode=mode):
            counts[tuple(o.token_ids)] = counts.get(tuple(o.token_ids), 0) + 1
    return counts


@pytest.mark.parametrize("mode, spec", [("ar", SpecConfig(k=2)), ("sd", SpecConfig(k=2)),
                                        ("ssd", SpecConfig(k=2, c=0.5, budget=4))])
def test_sampled_penalties_follow_the_penalised_target(vocab6, mode, spec):
    """AR's step, and SD's and SSD's verification (the draft proposes without penalties):
    the output follows the penalised target, whose law is far from the plain one."""
    target, draft, hf = vocab6
    counts = _counts(target, draft, mode, spec)
    probs = exact_sequence_probs(hf, [1, 2, 3], 1.0, 1.0, N_OUT, penalties=PEN)
    assert chi2_pvalue(counts, probs) > 1e-3
    assert chi2_pvalue(counts, exact_sequence_probs(hf, [1, 2, 3], 1.0, 1.0, N_OUT)) < 1e-3


def test_penalties_test_has_teeth(vocab6, monkeypatch):
    """Verification that penalises every position of a round by the tokens before the round
    (forgetting the round's own drafts): the same test rejects the output."""
    import ssd_jax.core.target as target_mod
    target, draft, hf = vocab6
    right = target_mod.target_logits
    monkeypatch.setattr(target_mod, "target_logits",
                        lambda logits, req, first, seen, drafts: right(logits, req, first, seen))
    jax.clear_caches()
    counts = _counts(target, draft, "sd", SpecConfig(k=2))
    jax.clear_caches()
    probs = exact_sequence_probs(hf, [1, 2, 3], 1.0, 1.0, N_OUT, penalties=PEN)
    assert chi2_pvalue(counts, probs) < 1e-3
