"""How every command and message prints a size in bytes: one formatter, which picks the unit."""

from __future__ import annotations

UNITS = ("KiB", "MiB", "GiB")


def format_size(n: float) -> str:
    """``n`` bytes in the largest binary unit that keeps it at 1 or more: ``"320 B"``, ``"16.00 KiB"``,
    ``"1.50 MiB"``, ``"95.37 GiB"`` (never ``"0.00 GiB"`` for a small file)."""
    if abs(n) < 1024:
        return f"{n:,.0f} B"
    value, unit = n / 1024, UNITS[0]
    for bigger in UNITS[1:]:
        if abs(value) < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{value:,.2f} {unit}"
