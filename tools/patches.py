"""``flashnext patches``: the vLLM patch series."""

from __future__ import annotations

from pathlib import Path

import click

from flashnext.tools._common import begin, emit_json, json_option, user_errors


@click.group("patches")
def main() -> None:
    """The vLLM patch series: the diffs the serving image applies, the plugin registrations, and the
    patches vLLM absorbed."""


@main.command("list")
@json_option
@user_errors
def list_cmd(as_json: bool) -> None:
    """Every patch, in order: what it fixes, its switch, the files it touches, upstream status."""
    from flashnext.serving.patch_series import load_series
    from flashnext.serving.patches.docs import listing

    series = load_series()
    if as_json:
        emit_json([listing(p) for p in series])
        return
    for p in series:
        click.echo(f"{p.order:2d}. {p.id}: {listing(p)['title']}")
        click.echo(f"    effect: {p.seed_effect}")
        click.echo(f"    off:    {p.env_switch}; touches {', '.join(p.touches)}")
        click.echo(f"    status: {p.upstream}")


@main.command("readme")
@click.option("--write", is_flag=True, help="Rewrite the documents generated from the series (in a source checkout).")
@user_errors
def readme_cmd(write: bool) -> None:
    """Print the patches README's tables (the series, and what each patch's tests drive), generated
    from the series, or --write every generated document (the patches README, docs/serving.md's
    patch sections, README.md's list). Exits 1 without --write when one is out of date."""
    from flashnext.errors import FlashnextError
    from flashnext.serving.patch_series import load_series
    from flashnext.serving.patches.docs import REPO_ROOT, coverage_table, series_table, wanted

    series = load_series()
    texts = wanted(series)
    if write:
        if not (REPO_ROOT / "pyproject.toml").is_file():
            raise FlashnextError(f"{REPO_ROOT} is an installed package; --write edits a source checkout")
        for path, (current, text) in texts.items():
            if text != current:
                path.write_text(text, encoding="utf-8")
            click.echo(f"wrote {path}")
        return
    click.echo(series_table(series) + "\n\n" + coverage_table(series))
    stale = [str(path) for path, (current, text) in texts.items() if text != current]
    if stale:
        raise FlashnextError(f"{', '.join(stale)} out of date: run `flashnext patches readme --write`")


@main.command("check")
@click.option("--vllm", type=click.Path(path_type=Path), default=None,
              help="A vllm install directory or wheel (default: the installed vllm, never modified).")
@click.option("--progress/--no-progress", default=True, show_default=True,
              help="Print each step on stderr as it happens (the probes take minutes).")
@json_option
@user_errors
def check(vllm: Path | None, progress: bool, as_json: bool) -> None:
    """The drift table for a vllm: each diff applied with zero fuzz to a shadow copy (or the hunk that
    fails), each plugin registration and each absorbed patch's upstream fix probed. Exits 1 unless
    every row is ok, so a new vLLM release shows at once what to port (docs/serving.md, porting)."""
    from flashnext.errors import FlashnextError
    from flashnext.serving.patch_series import drift_table

    begin(f"checking the patch series against {vllm or 'the installed vllm'}")
    rows = drift_table(vllm, progress=(lambda line: click.echo(line, err=True)) if progress else lambda line: None)
    if as_json:
        emit_json([r.as_json() for r in rows])
    else:
        width = max(len(r.id) for r in rows)
        for r in rows:
            click.echo(f"{'ok ' if r.ok else 'NO '} {r.id:<{width}}  {r.verdict:<8}  {r.status:<12}  {r.detail}")
    bad = [r.id for r in rows if not r.ok]
    if bad:
        raise FlashnextError(f"{len(bad)} of {len(rows)} entries need porting to this vllm: {', '.join(bad)}")


@main.command("apply")
@click.option("--target", type=click.Path(path_type=Path), required=True,
              help="The site-packages directory whose vllm is modified in place (the serving image's).")
@click.option("--revert", is_flag=True, help="Restore the files an earlier apply changed, from its record.")
@user_errors
def apply(target: Path, revert: bool) -> None:
    """Apply the series in place, all or nothing, keeping the originals to --revert to (the serving
    image's build step; run `check` first). A rerun on a patched tree says so and changes nothing."""
    from flashnext.serving.patch_series import apply_series, revert_series

    if revert:
        restored = revert_series(target)
        for rel in restored:
            click.echo(f"restored {rel}")
        click.echo(f"reverted: {target} has vllm's original files again")
        return
    result = apply_series(target)
    if result.already:
        click.echo(f"already patched: {target} has the whole series ({len(result.ids)} patches, record "
                   f"{result.record}); nothing to do")
        return
    for patch_id in result.ids:
        click.echo(f"applied {patch_id}")
