"""Saguaro's C in the speed model (ssd_jax/saguaro_curve.py): the fitted acceptance, recovery
hit and bonus hit equal a simulation of the verification rule itself (draw s from q', accept
with min(1, p/q'), else draw the recovery from max(0, p - q')); the chooser keeps C = 1 where
it cannot help; the engine measures a curve once for a sampled run and chooses C with K."""
import numpy as np
import pytest

from ssd_jax import autotune
from ssd_jax.saguaro_curve import SaguaroCurve


def _dists(rng, n, v, sharp):
    logits = rng.normal(size=(n, v)) * sharp
    e = np.exp(logits - logits.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


def _simulate(p, q, c, f, draws, rng):
    """Acceptance rate, hit rate of recoveries (in q's top-f) and of bonus tokens, by sampling
    the rule position by position (numpy, written from the definitions)."""
    accepted = rejected = forked = bonus = 0
    for pn, qn in zip(p, q):
        top = np.argsort(-qn, kind="stable")[:f]
        qc = qn.copy()
        qc[top] *= c
        qc /= qc.sum()
        s = rng.choice(len(qn), size=draws, p=qc)
        ok = rng.random(draws) < np.minimum(1.0, pn[s] / qc[s])
        accepted += ok.sum()
        resid = np.maximum(pn - qc, 0)
        rec = rng.choice(len(qn), size=(~ok).sum(), p=resid / resid.sum())
        rejected += (~ok).sum()
        forked += np.isin(rec, top).sum()
        bonus += np.isin(rng.choice(len(pn), size=draws, p=pn), top).sum()
    total = draws * len(p)
    return accepted / total, forked / rejected, bonus / total


@pytest.mark.parametrize("c,f", [(1.0, 2), (0.5, 1), (0.3, 3)])
def test_curve_equals_a_simulation_of_the_rule(c, f):
    rng = np.random.default_rng(0)
    p, q = _dists(rng, 4, 9, 1.5), _dists(rng, 4, 9, 1.5)
    curve = SaguaroCurve.fit(p, q, cs=(1.0, c), f_max=4)
    i = curve.cs.index(c)
    acc, rec, bonus = _simulate(p, q, c, f, 40_000, rng)
    assert curve.alpha[i][f] == pytest.approx(acc, abs=0.01)
    assert curve.rec[i][f] == pytest.approx(rec, abs=0.015)
    assert curve.bonus[f] == pytest.approx(bonus, abs=0.01)
    # C = 1 is no rescaling, whatever F; F = 0 likewise; fewer C, more mass on forked tokens.
    assert curve.alpha[0][f] == pytest.approx(curve.alpha[0][0])
    assert curve.alpha[i][0] == pytest.approx(curve.alpha[0][0])
    if c < 1:
        assert curve.rec[i][f] > curve.rec[0][f]


def test_round_trip_and_a_perfect_draft_keeps_c_one():
    rng = np.random.default_rng(1)
    p = _dists(rng, 6, 12, 2.0)
    curve = SaguaroCurve.fit(p, p)  # the draft is the target: every token accepted at C = 1
    assert SaguaroCurve.from_dict(curve.to_dict()) == curve
    assert curve.alpha[0][3] == pytest.approx(1.0)
    costs = autotune.StepCosts({t: 0.1 * (1 + 0.2 * (t - 1)) for t in autotune.TARGET_TOKENS},
                               {t: 0.03 * (1 + 0.1 * (t - 1)) for t in autotune.DRAFT_TOKENS})
    choice = autotune.choose(costs, a=0.95, r=1.5, saguaro=curve)
    assert choice.c == 1.0
    # Greedy runs (no curve) carry no C; SD never does.
    assert autotune.choose(costs, a=0.95, r=1.5).c is None
    assert autotune.choose(costs, a=0.95, r=1.5, mode="sd", saguaro=curve).c is None


def test_low_c_is_chosen_when_it_raises_the_hit_rate():
    """Unrelated p and q: after a rejection the target rarely wants the draft's top tokens,
    and lowering C moves the residual onto them (here without costing acceptance: q is the
    more confident). The choice is the C of the highest predicted SSD tok/s, a low one."""
    rng = np.random.default_rng(2)
    p, q = _dists(rng, 32, 40, 1.0), _dists(rng, 32, 40, 1.0)
    curve = SaguaroCurve.fit(p, q)
    costs = autotune.StepCosts({t: 0.1 * (1 + 0.05 * (t - 1)) for t in autotune.TARGET_TOKENS},
                               {t: 0.05 * (1 + 0.02 * (t - 1)) for t in autotune.DRAFT_TOKENS})
    choice = autotune.choose(costs, a=0.6, r=1.5, saguaro=curve)
    best = max(curve.cs, key=lambda c: autotune.predict(
        costs, choice.k, choice.budget, a=0.6, r=1.5, batch=1, backup=choice.backup, c=c,
        saguaro=curve)["ssd"])
    assert choice.c == best < 1.0
    assert curve.rec[curve.cs.index(best)][4] > curve.rec[0][4]


def test_engine_measures_a_curve_for_sampled_runs_and_chooses_c(tiny_llama, tmp_path):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import pre_tokenizers
    from tokenizers.models import WordLevel
    from ssd_jax import LLM, EngineConfig, SamplingParams
    from ssd_jax.config import SpecConfig
    from ssd_jax.loading import load
    from ssd_jax.loading.tokenizer import Tokenizer
    from tests.conftest import save_noisy_draft
    save_noisy_draft(tiny_llama[1], tmp_path / "draft", scale=0.3)
    backend = HFTokenizer(WordLevel({f"w{i}": i for i in range(128)}, unk_token="w3"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    llm = LLM(load(tiny_llama[0])[0], draft=load(tmp_path / "draft")[0],
              tokenizer=Tokenizer(backend), cache_dir=tmp_path,
              engine=EngineConfig(max_batch=1, max_seq_len=128, prefill_bucket=16,
                                  driver="single"))
    sampled = SamplingParams(temperature=0.8, seed=0)
    spec, settings = llm.settings("ssd", sampling_params=sampled)
    assert spec.c in autotune_cs() and settings["automatic"]
    store = autotune.TuneStore(tmp_path / "autotune.json")
    assert len(store._read()["saguaro"]) == 1  # measured once, cached per sampling settings
    llm.settings("ssd", sampling_params=sampled)
    assert len(store._read()["saguaro"]) == 1
    assert llm.settings("ssd")[0].c == 1.0  # greedy: no Saguaro
    assert llm.settings("ssd", spec=SpecConfig(c=0.5), sampling_params=sampled)[0].c == 0.5
    assert llm.settings("ssd", spec=SpecConfig(k=2), sampling_params=sampled)[0].c == 1.0
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.8, seed=3, max_new_tokens=8,
                                                   ignore_eos=True), mode="ssd")[0]
    assert out.metrics.settings["c"] == spec.c and len(out.token_ids) == 8


def test_learnt_hit_scale_scales_the_curves_hit_rate_and_pools_by_rounds(tmp_path):
    rng = np.random.default_rng(2)
    curve = SaguaroCurve.fit(_dists(rng, 6, 12, 1.5), _dists(rng, 6, 12, 1.5))
    raw = curve.hit_rate(1.0, [2, 2, 3], 0.7)
    scaled = SaguaroCurve(curve.cs, curve.alpha, curve.rec, curve.bonus, hit_scale=0.8)
    assert scaled.hit_rate(1.0, [2, 2, 3], 0.7) == pytest.approx(0.8 * raw)
    assert scaled.hit_rate(1.0, [2, 2, 3], 0.7, learnt=False) == pytest.approx(raw)
    big = SaguaroCurve(curve.cs, curve.alpha, curve.rec, curve.bonus, hit_scale=100.0)
    assert big.hit_rate(1.0, [2, 2, 3], 0.7) == 1.0  # a rate, capped
    store = autotune.TuneStore(tmp_path / "t.json")
    store.observe_saguaro_hits("k", 0.5, rounds=30)  # no curve there: nothing to scale
    assert store.saguaro("k") is None
    store.save_saguaro("k", curve)
    assert store.saguaro("k").hit_scale == 1.0
    store.observe_saguaro_hits("k", 0.8, rounds=30)  # the first run stands alone
    store.observe_saguaro_hits("k", 0.6, rounds=90)  # then runs pool by rounds: 30 + 90
    assert store.saguaro("k").hit_scale == pytest.approx((0.8 * 30 + 0.6 * 90) / 120)
    assert store.saguaro("k").rec == curve.rec
    store.save_saguaro("k", curve)  # measured again: what runs taught goes with the old one
    assert store.saguaro("k").hit_scale == 1.0


def test_a_sampled_ssd_run_teaches_the_curves_hit_scale(tiny_llama, tmp_path):
    """What the run hit in its steady rounds (its first misses by construction) over what the
    curve promised at the run's C, fan-out and acceptance (the choice's use of it: the test
    above, through SaguaroCurve.hit_rate)."""
    from ssd_jax import LLM, EngineConfig, SamplingParams
    from ssd_jax.config import SpecConfig
    from ssd_jax.loading import load
    from tests.conftest import save_noisy_draft, with_word_tokenizer
    target = with_word_tokenizer(tiny_llama[0], tmp_path / "target")
    save_noisy_draft(tiny_llama[1], tmp_path / "draft", scale=0.3)
    llm = LLM(target, draft=load(tmp_path / "draft")[0], cache_dir=tmp_path,
              engine=EngineConfig(max_batch=1, max_seq_len=256, prefill_bucket=16,
                                  driver="single"))
    sampled = SamplingParams(temperature=0.8, seed=0)
    llm.settings("ssd", sampling_params=sampled)  # measures the curve
    store = autotune.TuneStore(tmp_path / "autotune.json")
    (key, entry), = store._read()["saguaro"].items()
    assert "hit_scale" not in entry
    run = SamplingParams(temperature=0.8, seed=5, max_new_tokens=80, ignore_eos=True)
    m = llm.generate([[5, 6, 7]], run, mode="ssd", spec=SpecConfig(k=2, budget=6))[0].metrics
    st, fan = m.ssd, m.ssd.fanout
    assert st.rounds >= 20  # engine.STEADY_ROUNDS: enough to teach
    steady = st.hits / (st.rounds - 1)
    a = autotune.acceptance_from_rounds(m.accept_hist)
    promised = store.saguaro(key).hit_rate(1.0, fan, a, learnt=False)
    learnt = store.saguaro(key)
    assert learnt.hit_scale == pytest.approx(steady / promised, rel=1e-6)
    assert store._read()["saguaro"][key]["rounds_hit_scale"] == sum(m.accept_hist)


def autotune_cs():
    from ssd_jax.saguaro_curve import C_CANDIDATES
    return C_CANDIDATES


def test_worker_processes_calibrate_as_one_process_does(tiny_llama, tmp_path):
    """The processes driver splits the calibration over its workers (the target samples and
    scores, then the draft scores the target's tokens): the curve equals one process's."""
    from ssd_jax import LLM, EngineConfig, SamplingParams
    from tests.conftest import save_noisy_draft, with_word_tokenizer
    target = with_word_tokenizer(tiny_llama[0], tmp_path / "target")
    save_noisy_draft(tiny_llama[1], tmp_path / "draft", scale=0.3)
    sampled = SamplingParams(temperature=0.8, top_p=0.95, min_p=0.1, seed=0)
    curves = []
    for driver in ("single", "processes"):
        with LLM(str(target), draft=str(tmp_path / "draft"), cache_dir=tmp_path / driver,
                 progress=False, engine=EngineConfig(max_batch=1, max_seq_len=128,
                                                     prefill_bucket=16, driver=driver)) as llm:
            assert llm.driver("ssd") == driver
            llm.settings("ssd", sampling_params=sampled)
            curves.append(llm.core._curve)
    one, workers = curves
    assert one.cs == workers.cs
    for field in ("alpha", "rec", "bonus"):
        np.testing.assert_allclose(np.asarray(getattr(one, field)),
                                   np.asarray(getattr(workers, field)), atol=1e-4)
