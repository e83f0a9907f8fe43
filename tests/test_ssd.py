"""SSD: greedy output equals AR; sampled output follows the target distribution (C = 1, C < 1,
fast backup), with teeth; the tree decode and fork match brute-force references."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ssd_jax import LLM, EngineConfig, SamplingParams
from ssd_jax.config import SpecConfig
from ssd_jax.core.backups import BACKUPS
from ssd_jax.core.draft import DraftConfig, DraftState, FanLists, build_cache, select
from ssd_jax.core.glue import fork_candidates, greedy_with_candidates
from ssd_jax.core.rows import Requests, RowSampling, RowState
from ssd_jax.core.runner import ModelRunner
from ssd_jax.core.speculation import Outcome, Speculation, draft_decode
from ssd_jax.draft_vocab import SameVocab, VocabMap
from ssd_jax.loading import load
from ssd_jax.models import causal_mask, commit
from tests.conftest import make_vocab6, save_noisy_draft
from tests.oracles import chi2_pvalue, exact_sequence_probs

N_OUT = 4  # K=1: every row needs two or more rounds, so cache hits decide later tokens

ENGINE = EngineConfig(max_batch=4, max_seq_len=256, prefill_bucket=16)
PROMPTS = [[5, 9, 11], list(range(20, 39)), [7] * 8, [3, 1, 4, 1, 5, 9, 2, 6]]


@pytest.fixture(scope="module")
def pair(tiny_llama, tmp_path_factory):
    """Target = tiny Llama; draft = the same weights with noise, so acceptance is partial but
    high enough that the cache both hits and misses."""
    path = tmp_path_factory.mktemp("noisy_draft")
    save_noisy_draft(tiny_llama[1], path)
    return load(tiny_llama[0])[0], load(path)[0]


@pytest.mark.parametrize("backup", ["neural", "fast"])
@pytest.mark.parametrize("fanout", ["uniform", "geometric", "empirical"])
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_ssd_equals_ar(pair, backup, fanout, batch):
    target, draft = pair
    llm = LLM(target, draft=draft, spec=SpecConfig(k=3, fanout=fanout, backup=backup, budget=8),
              engine=ENGINE)
    p = SamplingParams(max_new_tokens=24, ignore_eos=True)
    ar = llm.generate(PROMPTS[:batch], p, mode="ar")
    ssd = llm.generate(PROMPTS[:batch], p, mode="ssd")
    assert [o.token_ids for o in ssd] == [o.token_ids for o in ar]
    stats = ssd[0].metrics.ssd
    assert 0 < stats.hits < stats.rounds  # the cache both hit and missed


def test_self_draft_hits_after_first_round(pair):
    target, _ = pair
    llm = LLM(target, draft=target, spec=SpecConfig(k=3), engine=ENGINE)
    out = llm.generate([PROMPTS[0]], SamplingParams(max_new_tokens=25, ignore_eos=True),
                       mode="ssd")[0]
    s = out.metrics.ssd
    assert s.rounds - s.hits == 1  # only the first round (no cache yet) misses
    assert sum(s.accept_hist_hit[:3]) == 0


# ---------------------------------------------------------------- distribution tests

@pytest.fixture(scope="module")
def vocab6(tmp_path_factory):
    """Target over 6 tokens and a draft = target + noise: acceptance is partial, and the cache
    both hits (bonus tokens, recoveries the draft foresaw) and misses."""
    tp, dp = tmp_path_factory.mktemp("t6s"), tmp_path_factory.mktemp("d6s")
    t = make_vocab6(tp)
    save_noisy_draft(t, dp, scale=0.05, seed=5)
    return load(tp)[0], load(dp)[0], t


@pytest.fixture(scope="module")
def vocab6_noisy(vocab6, tmp_path_factory):
    """The same target with a much noisier draft: rejections are frequent, so a wrong recovery
    rule moves the output distribution far. (With vocab6's draft, a planted rule gave p-values
    of 5e-4, 0.12 and 0.29 over three seed bases: the test had no reliable teeth.)"""
    dp = tmp_path_factory.mktemp("d6noisy")
    save_noisy_draft(vocab6[2], dp, scale=0.3, seed=5)
    return vocab6[0], load(dp)[0], vocab6[2]


def _ssd_counts(target, draft, spec, n_samples, temperature=1.0, top_p=1.0, **params):
    llm = LLM(target, draft=draft, spec=spec, engine=EngineConfig(
        max_batch=64, max_seq_len=64, prefill_bucket=8, sync_every=4))
    counts, hits, rounds = {}, 0, 0
    for start in range(0, n_samples, 64):
        outs = llm.generate([[1, 2, 3]] * 64, [SamplingParams(
            temperature=temperature, top_p=top_p, max_new_tokens=N_OUT, seed=start + i,
            ignore_eos=True, **params) for i in range(64)], mode="ssd")
        for o in outs:
            counts[tuple(o.token_ids[:N_OUT])] = counts.get(tuple(o.token_ids[:N_OUT]), 0) + 1
        hits += outs[0].metrics.ssd.hits
        rounds += outs[0].metrics.ssd.rounds
    return counts, (hits, rounds)


@pytest.mark.parametrize("k, c, backup", [(1, 1.0, "neural"), (1, 0.4, "neural"),
                                          (1, 1.0, "fast"), (2, 0.4, "neural")])
def test_sampled_ssd_matches_target_distribution(vocab6, k, c, backup):
    """K=2: tokens after a hit come from tree step 1 (its own Saguaro set and q'), so later
    tokens depend on the tree's second-step proposals, not only on forks."""
    target, draft, hf_target = vocab6
    probs = exact_sequence_probs(hf_target, [1, 2, 3], 1.0, 1.0, N_OUT)
    counts, (hits, rounds) = _ssd_counts(target, draft,
                                         SpecConfig(k=k, c=c, backup=backup, budget=4), 3200)
    assert 0.1 * rounds < hits < rounds
    assert chi2_pvalue(counts, probs) > 1e-3


def test_sampled_ssd_with_truncated_vocab_draft(vocab6, tmp_path):
    """A draft over 4 of the 6 target tokens (vocab map): q' is zero on the other two, which
    only recoveries can emit; the output still follows the target exactly."""
    from flax import nnx
    from ssd_jax.config import ModelConfig
    from ssd_jax.draft_vocab import VocabMap
    from ssd_jax.loading.orbax_ckpt import save
    from ssd_jax.models.transformer import Transformer
    target, _, hf_target = vocab6
    vm = VocabMap.from_target_ids(np.array([1, 3, 4, 5]), 6)
    cfg = ModelConfig(vocab_size=vm.draft_size, hidden_size=32, intermediate_size=64,
                      num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)
    save(Transformer(cfg, rngs=nnx.Rngs(0)), None, tmp_path / "d",
         extra={"vocab_map": vm.to_dict()})
    probs = exact_sequence_probs(hf_target, [1, 2, 3], 1.0, 1.0, N_OUT)
    counts, (hits, rounds) = _ssd_counts(target, str(tmp_path / "d"),
                                         SpecConfig(k=2, c=0.5, budget=4), 3200)
    assert 0 < hits < rounds
    assert chi2_pvalue(counts, probs) > 1e-3


def test_sampled_ssd_with_top_p(vocab6):
    target, draft, hf_target = vocab6
    probs = exact_sequence_probs(hf_target, [1, 2, 3], 0.8, 0.9, N_OUT)
    counts, _ = _ssd_counts(target, draft, SpecConfig(k=1, c=0.5, budget=4), 3200, 0.8, 0.9)
    assert chi2_pvalue(counts, probs) > 1e-3


def test_sampled_ssd_with_min_p(vocab6):
    """min_p on both sides (the target's p, the tree's and backup's q): the output follows the
    min-p target, and the same counts reject the law without min_p (the setting bites)."""
    target, draft, hf_target = vocab6
    counts, _ = _ssd_counts(target, draft, SpecConfig(k=2, c=0.5, budget=4), 3200, min_p=0.3)
    assert chi2_pvalue(counts, exact_sequence_probs(hf_target, [1, 2, 3], 1.0, 1.0, N_OUT,
                                                    min_p=0.3)) > 1e-3
    assert chi2_pvalue(counts, exact_sequence_probs(hf_target, [1, 2, 3], 1.0, 1.0,
                                                    N_OUT)) < 1e-3


def test_sampled_ssd_with_logit_bias(vocab6):
    """The target's logits biased (token 1 favoured, 4 banned); the draft's tree, forks and
    backup propose without the bias, and the output still follows the biased target."""
    target, draft, hf_target = vocab6
    bias = {1: 1.5, 4: -100.0, 5: -0.7}
    probs = exact_sequence_probs(hf_target, [1, 2, 3], 0.9, 1.0, N_OUT, bias=bias)
    counts, (hits, rounds) = _ssd_counts(target, draft, SpecConfig(k=2, c=0.5, budget=4), 3200,
                                         0.9, logit_bias=bias)
    assert 0 < hits < rounds
    assert chi2_pvalue(counts, probs) > 1e-3


def test_sampled_ssd_with_min_tokens(vocab6):
    """min_tokens=2 with stop id 2: masked in the target's first two positions; a row may stop
    at its third token (frozen mid-round), so the law compared is the first three tokens'."""
    target, draft, hf_target = vocab6
    probs = exact_sequence_probs(hf_target, [1, 2, 3], 1.0, 1.0, 3, no_stop=([2], 2))
    counts, _ = _ssd_counts(target, draft, SpecConfig(k=2, c=0.5, budget=4), 3200,
                            stop_token_ids=(2,), min_tokens=2)
    first3: dict = {}
    for seq, c in counts.items():
        first3[seq[:3]] = first3.get(seq[:3], 0) + c
    assert any(seq[2] == 2 for seq in first3)  # the third token may stop
    assert chi2_pvalue(first3, probs) > 1e-3


@pytest.mark.parametrize("backup", ["neural", "fast"])
def test_ssd_distribution_test_has_teeth(vocab6_noisy, monkeypatch, backup):
    """Recovery sampled from p instead of the residual (ratio rule) or instead of p without the
    guess (point mass): the same test rejects it (p-values ~1e-15 measured, over seeds)."""
    import ssd_jax.core.verify as verify_mod
    target, draft, hf_target = vocab6_noisy
    monkeypatch.setattr(verify_mod, "_recovery_weights", lambda p_k, q_k, s_k, pm: p_k)
    jax.clear_caches()
    probs = exact_sequence_probs(hf_target, [1, 2, 3], 1.0, 1.0, N_OUT)
    counts, _ = _ssd_counts(target, draft, SpecConfig(k=1, backup=backup, budget=4), 3200)
    jax.clear_caches()
    assert chi2_pvalue(counts, probs) < 1e-3


# ---------------------------------------------------------------- tree decode and fork

def _draft_state(runner, prompt, last, spec, fan, temperature):
    """A draft side holding the prompt in its cache, r = `last`, speculation `spec` under
    verification."""
    B, T = prompt.shape
    cache = runner.new_cache(B, 64)
    _, kv = runner.forward(jnp.asarray(prompt), jnp.broadcast_to(jnp.arange(T), (B, T)), cache,
                           jnp.zeros((B,), jnp.int32), causal_mask(B, T))
    cache = commit(cache, kv, jnp.zeros((B,), jnp.int32))
    rows = RowState(prev=jnp.asarray(prompt[:, -1]), last=last, lengths=jnp.full((B,), T),
                    generated=jnp.ones(B, jnp.int32), done=jnp.zeros(B, bool))
    no = jnp.zeros(B, bool)
    ds = DraftState(rows, cache, jnp.zeros((B, 64), jnp.int32),
                    Speculation(spec, None, no, no), FanLists(fan, fan))
    req = Requests(RowSampling(jnp.full(B, temperature), jnp.zeros(B, jnp.int32), jnp.ones(B),
                               jax.vmap(jax.random.key)(jnp.arange(B, dtype=jnp.uint32)),
                               jnp.zeros((B, 1), jnp.int32), jnp.zeros((B, 1)), jnp.zeros(B),
                               jnp.zeros(B), jnp.ones(B), jnp.zeros(B)),
                   jnp.full((B, 1), -1, jnp.int32), jnp.full((B,), 100, jnp.int32),
                   jnp.zeros((B,), jnp.int32))
    return ds, req


def test_tree_branches_equal_plain_decode(pair):
    """Every branch's draft distributions equal a plain AR decode of prefix + glue[:j+1] +
    fork token + the branch's own tokens; no branch forks on the excluded token; keys unique."""
    _, draft = pair
    runner = ModelRunner(draft)
    K, M, B = 3, 8, 2
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 128, size=(B, 9))
    last = jnp.array([17, 42])
    spec = jnp.asarray(rng.integers(0, 128, size=(B, K)), jnp.int32)
    fan = jnp.array([[3, 2, 2, 1], [1, 1, 2, 4]], jnp.int32)
    ds, req = _draft_state(runner, prompt, last, spec, fan, 1.0)
    cfg = DraftConfig(runner.graphdef, SameVocab(128), K, M, greedy_only=False)
    sc, _ = build_cache(cfg, runner.params, ds, req)
    for b in range(B):
        keys = set()
        for m in range(M):
            j, x = int(sc.branch_j[b, m]), int(sc.fork_tok[b, m])
            assert int(fan[b, j]) > 0
            keys.add((j, x))
            if j < K:
                assert x != int(spec[b, j])
            seq = list(prompt[b]) + [int(last[b])] + [int(s) for s in spec[b, :j]] + [x]
            branch = [int(t) for t in sc.tokens[b, m]]
            # plain decode: full forward over prefix + branch tokens, no cache tricks
            full = np.array([seq + branch[:-1]])
            T = full.shape[1]
            logits, _ = runner.forward(jnp.asarray(full), jnp.arange(T)[None],
                                       runner.new_cache(1, T), jnp.zeros((1,), jnp.int32),
                                       causal_mask(1, T))
            ref = jax.nn.softmax(logits[0, len(seq) - 1:], axis=-1)
            np.testing.assert_allclose(np.asarray(sc.q[b, m]), np.asarray(ref), atol=2e-5)
        assert len(keys) == M


