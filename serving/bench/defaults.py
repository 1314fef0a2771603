"""The defaults of the settings a report from before their phase lacks.

``Settings`` (report.py) gives the multiturn and images phases' fields these defaults, so that a
report written before those phases existed still loads as a ``--baseline``, and the phases' options
(phases/multiturn.py, phases/images.py) offer the same numbers. Both read them here, a module that
imports nothing: the report's types sit below the phases that fill them, and the report imports no
phase.
"""

from __future__ import annotations

# Seed 004: 13 turns, the first 74,160 tokens, later turns 753 in and 753 out.
MULTITURN = {"multiturn_sessions": [1, 2, 4, 8], "multiturn_turns": 13, "multiturn_first_tokens": 74160,
             "multiturn_turn_tokens": 753, "multiturn_output_tokens": 753}

# Seed 000 section 6: 45 images of 2 MP (2048 x 1024 = 2,097,152 pixels, its max_pixels).
IMAGES = {"images": 45, "image_size": [2048, 1024], "image_concurrency": 4, "image_prefill_tokens": 65536,
          "image_max_tokens": 16}
