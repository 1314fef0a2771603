"""Summaries of timings, and how far two answers to the same prompt agree."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from flashnext.serving.bench.client import TopLogprobs


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100), linear between the nearest ranks (numpy's default)."""
    s = sorted(values)
    if not s:
        raise ValueError("no values")
    pos = (len(s) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summary(values: Sequence[float]) -> dict | None:
    """count, mean, p50, p90, p99, min and max; None for no values."""
    if not values:
        return None
    return {"count": len(values), "mean": sum(values) / len(values), "p50": percentile(values, 50),
            "p90": percentile(values, 90), "p99": percentile(values, 99), "min": min(values),
            "max": max(values)}


@dataclass
class Agreement:
    """Two greedy answers to one prompt, compared token by token."""

    compared: int          # positions compared (the shorter answer's length)
    matching: int          # positions where the tokens are equal
    first_divergence: int | None  # the first position where they differ; None if never
    by: str                # "tokens" (the servers' logprobs name them) or "characters"
    kl_positions: int = 0  # positions with logprobs on both sides, before the first divergence
    kl_sum: float = 0.0    # sum over those positions of KL(a || b), nats
    abs_logprob_diff_sum: float = 0.0  # sum of |logprob_a - logprob_b| of the token both chose


def compare(a_text: str, b_text: str, a_lp: list[TopLogprobs] | None,
            b_lp: list[TopLogprobs] | None) -> Agreement:
    """Token-level agreement when both servers returned logprobs (they name each token), else
    character-level: a server that streams several tokens in a chunk (speculative decoding) gives no
    other token boundary. KL is taken only up to the first divergence, where both sides still
    condition on the same context."""
    if a_lp and b_lp:
        seq_a, seq_b, by = [t.token for t in a_lp], [t.token for t in b_lp], "tokens"
    else:
        seq_a, seq_b, by = list(a_text), list(b_text), "characters"
    n = min(len(seq_a), len(seq_b))
    matching = sum(x == y for x, y in zip(seq_a, seq_b))
    first = next((i for i in range(n) if seq_a[i] != seq_b[i]), None)
    if first is None and len(seq_a) != len(seq_b):
        first = n
    out = Agreement(compared=max(len(seq_a), len(seq_b)), matching=matching, first_divergence=first, by=by)
    if by == "tokens":
        for x, y in zip(a_lp[: first if first is not None else n], b_lp):
            if x.top and y.top:
                out.kl_positions += 1
                out.kl_sum += topk_kl(x.top, y.top)
                out.abs_logprob_diff_sum += abs(x.logprob - y.logprob)
    return out


def topk_kl(p_top: dict[str, float], q_top: dict[str, float]) -> float:
    """KL(P || Q) in nats, from two servers' top-k logprobs at the same position.

    The support is the union of both top-k lists plus one bucket for every other token. A token one
    side did not list gets that side's leftover mass shared evenly among the tokens it did not list,
    capped by its own k-th probability (an unlisted token cannot be likelier than a listed one).
    """
    support = set(p_top) | set(q_top)

    def dist(top: dict[str, float]) -> dict[str | None, float]:
        probs = {t: math.exp(lp) for t, lp in top.items()}
        rest = max(0.0, 1.0 - sum(probs.values()))
        missing = [t for t in support if t not in probs]
        floor = min(probs.values()) if probs else rest
        share = min(rest / (len(missing) + 1), floor) if missing else 0.0
        d: dict[str | None, float] = {t: probs.get(t, share) for t in support}
        d[None] = max(rest - share * len(missing), 0.0)
        return d

    p, q = dist(p_top), dist(q_top)
    eps = 1e-12
    return max(0.0, sum(pv * math.log(pv / max(q[t], eps)) for t, pv in p.items() if pv > eps))


# About 95%: the normal approximation, which for a few samples widens to their min and max.
_Z95 = 1.96


def interval(values: Sequence[float], stat: str) -> tuple[float, float] | None:
    """An about-95% interval of ``stat`` ("mean" or "pNN") over ``values``, within their min and
    max; None for fewer than two values, whose spread nothing measures. A percentile's is the
    distribution-free one (the order statistics whose ranks the binomial bounds), so a pooled ITL
    of thousands of gaps costs one sort."""
    n = len(values)
    if n < 2:
        return None
    s = sorted(values)
    if stat == "mean":
        mean = sum(s) / n
        half = _Z95 * math.sqrt(sum((v - mean) ** 2 for v in s) / (n - 1) / n)
        return max(mean - half, s[0]), min(mean + half, s[-1])
    q = float(stat.removeprefix("p")) / 100
    half = _Z95 * math.sqrt(n * q * (1 - q))
    lo, hi = math.floor(n * q - half), math.ceil(n * q + half)
    return s[min(max(lo, 0), n - 1)], s[min(max(hi, 0), n - 1)]


def statistic(values: Sequence[float], stat: str) -> float:
    """``stat`` ("mean" or "pNN") of ``values``."""
    if stat == "mean":
        return sum(values) / len(values)
    return percentile(values, float(stat.removeprefix("p")))
