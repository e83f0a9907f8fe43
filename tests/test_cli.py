"""`python -m ssd_jax`, the main job's CLI: it answers, and bad input is one line, exit code 2."""
import re

import pytest

from ssd_jax.__main__ import main


@pytest.mark.parametrize("argv, needle", [
    (["hi", "--k", "0"], "K=0 is invalid"),
    (["hi", "--c", "1.5"], "Saguaro's C must lie in (0, 1]"),
    (["", "--model", "smollm2", "--mode", "ar"], "prompt is empty"),
    (["hi", "--model", "smollm2", "--mode", "ar", "--max-new-tokens", "5000"],
     "raise --max-seq-len"),
    (["hi", "--model", "/no/such/model", "--mode", "ar"], "not found"),
    (["hi", "--model", "smollm2", "--repetition-penalty", "0"],
     "repetition_penalty=0.0 is invalid: give a finite value > 0"),
    (["hi", "--model", "smollm2", "--min-p", "2"],
     "min_p=2.0 is invalid: it must lie in [0, 1]"),
    (["hi", "--model", "smollm2", "--stop", ".", "--stop", ""],
     "stop=['.', ''] is invalid: give a non-empty string"),
])
def test_bad_input_is_one_line(argv, needle, capsys):
    assert main(argv) == 2
    err = [l for l in capsys.readouterr().err.splitlines() if l.startswith("error:")]
    assert len(err) == 1 and needle in err[0]


def test_answers_a_prompt_with_the_small_pair(capsys):
    assert main(["What is the capital of France?", "--model", "smollm2", "--draft",
                 "smollm2-draft", "--mode", "sd", "--k", "3", "--max-new-tokens", "8",
                 "--no-compare", "--stop", " Paris"]) == 0
    out, err = capsys.readouterr()
    # The answer is "The capital of France is Paris." cut before its stop string.
    assert out.startswith("> What is the capital of France?")
    assert out.splitlines()[1] == "The capital of France is"
    assert re.search(r"\[sd\] [1-7] tokens", err) and "K=3" in err


@pytest.mark.slow  # ~2-3 min on a fresh machine: fetches the real pair (1.6 GB), dequantises
def test_answers_a_prompt(capsys):
    assert main(["What is the capital of France?", "--mode", "ar", "--max-new-tokens", "8"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("> What is the capital of France?") and "Paris" in out
    assert "[ar] 8 tokens" in err


def test_k_takes_auto_as_the_bench_does(capsys):
    from ssd_jax.__main__ import parse_lookahead
    assert parse_lookahead("auto") is None and parse_lookahead("3") == 3
    with pytest.raises(SystemExit) as e:
        main(["hi", "--k", "four"])
    assert e.value.code == 2 and "'four' is not a lookahead" in capsys.readouterr().err
