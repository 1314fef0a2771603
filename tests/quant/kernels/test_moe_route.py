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
    aligned = reference_align(want[2], 8, 512)
    assert all(torch.equal(g.cpu(), a) for g, a in zip(got[4:], aligned))


@pytest.mark.parametrize("m,align", [(1, 8), (3, 8), (4, 16)])
def test_marlin_block_alignment_in_the_same_launch(m, align):
    """vLLM's moe_align_block_size layout, from the router's own picks (the last token repeats the
    first, so experts are shared between tokens)."""
    x, w = case(m, 64, 256, seed=30 + m, exact=True, ties=True)
    x[-1] = x[0]
    logits, gate, ids, weights, sorted_ids, expert_ids, total = route(x.to(DEVICE), w.to(DEVICE), 6, align_block=align)
    want = reference_align(ids.cpu(), align, 64)
    assert int(total) == int(want[2][0]) and torch.equal(expert_ids.cpu(), want[1])
    assert torch.equal(sorted_ids.cpu(), want[0])
    assert torch.equal(route(x.to(DEVICE), w.to(DEVICE), 6)[2].cpu(), ids.cpu())  # the routing itself unchanged


def vllm_alignment(topk_ids: torch.Tensor, block: int, experts: int) -> tuple[torch.Tensor, ...]:
    """vLLM 0.34.0's own ``moe_align_block_size`` as ``fused_marlin_moe`` calls it: its Python sizes
    the three buffers; the CUDA op that fills them (``_moe_C.moe_align_block_size``, not in this
    vLLM build's CPU ops) is the one stand-in, filling them as that kernel does
    (:func:`~flashnext.quant.kernels.reference.reference_align`: ``csrc/moe/moe_align_sum_kernels.cu``)."""
    import vllm._custom_ops as ops
    from vllm.model_executor.layers.fused_moe import moe_align_block_size as vllm_align

    def kernel_stand_in(topk_ids, num_experts, block_size, sorted_ids, expert_ids, total, expert_map=None,
                        scatter_idx=None):
        assert expert_map is None and scatter_idx is None
        for buffer, filled in zip((sorted_ids, expert_ids, total), reference_align(topk_ids, block_size, num_experts)):
            assert buffer.shape == filled.shape  # the kernel fills what the Python allocated, no more
            buffer.copy_(filled)

    real, ops.moe_align_block_size = ops.moe_align_block_size, kernel_stand_in
    try:
        return vllm_align.moe_align_block_size(topk_ids, block, experts, None, ignore_invalid_experts=True)
    finally:
        ops.moe_align_block_size = real


@pytest.mark.parametrize("experts,top_k", [(4, 4), (8, 4), (64, 6), (512, 10)])
@pytest.mark.parametrize("block", [8, 16, 48, 64])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_alignment_is_vllms_moe_align_block_size(m, block, experts, top_k):
    """Issue 40 item 7: Marlin's op reads ``sorted_token_ids.size(0)`` (its fp32 reduction buffer and
    workspace check), so the fused alignment's buffers are vLLM's sizes, not ``M x k x block``:
    ``M*k + E*(block - 1)``, capped at ``M*k*block`` below E assignments (the two differ when the
    step routes more assignments than there are experts: 4 experts, top 4). Contents as the
    contract gives them: the padded total and each block's expert exactly; each block's token
    indices as a set (vLLM's kernel for more than 64 experts places them by atomics); padding
    ``M*k``, and -1 for the blocks past the total."""
    pytest.importorskip("vllm")
    x, w = case(m, experts, 256, seed=100 * m + block + experts, exact=True)
    x[-1] = x[0]  # a shared expert between the first and last token
    *_, ids, _, sorted_ids, expert_ids, total = route(x.to(DEVICE), w.to(DEVICE), top_k, align_block=block)
    want_sorted, want_experts, want_total = vllm_alignment(ids.cpu(), block, experts)
    assert (sorted_ids.shape, expert_ids.shape, total.shape) == (want_sorted.shape, want_experts.shape,
                                                                   want_total.shape)
    assert int(total) == int(want_total) and torch.equal(expert_ids.cpu(), want_experts)
    by_block = lambda t: [chunk.sort().values.tolist() for chunk in t.cpu().split(block)]  # the last may be short
    assert by_block(sorted_ids) == by_block(want_sorted)
