"""mtp-02 on a GPU: the draft's INT8 embedding (the release's layout: int32 words, a bf16 scale per
128, the shape) moved after loading to exact-size pinned host memory and read by the GPU through
UVA views, holding no device memory but its 16-byte shape. Needs no vLLM: the module carries the
parameters int8-modules' ``Int8EmbeddingMethod`` creates, and the rows are gathered and dequantized
the way its ``embedding`` does, on the device."""

import pytest
import torch

from flashnext.quant.formats.packing import dequantize_groups, pack_int32, unpack_int32


@pytest.mark.gpu
def test_int8_draft_embedding_read_through_uva(tmp_path, monkeypatch):
    from flashnext.serving.runtime import host_pool
    from flashnext.serving.hooks.mtp import draft_embedding_pinned_bytes, finish_draft_embedding

    monkeypatch.setenv("VLLM_HOST_POOL_LOCK", str(tmp_path / "lock"))
    vocab, hidden, group = 4096, 256, 128
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(-128, 128, (vocab, hidden), generator=g, dtype=torch.int32)
    scale = (torch.rand(vocab, hidden // group, generator=g) * 0.01 + 1e-3).to(torch.bfloat16)
    module = torch.nn.Module()  # as Int8EmbeddingMethod builds it on the CPU under draft_embedding
    for name, value in (("weight_packed", pack_int32(codes, 8)), ("weight_scale", scale.clone()),
                        ("weight_shape", torch.tensor([vocab, hidden]))):
        module.register_parameter(name, torch.nn.Parameter(value, requires_grad=False))
    pools = len(host_pool._POOLS)
    before = torch.cuda.memory_allocated()
    finish_draft_embedding(module)
    assert module.weight_packed.is_cuda and module.weight_scale.is_cuda and module.weight_shape.is_cuda
    assert torch.cuda.memory_allocated() - before <= 512  # the shape's one block; words and scales on the host
    assert all(t.is_pinned() for t in module.host_tensors.values())
    pinned = sum(p.nbytes for p in host_pool._POOLS[pools:])
    assert pinned == draft_embedding_pinned_bytes(vocab, hidden, group) == vocab * hidden + vocab * 2 * 2
    ids = torch.tensor([0, 17, 4095, 17], device="cuda")
    rows = dequantize_groups(unpack_int32(module.weight_packed[ids], 8, hidden), module.weight_scale[ids],
                             torch.bfloat16)
    want = (codes[ids.cpu()].float().view(4, -1, group) * scale[ids.cpu()].float().unsqueeze(-1)).view(4, hidden)
    assert torch.equal(rows.cpu(), want.to(torch.bfloat16))
