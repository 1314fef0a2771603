"""What the bench sends: fixed prompts of a chosen length, haystacks with a needle, and a JSON schema.

Seed 000's method: the measured prompts are fixed (the same text and seed every round, after one
warm-up round), because random prompts miss the PLE table's page cache and move the median. A cold
measurement needs text the server has never read, so the cold rounds draw a fresh text each.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

import jsonschema

from flashnext.serving.bench.client import Malformed, parse_strict

# Filler vocabulary: plain English words, so that any tokenizer spends a few characters per token.
_WORDS = (
    "the a river stone window morning garden letter engine harbor quiet bright slowly under across "
    "between market bridge lantern copper winter summer orchard village signal ledger compass "
    "station ferry meadow timber glass thread needle archive canal mirror pocket ribbon saddle "
    "thunder valley whistle yellow anchor basket candle desert feather gravel hollow island jacket "
    "kettle ladder marble narrow orange pepper quarry rescue silver tunnel velvet walnut"
).split()

# The needle's sentence and question (NIAH "pass key" style: a number that cannot be guessed).
NEEDLE = "The pass key is {key}. Remember it; the pass key is {key}."
NEEDLE_QUESTION = "What is the pass key mentioned in the text above? Answer with the number only."

# Bounded, as a real extraction schema is: a grammar-constrained answer then always fits in
# --structured-max-tokens, so an invalid answer is the server's fault, not a cut-off.
STRUCTURED_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "country": {"type": "string", "maxLength": 24},
        "population": {"type": "integer", "minimum": 0},
        "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 3},
    },
    "required": ["city", "country", "population", "landmarks"],
    "additionalProperties": False,
}
_CITIES = ("Kyoto", "Lisbon", "Nairobi", "Montreal", "Osaka", "Valparaiso", "Tbilisi", "Hanoi",
           "Bergen", "Cusco", "Dakar", "Perth", "Riga", "Porto", "Sapporo", "Zanzibar")
_TOPICS = ("a lighthouse keeper", "a river ferry", "a clockmaker's shop", "a mountain observatory",
           "a night market", "a glass workshop", "a desert railway", "a harbor in winter")


def filler(n_chars: int, rng: random.Random) -> str:
    """Sentences of filler words, ``n_chars`` long (to the word)."""
    words: list[str] = []
    size = 0
    while size < n_chars:
        sentence = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(8, 16)))
        sentence = sentence[0].upper() + sentence[1:] + "."
        words.append(sentence)
        size += len(sentence) + 1
    return " ".join(words)[:n_chars].rsplit(" ", 1)[0]


@dataclass(frozen=True)
class TextScale:
    """Characters per prompt token, measured on the server (``usage.prompt_tokens``): what turns a
    prompt length in tokens into filler of that many characters."""

    chars_per_token: float
    template_tokens: int  # what the chat template adds around a message

    def chars_for(self, tokens: int) -> int:
        return max(1, round((tokens - self.template_tokens) * self.chars_per_token))


def messages(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def latency_prompt(tokens: int, scale: TextScale, slot: int, seed: int | None) -> list[dict]:
    """A prompt of about ``tokens`` tokens for request ``slot``. ``seed`` None: a text nobody read
    before (a cold measurement); otherwise the same text for the same (tokens, slot, seed)."""
    rng = random.Random() if seed is None else random.Random(f"latency/{tokens}/{slot}/{seed}")
    head = "Continue the following text.\n\n"
    return messages(head + filler(scale.chars_for(tokens) - len(head), rng))


def decode_prompt(slot: int) -> list[dict]:
    """A short fixed prompt that asks for a long answer: a different topic for each slot."""
    return messages(f"Write a long, detailed story about {_TOPICS[slot % len(_TOPICS)]}.")


@dataclass(frozen=True)
class Needle:
    context_tokens: int
    depth: float   # where the needle sits, 0 = start of the haystack, 1 = end
    key: str
    prompt: list[dict]

    def score(self, answer: str) -> bool:
        """Found: the answer names the key (as a whole number, not part of a longer one)."""
        return re.search(rf"(?<!\d){self.key}(?!\d)", answer) is not None


def needle_prompt(context_tokens: int, depth: float, scale: TextScale, seed: int) -> Needle:
    rng = random.Random(f"needle/{context_tokens}/{depth}/{seed}")
    key = str(rng.randint(100000, 999999))
    sentence = NEEDLE.format(key=key)
    budget = scale.chars_for(context_tokens) - len(sentence) - len(NEEDLE_QUESTION) - 4
    hay = filler(max(budget, 1), rng)
    at = hay.rfind(". ", 0, int(len(hay) * depth)) + 2 if depth > 0 else 0
    text = f"{hay[:at]}{sentence} {hay[at:]}\n\n{NEEDLE_QUESTION}"
    return Needle(context_tokens, depth, key, messages(text))


def structured_prompt(slot: int) -> list[dict]:
    city = _CITIES[slot % len(_CITIES)]
    return messages(f"Describe {city} as a JSON object with its country, population and up to three "
                    "landmarks.")


def structured_response_format(kind: str = "json_schema") -> dict:
    """How a server is asked for the schema (``--structured-format``, the structured phase's FORMATS)."""
    if kind == "json_object":
        return {"type": "json_object", "schema": STRUCTURED_SCHEMA}
    return {"type": "json_schema", "json_schema": {"name": "city", "schema": STRUCTURED_SCHEMA, "strict": True}}


def validate_structured(answer: str) -> str | None:
    """None if ``answer`` is JSON that follows :data:`STRUCTURED_SCHEMA`, else why not (one line)."""
    try:
        value = parse_strict(answer, "the answer")
    except Malformed as e:  # a hostile answer nested 10^5 deep must not cost the run
        return f"not JSON: {e}"
    try:
        jsonschema.validate(value, STRUCTURED_SCHEMA)
    except jsonschema.ValidationError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "the top level"
        return f"schema: {e.message[:120]} at {where}"
    return None


# -- multiturn: an agent session (seed 004's OpenHands-like workload) -------------------------------

_AGENT_TASK = ("You are a software agent working in a repository. Read the files and tool output below, "
               "then say what you will do next.\n\n")
_TOOL_OUTPUT = "Tool output:\n"


def agent_first_turn(tokens: int, scale: TextScale, rng: random.Random) -> list[dict]:
    """The session's first message, about ``tokens`` long: the task and the context an agent reads."""
    return messages(_AGENT_TASK + filler(scale.chars_for(tokens) - len(_AGENT_TASK), rng))


def agent_next_turn(tokens: int, scale: TextScale, rng: random.Random) -> dict:
    """A later user message, about ``tokens`` long: tool output the agent feeds back. It sits inside
    a conversation, so no chat template's overhead is taken off."""
    chars = max(1, round(tokens * scale.chars_per_token) - len(_TOOL_OUTPUT))
    return {"role": "user", "content": _TOOL_OUTPUT + filler(chars, rng)}


# -- images: generated, no downloads (seed 000 section 6) -------------------------------------------

IMAGE_QUESTION = "Describe this image in one sentence."


def image_data_url(index: int, width: int, height: int, seed: int) -> str:
    """A JPEG of ``width`` x ``height`` as a ``data:`` URL: a gradient and shapes drawn from
    (``index``, ``seed``), so that every image is new to the server (a repeated one would be
    answered from vLLM's multi-modal cache) and the same in every run."""
    import base64
    import io

    import numpy as np
    from PIL import Image, ImageDraw

    rng = random.Random(f"image/{index}/{seed}")
    a, b = (np.array([rng.randrange(256) for _ in range(3)], dtype=np.float32) for _ in range(2))
    ramp = np.linspace(0.0, 1.0, width, dtype=np.float32)[None, :, None]
    rows = np.linspace(0.0, 1.0, height, dtype=np.float32)[:, None, None]
    pixels = a * (1 - ramp) * (1 - rows / 2) + b * ramp * (0.5 + rows / 2)
    image = Image.fromarray(pixels.clip(0, 255).astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(image)
    for _ in range(12):
        x0, y0 = rng.randrange(width), rng.randrange(height)
        x1, y1 = x0 + rng.randrange(1, max(2, width // 3)), y0 + rng.randrange(1, max(2, height // 3))
        color = tuple(rng.randrange(256) for _ in range(3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)((x0, y0, x1, y1), fill=color)
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=85)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def image_messages(data_url: str) -> list[dict]:
    """One user message with the image and a short question (OpenAI's, and vLLM's, content parts)."""
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url}},
                                         {"type": "text", "text": IMAGE_QUESTION}]}]
