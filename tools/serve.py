"""``serve``: run a serving profile (compose profiles, preflight, capacity plan)."""

from __future__ import annotations

import click

from flashnext.quant.errors import FlashnextError
from flashnext.tools._common import user_errors


@click.command("serve")
@click.option("--profile", required=True, help="Serving profile name (see serving/profiles/).")
@user_errors
def main(profile: str) -> None:
    """Start the optimized vLLM system for a profile."""
    raise FlashnextError(
        f"serving profile {profile!r} is not available: this release ships no serving profiles yet "
        "(checkpoint preparation only)")


if __name__ == "__main__":
    main()
