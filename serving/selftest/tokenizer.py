"""A tokenizer for the demo checkpoint, so that ``vllm serve`` can answer chat completions on it.

The demo snapshot has no tokenizer (its weights are random; nothing reads text). The selftest adds
one to its own copy: byte-level BPE without merges (every byte one token, ids 0-255), the demo
config's special ids where its config.json puts them (end of turn = ``eos_token_id``, the vision
markers), every other id of the 4,096-row vocabulary a reserved token, and a ChatML template.
"""

from __future__ import annotations

import json
from pathlib import Path

from flashnext.quant.checkpoint.snapshot import read_config, text_config_of

_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _special_ids(config: dict) -> dict[int, str]:
    text = text_config_of(config)
    eos = text["eos_token_id"]
    ids = {eos: "<|im_end|>", eos + 1: "<|im_start|>", eos + 2: "<|endoftext|>"}
    for key, token in (("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"),
                       ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>")):
        if key in config:
            ids[config[key]] = token
    return ids


def write_tokenizer(model_dir: Path) -> None:
    """tokenizer.json and tokenizer_config.json for the snapshot at ``model_dir`` (its config.json)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    config = read_config(Path(model_dir) / "config.json")
    text = text_config_of(config)
    size = text["vocab_size"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    special = _special_ids(config)
    vocab = {c: i for i, c in enumerate(alphabet)}
    for i in range(len(alphabet), size):
        vocab[special.get(i, f"<|reserved_{i}|>")] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(special.values()))
    tok.save(str(Path(model_dir) / "tokenizer.json"))
    (Path(model_dir) / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "bos_token": None, "model_max_length": text["max_position_embeddings"],
        "chat_template": _TEMPLATE}, indent=2) + "\n")