def _built_round(draft, seed: int, m: int, fan_row: list[int], temperature: float):
    """Two rows (K=3) whose draft side has built its speculation cache and committed the
    glue: (runner, cfg, ds, req, cache), ready for select."""
    runner = ModelRunner(draft)
    K, B = len(fan_row) - 1, 2
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, 128, size=(B, 9))
    spec = jnp.asarray(rng.integers(0, 128, size=(B, K)), jnp.int32)
    ds, req = _draft_state(runner, prompt, jnp.array([17, 42]), spec,
                           jnp.array([fan_row] * B, jnp.int32), temperature)
    cfg = DraftConfig(runner.graphdef, SameVocab(128), K, m, greedy_only=temperature == 0,
                      backup=BACKUPS["neural"])
    sc, glue_kv = build_cache(cfg, runner.params, ds, req)
    return runner, cfg, ds._replace(cache=commit(ds.cache, glue_kv, ds.rows.lengths)), req, sc


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_known_glue_equals_a_full_glue_pass(pair, temperature):
    """Row 0 hits a cached branch, row 1 misses and takes the neural backup: both speculations
    came out of the draft, so the next build feeds s_K alone (glue.py). Its glue K/V and fork
    candidates must equal a full glue pass over [r, s_1..s_K] (ds.glue=None), and so must the
    tree built on them."""
    K, M = 3, 8
    runner, cfg, ds, req, sc = _built_round(pair[1], 2, M, [2, 2, 2, 2], temperature)
    m0 = 5  # a branch of row 0 at accept length 2
    n = jnp.array([int(sc.branch_j[0, m0]), 1])
    cached = {int(x) for x in sc.fork_tok[1][np.asarray(sc.branch_j[1]) == 1]}
    t = jnp.array([int(sc.fork_tok[0, m0]), next(x for x in range(128) if x not in cached)])
    after, nxt, _ = select(cfg, runner.params, ds, sc, Outcome(n, t), req)
    assert np.asarray(nxt.hit).tolist() == [True, False]
    assert np.asarray(after.glue.ok).all()
    known, known_kv = build_cache(cfg, runner.params, after, req)
    full, full_kv = build_cache(cfg, runner.params, after._replace(glue=None), req)
    for a, b in zip(jax.tree.leaves(known_kv), jax.tree.leaves(full_kv)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(known.cand), np.asarray(full.cand))
    np.testing.assert_array_equal(np.asarray(known.fork_tok), np.asarray(full.fork_tok))
    np.testing.assert_array_equal(np.asarray(known.tokens), np.asarray(full.tokens))
    # A fast-backup guess came from no decoding: its row has no known prefix.
    fast = DraftConfig(runner.graphdef, SameVocab(128), K, M, greedy_only=temperature == 0,
                       backup=BACKUPS["fast"])
    after_fast, _, _ = select(fast, runner.params, ds, sc, Outcome(n, t), req)
    assert np.asarray(after_fast.glue.ok).tolist() == [True, False]


