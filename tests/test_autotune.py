"""Automatic speculation settings: the cost model's choices, the store, and an engine run that
chooses its own K and budget and stays exact."""
import numpy as np
import pytest

from ssd_jax import autotune
from ssd_jax.autotune import StepCosts, TuneStore, choose, hit_rate, predict


def _costs(verify_per_token: float, draft_step: float, draft_per_token: float) -> StepCosts:
    target = {t: 0.1 * (1 + verify_per_token * (t - 1)) for t in autotune.TARGET_TOKENS}
    draft = {t: draft_step * (1 + draft_per_token * (t - 1)) for t in autotune.DRAFT_TOKENS}
    return StepCosts(target, draft)


def test_hit_rate_grows_with_branches_and_acceptance():
    fans = [np.array(f) for f in ([1, 1, 1], [2, 2, 2], [3, 3, 3])]
    rates = [hit_rate(0.8, 1.5, f) for f in fans]
    assert rates[0] < rates[1] < rates[2] < 1
    assert hit_rate(0.9, 1.5, fans[1]) > hit_rate(0.5, 1.5, fans[1])
    assert hit_rate(0.8, 1.5, np.array([0, 0, 3])) < hit_rate(0.8, 1.5, np.array([1, 1, 1]))


def test_predictions_follow_the_speed_model_by_hand():
    """K=1, M=2, a=0.5, r=1, costs chosen so every term is easy to compute by hand."""
    costs = StepCosts({1: 0.1, 2: 0.2}, {1: 0.04, 2: 0.15, 3: 0.15})
    got = predict(costs, 1, 2, a=0.5, r=1.0, batch=1)
    # Fan-out of M=2 over two outcomes of equal weight: [1, 1]. P(0) = P(1) = 0.5.
    assert got["fanout"] == [1, 1]
    p = 0.5 * (1 - 2 ** -1) + 0.5 * (1 - 0.5 * 1 ** -1)  # 0.25 + 0.25
    e = 0.5 * 1 + 0.5 * 2
    # Neural backup: every speculation was decoded by the draft, so the glue feeds one token
    # (core/glue.py); then one tree step of M=2.
    t_v, t_build, t_b = 0.2, 0.04 + 0.15, 0.04
    den = p * max(1, t_build / t_v) + (1 - p) * (1 + t_b / t_v)
    assert got["hit_rate"] == pytest.approx(p)
    assert got["ssd"] == pytest.approx(e / (t_v * den))
    assert got["sd"] == pytest.approx(e / (0.04 + 0.2))
    assert got["ar"] == pytest.approx(10.0)
    # Fast backup: after a miss the speculation is an n-gram guess, whose glue scores K+1 = 2.
    fast = predict(costs, 1, 2, a=0.5, r=1.0, batch=1, backup="fast")
    t_build = p * 0.04 + (1 - p) * 0.15 + 0.15
    den = p * max(1, t_build / t_v) + (1 - p) * 1
    assert fast["ssd"] == pytest.approx((p * e + (1 - p) * autotune.FAST_E_MISS) / (t_v * den))


def test_overlap_slows_ssd_alone():
    """Learnt overlap factors scale SSD's verification and build; SD and AR run one side at a
    time and keep the step costs as timed."""
    from dataclasses import replace
    costs = _costs(0.2, 0.03, 0.1)
    alone = predict(costs, 2, 6, a=0.8, r=1.5, batch=1)
    both = predict(replace(costs, verify_overlap=1.25, build_overlap=1.25), 2, 6, a=0.8,
                   r=1.5, batch=1)
    # Build and backup ratios to verification: the build's is unchanged, the backup's (the
    # target waits, alone) shrinks, so SSD slows by at most the factor and at least a bit.
    assert alone["ssd"] / 1.25 <= both["ssd"] < alone["ssd"]
    assert (both["sd"], both["ar"]) == (alone["sd"], alone["ar"])
    # SD's drafting scale is also the neural backup's: K draft steps in series either way.
    slow = predict(replace(costs, sd_draft_scale=1.5), 2, 6, a=0.8, r=1.5, batch=1)
    fast = predict(replace(costs, sd_draft_scale=1.5), 2, 6, a=0.8, r=1.5, batch=1,
                   backup="fast")
    assert slow["ssd"] < alone["ssd"] and slow["sd"] < alone["sd"]
    assert fast["ssd"] == predict(costs, 2, 6, a=0.8, r=1.5, batch=1, backup="fast")["ssd"]
    # The target's decode-time multiples, per token count, scale AR's step and SD's
    # verification; SSD's verification has its own learnt multiple (verify_overlap).
    scaled = predict(replace(costs, target_scale={1: 1.2, 3: 0.9}), 2, 6, a=0.8, r=1.5, batch=1)
    assert scaled["ar"] == pytest.approx(1 / (1.2 * costs.target[1]))
    e = alone["tokens_per_round"]
    assert scaled["sd"] == pytest.approx(e / (2 * costs.draft_at(1) + 0.9 * costs.target[3]))
    assert scaled["ssd"] == alone["ssd"]
    k3 = predict(replace(costs, target_scale={1: 1.2, 3: 0.9}), 3, 6, a=0.8, r=1.5, batch=1)
    assert k3["sd"] == predict(costs, 3, 6, a=0.8, r=1.5, batch=1)["sd"]  # T=4: none learnt


