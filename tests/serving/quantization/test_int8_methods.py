"""The INT8 methods of patch int8-modules, built through vLLM's own parameter classes: the linear
and the embedding method multiply through one ``apply``, and both read the checkpoint's words as
compressed-tensors writes them (``pack_int32``)."""

import subprocess
import sys

import pytest
import torch

from flashnext.quant.formats.packing import pack_int32

pytest.importorskip("vllm", reason="vLLM 0.34.0 is installed by .ci/run")

ROWS, COLS, GROUP = 48, 256, 64


def int8_weights():
    g = torch.Generator().manual_seed(27)
    codes = torch.randint(-128, 128, (ROWS, COLS), generator=g, dtype=torch.int32)
    scales = (torch.rand(ROWS, COLS // GROUP, generator=g) * 0.02 + 1e-3).to(torch.bfloat16)
    dense = (codes.float().view(ROWS, -1, GROUP) * scales.float().unsqueeze(-1)).view(ROWS, COLS)
    return pack_int32(codes, 8), scales, dense


@pytest.fixture(autouse=True)
def one_rank(monkeypatch):
    # vLLM's parameters ask for their tensor-parallel rank when built; this process runs no engine.
    from vllm.model_executor import parameter

    monkeypatch.setattr(parameter, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(parameter, "get_tensor_model_parallel_world_size", lambda: 1)


def loaded(method) -> torch.nn.Module:
    """A layer whose parameters ``method`` created, filled as vLLM's loader fills them."""
    layer = torch.nn.Module()
    method.create_weights(layer, COLS, [ROWS], COLS, ROWS, torch.bfloat16)
    packed, scales, _ = int8_weights()
    layer.weight_packed.data.copy_(packed)
    layer.weight_scale.data.copy_(scales)
    return layer


def test_linear_and_embedding_share_one_apply():
    """One INT8 multiply for both: the embedding method (an LM head's) defers to the linear one's
    wherever vLLM's chooser gives the LM head no kernel of its own (tests/serving/patches/test_int8_lm_head.py)."""
    from flashnext.serving.quantization.int8 import Int8EmbeddingMethod, Int8LinearMethod, _Int8Matmul

    assert Int8LinearMethod.apply is _Int8Matmul.apply and issubclass(Int8EmbeddingMethod, _Int8Matmul)
    method = Int8EmbeddingMethod(128)
    assert method.scheme is None and method.kernel == "int8_matmul"  # before create_weights, and on the CPU
    from vllm.model_executor.layers.linear import LinearMethodBase
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    assert issubclass(Int8LinearMethod, LinearMethodBase) and issubclass(Int8EmbeddingMethod, QuantizeMethodBase)


@pytest.mark.parametrize("tokens", [1, 5, 40], ids=lambda m: f"{m}tok")
@pytest.mark.parametrize("kind", ["linear", "embedding"])
def test_apply_multiplies_by_the_stored_weights(kind, tokens):
    from flashnext.serving.quantization.int8 import Int8EmbeddingMethod, Int8LinearMethod

    method = (Int8LinearMethod if kind == "linear" else Int8EmbeddingMethod)(GROUP)
    layer = loaded(method)
    x = torch.randn(tokens, COLS, generator=torch.Generator().manual_seed(tokens)).to(torch.bfloat16)
    bias = torch.randn(ROWS).to(torch.bfloat16)
    want = x.float() @ int8_weights()[2].T + bias.float()
    got = method.apply(layer, x.view(1, tokens, COLS), bias)
    assert got.shape == (1, tokens, ROWS) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.view(tokens, ROWS).float(), want, atol=0.1, rtol=0.02)


def test_embedding_dequantizes_only_the_steps_rows():
    from flashnext.serving.quantization.int8 import Int8EmbeddingMethod

    method = Int8EmbeddingMethod(GROUP)
    layer = loaded(method)
    ids = torch.tensor([[3, 0], [47, 3]])
    rows = method.embedding(layer, ids)
    assert rows.shape == (2, 2, COLS) and rows.dtype == torch.bfloat16
    assert torch.equal(rows, int8_weights()[2][ids].to(torch.bfloat16))


def test_the_packages_import_no_vllm_until_a_method_is_needed():
    # The command lines import flashnext.serving; only a patched vLLM imports the method modules.
    code = ("import sys, flashnext.serving.quantization, flashnext.serving.runtime.host_pool, "
            "flashnext.serving.runtime.block_stream; print('vllm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
