"""decode-05's fused router against vLLM's unfused routing in torch: through Triton's CPU
interpreter in CI, at the real shape on the GPU (``-m gpu``)."""
import pytest
import torch

from flashnext.quant.kernels._common import INTERPRETED
from flashnext.quant.kernels.moe_route import route
from flashnext.quant.kernels.reference import reference_align, reference_route, round_toward_zero

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROUND = round_toward_zero if INTERPRETED else None  # how the kernel's bf16 stores round


def case(m: int, experts: int, hidden: int, seed: int, exact: bool, ties: bool = False):
    g = torch.Generator().manual_seed(seed)
    if exact:  # small integers times powers of two: the fp32 sums are exact in any order
        x = (torch.randint(-4, 5, (m, hidden), generator=g).float() / 8).to(torch.bfloat16)
        w = (torch.randint(-4, 5, (experts + 1, hidden), generator=g).float() / 64).to(torch.bfloat16)
    else:
        x = torch.randn(m, hidden, generator=g).to(torch.bfloat16)
        w = (torch.randn(experts + 1, hidden, generator=g) * 0.05).to(torch.bfloat16)
    if ties:
        w[7] = w[3]  # experts 3 and 7 always tie; vLLM picks 3 first
        w[40] = w[3]
    return x, w


@pytest.mark.parametrize("m", [1, 4, 16])
def test_route_matches_vllm_routing(m):
    x, w = case(m, 64, 512, seed=m, exact=True, ties=True)
    want = reference_route(x, w, 10, ROUND)
    got = route(x.to(DEVICE), w.to(DEVICE), 10)
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])  # logits, bit for bit
    assert torch.equal(got[2].cpu(), want[2])  # the same experts in the same order, ties included
    assert torch.allclose(got[3].cpu(), want[3], rtol=2e-6, atol=1e-7)  # softmax over k vs over all
    assert torch.allclose(got[3].sum(-1).cpu(), torch.ones(m))


def test_route_random_weights_select_the_same_experts():
    x, w = case(3, 128, 256, seed=11, exact=False)
    want = reference_route(x, w, 8, ROUND)
    got = route(x.to(DEVICE), w.to(DEVICE), 8)
    assert torch.equal(got[2].cpu(), want[2])
    assert torch.allclose(got[3].cpu(), want[3], rtol=1e-5, atol=1e-6)


def test_route_checks_its_inputs():
    x, w = case(2, 16, 256, seed=0, exact=True)
    with pytest.raises(ValueError, match="1..16 tokens"):
        route(torch.zeros(17, 256, dtype=torch.bfloat16), w, 4)
    with pytest.raises(ValueError, match="top_k"):
        route(x, w, 17)
    with pytest.raises(ValueError, match="bf16"):
        route(x.half(), w, 4)
    with pytest.raises(ValueError, match="alignment takes 1..4 tokens"):
        route(torch.zeros(5, 256, dtype=torch.bfloat16), w, 4, align_block=8)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 4])
def test_real_shape(m):
    """512 experts + the shared gate over hidden 2560, top 10 (Qwen3.8-Flash-Next), with Marlin's
    decode block alignment (8)."""
    x, w = case(m, 512, 2560, seed=50 + m, exact=True, ties=True)
    x[-1] = x[0]
    want = reference_route(x, w, 10)
    got = route(x.cuda(), w.cuda(), 10, align_block=8)
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
    assert torch.equal(got[2].cpu(), want[2])
    assert torch.allclose(got[3].cpu(), want[3], rtol=2e-6, atol=1e-7)
    aligned = reference_align(want[2], 8)
    assert all(torch.equal(g.cpu(), a) for g, a in zip(got[4:], aligned))


@pytest.mark.parametrize("m,align", [(1, 8), (3, 8), (4, 16)])
def test_marlin_block_alignment_in_the_same_launch(m, align):
    """vLLM's moe_align_block_size layout, from the router's own picks (the last token repeats the
    first, so experts are shared between tokens)."""
    x, w = case(m, 64, 256, seed=30 + m, exact=True, ties=True)
    x[-1] = x[0]
    logits, gate, ids, weights, sorted_ids, expert_ids, total = route(x.to(DEVICE), w.to(DEVICE), 6, align_block=align)
    want = reference_align(ids.cpu(), align)
    assert int(total) == int(want[2][0]) and torch.equal(expert_ids.cpu(), want[1])
    assert torch.equal(sorted_ids.cpu(), want[0])
    assert torch.equal(route(x.to(DEVICE), w.to(DEVICE), 6)[2].cpu(), ids.cpu())  # the routing itself unchanged
