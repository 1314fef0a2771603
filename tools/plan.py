"""``flashnext plan``: the KV cache layout a profile will get, before starting anything."""

from __future__ import annotations

import math
import os
from pathlib import Path

import click

from flashnext.errors import FlashnextError, UsageError
from flashnext.output import held_back_output
from flashnext.sizes import format_size
from flashnext.tools._common import begin, emit_json, json_option, user_errors

REFERENCE_HOST_GIB = 125  # the reference rig's host RAM (seed 000)
GIB = 1 << 30


def _print(label: str, p) -> None:
    mode = "on (mamba align)" if p.prefix_caching else "off"
    spec = f", {p.num_speculative_tokens} draft token(s)" if p.num_speculative_tokens else ""
    click.echo(f"{label}: --kv-cache-memory-bytes {p.kv_cache_memory_bytes:,}, prefix caching {mode}{spec}")
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
@click.option("--profile", default=None,
              help="Serving profile: a name (serving/profiles/NAME.json) or a profile file (--write-profile's).")
@click.option("--kv-cache-memory-bytes", type=click.IntRange(min=1), default=None,
              help="Override the profile's --kv-cache-memory-bytes.")
@click.option("--prefix-caching/--no-prefix-caching", default=None,
              help="Override the profile's prefix caching (on means --mamba-cache-mode align).")
@click.option("--model", type=click.Path(path_type=Path), default=None,
              help="A snapshot directory or config.json to plan for; default: the pinned base checkpoint's config.")
@click.option("--ple-format", type=click.Choice(["file", "bf16", "nvfp4", "fp8"]), default=None,
              help="Count the host memory with the PLE table served from a file (--ple-table) or pinned in this "
                   "format (`flashnext ple build --format`); for the pinned base checkpoint. With --gpus: where "
                   "the rig's profile keeps the table (default: file).")
@click.option("--host-ram", type=float, default=None,
              help="GiB of host RAM: with --gpus, the rig's; with --profile, say whether every pinned host byte "
                   "fits (default with --ple-format: 125, the reference rig), and which --kv-cache-memory-bytes does.")
@click.option("--gpus", type=int, default=None,
              help="Plan a rig of this many equal GPUs instead of a profile (with --gpu-memory and --host-ram).")
@click.option("--gpu-memory", type=float, default=None,
              help="With --gpus: each GPU's memory in GiB (24 for an RTX 3090).")
@click.option("--mtp", is_flag=True, help="With --gpus: serve the MTP draft head (1 draft token) too.")
@click.option("--context", type=int, default=None,
              help="With --gpus: the context (--max-model-len) each sequence gets; default 262,144.")
@click.option("--write-profile", type=click.Path(path_type=Path), default=None,
              help="With --gpus: write the rig's profile to this new NAME.json (never replaced), for "
                   "`serve --profile NAME.json`.")
@json_option
@user_errors
def main(profile: str | None, kv_cache_memory_bytes: int | None, prefix_caching: bool | None, model: Path | None,
         ple_format: str | None, host_ram: float | None, gpus: int | None, gpu_memory: float | None, mtp: bool,
         context: int | None, write_profile: Path | None, as_json: bool) -> None:
    """KV cache plan for a profile: attention block size, state page, blocks per rank, blocks for one
    max-length request, token capacity and concurrency, pinned host memory and VRAM. The grouping is
    vLLM 0.34.0's own, so plan needs vLLM installed (`pip install --no-deps vllm==0.34.0 && pip
    install 'flashnext[serve]'`).

    With --gpus N --gpu-memory GiB --host-ram GiB it plans a rig of N equal GPUs instead: the layer
    partition, --max-num-seqs and the KV memory that fit, VRAM per rank, pinned host memory, and
    whether it fits (if not, why, in numbers, and exit 1); --write-profile writes that profile.
    With --host-ram, a profile whose pinned host memory does not fit exits 1 too.

    \b
    Examples:
      flashnext plan --profile 3x3090
      flashnext plan --gpus 4 --gpu-memory 24 --host-ram 125 --mtp
      flashnext plan --gpus 4 --gpu-memory 24 --host-ram 96 --write-profile my-rig.json
    """
    rig_options = {"--gpu-memory": gpu_memory, "--context": context, "--write-profile": write_profile,
                   "--mtp": mtp or None}
    if gpus is not None:
        if profile is not None:
            raise UsageError("--profile and --gpus contradict each other: plan a profile or a rig")
        if gpu_memory is None or host_ram is None:
            raise UsageError("--gpus needs --gpu-memory GiB and --host-ram GiB")
        given = [name for name, value in {"--model": model, "--kv-cache-memory-bytes": kv_cache_memory_bytes,
                                          "--prefix-caching": prefix_caching}.items() if value is not None]
        if given:
            raise UsageError(f"{given[0]} is for --profile; a rig plan chooses it (and is for the pinned base "
                             "checkpoint)")
        return _rig(gpus, gpu_memory, host_ram, mtp, context, ple_format, write_profile, as_json)
    if profile is None:
        raise UsageError("plan needs --profile NAME, or --gpus N --gpu-memory GiB --host-ram GiB")
    given = [name for name, value in rig_options.items() if value is not None]
    if given:
        raise UsageError(f"{given[0]} is for a rig plan: give --gpus N too")
    if host_ram is not None and not (math.isfinite(host_ram) and host_ram > 0):
        raise FlashnextError(f"--host-ram must be a positive number of GiB, got {host_ram:g}")
    from flashnext.serving.capacity import plan_profile
    from flashnext.serving.profiles import load_profile

    loaded = load_profile(profile)
    begin(f"planning {profile} with vLLM's own config classes and KV planner (vLLM loads first)")
    if ple_format is not None and model is not None:
        raise UsageError("--ple-format is for the pinned base checkpoint; with --model the snapshot's config says "
                         "how its table is stored")
    with held_back_output():  # vLLM's and torch's import-time notes: the plan is the first line
        result = plan_profile(loaded, kv_cache_memory_bytes, prefix_caching, model)
        host = _host(loaded, result, model, ple_format, host_ram) if ple_format or host_ram else None
        ledger = _ledger(loaded, result, model, ple_format)
    if as_json:
        emit_json({"profile": loaded.name, **result.to_json(), **({"host": host} if host else {}),
                   **({"ledger": ledger.to_json()} if ledger else {})})
    else:
        _print(f"profile {loaded.name}", result)
        if host:
            _print_host(host)
        if ledger:
            _print_ledger(ledger)
    if host and not host["fits"]:  # the plan is printed; the exit status says it does not fit
        raise FlashnextError(f"profile {loaded.name} does not fit: {_host_reason(host)}")


