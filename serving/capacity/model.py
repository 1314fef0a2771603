"""The model facts a capacity plan reads: the text and vision configs, from the pinned manifest or a snapshot.

Both configs are parsed with :mod:`flashnext.quant.records.jsonfile`'s getters, so a missing or
mistyped key is the same one-line error as in every other reader of a ``config.json``; and they are
read from wherever the caller points (``--model``) or from ``manifests/`` when it points nowhere, one
loader per config so that ``plan`` and the preflight always read the same one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from flashnext.errors import FlashnextError
from flashnext.manifests import manifest_path
from flashnext.quant.checkpoint.snapshot import CONFIG_FILE, read_config_version, text_config_of
from flashnext.quant.records.inputs import FileIdentity
from flashnext.quant.records.jsonfile import get_dict, get_int, read_json

MANIFEST = manifest_path("qwen3.8-flash-next.json")

# Transformers 5.18 renamed `qwen_sparse_attention` to `indexed_attention`; some releases say
# `full_attention` (vLLM 0.34.0 accepts all three).
QSA_LAYER_TYPES = ("full_attention", "qwen_sparse_attention", "indexed_attention")
GDN_LAYER_TYPE = "linear_attention"
# transformers' Qwen3-VL vision config default (a 48 x 48 grid of learned positions)
QWEN3_VL_POSITIONS = 2304


def base_manifest() -> dict:
    """The base checkpoint's pinned facts (:data:`MANIFEST`), read as every JSON input is."""
    return read_json(MANIFEST, "the base checkpoint's manifest")


def _int_list(obj: dict, key: str, where: str) -> tuple[int, ...]:
    values = obj.get(key) or []
    if not isinstance(values, list):
        raise FlashnextError(f"{where}: {key} must be a JSON array, got {values!r}")
    return tuple(get_int({f"{key}[{i}]": v}, f"{key}[{i}]", where) for i, v in enumerate(values))


def _layer_types(text: dict, num_layers: int, where: str) -> tuple[str, ...]:
    types = text.get("layer_types")
    if types is None:  # older configs state the QSA layers by their period
        interval = get_int(text, "full_attention_interval", where, minimum=1)
        return tuple("full_attention" if (i + 1) % interval == 0 else GDN_LAYER_TYPE for i in range(num_layers))
    if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
        raise FlashnextError(f"{where}: layer_types must be a JSON array of strings, got {types!r}")
    return tuple(types)


def is_qsa(layer_type: str) -> bool:
    return layer_type in QSA_LAYER_TYPES


@dataclass(frozen=True)
class TextConfig:
    """The part of a ``qwen4_exp`` text config that sizes the KV cache."""

    num_hidden_layers: int
    layer_types: tuple[str, ...]
    hidden_size: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    indexer_head_dim: int
    indexer_compress_ratio: int
    ple_layer_ids: tuple[int, ...]
    ple_conv_kernel_size: int
    ngram_size: int
    hc_count: int
    mtp_num_hidden_layers: int
    uses_mrope: bool
    # What sizes the memory ledger besides the KV cache (0 where a config does not say)
    num_attention_heads: int = 0
    indexer_budget: int = 0  # the QSA selection (vLLM's topk buffer: budget + compress ratio, its count last)
    num_experts: int = 0
    vocab_size: int = 0
    ple_embed_dim: int = 0
    heads_per_ngram: int = 0
    hc_lowrank: int = 0  # the hyper-connection mixers' low rank (their down projection's rows)
    shared_expert_intermediate_size: int = 0

    @classmethod
    def from_dict(cls, config: dict, where: str) -> "TextConfig":
        """``config``'s text model: its ``text_config`` (a multimodal config), else ``config`` itself."""
        if get_dict(config, "text_config", where, required=False) is not None:
            where = f"{where}: text_config"
        text = text_config_of(config)
        n = get_int(text, "num_hidden_layers", where, minimum=1)
        layer_types = _layer_types(text, n, where)
        rope = (get_dict(text, "rope_parameters", where, required=False)
                or get_dict(text, "rope_scaling", where, required=False) or {})
        sizes = {key: get_int(text, key, where, minimum=1) for key in (
            "hidden_size", "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
            "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim", "indexer_head_dim",
            "indexer_compress_ratio", "hc_count")}
        return cls(
            num_hidden_layers=n,
            layer_types=layer_types,
            ple_layer_ids=_int_list(text, "ple_layer_ids", where),
            ple_conv_kernel_size=get_int(text, "ple_conv_kernel_size", where, minimum=1, default=4),
            ngram_size=get_int(text, "ngram_size", where, minimum=1, default=3),
            mtp_num_hidden_layers=get_int(text, "mtp_num_hidden_layers", where, minimum=0, default=0),
            uses_mrope="mrope_section" in rope,
            **sizes,
            **{key: get_int(text, key, where, minimum=0, default=0) for key in (
                "num_attention_heads", "num_experts", "vocab_size", "ple_embed_dim", "heads_per_ngram",
                "indexer_budget", "hc_lowrank", "shared_expert_intermediate_size")},
        )

    @property
    def ple_ngram_heads(self) -> int:
        """The n-gram heads of a PLE layer: a row per head and token (vLLM's ``Qwen4ExpNGramEmbedding``)."""
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def ple_head_dim(self) -> int:
        return self.ple_embed_dim // self.ple_ngram_heads if self.ple_ngram_heads else 0

    def __post_init__(self):
        if len(self.layer_types) != self.num_hidden_layers:
            raise FlashnextError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        unknown = set(self.layer_types) - {GDN_LAYER_TYPE, *QSA_LAYER_TYPES}
        if unknown:
            raise FlashnextError(f"unknown layer types {sorted(unknown)}")


