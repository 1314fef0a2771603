"""Real OpenAI-compatible servers on loopback for ``flashnext bench``, on the CPU, each with a tiny
chat model built here (random weights, a byte-level vocabulary, a ChatML template):

* ``transformers serve`` (:class:`TransformersServer`, :func:`build_tiny_chat_model`): streams usage,
  refuses ignore_eos, returns no logprobs and ignores ``response_format``;
* llama.cpp's server from ``llama-cpp-python`` (:class:`LlamaCppServer`, :func:`build_tiny_gguf`):
  returns top-k logprobs and constrains answers to a JSON schema with a grammar.

The models' answers are noise; the servers, their streaming, logprobs, grammars and timing are real.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _byte_alphabet() -> list[str]:
    from tokenizers import pre_tokenizers

    return sorted(pre_tokenizers.ByteLevel.alphabet())


def _printable(alphabet: list[str]) -> list[int]:
    """The byte-level tokens of printable ASCII and the space: the only ones the models may pick
    (others get a zero, tied, embedding row), so every token streams as text at once, and a JSON
    string holds no control character."""
    return [i for i, c in enumerate(alphabet) if 33 <= ord(c) <= 126 or c == "\u0120"]


def build_tiny_chat_model(path: Path, seed: int = 0) -> Path:
    """A 2-layer Llama with a 259-token byte-level vocabulary; ``seed`` picks the weights."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    alphabet = _byte_alphabet()
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = _TEMPLATE
    fast.save_pretrained(path)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                         eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id, tie_word_embeddings=True,
                         # Wide weights: the default 0.02 makes every seed answer the same newline.
                         initializer_range=0.5)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        # EOS is zeroed too: the server refuses ignore_eos, and answers should run to max_tokens.
        rows = torch.ones(len(fast), dtype=torch.bool)
        rows[_printable(alphabet)] = False
        model.model.embed_tokens.weight[rows] = 0
    model.save_pretrained(path)
    return path


def build_tiny_gguf(path: Path, seed: int = 0, perturb: float = 0.0) -> Path:
    """The same kind of model as one GGUF file for llama.cpp (a Llama: 2 layers, width 64).
    ``perturb`` adds that much noise (relative) to every weight: a nearby model, for an A/B whose
    answers differ a little."""
    import gguf
    import numpy as np

    alphabet = _byte_alphabet()
    # llama.cpp's BPE vocabulary needs at least one merge: two spaces, a token nothing picks.
    tokens = alphabet + ["\u0120\u0120", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    d, ff, layers, heads, kv_heads = 64, 128, 2, 4, 2
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("flashnext-tiny")
    w.add_context_length(8192)
    w.add_embedding_length(d)
    w.add_block_count(layers)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(d // heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.NORMAL] * (len(alphabet) + 1) + [gguf.TokenType.CONTROL] * 3)
    w.add_token_merges(["\u0120 \u0120"])
    w.add_bos_token_id(len(tokens) - 1)
    w.add_eos_token_id(len(tokens) - 2)
    w.add_add_bos_token(False)
    w.add_chat_template(_TEMPLATE)
    rng = np.random.default_rng(seed)
    noise = np.random.default_rng(10_000 + seed)

    def normal(*shape):
        x = rng.standard_normal(shape) * 0.5
        return (x * (1 + perturb * noise.standard_normal(shape))).astype(np.float32)

    embedding = np.zeros((len(tokens), d), np.float32)
    embedding[_printable(alphabet)] = normal(len(_printable(alphabet)), d)
    w.add_tensor("token_embd.weight", embedding)  # tied: no output.weight
    kv = kv_heads * d // heads
    for i in range(layers):
        for name, shape in (("attn_q", (d, d)), ("attn_k", (kv, d)), ("attn_v", (kv, d)), ("attn_output", (d, d)),
                            ("ffn_gate", (ff, d)), ("ffn_up", (ff, d)), ("ffn_down", (d, ff))):
            w.add_tensor(f"blk.{i}.{name}.weight", normal(*shape))
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(d, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(d, np.float32))
    w.add_tensor("output_norm.weight", np.ones(d, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _ServerProcess:
    """A server in a subprocess (its own session, so that its children go with it): up when the
    context is entered (``ready_path`` answers 200), gone after."""

    ready_path = "/health"

    def __init__(self, model: Path, log: Path):
        self.model, self.log, self.port = model, log, free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def argv(self) -> list[str]:
        raise NotImplementedError

    def __enter__(self):
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.argv()[2]} exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}{self.ready_path}", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.5)
        self.__exit__()
        raise RuntimeError(f"{self.argv()[2]} did not come up in 180 s:\n{self.log.read_text()[-3000:]}")

    def __exit__(self, *exc) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


class TransformersServer(_ServerProcess):
    """``transformers serve MODEL`` (pinned to the model: requests must name it)."""

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "transformers.cli.transformers", "serve", str(self.model), "--host",
                "127.0.0.1", "--port", str(self.port), "--device", "cpu", "--dtype", "float32",
                "--log-level", "warning"]


class LlamaCppServer(_ServerProcess):
    """``python -m llama_cpp.server --model FILE.gguf``: one slot, requests queue for it. (With its
    default ``--interrupt_requests True`` a second concurrent request gets a bare ``[DONE]``, which
    flashnext bench reports as an empty answer.)"""

    ready_path = "/v1/models"

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "llama_cpp.server", "--model", str(self.model), "--host", "127.0.0.1",
                "--port", str(self.port), "--n_ctx", "4096", "--n_threads", "1", "--seed", "0",
                "--interrupt_requests", "False"]
