"""``flashnext``: the umbrella command."""

from __future__ import annotations

import click

from flashnext import __version__
from flashnext.tools import bench, demo_checkpoint, doctor, make_mtp_int4, overlay, patches, plan, ple, repack_int6, serve
from flashnext.tools import selftest
from flashnext.tools._common import CONTEXT_SETTINGS, RootGroup


@click.group(cls=RootGroup, context_settings=CONTEXT_SETTINGS)
@click.version_option(__version__, prog_name="flashnext")
def main() -> None:
    """Checkpoint overlays and serving for Qwen3.8-Flash-Next on small rigs."""


main.add_command(make_mtp_int4.main)
main.add_command(demo_checkpoint.main)
main.add_command(serve.main)
main.add_command(ple.main)
main.add_command(overlay.main)
main.add_command(doctor.main)
main.add_command(repack_int6.main)
main.add_command(patches.main)
main.add_command(plan.main)
main.add_command(bench.main)
main.add_command(selftest.main)


if __name__ == "__main__":
    main()