def test_backup_runs_only_when_a_live_row_misses(pair):
    """Row 0 hits; row 1 misses. While row 1 is live, select fills it from the neural backup;
    once row 1 is finished (or padding), its miss must not run the K-step backup at all (its
    speculation is discarded), so the batch's round costs what an all-hit round costs."""
    from flax import nnx
    runner, cfg, ds, req, sc = _built_round(pair[1], 1, 6, [3, 1, 1, 1], 0.0)
    n = jnp.array([0, 0])
    cached = {int(x) for x in sc.fork_tok[1][np.asarray(sc.branch_j[1]) == 0]}
    miss_tok = next(x for x in range(128) if x not in cached)
    t = jnp.array([int(sc.fork_tok[0, 0]), miss_tok])
    assert int(sc.branch_j[0, 0]) == 0

    def run(done):
        before = ds._replace(rows=ds.rows._replace(done=jnp.array(done)))
        after, spec, _ = select(cfg, runner.params, before, sc, Outcome(n, t), req)
        return after, np.asarray(spec.tokens), np.asarray(spec.hit)

    after, toks, hit = run([False, False])
    assert hit.tolist() == [True, False]
    np.testing.assert_array_equal(toks[0], np.asarray(sc.tokens[0, 0]))
    # The backup: K draft tokens after r = t at the advanced length, from the committed cache.
    assert after.rows.lengths.tolist() == [10, 10]
    want, _, _, _ = draft_decode(runner.graphdef.merge(runner.params), cfg, t[:, None],
                                 after.rows.lengths, ds.cache, req, after.rows.generated + 1)
    np.testing.assert_array_equal(toks[1], np.asarray(want[1]))
    assert toks[1].any()  # the skipped branch would give zeros: this test tells them apart
    _, toks, _ = run([False, True])
    np.testing.assert_array_equal(toks[1], 0)  # backup skipped: row 1 is done
    np.testing.assert_array_equal(toks[0], np.asarray(sc.tokens[0, 0]))