def test_overlap_of_a_run_is_robust_to_a_compile():
    """Per-round means against the step costs: one round that compiled (10 s) moves nothing,
    uneven rounds count as they cost (half at 1x and half at 1.6x the step cost: 1.3x)."""
    costs = _costs(0.2, 0.03, 0.1)
    k, m = 2, 6
    build = autotune.build_seconds(costs, k, m, "neural", 0.8)
    assert build == pytest.approx(costs.draft_at(1) + k * costs.draft_at(m))
    verify_rounds = [10.0] + [1.0 * costs.target[k + 1], 1.6 * costs.target[k + 1]] * 10
    build_rounds = [10.0] + [1.1 * build] * 20
    got = autotune.overlap_of_run(costs, k, m, "neural", 0.8, verify_rounds, build_rounds)
    assert got == pytest.approx((1.3, 1.1))
    assert autotune.overlap_of_run(costs, k, m, "neural", 0.8, verify_rounds[:5],
                                   build_rounds[:5]) is None  # too few rounds to say


def test_a_hit_round_waits_for_the_later_of_build_and_verification():
    """E[max(1, ratio + spread Z)] against a sampled mean; no spread: the paper's max."""
    rng = np.random.default_rng(0)
    z = rng.standard_normal(400_000)
    for ratio, spread in ((1.0, 0.15), (0.8, 0.2), (1.3, 0.1), (0.5, 0.05)):
        want = np.maximum(1.0, ratio + spread * z).mean()
        assert autotune.expected_wait(ratio, spread) == pytest.approx(want, abs=2e-3)
    assert autotune.expected_wait(0.7, 0.0) == 1.0
    assert autotune.expected_wait(1.4, 0.0) == 1.4
    # A spread slows SSD wherever the build can overrun (most where it takes as long as the
    # verification), so the choice leans to builds that fit with room.
    from dataclasses import replace
    costs = _costs(0.2, 0.03, 0.1)
    calm, jumpy = (predict(replace(costs, round_spread=s), 2, 6, a=0.8, r=1.5, batch=1)
                   for s in (0.0, 0.2))
    assert jumpy["ssd"] < calm["ssd"]


def test_spread_of_a_run_gives_back_the_wait_it_was_made_with():
    """A run whose wait after verification is what the model says at a spread gives that
    spread back; a wait the spread-free model already covers gives 0."""
    from dataclasses import replace
    costs = replace(_costs(0.2, 0.03, 0.1), sd_draft_scale=1.2)
    k, p_all, v, b = 3, 0.75, 0.40, 0.38
    t_backup = k * costs.draft_at(1) * 1.2  # by hand: K steps at SD's drafting multiple
    assert autotune.backup_seconds(costs, k, "neural") == pytest.approx(t_backup)
    for spread in (0.05, 0.15, 0.3):
        wait = p_all * v * (autotune.expected_wait(b / v, spread) - 1) + (1 - p_all) * t_backup
        got = autotune.spread_of_run(costs, k, "neural", p_all, [v] * 20, [b] * 20, wait)
        assert got == pytest.approx(spread, abs=1e-6)
    assert autotune.spread_of_run(costs, k, "neural", p_all, [v] * 20, [b] * 20,
                                  0.5 * (1 - p_all) * t_backup) == 0.0
    assert autotune.spread_of_run(costs, k, "neural", p_all, [v] * 5, [b] * 5, 0.1) is None


