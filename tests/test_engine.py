"""The AR engine: batching, stop handling, seeds, streaming, and bad input."""
from dataclasses import replace

import numpy as np
import pytest
import torch

from ssd_jax import LLM, EngineConfig, SamplingParams
from ssd_jax.config import SpecConfig
from ssd_jax.loading import load
from tests.oracles import chi2_pvalue

ENGINE = EngineConfig(max_batch=4, max_seq_len=256, prefill_bucket=16)


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    model, tok, _ = load(tiny_llama[0])
    return LLM(model, tokenizer=tok, engine=ENGINE), tiny_llama[1]


def _hf_greedy(hf_model, ids, n):
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n,
                                do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_batched_greedy_matches_transformers(tiny):
    llm, hf_model = tiny
    prompts = [[5, 9, 11], list(range(20, 39)), [7] * 8]
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=20, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.token_ids == _hf_greedy(hf_model, p, 20)
        assert o.finish_reason == "length" and len(o.token_ids) == 20


def test_stop_token_ends_row_only(tiny):
    llm, hf_model = tiny
    ref = _hf_greedy(hf_model, [5, 9, 11], 12)
    stop = ref[4]
    first = ref.index(stop)
    outs = llm.generate([[5, 9, 11], list(range(20, 39))],
                        [SamplingParams(max_new_tokens=12, stop_token_ids=(stop,), ignore_eos=True),
                         SamplingParams(max_new_tokens=12, ignore_eos=True)])
    assert outs[0].token_ids == ref[:first + 1] and outs[0].finish_reason == "stop"
    assert outs[1].token_ids == _hf_greedy(hf_model, list(range(20, 39)), 12)


def test_seeded_sampling_is_independent_of_batch(tiny):
    llm, _ = tiny
    p = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_new_tokens=10, seed=7,
                       ignore_eos=True)
    alone = llm.generate([[3, 4, 5]], p)[0].token_ids
    batched = llm.generate([[8, 8], [3, 4, 5], [1, 2]],
                           [SamplingParams(temperature=1.0, seed=1), p,
                            SamplingParams(max_new_tokens=3)])[1].token_ids
    assert alone == batched
    other = llm.generate([[3, 4, 5]], SamplingParams(temperature=0.9, top_p=0.95, top_k=50,
                                                      max_new_tokens=10, seed=8,
                                                      ignore_eos=True))[0].token_ids
    assert other != alone  # 10 tokens over a 128 vocab: a collision would be a bug


def test_unseeded_rows_sample_independently_and_runs_repeat(tiny_llama):
    """Requests without a seed: identical prompts in one batch get different samples (one shared
    default seed made them identical), and an engine seed makes the whole run repeatable."""
    model, tok, _ = load(tiny_llama[0])
    p = SamplingParams(temperature=1.0, max_new_tokens=10, ignore_eos=True)

    def run(seed):
        llm = LLM(model, tokenizer=tok, engine=EngineConfig(
            max_batch=4, max_seq_len=256, prefill_bucket=16, seed=seed))
        return [o.token_ids for o in llm.generate([[3, 4, 5]] * 4, p)]

    a = run(0)
    assert len({tuple(r) for r in a}) == 4  # 10 tokens over a 128 vocab: no collisions
    assert run(0) == a
    assert run(1) != a


def test_first_sampled_token_follows_target_distribution(tiny):
    """64 seeds x first token at T=1 vs the exact softmax of transformers' logits (chi-square)."""
    llm, hf_model = tiny
    prompt = [5, 9, 11]
    with torch.no_grad():
        p = torch.softmax(hf_model(torch.tensor([prompt])).logits[0, -1].double() / 0.7, -1).numpy()
    counts = np.zeros(128)
    for start in range(0, 256, 4):
        outs = llm.generate([prompt] * 4, [SamplingParams(temperature=0.7, max_new_tokens=1,
                                                          seed=start + i) for i in range(4)])
        for o in outs:
            counts[o.token_ids[0]] += 1
    assert chi2_pvalue(counts, p) > 1e-3


def test_stream_concatenates_to_generate(smollm2):
    p = SamplingParams(max_new_tokens=20)
    text = "".join(smollm2.stream("Name three colours.", p))
    assert text == smollm2.generate("Name three colours.", p)[0].text
    assert len(text) > 0