def test_truncated_vocab_draft_is_lossless(pair, tmp_path):
    """A draft over 100 of the target's 128 tokens (draft_vocab.VocabMap, saved in the orbax
    checkpoint): SD and SSD still reproduce AR exactly, and sampled runs complete."""
    from flax import nnx
    from ssd_jax.config import ModelConfig
    from ssd_jax.draft_vocab import VocabMap
    from ssd_jax.loading.orbax_ckpt import save
    from ssd_jax.models.transformer import Transformer
    target, _ = pair
    vm = VocabMap.from_target_ids(np.random.default_rng(0).permutation(128)[:100], 128)
    cfg = ModelConfig(vocab_size=vm.draft_size, hidden_size=32, intermediate_size=64,
                      num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)
    save(Transformer(cfg, rngs=nnx.Rngs(0)), None, tmp_path / "d", extra={"vocab_map": vm.to_dict()})
    llm = LLM(target, draft=str(tmp_path / "d"), spec=SpecConfig(k=3, budget=8),
              engine=EngineConfig(max_batch=4, max_seq_len=128, prefill_bucket=16,
                                  driver="single"))
    p = SamplingParams(max_new_tokens=16, ignore_eos=True)
    want = [o.token_ids for o in llm.generate(PROMPTS[:2], p, mode="ar")]
    for mode in ("sd", "ssd"):
        assert [o.token_ids for o in llm.generate(PROMPTS[:2], p, mode=mode)] == want
    ps = SamplingParams(max_new_tokens=16, ignore_eos=True, temperature=1.0)
    for mode in ("sd", "ssd"):
        assert all(len(o.token_ids) == 16 for o in llm.generate(PROMPTS[:2], ps, mode=mode))