def test_miss_exponent_recovers_the_hit_models_r():
    for a, fan, r in ((0.88, [2, 1, 1, 2], 0.9), (0.6, [4, 2, 1], 2.5), (0.8, [3, 3, 6], 1.5)):
        got = autotune.miss_exponent(a, fan, hit_rate(a, r, np.array(fan)))
        assert got == pytest.approx(r, abs=1e-3)


def test_choice_follows_the_costs():
    # A free draft and flat verification: speculate as far as measured.
    cheap = choose(_costs(0.0, 1e-4, 0.0), a=0.9, r=2.0)
    assert cheap.k == autotune.K_MAX
    # A draft step costing 60% of a target step whose tree steps grow with branches, and a
    # verification that doubles by K+1=5: short speculation, few branches.
    dear = choose(_costs(0.25, 0.06, 0.15), a=0.85, r=2.0)
    assert dear.k <= 2 and dear.budget <= 3 * (dear.k + 1)
    assert dear.tok_s["ssd"] >= max(predict(_costs(0.25, 0.06, 0.15), k, m, a=0.85, r=2.0,
                                            batch=1)["ssd"]
                                    for k in (1, 2, 3, 4) for m in range(k + 1, 4 * (k + 1) + 1))
    sd = choose(_costs(0.25, 0.06, 0.15), a=0.85, r=2.0, mode="sd")
    assert sd.tok_s["sd"] == max(predict(_costs(0.25, 0.06, 0.15), k, k + 1, a=0.85, r=2.0,
                                         batch=1)["sd"] for k in (1, 2, 3, 4))
    # Acceptance too low for that dear draft: the best speculation is predicted below AR,
    # which the choice says (the engine warns; it still runs the mode asked for).
    low = choose(_costs(0.25, 0.06, 0.15), a=0.2, r=2.0, mode="sd")
    assert low.ar_is_faster("sd") and low.tok_s["sd"] < low.tok_s["ar"]
    assert not sd.ar_is_faster("sd") and not cheap.ar_is_faster("ssd")


def test_rounds_per_answer_match_a_simulated_decode():
    """An answer's rounds against an independent simulation of the loop: rounds dispatched
    sync_every at a time, the host reading after each chunk whether the row has its tokens
    (each round emitting n + 1, n drawn from the capped-geometric law)."""
    from ssd_jax.core.fanout import geometric_probs
    rng = np.random.default_rng(0)
    for a, k, tokens, sync in ((0.92, 4, 95, 2), (0.6, 3, 40, 1), (0.8, 2, 200, 8)):
        rounds = []
        for _ in range(4000):
            got = n = 0
            while got < tokens:
                emitted = rng.choice(k + 1, size=sync, p=geometric_probs(a, k)) + 1
                got, n = got + emitted.sum(), n + sync
                if got >= tokens:  # the rounds of the chunk after the row's end still ran
                    break
            rounds.append(n)
        want = float(np.mean(rounds))
        assert autotune.rounds_per_answer(a, k, tokens, sync) == pytest.approx(want, rel=0.02)
    # Long answers: E tokens a round; past the horizon the count grows by 1 / E a token.
    e = autotune._tokens_per_round(0.9, 4)
    long = autotune.rounds_per_answer(0.9, 4, 20_000)
    assert long == pytest.approx(20_000 / e, rel=1e-3)
    assert (autotune.rounds_per_answer(0.9, 4, 20_001) - long) == pytest.approx(1 / e)
    # The prediction for short answers: SD and SSD by E over the tokens a round, AR as it was.
    costs = _costs(0.25, 0.03, 0.1)
    steady = predict(costs, 3, 6, a=0.8, r=1.5, batch=1)
    short = predict(costs, 3, 6, a=0.8, r=1.5, batch=1, answer=(63, 2))
    ratio = 63 / autotune._tokens_per_round(0.8, 3) / autotune.rounds_per_answer(0.8, 3, 63, 2)
    assert ratio < 0.97
    assert short["sd"] == pytest.approx(steady["sd"] * ratio)
    assert short["ssd"] == pytest.approx(steady["ssd"] * ratio)
    assert short["ar"] == steady["ar"]


def test_acceptance_is_recovered_from_accept_lengths():
    """Rounds drawn from the capped-geometric law give back its a."""
    from ssd_jax.core.fanout import geometric_probs
    for a, k in ((0.3, 2), (0.8, 4), (0.95, 3)):
        hist = np.round(geometric_probs(a, k) * 1e6)
        assert autotune.acceptance_from_rounds(hist) == pytest.approx(a, abs=1e-3)
    assert autotune.acceptance_from_rounds([0, 0]) is None


