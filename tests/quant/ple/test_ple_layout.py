"""The PLE layout equals vLLM 0.34.0's own computation, and the reference's real-model numbers."""

import pytest

from flashnext.quant.demo import DEMO_TEXT_CONFIG
from flashnext.quant.ple.layout import is_prime, ple_layout

REAL_TEXT_CONFIG = {"ngram_size": 3, "heads_per_ngram": 8, "ple_embed_dim": 2560, "vocab_size": 248320,
                    "ngram_vocab_size_base": 20000000, "make_ngram_vocab_size_divisible_by": 128,
                    "split_ngram_parts": 128, "eos_token_id": 248044}


def test_real_model_numbers():
    layout = ple_layout(REAL_TEXT_CONFIG)
    assert layout.multipliers == (23703573157769, 20109073645365, 8052911324071)
    assert layout.head_sizes[0] == 20000003 and layout.head_sizes[-1] == 20000171
    assert layout.head_offsets[-1] == 300001275
    assert layout.rows == 320_001_446 and layout.padded_rows == 320_001_536
    assert layout.shard_rows == 2_500_012 and layout.shard_range(127) == (317_501_524, 320_001_536)
    assert layout.padded_rows * layout.head_dim * 2 == 102_400_491_520


@pytest.mark.parametrize("config", [REAL_TEXT_CONFIG, DEMO_TEXT_CONFIG], ids=["real", "demo"])
@pytest.mark.parametrize("layer", [0, 1, 3])
def test_equals_vllm(config, layer):
    ngram = pytest.importorskip("vllm.models.qwen4_exp.nvidia.ngram_embedding",
                                reason="vLLM 0.34.0 is installed by .ci/run")
    cls = ngram.Qwen4ExpNGramEmbedding
    layout = ple_layout(config, layer)
    mult = cls._make_layer_multipliers(ngram_size=config["ngram_size"], unigram_vocab_size=config["vocab_size"],
                                       seed=1234, ple_dense_layer_id=layer)
    sizes, offsets, total = cls._make_vocab_layout(
        ngram_vocab_size_base=config["ngram_vocab_size_base"],
        ngram_heads=layout.num_heads, ple_dense_layer_id=layer)
    assert list(layout.multipliers) == list(mult)
    assert list(layout.head_sizes) == list(sizes)
    assert list(layout.head_offsets) == list(offsets)
    assert layout.rows == total


def test_primality():
    primes = [n for n in range(200) if is_prime(n)]
    assert primes[:10] == [2, 3, 5, 7, 11, 13, 17, 19, 23, 29] and len(primes) == 46
    assert is_prime(2**61 - 1) and not is_prime(3215031751)  # a strong pseudoprime to bases 2,3,5,7
