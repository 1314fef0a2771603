"""``flashnext plan``: the KV cache layout a profile will get, before starting anything."""

from __future__ import annotations

from pathlib import Path

import click

from flashnext.errors import UsageError
from flashnext.sizes import format_size
from flashnext.tools._common import emit_json, held_back_output, json_option, user_errors

REFERENCE_HOST_GIB = 125  # the reference rig's host RAM (seed 000)


def _print(profile: str, p) -> None:
    mode = "on (mamba align)" if p.prefix_caching else "off"
    spec = f", {p.num_speculative_tokens} draft token(s)" if p.num_speculative_tokens else ""
    click.echo(f"profile {profile}: --kv-cache-memory-bytes {p.kv_cache_memory_bytes:,}, prefix caching {mode}{spec}")
    click.echo(f"  layers per rank      {p.layers_per_rank} (QSA {p.qsa_layers_per_rank})")
    click.echo(f"  state page           {p.state_page_bytes:,} B; a block is {max(p.bytes_per_block):,} B per rank")
    click.echo(f"  attention block size {p.block_size:,} tokens")
    click.echo(f"  blocks per rank      {p.blocks}")
    kinds: dict[str, list] = {}
    for g in p.groups:
        kinds.setdefault(g.kind, []).append(g)
    parts = " + ".join(f"{len(gs)} {kind} x {gs[0].blocks_per_request}" for kind, gs in kinds.items())
    click.echo(f"  blocks per request   {p.blocks_per_request} = {parts}  (one {p.max_model_len:,}-token request)")
    click.echo(f"  capacity             {p.capacity_tokens:,} tokens ({p.concurrency:.2f}x)")
    click.echo(f"  VRAM per rank        {', '.join(f'{v:,}' for v in p.vram_bytes)} B")
    if p.qsa_arena_rows:
        shares = ", ".join(f"{n} x {rows:,}" for n, rows in zip(p.qsa_layers_per_rank, p.qsa_row_cache_rows))
        arena = ", ".join(format_size(b) for b in p.qsa_arena_bytes)
        click.echo(f"  QSA arena            {p.qsa_arena_rows:,} rows per rank, {arena} "
                   f"(row cache: {shares} rows), allocated at model load")
    if p.vision is not None:
        v = p.vision
        weights = (f"{format_size(v.streamed_weight_bytes)} streamed (vit-stream; {format_size(v.resident_weight_bytes)} resident)"
                   if v.streamed else f"{format_size(v.resident_weight_bytes)} resident")
        click.echo(f"  vision tower         rank 0 only: {weights} + ~{format_size(v.activation_bytes)} activations "
                   f"for a {v.max_pixels:,}-pixel image")
        click.echo(f"  VRAM with images     {', '.join(f'{b:,}' for b in p.vram_bytes_with_images)} B")
    else:
        click.echo("  vision tower         none (text only)")
    click.echo(f"  VRAM in all          {', '.join(f'{b:,}' for b in p.vram_bytes_total)} B (KV pool + arena"
               f"{' + tower' if p.vision is not None else ''})")
    click.echo(f"  pinned host K/V      {format_size(p.pinned_host_bytes)} exact-size; {format_size(p.pinned_host_bytes_pow2)} "
               "with PyTorch's power-of-two rounding")
    click.echo(f"  marginal             {p.tokens_per_mib_vram:,.0f} tokens per MiB of VRAM, "
               f"{p.tokens_per_gib_host:,.0f} per GiB of host RAM")
    for note in p.notes:
        click.echo(f"note: {note}")


@click.command("plan")
@click.option("--profile", required=True, help="Serving profile (serving/profiles/NAME.json).")
@click.option("--kv-cache-memory-bytes", type=click.IntRange(min=1), default=None,
              help="Override the profile's --kv-cache-memory-bytes.")
@click.option("--prefix-caching/--no-prefix-caching", default=None,
              help="Override the profile's prefix caching (on means --mamba-cache-mode align).")
@click.option("--model", type=click.Path(path_type=Path), default=None,
              help="A snapshot directory or config.json to plan for; default: the pinned base checkpoint's config.")
@click.option("--ple-format", type=click.Choice(["file", "bf16", "nvfp4", "fp8"]), default=None,
              help="Count the host memory with the PLE table served from a file (--ple-table) or pinned in this "
                   "format (`flashnext ple build --format`); for the pinned base checkpoint.")
@click.option("--host-ram", type=click.FloatRange(min=1), default=None,
              help="Say whether every pinned host byte fits a host of this many GiB (default with --ple-format: "
                   "125, the reference rig), and which --kv-cache-memory-bytes does.")
@json_option
@user_errors
def main(profile: str, kv_cache_memory_bytes: int | None, prefix_caching: bool | None, model: Path | None,
         ple_format: str | None, host_ram: float | None, as_json: bool) -> None:
    """KV cache plan for a profile: attention block size, state page, blocks per rank, blocks for one
    max-length request, token capacity and concurrency, pinned host memory and VRAM. The grouping is
    vLLM 0.33.0's own (`pip install 'flashnext[serve]'`)."""
    from flashnext.serving.capacity import plan_profile
    from flashnext.serving.profiles import load_profile

    loaded = load_profile(profile)
    if ple_format is not None and model is not None:
        raise UsageError("--ple-format is for the pinned base checkpoint; with --model the snapshot's config says "
                         "how its table is stored")
    with held_back_output():  # vLLM's and torch's import-time notes: the plan is the first line
        result = plan_profile(loaded, kv_cache_memory_bytes, prefix_caching, model)
        host = _host(loaded, result, model, ple_format, host_ram) if ple_format or host_ram else None
    if as_json:
        emit_json({"profile": profile, **result.to_json(), **({"host": host} if host else {})})
    else:
        _print(profile, result)
        if host:
            _print_host(host)


def _host(profile, plan, model: Path | None, ple_format: str | None, host_ram: float | None) -> dict:
    """Every pinned host byte of the profile (the preflight's terms) against a host of ``host_ram`` GiB."""
    from flashnext.serving import capacity
    from flashnext.serving.preflight import host_fit, pinned_host_terms

    shape = capacity.ServingShape.from_profile(profile, plan.kv_cache_memory_bytes)
    terms = pinned_host_terms(shape, plan, model, None, ple_format=ple_format)
    available = int((host_ram or REFERENCE_HOST_GIB) * (1 << 30))
    fits, kv_fits = host_fit(shape, plan, terms, available)
    return {"host_bytes": available, "headroom_bytes": capacity.HOST_HEADROOM, "ple_format": ple_format,
            "pinned": {t.name: t.bytes for t in terms}, "pinned_total_bytes": sum(t.bytes for t in terms),
            "fits": fits, "largest_kv_cache_memory_bytes_that_fits": kv_fits}


def _print_host(host: dict) -> None:
    terms = " + ".join(f"{name} {format_size(n)}" for name, n in host["pinned"].items())
    verdict = "fits" if host["fits"] else "does NOT fit"
    click.echo(f"  pinned host in all   {terms} = {format_size(host['pinned_total_bytes'])} + "
               f"{format_size(host['headroom_bytes'])} headroom: {verdict} a {format_size(host['host_bytes'])} host")
    kv = host["largest_kv_cache_memory_bytes_that_fits"]
    if not host["fits"]:
        click.echo(f"  fits with            --kv-cache-memory-bytes {kv:,} or less" if kv else
                   "  fits with            no KV setting: serve the PLE table from a file or quantized")
