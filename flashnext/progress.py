"""The progress bar of every long command (``--progress/--no-progress``): tqdm on stderr, so that
``--json`` output on stdout stays one JSON document."""

from __future__ import annotations


class Progress:
    """A bar over ``total`` units of work (``unit="B"``: bytes, scaled by 1024), or nothing when not
    ``enabled``. ``update`` takes the units just done, so it can be handed to ``sha256_file``;
    ``initial`` units were done before (by the run a resumed build continues), and show as such."""

    def __init__(self, total: int, enabled: bool, desc: str, unit: str = "B", initial: int = 0):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit=unit, unit_scale=True, unit_divisor=1024 if unit == "B" else 1000,
                            desc=desc, leave=False, initial=initial)

    def update(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
