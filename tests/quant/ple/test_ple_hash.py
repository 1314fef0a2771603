"""n-gram ids in numpy against vLLM 0.34.0's own Triton kernel, run by Triton's CPU interpreter."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flashnext.quant.demo import DEMO_TEXT_CONFIG
from flashnext.quant.ple.hashing import NgramHasher
from flashnext.quant.ple.layout import ple_layout

REAL = {"ngram_size": 3, "heads_per_ngram": 8, "ple_embed_dim": 2560, "vocab_size": 248320,
        "ngram_vocab_size_base": 20000000, "make_ngram_vocab_size_divisible_by": 128,
        "split_ngram_parts": 128, "eos_token_id": 248044}
EOS = REAL["eos_token_id"]
HASHER = NgramHasher(ple_layout(REAL))

# qwen4exp-upstream.md §1.4, computed independently from the rules.
WORKED = {
    9707: [16410909, 39682429, 55103279, 60931720, 87006904, 116506179, 131512017, 152932897,
           169641436, 182022480, 209277433, 237891023, 256841529, 277007269, 290665954, 300984276],
    11: [18158303, 36390029, 45652312, 70783524, 98191154, 114024957, 127804916, 159566246,
         175132467, 192583600, 217919476, 237199054, 259336807, 261799367, 289359313, 307699687],
    1879: [6380558, 26411572, 56460672, 78566983, 94693008, 106742196, 124822692, 148942556,
           164226950, 190352573, 210933682, 238908951, 242182004, 265475238, 299910982, 312121804],
    EOS: [18827606, 27700912, 56521518, 65780303, 81132822, 100518937, 120474864, 142052741,
          163793416, 184135950, 219854666, 227756662, 248975183, 271245822, 285569892, 318943450],
    3555: [12145267, 35540298, 40916942, 68564904, 90375166, 111763510, 124581791, 149713066,
           161432964, 191619397, 216443460, 238880610, 257002906, 276366068, 289762923, 318814986],
}


def test_worked_example():
    ids = HASHER.ids([9707, 11, 1879, EOS, 3555])
    assert ids.tolist() == list(WORKED.values())
    decode = HASHER.ids([3555], [0, 1], [[11, 1879]])[0].tolist()
    assert decode[:8] == [19400108, 38369100, 47944246, 65450985, 89122494, 117032400, 138915334, 154793048]
    assert decode[8:] == [175893833, 191847562, 207236839, 234715653, 252920942, 271147981, 290561934, 307667305]
    masked = HASHER.ids([3555], [0, 1], [[EOS, 1879]])[0].tolist()
    assert masked[:8] == decode[:8]
    assert masked[8:] == [163524359, 194612151, 205924733, 231252287, 250348321, 269782653, 289669381, 309666207]


def test_single_token_path_agrees():
    rng = np.random.default_rng(3)
    for _ in range(200):
        tok, p1, p2 = (int(x) for x in rng.choice([EOS, *rng.integers(0, 248320, 5)], 3))
        assert HASHER.token_ids(tok, (p1, p2)) == HASHER.ids([tok], [0, 1], [[p2, p1]])[0].tolist()


ops = pytest.importorskip("vllm.models.qwen4_exp.common.ops.ple", reason="vLLM 0.34.0 is installed by .ci/run")


def upstream(hasher, tokens, qsl, ctx, token_dtype=torch.int32):
    layout = hasher.layout
    return ops.ple_ngram_ids(
        torch.tensor(tokens, dtype=token_dtype), torch.tensor(qsl, dtype=torch.int32),
        torch.tensor(ctx, dtype=token_dtype).reshape(len(qsl) - 1, layout.ngram_size - 1),
        torch.tensor(layout.multipliers, dtype=torch.int64), torch.tensor(layout.head_sizes, dtype=torch.int64),
        torch.tensor(layout.head_offsets, dtype=torch.int64), layout.eos_token_id,
        layout.heads_per_ngram).numpy()


def test_worked_example_upstream():
    assert upstream(HASHER, [9707, 11, 1879, EOS, 3555], [0, 5], [EOS, EOS]).tolist() == list(WORKED.values())


@st.composite
def batches(draw, vocab=248320, eos=EOS):
    lens = draw(st.lists(st.integers(0, 13), min_size=1, max_size=5))
    qsl = np.concatenate([[0], np.cumsum(lens)]).tolist()
    total = qsl[-1]
    pad = draw(st.integers(0, 3))  # tokens past the last request, as in padded batches
    special = st.sampled_from([eos, 0, vocab - 1, 2**31 - 1])
    token = st.one_of(st.integers(0, vocab - 1), special)
    tokens = draw(st.lists(token, min_size=total + pad, max_size=total + pad))
    if not tokens:
        tokens = [draw(token)]
        qsl[-1] = max(qsl[-1], 0)
    ctx = draw(st.lists(token, min_size=2 * len(lens), max_size=2 * len(lens)))
    return tokens, qsl, ctx


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=batches())
def test_bit_identical_to_vllm_kernel(batch):
    tokens, qsl, ctx = batch
    ours = HASHER.ids(tokens, qsl, np.array(ctx).reshape(-1, 2))
    assert np.array_equal(ours, upstream(HASHER, tokens, qsl, ctx))


@pytest.mark.parametrize("extreme", [2**62 + 12345, -(2**40), 2**63 - 1, -(2**63)])
def test_int64_wraparound_and_negative_remainders(extreme):
    """Token ids no real vocabulary has, so that products overflow int64 and XORs go negative."""
    tokens = [extreme, 5, extreme, EOS, extreme]
    ours = HASHER.ids(tokens, [0, 5], [[extreme, 7]])
    theirs = upstream(HASHER, tokens, [0, 5], [extreme, 7], token_dtype=torch.int64)
    assert np.array_equal(ours, theirs)
    assert (ours >= 0).all()


def test_demo_layout_against_kernel():
    hasher = NgramHasher(ple_layout(DEMO_TEXT_CONFIG))
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, DEMO_TEXT_CONFIG["vocab_size"], 300)
    tokens[rng.integers(0, 300, 20)] = DEMO_TEXT_CONFIG["eos_token_id"]
    qsl = [0, 7, 7, 150, 300]
    ctx = rng.integers(0, 4096, 8)
    ours = hasher.ids(tokens, qsl, ctx.reshape(4, 2))
    assert np.array_equal(ours, upstream(hasher, tokens.tolist(), qsl, ctx.tolist()))
    assert ours.max() < hasher.layout.rows