def test_auto_backup_is_lossless_and_reports_choice(pair):
    target, draft = pair
    llm = LLM(target, draft=draft, spec=SpecConfig(k=3, backup="auto", budget=8), engine=ENGINE)
    p = SamplingParams(max_new_tokens=24, ignore_eos=True)
    want = [o.token_ids for o in llm.generate(PROMPTS, p, mode="ar")]
    out = llm.generate(PROMPTS, p, mode="ssd")
    assert [o.token_ids for o in out] == want
    assert out[0].metrics.ssd.backup in ("neural", "fast")


def _masked_ranking(g, exclude, f):
    """Oracle, the definition: `exclude` set to -1e30, then token ids by (logit desc, id asc),
    the first f."""
    g = np.where(np.arange(len(g)) == exclude, -1e30, g)
    return sorted(range(len(g)), key=lambda i: (-g[i], i))[:f]


@pytest.mark.parametrize("vocab_size,f", [(40, 4), (6, 6)])  # (6, 6): f + 1 > V, masked form
def test_fork_candidates_rank_the_rest_without_the_speculated_token(vocab_size, f):
    """fork_candidates (one top-(f+1), the excluded token dropped) and the greedy tree step's
    fused form against a sort, with the excluded token at every rank, ties, and a draft
    vocabulary whose ids name other target ids (its OOV column never proposed)."""
    rng = np.random.default_rng(0)
    g = rng.integers(0, 6, size=(3, vocab_size)).astype(np.float32)  # many ties
    ids = rng.permutation(100)[:vocab_size - 1]
    for vocab, names in ((SameVocab(vocab_size), np.arange(vocab_size)),
                         (VocabMap.from_target_ids(ids, 100), np.append(ids, -1))):
        proposable = np.asarray(vocab.proposable(jnp.asarray(g)))
        for rank in range(vocab_size):
            ex = np.array([sorted(range(vocab_size), key=lambda i: (-row[i], i))[rank]
                           for row in proposable])
            if (names[ex] < 0).any():  # the OOV column: no target id names it
                continue
            got = fork_candidates(vocab, jnp.asarray(g), jnp.asarray(names[ex]), f)
            want = [names[_masked_ranking(row, e, f)] for row, e in zip(proposable, ex)]
            assert (np.asarray(got) == np.array(want)).all(), (rank, got, want)
        x, cand = greedy_with_candidates(vocab, jnp.asarray(g), f)
        top = proposable.argmax(-1)
        assert (np.asarray(x) == names[top]).all()
        assert (np.asarray(cand) == np.array([names[_masked_ranking(row, t, f)]
                                               for row, t in zip(proposable, top)])).all()