def test_store_keeps_costs_and_blends_acceptance(tmp_path):
    store = TuneStore(tmp_path / "autotune.json")
    costs = _costs(0.1, 0.01, 0.1)
    assert store.costs("k") is None and store.acceptance("p") == (autotune.PRIOR_A,
                                                                  autotune.PRIOR_R)
    store.save_costs("k", costs, note="test")
    assert store.costs("k") == costs
    # Runs pool by their rounds until the window fills; then older evidence fades.
    store.observe("p", 0.9, rounds=30)
    store.observe("p", 0.5, rounds=10)
    assert store.acceptance("p")[0] == pytest.approx(0.8)
    # Hit rates pool like acceptance, and r is fitted to the pooled a and hit rate at the
    # latest run's fan-out (not a mean of per-run r's, which leans on the easiest runs).
    fan = [2, 2, 1, 3]
    store.observe("p", 0.7, hit=0.8, fan=fan, rounds=60)
    store.observe("p", 0.7, hit=0.96, fan=fan, rounds=20)
    a = (27 + 5 + 56) / 120
    assert store.acceptance("p") == pytest.approx((a, autotune.miss_exponent(a, fan, 0.84)))
    assert hit_rate(a, store.acceptance("p")[1], np.array(fan)) == pytest.approx(0.84, abs=1e-6)
    mean_r = (60 * autotune.miss_exponent(0.7, fan, 0.8)
              + 20 * autotune.miss_exponent(0.7, fan, 0.96)) / 80
    assert hit_rate(0.7, mean_r, np.array(fan)) > 0.85  # the mean of r's: too high
    for _ in range(20):
        store.observe("p", 0.6, rounds=autotune.ACCEPT_WINDOW)
    store.observe("p", 0.9, rounds=autotune.ACCEPT_WINDOW // 3)
    assert store.acceptance("p")[0] == pytest.approx(0.6 + 0.3 / 4)
    store.forget("p")
    assert store.acceptance("p") == (autotune.PRIOR_A, autotune.PRIOR_R)
    # Learnt scales pool by rounds as acceptance does; the first run after the costs were
    # measured stands alone (not blended with the prior 1.0).
    store.observe_scales("k", rounds=30, verify_overlap=1.4, build_overlap=1.2,
                         sd_draft_scale=2.0, round_spread=0.2)
    store.observe_target_scale("k", 4, 1.1, rounds=30)
    store.observe_target_scale("k", 4, 0.9, rounds=10)
    store.observe_target_scale("k", 1, 1.2, rounds=100)
    got = store.costs("k")
    assert (got.verify_overlap, got.build_overlap, got.sd_draft_scale,
            got.round_spread) == pytest.approx((1.4, 1.2, 2.0, 0.2))
    assert got.target_scale == pytest.approx({4: 1.05, 1: 1.2})
    assert got.target_run(4) == pytest.approx(1.05 * costs.target[4])
    assert got.target_run(2) == costs.target[2] and got.target == costs.target
    store.observe_scales("k", rounds=10, verify_overlap=1.0)
    assert store.costs("k").verify_overlap == pytest.approx(1.3)
    assert store.costs("k").build_overlap == pytest.approx(1.2)
    W = autotune.ACCEPT_WINDOW
    for _ in range(20):
        store.observe_scales("k", rounds=W, verify_overlap=1.2)
    store.observe_scales("k", rounds=W // 3, verify_overlap=1.6)
    assert store.costs("k").verify_overlap == pytest.approx(1.2 + 0.4 / 4)
    store.save_costs("k", costs, note="measured afresh")  # new costs: what runs taught goes
    store.observe_scales("k", rounds=5, verify_overlap=1.5)
    assert store.costs("k").verify_overlap == pytest.approx(1.5)
    # Restarted multiples stay as a first guess until the next run's lesson replaces them
    # (the target's per token count too); then runs pool again.
    store.observe_target_scale("k", 5, 1.3, rounds=W)
    store.restart_multiples("k")
    assert store.costs("k").verify_overlap == pytest.approx(1.5)
    store.observe_scales("k", rounds=5, verify_overlap=1.1)
    store.observe_target_scale("k", 5, 0.9, rounds=5)
    assert store.costs("k").verify_overlap == pytest.approx(1.1)
    assert store.costs("k").target_scale[5] == pytest.approx(0.9)
    store.observe_scales("k", rounds=5, verify_overlap=1.3)
    assert store.costs("k").verify_overlap == pytest.approx(1.2)
    store.restart_multiples("absent")  # nothing stored there: nothing to restart


def _noisy_pair(tiny_llama, tmp_path, max_batch: int):
    """An LLM over the tiny target and a noisy copy as its draft, one process, its tuning
    store in tmp_path."""
    from tests.conftest import save_noisy_draft
    from ssd_jax import LLM, EngineConfig
    from ssd_jax.loading import load
    save_noisy_draft(tiny_llama[1], tmp_path / "draft")
    target, _, _ = load(tiny_llama[0])
    draft, _, _ = load(tmp_path / "draft")
    return LLM(target, draft=draft, cache_dir=tmp_path,
               engine=EngineConfig(max_batch=max_batch, max_seq_len=128, prefill_bucket=16,
                                   driver="single"))


def test_a_given_k_past_the_stored_costs_decodes_exactly_and_learns_nothing(tiny_llama,
                                                                            tmp_path):
    # Step costs reach K_MAX + 1 tokens; a caller's K past that has no target(K+1) to hold
    # its rounds to. It once failed with a KeyError in learning, after the answer was out.
    from ssd_jax import SamplingParams
    from ssd_jax.config import SpecConfig
    llm = _noisy_pair(tiny_llama, tmp_path, max_batch=1)
    store = TuneStore(tmp_path / "autotune.json")
    costs = llm.core._step_costs("ssd", 1)
    key = llm.core._cost_key("ssd", 1)[0]
    assert max(costs.target) == autotune.K_MAX + 1 and store.costs(key) == costs
    p = SamplingParams(max_new_tokens=16, ignore_eos=True)
    ar = [o.token_ids for o in llm.generate([[5, 6, 7, 8]], p, mode="ar")]
    k = autotune.K_MAX + 2
    for mode in ("sd", "ssd"):
        out = llm.generate([[5, 6, 7, 8]], p, mode=mode, spec=SpecConfig(k=k, budget=k + 2),
                           sync_phases=True)
        assert [o.token_ids for o in out] == ar and len(out[0].metrics.verify_rounds) >= 2
    assert store.costs(key) == costs


def test_engine_chooses_settings_and_stays_exact(tiny_llama, tmp_path, caplog):
    """SpecConfig() measures costs (single driver), picks K/M, reports them, equals AR."""
    from ssd_jax import SamplingParams
    llm = _noisy_pair(tiny_llama, tmp_path, max_batch=2)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    p = SamplingParams(max_new_tokens=12, ignore_eos=True)
    ar = [o.token_ids for o in llm.generate(prompts, p, mode="ar")]
    for mode in ("sd", "ssd"):
        out = llm.generate(prompts, p, mode=mode)
        assert [o.token_ids for o in out] == ar
        s = out[0].metrics.settings
        assert s["automatic"] and 1 <= s["k"] <= autotune.K_MAX and s["predicted_tok_s"] > 0
    assert (tmp_path / "autotune.json").exists()
    # Settings given by the caller: the same model's prediction for them (costs are stored).
    from ssd_jax.config import SpecConfig
    given = llm.generate(prompts, p, mode="ssd", spec=SpecConfig(k=2, budget=5))[0].metrics
    want = autotune.predict(TuneStore(tmp_path / "autotune.json").costs(
        llm.core._cost_key("ssd", given.settings["rows"])[0]), 2, 5, a=given.settings["a_prior"],
        r=given.settings["r_prior"], batch=given.settings["rows"],
        answer=(11, llm.core.config.sync_every))["ssd"]  # 12 tokens: 11 after the prefill's
    assert not given.settings["automatic"]
    assert given.settings["predicted_tok_s"] == pytest.approx(want)
    store = TuneStore(tmp_path / "autotune.json")
    assert store.acceptance("model|model")[0] != autotune.PRIOR_A
    # Learning weighs the evidence: a run's rounds against the rounds the store holds (at
    # most the window). After forget_acceptance a run stands alone; against a full window, a
    # run of 10 rounds moves the stored figure by 10 / (window + 10).
    from ssd_jax.core.metrics import RunMetrics
    W = autotune.ACCEPT_WINDOW
    m = RunMetrics("ssd", 1, accept_hist=[0, 0, 10], k=2)  # all accepted: a = 0.98
    llm.core.forget_acceptance()
    assert store.acceptance("model|model")[0] == autotune.PRIOR_A
    llm.core.learn("ssd", m)
    assert store.acceptance("model|model")[0] == pytest.approx(0.98)
    llm.core.forget_acceptance()
    store.observe("model|model", 0.2, rounds=W)
    llm.core.learn("ssd", m)
    got = store.acceptance("model|model")[0]
    assert got == pytest.approx(0.2 + 10 / (W + 10) * (0.98 - 0.2), abs=1e-6)
    # A greedy SSD run timed per round teaches the hit model's r and the overlap factors of
    # its step costs (here one process, phases apart: whatever they measure, not the prior);
    # an SD run its drafting's multiple of the draft's step cost.
    long = SamplingParams(max_new_tokens=80, ignore_eos=True)
    for mode, names in (("ssd", ("verify_overlap", "build_overlap")),
                        ("sd", ("sd_draft_scale",))):
        m = llm.generate(prompts, long, mode=mode, sync_phases=True)[0].metrics
        assert len(m.verify_rounds) == m.decode_steps >= 8
        assert len(m.ssd.build_rounds if mode == "ssd" else m.draft_rounds) == m.decode_steps
        entry = store._read()["costs"][llm.core._cost_key(mode, m.settings["rows"])[0]]
        assert all(entry[name] != 1.0 for name in names)
        if mode == "sd":  # and its verification, the target's steps of K+1 tokens
            assert str(m.settings["k"] + 1) in entry["target_scale"]
        if mode == "ssd":  # whole answers (>= STEADY_ROUNDS rounds a row) teach r; one
            # process learns no spread (its wait after verification holds the whole build)
            assert entry["round_spread"] == 0.0
            assert m.ssd.rounds >= 20 * len(prompts)
            assert "r" in store._read()["pairs"]["model|model"]
    # An AR run teaches the target's decode-time scale from its steps, a chunk at a time
    # without the first (costs measured afresh: it stands alone), and the model's AR speed
    # for the batch has it.
    key = llm.core._cost_key("ar", 2)[0]
    store.save_costs(key, store.costs(key), note="afresh")
    m = llm.generate(prompts, long, mode="ar")[0].metrics
    entry = store._read()["costs"][key]
    assert len(m.step_chunks) == -(-m.decode_steps // llm.engine.sync_every) >= 9
    assert entry["target_scale"]["rounds_1"] == pytest.approx(
        m.decode_steps * (len(m.step_chunks) - 1) / len(m.step_chunks), abs=1)
    assert entry["target_scale"]["1"] == pytest.approx(np.clip(
        autotune.per_round(m.step_chunks[1:]) / entry["target"]["1"], 0.5, 3.0))
    assert llm.core.ar_prediction(2) == pytest.approx(
        2 / (entry["target"]["1"] * entry["target_scale"]["1"]))
    # Acceptance too low to pay (a draft as large as its target): the run is still the mode
    # asked for, and exact, but the log says AR would be faster.
    # The costs are the timed target's for both sides (the same model), with no learnt
    # multiples: SD's prediction then cannot beat AR's on a noisy machine's timings.
    llm.core.forget_acceptance()
    store.observe("model|model", 0.05, rounds=W)
    key = llm.core._cost_key("sd", 2)[0]
    timed = store.costs(key).target
    store.save_costs(key, autotune.StepCosts(dict(timed), dict(timed)), note="fixed")
    caplog.clear()
    with caplog.at_level("WARNING"):
        out = llm.generate(prompts, p, mode="sd")
    assert [o.token_ids for o in out] == ar and out[0].metrics.mode == "sd"
    said = [r.getMessage() for r in caplog.records if "mode='ar'" in r.getMessage()]
    assert len(said) == 1 and "below AR's" in said[0] and "a=0.05" in said[0]
    # Warned once: a later run whose acceptance moved the verdict says it at INFO (a generate
    # of many batches would otherwise warn every batch).
    store.observe("model|model", 0.07, rounds=W)
    caplog.clear()
    with caplog.at_level("INFO"):
        llm.generate(prompts, p, mode="sd")
    said = [r for r in caplog.records if "below AR's" in r.getMessage()]
    assert [r.levelname for r in said] == ["INFO"] and "a=0.05" not in said[0].getMessage()


def test_sampled_runs_learn_their_own_multiples(tiny_llama, tmp_path):
    """Sampled runs verify more slowly (sampling over the vocabulary), so they keep their own
    cost entry: a copy of the greedy one at first, then taught by sampled runs alone."""
    from ssd_jax import SamplingParams
    llm = _noisy_pair(tiny_llama, tmp_path, max_batch=1)
    store = TuneStore(tmp_path / "autotune.json")
    greedy = SamplingParams(max_new_tokens=40, ignore_eos=True)
    m = llm.generate([[5, 6, 7, 8]], greedy, mode="sd", sync_phases=True)[0].metrics
    g_key = llm.core._cost_key("sd", m.settings["rows"])[0]
    s_key = llm.core._cost_key("sd", m.settings["rows"], sampled=True)[0]
    assert s_key != g_key and s_key not in store._read()["costs"]
    before = dict(store._read()["costs"][g_key])
    sampled = SamplingParams(max_new_tokens=40, ignore_eos=True, temperature=0.8, seed=3)
    m = llm.generate([[5, 6, 7, 8]], sampled, mode="sd", sync_phases=True)[0].metrics
    entries = store._read()["costs"]
    assert entries[g_key] == before  # the greedy entry learnt nothing from the sampled run
    got = entries[s_key]
    assert "sampled (from the greedy entry)" in got["note"]
    assert got["target"] == before["target"] and got["draft"] == before["draft"]
    # The sampled run's lesson stands alone (the copy kept no rounds to blend with).
    k1 = str(m.settings["k"] + 1)
    assert got["target_scale"][f"rounds_{k1}"] == len(m.verify_rounds)
    assert got["rounds_sd_draft_scale"] == len(m.draft_rounds)
    # A bench about to probe a cell restarts that entry's multiples alone (forget_timings):
    # the next sampled run's lesson replaces them; greedy runs' stay pooled.
    llm.core.forget_timings("sd", m.settings["rows"], sampled=True)
    entries = store._read()["costs"]
    assert entries[g_key] == before
    assert entries[s_key]["rounds_sd_draft_scale"] == 0
    assert entries[s_key]["target_scale"][f"rounds_{k1}"] == 0
    assert entries[s_key]["sd_draft_scale"] == got["sd_draft_scale"]  # kept as a first guess


def test_ar_prediction_of_a_target_alone(tiny_llama, tmp_path):
    """An LLM without a draft (`ssd-bench --mode ar`) measures the target's step alone for
    AR's prediction: there is no draft to time, and AR reads nothing else."""
    from ssd_jax import LLM, EngineConfig, SamplingParams
    llm = LLM(tiny_llama[0], cache_dir=tmp_path,
              engine=EngineConfig(max_batch=1, max_seq_len=128, prefill_bucket=16))
    got = llm.core.ar_prediction(1, measure=True)
    entry = TuneStore(tmp_path / "autotune.json")._read()["costs"][
        llm.core._cost_key("ar", 1)[0]]
    assert list(entry["target"]) == ["1"] and entry["draft"] == {}
    assert got == pytest.approx(1 / entry["target"]["1"])
    # An AR run then teaches the target's decode-time multiple, as with a pair.
    m = llm.generate([[5, 6, 7, 8]], SamplingParams(max_new_tokens=80, ignore_eos=True))[0]
    assert m.metrics.mode == "ar"
    assert "1" in TuneStore(tmp_path / "autotune.json")._read()["costs"][
        llm.core._cost_key("ar", 1)[0]]["target_scale"]


def test_cached_costs_are_per_xla_flags_but_not_per_device_count(monkeypatch):
    """A vector-width flag changes step costs, so it changes the cache key; the CPU device
    count is part of the split already and must not split the cache."""
    key = lambda: autotune.cache_key("t", "d", 1, "float32", "processes")
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_prefer_vector_width=512")
    wide = key()
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_prefer_vector_width=512 "
                       "--xla_force_host_platform_device_count=4")
    assert key() == wide
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_prefer_vector_width=256")
    assert key() != wide


def test_cached_costs_are_per_cpu_kernel_build_and_processor(monkeypatch, tmp_path):
    """Costs measured with one build of the CPU kernel (its source, jax, compiler flags) or
    on one processor model are not another's."""
    from ssd_jax import compile_cache
    from ssd_jax.kernels import cpu
    key = lambda: autotune.cache_key("t", "d", 1, "float32", "processes")
    before = key()
    monkeypatch.setenv(cpu.FLAGS_ENV, "-O2")
    assert key() != before
    monkeypatch.delenv(cpu.FLAGS_ENV)
    source, other = cpu.SOURCE, tmp_path / "cpu_matmul.cc"
    other.write_bytes(source.read_bytes() + b"// another version\n")
    monkeypatch.setattr(cpu, "SOURCE", other)
    assert key() != before
    monkeypatch.setattr(cpu, "SOURCE", source)
    assert key() == before
    monkeypatch.setattr(compile_cache, "read_cpuinfo",
                        lambda: "model name : Another CPU\nflags : fpu sse2\n")
    assert key() != before


def test_ar_fallback_decodes_with_ar_and_probes(tiny_llama, tmp_path, caplog, monkeypatch):
    """SpecConfig(ar_fallback=True): where the model predicts AR faster, runs decode with AR
    (equal to an AR run), say why, and speculate again once enough AR tokens have gone by;
    settings given fall back where the model predicts them slower than AR."""
    from ssd_jax import SamplingParams
    from ssd_jax import engine as engine_mod
    from ssd_jax.config import SpecConfig
    with pytest.raises(ValueError, match="ar_fallback='yes' is invalid"):
        SpecConfig(ar_fallback="yes")
    monkeypatch.setattr(engine_mod, "PROBE_TOKENS", 30)
    llm = _noisy_pair(tiny_llama, tmp_path, max_batch=1)
    store = TuneStore(tmp_path / "autotune.json")
    p = SamplingParams(max_new_tokens=12, ignore_eos=True)
    prompt = [[5, 6, 7, 8]]
    ar = llm.generate(prompt, p, mode="ar")[0].token_ids
    fallback = SpecConfig(ar_fallback=True)
    llm.settings("sd", spec=fallback)  # measures the step costs, runs nothing
    llm.core.forget_acceptance()
    store.observe("model|model", 0.05, rounds=autotune.ACCEPT_WINDOW)
    ran = []
    with caplog.at_level("INFO"):
        for _ in range(5):
            out = llm.generate(prompt, p, mode="sd", spec=fallback)[0]
            assert out.token_ids == ar
            ran.append(out.metrics.mode)
            s = out.metrics.settings
            if out.metrics.mode == "ar":
                assert s["ar_fallback"] and s["automatic"]
                assert s["predicted"]["ar"] > s["predicted"]["sd"]
            else:  # the probe teaches acceptance again: keep it low for the runs after
                # It still records what it decided on (the probe overrode the model).
                assert s["predicted"]["ar"] > s["predicted"]["sd"] and not s.get("ar_fallback")
                store.observe("model|model", 0.05, rounds=autotune.ACCEPT_WINDOW)
    # 12 tokens a run: AR, AR, AR (36 >= 30), then the probe, then AR again (its 12 tokens
    # need max(30, 4 x 12) before the next probe).
    assert ran == ["ar", "ar", "ar", "sd", "ar"]
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "instead (ar_fallback)" in said and "refresh the pair's acceptance" in said
    # Settings given are held to the model at those settings, and fall back alike; each
    # mode keeps its own count (an SSD call between SD calls neither resets nor adds to
    # SD's: with one count, SD would probe a call earlier).
    store.observe("model|model", 0.05, rounds=autotune.ACCEPT_WINDOW)
    given = SpecConfig(k=2, ar_fallback=True)
    out = llm.generate(prompt, p, mode="sd", spec=given)[0]  # SD's count: 24 AR after 12
    assert out.token_ids == ar and out.metrics.mode == "ar"
    s = out.metrics.settings
    assert s["ar_fallback"] and not s["automatic"] and s["k"] == 2
    assert s["predicted"]["ar"] > s["predicted"]["sd"]
    assert llm.generate(prompt, p, mode="ssd", spec=given)[0].metrics.mode == "ar"
    ran = [llm.generate(prompt, p, mode="sd", spec=given)[0].metrics.mode for _ in range(3)]
    assert ran == ["ar", "ar", "sd"]  # 36, 48 >= 4 x 12: the probe
    # Without ar_fallback the mode asked for runs, whatever the model says.
    assert llm.generate(prompt, p, mode="sd", spec=SpecConfig(k=2))[0].metrics.mode == "sd"