def test_n_answers_per_prompt(tiny):
    """SamplingParams(n): n outputs per prompt, consecutive, in prompt order. Sampled, answer
    i is the one a request seeded choice_seed(seed, i) gets alone (answer 0: the seed's own);
    greedy answers are equal."""
    from ssd_jax.config import choice_seed
    llm, _ = tiny
    a, b = [5, 9, 11], [1, 2]
    p = SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=1.0, seed=7)
    got = llm.generate([a, b], [replace(p, n=3), p])
    alone = [llm.generate([a], replace(p, seed=choice_seed(7, i)))[0] for i in range(3)]
    assert choice_seed(7, 0) == 7
    assert [o.token_ids for o in got[:3]] == [o.token_ids for o in alone]
    assert len({tuple(o.token_ids) for o in alone}) == 3  # the answers differ
    assert got[3].token_ids == llm.generate([b], p)[0].token_ids
    assert [o.prompt_token_ids for o in got] == [a, a, a, b]
    greedy = llm.generate(a, SamplingParams(max_new_tokens=8, ignore_eos=True, n=2))
    assert greedy[0].token_ids == greedy[1].token_ids
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match=f"^n={bad!r}"):
            SamplingParams(n=bad)
    with pytest.raises(ValueError, match="gives one answer, not n=2"):
        next(llm.stream(a, SamplingParams(n=2)))


def test_fill_in_the_middle_prompt(tiny):
    """A tokenizer with FIM tokens (StarCoder's names here; Qwen2.5-Coder's in
    test_real_pair): prefix-suffix-middle order; one without them is one line naming the fix."""
    from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, pre_tokenizers
    from tokenizers.models import WordLevel
    from ssd_jax.loading.tokenizer import Tokenizer
    from ssd_jax.prompts import Prompts
    llm, _ = tiny
    words = {f"w{i}": i for i in range(125)}
    words.update({"<fim_prefix>": 125, "<fim_suffix>": 126, "<fim_middle>": 127})
    backend = HFTokenizer(WordLevel(words, unk_token="w0"))
    backend.pre_tokenizer, backend.decoder = pre_tokenizers.WhitespaceSplit(), decoders.WordPiece()
    backend.add_special_tokens([AddedToken(t, special=True) for t in list(words)[125:]])
    prompts = Prompts(Tokenizer(backend), llm.core.model_config, 0)
    assert prompts.fill_in_middle("w5 w6", "w7") == [125, 5, 6, 126, 7, 127]
    with pytest.raises(ValueError, match="no fill-in-the-middle tokens"):
        llm.fill_in_middle("w5", "w6")


def test_more_rows_than_max_batch(tiny, capsys):
    """Six rows (two prompts, n=3) with max_batch=4: one continuous batch of 4 slots, or with
    continuous=False two consecutive batches; in order either way, each answer the one its
    row gives alone; a progress bar counts them."""
    from ssd_jax.config import choice_seed
    llm, _ = tiny
    a, b = [5, 9, 11], [1, 2, 3, 4]
    p = SamplingParams(max_new_tokens=10, ignore_eos=True, temperature=1.0, seed=3, n=3)
    alone = [llm.generate([t], replace(p, n=1, seed=choice_seed(3, i)))[0].token_ids
             for t in (a, b) for i in range(3)]
    assert llm.shapes([a, b], p) == (4, 16, 256)  # 4 slots, each prompt joins alone
    assert llm.warmup([a, b], p) > 0
    got = llm.generate([a, b], p)
    assert [o.token_ids for o in got] == alone
    assert [o.metrics.batch for o in got] == [6] * 6
    assert "generate (ar)" in capsys.readouterr().err
    # Rows a live batch cannot hold (more stop ids than its width) run in consecutive batches.
    rows = [replace(p, n=1)] * 6
    assert llm.core.continuous(rows, [[2]] * 6)
    assert not llm.core.continuous(rows[:4], [[2]] * 4)
    assert not llm.core.continuous(rows, [[2]] * 5 + [list(range(17))])
    apart = LLM(llm.model, tokenizer=llm.tokenizer, engine=replace(ENGINE, continuous=False))
    got = apart.generate([a, b], p)
    assert [o.token_ids for o in got] == alone
    assert [o.metrics.batch for o in got] == [4, 4, 4, 4, 2, 2]


@pytest.mark.parametrize("bad, match", [
    (dict(prompts=[""]), "prompt is empty"),
    (dict(prompts=[[]]), "prompt is empty"),
    (dict(prompts=[[1] * 250], params=SamplingParams(max_new_tokens=10)), "more than the context"),
    # A later batch that does not fit is an error before the first runs.
    (dict(prompts=[[1]] * 4 + [[1] * 250], params=SamplingParams(max_new_tokens=10)),
     "more than the context"),
    (dict(prompts=[[1, 999]]), "outside the model's vocabulary"),
    (dict(prompts=[[1, 2]], params=SamplingParams(logit_bias={999: 1.0})),
     r"logit_bias ids \[999\] are outside the model's vocabulary"),
    (dict(prompts=[{"role": "user"}]), "chat message .* is invalid"),
    (dict(prompts=[{"role": "bogus", "content": "hi"}]), "chat message .* is invalid"),
    (dict(prompts=[[1, 2], 3.5]), "3.5 is not a prompt"),
    (dict(prompts=[[1, 2]], params={"max_new_tokens": 2}), "must be SamplingParams"),
    (dict(prompts=[[1, 2]], params=None), "must be SamplingParams"),
])
def test_bad_input_names_the_problem(tiny, bad, match):
    llm, _ = tiny
    with pytest.raises(ValueError, match=match):
        llm.generate(bad["prompts"], bad.get("params", SamplingParams()))