def _rig(gpus: int, gpu_memory: float, host_ram: float, mtp: bool, context: int | None, ple_format: str | None,
         write_profile: Path | None, as_json: bool) -> None:
    begin(f"planning a rig of {gpus} GPU(s) with vLLM's own config classes and KV planner (vLLM loads first)")
    from flashnext.serving.capacity.rig import Rig, plan_rig, rig_profile
    from flashnext.serving.profiles import PROFILE_NAME, PROFILE_NAME_RULE, write_profile as write

    if write_profile is not None:  # refused before the plan's seconds, not after
        name = write_profile.name[:-len(".json")] if write_profile.name.endswith(".json") else ""
        if not PROFILE_NAME.fullmatch(name):
            raise FlashnextError(f"--write-profile {write_profile}: name the file NAME.json, NAME of "
                                 f"{PROFILE_NAME_RULE} (it is the profile's name)")
        if os.path.lexists(write_profile):
            raise FlashnextError(f"{write_profile} already exists: choose another name (it is never replaced)")
    for flag, value in (("--gpu-memory", gpu_memory), ("--host-ram", host_ram)):
        if not math.isfinite(value) or value <= 0:
            raise FlashnextError(f"{flag} must be a positive number of GiB, got {value:g}")
    rig = Rig(gpus, int(gpu_memory * GIB), int(host_ram * GIB), mtp, 262_144 if context is None else context,
              ple_format or "file")
    with held_back_output():
        result = plan_rig(rig)
    profile = rig_profile(result, name) if write_profile is not None else None
    if profile is not None:
        write(profile, write_profile)
    with held_back_output():
        ledger = _ledger(result.profile, result.plan, None, rig.ple_format) if result.fits else None
    if as_json:
        emit_json({**result.to_json(), **({"profile_written": str(write_profile)} if profile else {}),
                   **({"ledger": ledger.to_json()} if ledger else {})})
    else:
        _print_rig(result)
        if ledger:
            _print_ledger(ledger)
        if profile is not None:
            click.echo(f"wrote {write_profile}: serve --profile {write_profile} --model SNAPSHOT"
                       f"{' --ple-table FILE' if profile.uses_ple_table else ''}")
    if not result.fits:  # the plan is printed; the exit status says it does not fit, and the first reason why
        more = len(result.reasons) - 1
        raise FlashnextError(f"the rig does not fit: {result.reasons[0] if result.reasons else 'see the plan'}"
                             + (f" (and {more} more reason(s) in the plan)" if more > 0 else ""))


