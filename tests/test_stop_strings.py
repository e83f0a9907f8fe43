"""Stop strings offline (SamplingParams.stop, vLLM's): the answer ends at the first one its text
holds, in generate, stream and every mode; the oracle is the same call without stop strings,
cut by hand with the tokenizer."""
from dataclasses import replace

import pytest

from ssd_jax import SamplingParams, stop_strings

PROMPT = "Write a haiku about the sea."
N = 32


def test_find_cut_and_shown():
    assert stop_strings.find("abcabc", ["c", "bc"]) == (1, "bc")  # earliest, then longest
    assert stop_strings.find("abc", ["x"]) is None
    assert stop_strings.cut("one. two.", ["."]) == "one"
    assert stop_strings.cut("one. two.", ["."], include=True) == "one."
    assert stop_strings.cut("one", ["."]) is None
    # Held back: the longest tail that starts a stop string, and an incomplete character.
    assert stop_strings.shown("a line\n", ["\n\n"]) == "a line"
    assert stop_strings.shown("a line", ["\n\n"]) == "a line"
    assert stop_strings.shown("xEN", ["END", "NX"]) == "x"
    assert stop_strings.shown("ab\ufffd", []) == "ab"


def test_bad_stop_strings_name_the_field():
    assert SamplingParams(stop="\n\n").stop == ("\n\n",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    for bad in ("", [""], [3], 3):
        with pytest.raises(ValueError, match="^stop=.* is invalid"):
            SamplingParams(stop=bad)
    with pytest.raises(ValueError, match="include_stop_str_in_output=1 is invalid"):
        SamplingParams(include_stop_str_in_output=1)


def _ended_at(tokenizer, ids: list[int], stop: str) -> int:
    """How many tokens an answer keeps: up to the one whose text completes `stop`."""
    return next(j for j in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:j]))


@pytest.fixture(scope="module")
def reference(smollm2):
    """The greedy answer with no stop string, and a stop string from its middle (one that may
    span tokens or sit inside one)."""
    ref = smollm2.generate(PROMPT, SamplingParams(max_new_tokens=N, ignore_eos=True,
                                                  logprobs=1))[0]
    stop = ref.text[9:13]
    assert ref.text.find(stop) == 9
    return ref, stop


def test_generate_ends_at_the_first_stop_string(smollm2, reference):
    ref, stop = reference
    keep = _ended_at(smollm2.tokenizer, ref.token_ids, stop)
    got = smollm2.generate(PROMPT, SamplingParams(max_new_tokens=N, ignore_eos=True,
                                                  stop=["never appears", stop], logprobs=1))[0]
    assert (got.text, got.finish_reason) == (ref.text[:9], "stop")
    assert got.token_ids == ref.token_ids[:keep]
    assert got.logprobs == ref.logprobs[:keep]
    # The run stopped once the row ended, not at its budget (AR reads 8 steps at a time).
    assert got.metrics.decode_steps < N - 1
    kept = smollm2.generate(PROMPT, SamplingParams(max_new_tokens=N, ignore_eos=True, stop=stop,
                                                   include_stop_str_in_output=True))[0]
    assert kept.text == ref.text[:9] + stop and kept.token_ids == got.token_ids


def test_stream_never_shows_what_the_stop_string_cuts(smollm2, reference):
    ref, stop = reference
    pieces = list(smollm2.stream(PROMPT, SamplingParams(max_new_tokens=N, ignore_eos=True,
                                                        stop=stop)))
    assert "".join(pieces) == ref.text[:9]


def test_a_row_with_stop_strings_beside_one_without(smollm2, reference):
    ref, stop = reference
    other = "Name three colours."
    alone = smollm2.generate(other, SamplingParams(max_new_tokens=N, ignore_eos=True))[0]
    got = smollm2.generate([PROMPT, other], [
        SamplingParams(max_new_tokens=N, ignore_eos=True, stop=stop),
        SamplingParams(max_new_tokens=N, ignore_eos=True)])
    assert got[0].text == ref.text[:9] and got[0].finish_reason == "stop"
    assert got[1].token_ids == alone.token_ids and got[1].finish_reason == "length"


def test_a_stop_string_frees_its_slot_in_a_continuous_batch(smollm2, reference):
    """Past max_batch (one continuous batch, continuous.py) a row ended by a stop string,
    which only the host sees, leaves its slot to the next row at once."""
    from ssd_jax import LLM, EngineConfig
    ref, stop = reference
    llm = LLM(smollm2.model, tokenizer=smollm2.tokenizer, engine=EngineConfig(max_batch=2),
              progress=False)
    other = "Name three colours."
    p = SamplingParams(max_new_tokens=N, ignore_eos=True)
    alone = smollm2.generate(other, p)[0]
    got = llm.generate([PROMPT, other, PROMPT], [replace(p, stop=stop), p, p])
    assert (got[0].text, got[0].finish_reason) == (ref.text[:9], "stop")
    assert got[1].token_ids == alone.token_ids and got[2].token_ids == ref.token_ids
    # The third row joined when the first ended (a few tokens in), not at its budget: the
    # rows in series would take 2 (N - 1) steps.
    assert got[0].metrics.decode_steps < N + 8


def test_stop_strings_need_a_tokenizer(smollm2):
    from ssd_jax import LLM
    llm = LLM(smollm2.model)  # weights alone: token ids in, token ids out
    assert llm.tokenizer is None
    with pytest.raises(ValueError, match="needs a tokenizer"):
        llm.generate([[5, 9, 11]], SamplingParams(max_new_tokens=4, stop="x"))