def test_prompt_forms(tiny):
    """One prompt or a batch, as lists, tuples, numpy arrays or numpy ints; chat messages."""
    llm, _ = tiny
    p = SamplingParams(max_new_tokens=4, ignore_eos=True)
    want = llm.generate([[5, 9, 11]], p)[0].token_ids
    for one in ([5, 9, 11], (5, 9, 11), np.array([5, 9, 11]), [np.int64(5), 9, np.int32(11)]):
        assert [o.token_ids for o in llm.generate(one, p)] == [want]
    two = llm.generate(np.array([[5, 9, 11], [5, 9, 11]]), p)
    assert [o.token_ids for o in two] == [want, want]
    with pytest.raises(ValueError, match="stream\\(\\) takes one prompt"):
        next(llm.stream([[5, 9, 11], [1, 2]], p))


def test_truncated_vocab_draft_cannot_be_the_target():
    with pytest.raises(ValueError, match="truncated vocabulary.*use it as a draft"):
        LLM("smollm2-draft")


def test_bad_sampling_params():
    with pytest.raises(ValueError, match="temperature=-0.5 is invalid"):
        SamplingParams(temperature=-0.5)
    with pytest.raises(ValueError, match="top_p=0.0"):
        SamplingParams(top_p=0.0)
    for bad in (-0.1, 1.5, True, "0.1"):
        with pytest.raises(ValueError, match=f"min_p={bad!r} is invalid: it must lie in"):
            SamplingParams(min_p=bad)
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="temperature=inf is invalid"):
        SamplingParams(temperature=float("inf"))
    with pytest.raises(ValueError, match="max_new_tokens=2.5 is invalid: it must be an integer"):
        SamplingParams(max_new_tokens=2.5)
    with pytest.raises(ValueError, match="stop_token_ids=2 is invalid"):
        SamplingParams(stop_token_ids=2)
    with pytest.raises(ValueError, match="seed=-1 is invalid"):
        SamplingParams(seed=-1)
    assert SamplingParams(stop_token_ids=[2, 3]).stop_token_ids == (2, 3)  # hashable
    for bad in ({-1: 1.0}, {1: float("inf")}, {"a": 1}, 5, {True: 1.0}):
        with pytest.raises(ValueError, match="logit_bias=.* is invalid: give {token id: value}"):
            SamplingParams(logit_bias=bad)
    with pytest.raises(ValueError, match=r"min_tokens=5 is invalid: it must lie in \[0, "):
        SamplingParams(min_tokens=5, max_new_tokens=2)
    # A dict or pairs, stored as sorted pairs (hashable; a pod's JSON messages keep them).
    assert SamplingParams(logit_bias={3: -1, 1: 2.5}).logit_bias == ((1, 2.5), (3, -1.0))
    assert SamplingParams(logit_bias=[[3, -1.0], [1, 2.5]]) == SamplingParams(
        logit_bias={1: 2.5, 3: -1.0})


def test_bad_configs():
    with pytest.raises(ValueError, match="k=2.5 is invalid: it must be an integer"):
        SpecConfig(k=2.5)
    with pytest.raises(ValueError, match="drop mesh, or use driver='single'"):
        EngineConfig(mesh=(1, 1), driver="processes")
    with pytest.raises(ValueError, match="continuous=1 is invalid: pass True or False"):
        EngineConfig(continuous=1)
    with pytest.raises(ValueError, match="pass engine=EngineConfig"):
        LLM("/unused", engine={"max_batch": 2})


def test_settings_refuse_a_row_count_below_one(tiny):
    llm, _ = tiny
    for rows in (0, -1, 1.5):
        with pytest.raises(ValueError, match=f"rows={rows!r} is invalid"):
            llm.settings("ar", rows=rows)


def test_unknown_model_path():
    with pytest.raises(FileNotFoundError, match="not found"):
        LLM("/no/such/model")


