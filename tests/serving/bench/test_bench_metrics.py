"""The bench's arithmetic: percentiles, agreement, KL from top-k logprobs, the prompts it builds."""

import math
import random

import numpy as np
import pytest

from flashnext.serving.bench import metrics, workloads
from flashnext.serving.bench.client import TopLogprobs


@pytest.mark.parametrize("q", [0, 1, 50, 90, 99, 100])
def test_percentile_is_numpys_linear(q):
    values = [random.Random(q).random() for _ in range(37)]
    assert metrics.percentile(values, q) == pytest.approx(np.percentile(values, q))


def _exact_kl(p, q):
    return sum(pv * math.log(pv / q[t]) for t, pv in p.items())


def test_topk_kl_is_exact_when_top_k_covers_the_vocabulary():
    p = {"a": 0.6, "b": 0.3, "c": 0.1}
    q = {"a": 0.5, "b": 0.25, "c": 0.25}
    got = metrics.topk_kl({t: math.log(v) for t, v in p.items()}, {t: math.log(v) for t, v in q.items()})
    assert got == pytest.approx(_exact_kl(p, q), rel=1e-9)


def test_topk_kl_is_zero_for_equal_lists_and_positive_when_one_side_misses_a_token():
    same = {"a": math.log(0.7), "b": math.log(0.2)}
    assert metrics.topk_kl(same, dict(same)) == pytest.approx(0.0, abs=1e-12)
    # B never lists "b": its leftover mass is shared, capped by its own smallest listed probability.
    other = {"a": math.log(0.7), "c": math.log(0.25)}
    assert metrics.topk_kl(same, other) > 0.05


def _lp(tokens, logprob=-0.5):
    return [TopLogprobs(t, logprob, {t: logprob, "zz": -3.0}) for t in tokens]


def test_compare_by_tokens_stops_kl_at_the_first_divergence():
    a, b = _lp(["x", "y", "z", "w"]), _lp(["x", "y", "q", "w"], logprob=-0.7)
    got = metrics.compare("", "", a, b)
    assert (got.by, got.compared, got.matching, got.first_divergence) == ("tokens", 4, 3, 2)
    assert got.kl_positions == 2
    assert got.abs_logprob_diff_sum == pytest.approx(0.4)


def test_compare_without_logprobs_is_by_characters_and_a_prefix_diverges_at_its_end():
    got = metrics.compare("hello", "hello world", None, _lp(["hello"]))
    assert (got.by, got.matching, got.first_divergence, got.kl_positions) == ("characters", 5, 5, 0)
    assert metrics.compare("same", "same", None, None).first_divergence is None


def test_needle_scoring_wants_the_key_as_a_whole_number():
    scale = workloads.TextScale(chars_per_token=4.0, template_tokens=10)
    n = workloads.needle_prompt(2000, 0.5, scale, seed=1)
    assert n.key in n.prompt[0]["content"]
    assert n.score(f"The pass key is {n.key}.")
    assert not n.score(f"1{n.key}") and not n.score("I do not know")
    # The needle sits near the asked depth, on a sentence boundary.
    text = n.prompt[0]["content"]
    assert 0.4 < text.index("The pass key") / len(text) < 0.6
    assert abs(len(text) - scale.chars_for(2000)) < 40


def test_fixed_prompts_repeat_and_cold_prompts_do_not():
    scale = workloads.TextScale(3.0, 5)
    fixed = [workloads.latency_prompt(300, scale, slot=0, seed=7) for _ in range(2)]
    assert fixed[0] == fixed[1]
    assert workloads.latency_prompt(300, scale, slot=1, seed=7) != fixed[0]
    assert workloads.latency_prompt(300, scale, 0, None) != workloads.latency_prompt(300, scale, 0, None)


def test_structured_answers_are_checked_against_the_schema():
    good = '{"city": "Kyoto", "country": "Japan", "population": 1460000, "landmarks": ["Kinkaku-ji"]}'
    assert workloads.validate_structured(good) is None
    assert workloads.validate_structured("{").startswith("not JSON")
    assert "population" in workloads.validate_structured(good.replace("1460000", '"many"'))
    assert "additional" in workloads.validate_structured(good[:-1] + ', "mayor": "x"}').lower()