@dataclass(frozen=True)
class VisionConfig:
    """The vision tower's sizes (pinned in ``manifests/``); its weights are bf16."""

    depth: int
    hidden_size: int
    intermediate_size: int
    patch_size: int
    temporal_patch_size: int
    in_channels: int
    spatial_merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    deepstack_mergers: int

    @classmethod
    def from_dict(cls, v: dict, where: str) -> "VisionConfig":
        sizes = {key: get_int(v, key, where, minimum=1) for key in (
            "depth", "hidden_size", "intermediate_size", "patch_size", "temporal_patch_size", "in_channels",
            "spatial_merge_size", "out_hidden_size")}
        return cls(**sizes,
                   num_position_embeddings=get_int(v, "num_position_embeddings", where, minimum=1,
                                                   default=QWEN3_VL_POSITIONS),
                   deepstack_mergers=len(_int_list(v, "deepstack_visual_indexes", where)))

    def block_parameter_bytes(self) -> list[int]:
        """One block's parameters in vLLM's ``Qwen3_VisionBlock`` order: two LayerNorms, qkv, proj, fc1, fc2."""
        h, i = self.hidden_size, self.intermediate_size
        counts = [h, h, 3 * h * h, 3 * h, h * h, h, h, h, i * h, i, h * i, h]
        return [2 * c for c in counts]

    def block_bytes(self) -> int:
        return sum(self.block_parameter_bytes())

    def linear_parameter_bytes(self) -> list[int]:
        """Each parameter of the tower's linear layers, the ones vLLM gives a quantization method:
        every block's qkv, proj, fc1 and fc2 (weights and biases), then each merger's fc1 and fc2.
        (The LayerNorms, the patch convolution and the position embedding have none.)"""
        per_block = self.block_parameter_bytes()
        merged = self.hidden_size * self.spatial_merge_size ** 2
        merger = [2 * c for c in (merged * merged, merged, merged * self.out_hidden_size, self.out_hidden_size)]
        return (per_block[2:6] + per_block[8:12]) * self.depth + merger * (1 + self.deepstack_mergers)

    def other_bytes(self) -> int:
        """Patch embedding, position embedding and the merger(s): resident either way."""
        h, m = self.hidden_size, self.spatial_merge_size ** 2
        patch = h * self.in_channels * self.temporal_patch_size * self.patch_size ** 2 + h
        merged = h * m
        merger = 2 * h + merged * merged + merged + merged * self.out_hidden_size + self.out_hidden_size
        deepstack = 2 * merged + merged * merged + merged + merged * self.out_hidden_size + self.out_hidden_size
        return 2 * (patch + self.num_position_embeddings * h + merger + self.deepstack_mergers * deepstack)

    def activation_bytes(self, max_pixels: int) -> int:
        """An estimate of the encoder's peak activations for one image of ``max_pixels``: a block's
        largest tensors alive at once (residual, qkv, attention output, MLP input and output) in bf16,
        plus the merged output embeddings."""
        patches = max_pixels // self.patch_size ** 2
        h, i = self.hidden_size, self.intermediate_size
        tokens = patches // self.spatial_merge_size ** 2
        return 2 * patches * (h + 3 * h + h + 2 * i) + 2 * tokens * self.out_hidden_size * (1 + self.deepstack_mergers)


@dataclass(frozen=True)
class ModelConfig:
    """A model's config.json as read once (or the pinned manifest), and where it came from: what a
    plan reads its text and vision configs from, so that one read serves every planner."""

    config: dict
    where: str
    version: FileIdentity | None = None  # of the config.json read (None: the manifest)


def read_model_config(model: "Path | ModelConfig | None") -> ModelConfig:
    """The config to plan for: ``model`` (a snapshot directory or its ``config.json``; one already
    read is passed through), else the pinned manifest."""
    if isinstance(model, ModelConfig):
        return model
    if model is None:
        return ModelConfig(base_manifest(), str(MANIFEST))
    path = Path(model)
    config = path / CONFIG_FILE if path.is_dir() else path
    if not config.exists():  # a FIFO or a device exists: the reader refuses it as what it is
        raise FlashnextError(f"{config}: no such config.json")
    keys, version = read_config_version(config)
    return ModelConfig(keys, str(config), version)


def load_text_config(model: "Path | ModelConfig | None" = None) -> TextConfig:
    """The base checkpoint's text config (pinned in ``manifests/``), or a snapshot's ``config.json``."""
    read = read_model_config(model)
    return TextConfig.from_dict(read.config, read.where)


def load_vision_config(model: "Path | ModelConfig | None" = None) -> VisionConfig | None:
    """The base checkpoint's vision config, or a snapshot's; None for a text-only config."""
    read = read_model_config(model)
    vision = get_dict(read.config, "vision_config", read.where, required=False)
    return VisionConfig.from_dict(vision, f"{read.where}: vision_config") if vision else None