def test_shapes_name_the_programs_a_call_compiles(tiny):
    """Calls with equal `shapes()` reuse the compiled programs (no backend compile), a call
    with other shapes does not: JAX's compile events are the oracle."""
    from jax import monitoring
    llm, _ = tiny
    p = SamplingParams(max_new_tokens=20, ignore_eos=True)
    first, same, longer = [[5, 9, 11], list(range(20, 39)), [7] * 8], [[6, 2], [9] * 30], [[1] * 40]
    # 3 rows pad to 4, the longest prompt (19) to the bucket of 16 -> 32, 19 + 20 + 1 -> 256
    assert llm.shapes(first, p, mode="ar") == (4, 32, 256)
    assert llm.shapes(same, p, mode="ar") == (2, 32, 256)
    assert llm.shapes(longer, p, mode="ar") == (1, 48, 256)
    compiles = []

    def listen(name, secs, **kw):
        if name == "/jax/core/compile/backend_compile_duration":
            compiles.append(name)
    monitoring.register_event_duration_secs_listener(listen)
    try:
        llm.generate([[3, 4], [8] * 20, [1], [2, 2]], p)  # (4, 32, 256), as `first`
        n = len(compiles)
        llm.generate(first, p)
        assert len(compiles) == n
        llm.generate(longer, p)
        assert len(compiles) > n
    finally:
        monitoring.unregister_event_duration_listener(listen)


def test_shapes_draw_no_seeds(tiny_llama):
    """Asking for shapes leaves the per-request seeds of later unseeded requests unchanged."""
    model, tok, _ = load(tiny_llama[0])
    p = SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True)
    a, b = (LLM(model, tokenizer=tok, engine=ENGINE) for _ in range(2))
    a.shapes([[3, 4, 5]] * 2, p)
    assert ([o.token_ids for o in a.generate([[3, 4, 5]] * 2, p)]
            == [o.token_ids for o in b.generate([[3, 4, 5]] * 2, p)])


@pytest.fixture(scope="module")
def pair(tiny_llama, tmp_path_factory):
    from tests.conftest import save_noisy_draft
    path = tmp_path_factory.mktemp("engine_draft")
    save_noisy_draft(tiny_llama[1], path)
    return LLM(str(tiny_llama[0]), draft=str(path), spec=SpecConfig(k=2),
               engine=EngineConfig(max_batch=2, max_seq_len=256, prefill_bucket=16,
                                   driver="single"))


def test_per_call_spec_and_sync_phases(pair):
    llm = pair
    prompts = [[5, 9, 11], list(range(20, 39))]
    p = SamplingParams(max_new_tokens=16, ignore_eos=True)
    ar = [o.token_ids for o in llm.generate(prompts, p, mode="ar")]
    out = llm.generate(prompts, p, mode="sd", spec=SpecConfig(k=4), sync_phases=True)
    m = out[0].metrics
    assert [o.token_ids for o in out] == ar
    assert m.k == 4 and m.settings["k"] == 4 and len(m.accept_hist) == 5
    assert m.sync_phases and m.verify_s > 0 and m.draft_s > 0
    m = llm.generate(prompts, p, mode="sd")[0].metrics  # the LLM's own settings again
    assert m.k == 2 and not m.sync_phases and m.draft_s == 0
    assert llm.spec == SpecConfig(k=2)
    assert llm.shapes(prompts, p, mode="ssd", spec=SpecConfig(k=4)) == (2, 32, 256)
    with pytest.raises(AttributeError):
        llm.spec = SpecConfig(k=3)  # settings travel with calls, not by mutating the LLM


def test_ssd_exposed_wait_split_by_hit(pair):
    """The target's wait after each verification is filed under all-hit rounds or rounds with
    a backup: the two parts add up to the whole, one entry per round."""
    prompts = [[5, 9, 11], list(range(20, 39))]
    p = SamplingParams(max_new_tokens=16, ignore_eos=True)
    m = pair.generate(prompts, p, mode="ssd", sync_phases=True)[0].metrics
    s = m.ssd
    assert s.exposed_hit_rounds + s.exposed_miss_rounds == m.decode_steps
    assert s.exposed_hit_s + s.exposed_miss_s == pytest.approx(s.exposed_s)


@pytest.mark.parametrize("kw, match", [
    (dict(spec={"k": 2}), r"spec=\{'k': 2\} is invalid: pass spec=SpecConfig\(...\)"),
    (dict(sync_phases="yes"), "sync_phases='yes' is invalid: pass True, False or None"),
])
def test_bad_per_call_settings(pair, kw, match):
    calls = [pair.generate, pair.warmup, lambda *a, **k: next(pair.stream(*a, **k))]
    if "spec" in kw:
        calls.append(pair.shapes)
    for call in calls:
        with pytest.raises(ValueError, match=match):
            call([1, 2, 3], SamplingParams(max_new_tokens=2), mode="sd", **kw)
