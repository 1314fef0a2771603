"""The PLE n-gram table layout of vLLM's ``qwen4_exp``: multipliers, per-head sizes, offsets, shards.

Every number here is computed exactly as vLLM 0.34.0 computes it (``Qwen4ExpNGramEmbedding``'s
``_make_layer_multipliers`` and ``_make_vocab_layout``), from config.json's ``text_config``.
"""

from __future__ import annotations

from dataclasses import dataclass

MASK64 = (1 << 64) - 1
INT64_MAX = (1 << 63) - 1  # vLLM hashes token ids, EOS included, as int64
SPLITMIX_GAMMA = 0x9E3779B97F4A7C15
SPLITMIX_M1 = 0xBF58476D1CE4E5B9
SPLITMIX_M2 = 0x94D049BB133111EB
DEFAULT_SEED = 1234
LAYER_SEED_STRIDE = 10007
_SMALL_PRIMES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
_MR_BASES = (2, 325, 9375, 28178, 450775, 9780504, 1795265022)


def splitmix64(x: int) -> int:
    z = (x + SPLITMIX_GAMMA) & MASK64
    z = ((z ^ (z >> 30)) * SPLITMIX_M1) & MASK64
    z = ((z ^ (z >> 27)) * SPLITMIX_M2) & MASK64
    return z ^ (z >> 31)


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin for 64-bit n (the bases vLLM uses)."""
    if n < 2:
        return False
    for p in _SMALL_PRIMES:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d //= 2
        r += 1
    for a in _MR_BASES:
        a %= n
        if a == 0:
            continue
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


@dataclass(frozen=True)
class PleLayout:
    """The table of one PLE layer."""

    vocab_size: int
    ngram_size: int
    heads_per_ngram: int
    head_dim: int
    multipliers: tuple[int, ...]  # one per n-gram position, oldest last
    head_sizes: tuple[int, ...]
    head_offsets: tuple[int, ...]
    rows: int  # sum of head sizes
    padded_rows: int
    split_parts: int
    eos_token_id: int

    @property
    def num_heads(self) -> int:
        return len(self.head_sizes)

    @property
    def shard_rows(self) -> int:
        return -(-self.padded_rows // self.split_parts)

    def shard_range(self, index: int) -> tuple[int, int]:
        """Global rows ``[begin, end)`` of checkpoint shard ``index`` (possibly empty)."""
        begin = index * self.shard_rows
        rows = max(0, min(self.shard_rows, self.padded_rows - begin))
        return begin, begin + rows


def layer_multipliers(vocab_size: int, ngram_size: int, seed: int, dense_layer_id: int) -> tuple[int, ...]:
    max_mult = ((1 << 63) - 1) // vocab_size
    half = max(1, max_mult // 2)
    base_seed = seed + LAYER_SEED_STRIDE * dense_layer_id
    return tuple(2 * (splitmix64(base_seed + SPLITMIX_GAMMA * (i + 1)) % half) + 1
                 for i in range(ngram_size))


def head_sizes(base: int, num_heads: int, dense_layer_id: int) -> tuple[int, ...]:
    """Consecutive primes >= ``base``: head h of layer L takes the (L*num_heads + h + 1)-th."""
    wanted = (dense_layer_id + 1) * num_heads
    primes, n = [], base
    while len(primes) < wanted:
        if is_prime(n):
            primes.append(n)
        n += 1
    return tuple(primes[dense_layer_id * num_heads:])


# The ngram_vocab_size_base past which finding the heads' primes would take minutes, not milliseconds.
MAX_NGRAM_VOCAB_BASE = 1 << 40
# More heads than this is no PLE config but a typo (the real model has 16).
MAX_HEADS = 4096


def ple_layout(text_config: dict, dense_layer_id: int = 0, where: str = "text_config") -> PleLayout:
    """The layout vLLM derives for PLE layer ``dense_layer_id`` from ``text_config``; a missing,
    mistyped or out-of-range key is a :class:`FlashnextError` naming ``where`` and the key."""
    from flashnext.errors import FlashnextError
    from flashnext.quant.records.jsonfile import get_int

    c = text_config
    if not isinstance(c, dict):
        raise FlashnextError(f"{where}: not a JSON object")
    if dense_layer_id < 0:
        raise FlashnextError(f"PLE layer {dense_layer_id} does not exist")
    ngram_size = get_int(c, "ngram_size", where, minimum=2)
    heads_per_ngram = get_int(c, "heads_per_ngram", where, minimum=1)
    num_heads = (ngram_size - 1) * heads_per_ngram
    if num_heads * (dense_layer_id + 1) > MAX_HEADS:
        raise FlashnextError(f"{where}: {num_heads} n-gram heads for PLE layer {dense_layer_id} is implausible")
    embed_dim = get_int(c, "ple_embed_dim", where, minimum=1)
    if embed_dim % num_heads:
        raise FlashnextError(f"{where}: ple_embed_dim {embed_dim} is not divisible by {num_heads} n-gram heads")
    vocab = get_int(c, "vocab_size", where, minimum=1)
    if vocab > (1 << 62):
        raise FlashnextError(f"{where}: vocab_size {vocab} does not fit vLLM's int64 hashing")
    seed = get_int(c, "seed", where, default=DEFAULT_SEED)
    mult = layer_multipliers(vocab, ngram_size, seed, dense_layer_id)
    base = get_int(c, "ngram_vocab_size_base", where, minimum=2)
    if base > MAX_NGRAM_VOCAB_BASE:
        raise FlashnextError(f"{where}: ngram_vocab_size_base {base} is implausible")
    sizes = head_sizes(base, num_heads, dense_layer_id)
    offsets, total = [], 0
    for s in sizes:
        offsets.append(total)
        total += s
    divisor = get_int(c, "make_ngram_vocab_size_divisible_by", where, minimum=1, default=1)
    padded = -(-total // divisor) * divisor
    return PleLayout(vocab, ngram_size, heads_per_ngram, embed_dim // num_heads, mult, sizes,
                     tuple(offsets), total, padded, get_int(c, "split_ngram_parts", where, minimum=1, default=512),
                     get_int(c, "eos_token_id", where, minimum=0, maximum=INT64_MAX))