def _print_rig(r) -> None:
    from flashnext.serving.capacity.shape import PP_LAYER_PARTITION

    rig, p = r.rig, r.plan
    click.echo(f"rig: {rig.gpus} x {rig.gpu_memory_bytes / GIB:g} GiB GPUs, {rig.host_ram_bytes / GIB:g} GiB host RAM, "
               f"MTP {'on (1 draft token)' if rig.mtp else 'off'}, context {rig.context:,}, PLE table "
               f"{'from a file (--ple-table)' if rig.ple_format == 'file' else 'pinned as ' + rig.ple_format}")
    split = "vLLM's even split" if r.even_split else f"{PP_LAYER_PARTITION}={','.join(map(str, r.partition))}"
    click.echo(f"  layer partition      {'/'.join(map(str, r.partition))} ({split})")
    # Where not one request fits, the numbers that follow are one request's (plan_rig's last try):
    # no setting to take, and said so, rather than "--max-num-seqs 0" beside "1 x N blocks".
    seqs = f"{r.max_num_seqs}" if r.max_num_seqs else "none: not one request fits; what follows is for one"
    click.echo(f"  --max-num-seqs       {seqs} (at most {r.max_num_seqs_limit}: the CUDA graphs' "
               f"{r.max_num_seqs_limit * (1 + p.num_speculative_tokens)} tokens a step)")
    click.echo(f"  --kv-cache-memory-bytes {r.kv_cache_memory_bytes:,} = {max(r.max_num_seqs, 1)} x "
               f"{p.blocks_per_request} blocks x {max(p.bytes_per_block):,} B"
               f"{'' if r.max_num_seqs else ' (one request)'}")
    _print("  its plan", p)
    peaks = ", ".join(format_size(m.total) for m in r.ranks)
    weights = ", ".join(format_size(m.weights) for m in r.ranks)
    click.echo(f"  VRAM per rank, peak  {peaks} of {format_size(r.usable_vram_bytes)} usable (weights {weights}; "
               f"runtime {format_size(r.ranks[0].runtime)} each)")
    _print_host(r.host)
    if r.fits:
        click.echo("fits")
        return
    click.echo("does NOT fit:")
    for reason in r.reasons:
        click.echo(f"  {reason}")
    if r.largest_context_that_fits:
        click.echo(f"  the largest context that fits one sequence: {r.largest_context_that_fits:,} tokens (--context)")
    if r.fewest_gpus_that_fit:
        click.echo(f"  the fewest GPUs of {rig.gpu_memory_bytes / GIB:g} GiB that fit: {r.fewest_gpus_that_fit}")


def _ledger(profile, plan, model: Path | None, ple_format: str | None):
    """The memory ledger of ``profile`` with ``plan`` (serving/capacity/ledger.py); None for a family
    it does not cover."""
    from flashnext.serving.capacity.ledger import profile_ledger

    if profile.model_family != "qwen4_exp":
        return None
    return profile_ledger(profile, plan, model=model, ple_format=ple_format)


def _print_ledger(ledger) -> None:
    from flashnext.serving.capacity.ledger import markdown

    click.echo("memory ledger (MiB; `inside`: which of vLLM's numbers holds it; serving/capacity/ledger.py):")
    for line in markdown(ledger).splitlines():
        click.echo(f"  {line}" if line else "")


def _host(profile, plan, model: Path | None, ple_format: str | None, host_ram: float | None) -> dict:
    """Every pinned host byte of the profile (the preflight's terms) against a host of ``host_ram`` GiB."""
    from flashnext.serving import capacity
    from flashnext.serving.capacity.ledger import host_fit, pinned_host_terms

    shape = capacity.ServingShape.from_profile(profile, plan.kv_cache_memory_bytes)
    terms = pinned_host_terms(shape, plan, model, None, ple_format=ple_format)
    available = int((host_ram or REFERENCE_HOST_GIB) * (1 << 30))
    fits, kv_fits = host_fit(shape, plan, terms, available)
    return {"host_bytes": available, "headroom_bytes": capacity.HOST_HEADROOM, "ple_format": ple_format,
            "pinned": {t.name: t.bytes for t in terms}, "pinned_total_bytes": sum(t.bytes for t in terms),
            "fits": fits, "largest_kv_cache_memory_bytes_that_fits": kv_fits}


def _host_reason(host: dict) -> str:
    return (f"pinned host memory {format_size(host['pinned_total_bytes'])} + {format_size(host['headroom_bytes'])} "
            f"headroom > a {format_size(host['host_bytes'])} host")


def _print_host(host: dict) -> None:
    terms = " + ".join(f"{name} {format_size(n)}" for name, n in host["pinned"].items())
    verdict = "fits" if host["fits"] else "does NOT fit"
    click.echo(f"  pinned host in all   {terms} = {format_size(host['pinned_total_bytes'])} + "
               f"{format_size(host['headroom_bytes'])} headroom: {verdict} a {format_size(host['host_bytes'])} host")
    kv = host["largest_kv_cache_memory_bytes_that_fits"]
    if not host["fits"]:
        click.echo(f"  fits with            --kv-cache-memory-bytes {kv:,} or less" if kv else
                   "  fits with            no KV setting: serve the PLE table from a file or quantized")
