"""What the tests share besides fixtures: the repository's paths, and helpers in this folder."""

from pathlib import Path

SUPPORT_DIR = Path(__file__).resolve().parent
ROOT = SUPPORT_DIR.parent.parent  # the repository
