"""``flashnext plan``: what a profile (or a rig) will hold, before starting anything: each rank's GPU
memory in one table (serving/capacity/vram.py), then the KV cache layout and the pinned host memory."""

from __future__ import annotations

import math
import os
import re
import textwrap
from pathlib import Path

import click

from flashnext.errors import FlashnextError, UsageError
from flashnext.output import held_back_output
from flashnext.sizes import format_size
from flashnext.tools._common import begin, emit_json, json_option, user_errors

REFERENCE_HOST_GIB = 125  # the reference rig's host RAM (seed 000)
GIB = 1 << 30
MIB = 1 << 20


# --- the VRAM table ------------------------------------------------------------------------------

LEGEND_WIDTH = 110  # the legend under the table is wrapped to this many columns
TABLE_HEADS = {"weights": "weights", "kv_cache": "KV cache", "runtime": "runtime", "flashnext": "flashnext",
               "total": "total", "card": "card", "free": "free"}


def _mib(n: int | None) -> str:
    return "?" if n is None else f"{n / MIB:,.2f}"


def _print_table(table, p, ledger, card_from: str) -> None:
    """Each rank's GPU memory at its peak (serving/capacity/vram.py), in MiB, and what each column
    holds: total = weights + KV cache + runtime + flashnext, free = card - total."""
    from flashnext.serving.capacity.vram import DEVICE_RESERVED_BYTES, RUNTIME_BYTES, column_of

    columns = [c for c in TABLE_HEADS if table.card_bytes is not None or c not in ("card", "free")]
    rows = [[str(r.rank), f"{r.layers:,}", *(_mib(getattr(r, c)) for c in columns)] for r in table.ranks]
    if len(rows) > 1:
        rows.append(["all", f"{sum(r.layers for r in table.ranks):,}", *(_mib(table.column_total(c)) for c in columns)])
    heads = ["rank", "layers", *(TABLE_HEADS[c] for c in columns)]
    widths = [max(len(cell) for cell in column) for column in zip(heads, *rows)]
    click.echo("VRAM per GPU at its peak, MiB (total = weights + KV cache + runtime + flashnext"
               f"{'; free = card - total' if table.card_bytes is not None else ''}):")
    for line in (heads, *rows):
        click.echo("  " + "  ".join(cell.rjust(width) for cell, width in zip(line, widths)))
    entries = [e for rank in ledger.ranks for e in rank.entries if e.gpu_peak and not e.vllms]
    own = list(dict.fromkeys(e.name for e in entries if column_of(e) == "flashnext"))
    within = list(dict.fromkeys(f"the {e.name} within the {e.within}" for e in entries if e.within))
    checkpoint = list(dict.fromkeys(e.name for e in entries if e.checkpoint))
    activations = p.vision.activation_bytes if p.vision is not None else 0
    tower = "; the vision tower's resident part on rank 0" if p.vision is not None else ""
    known = all(r.weights is not None for r in table.ranks)
    legend = [
        ("weights", f"the model's tensors on the GPU: {table.weights_from}{tower}"
                    + (f"; the {', '.join(checkpoint)} among them (the checkpoint's tensors, laid out anew)"
                       if checkpoint else "") if known else "not known, nor the total and what is free: "
                                                             "the note below says why"),
        ("KV cache", f"vLLM's pool: {p.blocks:,} blocks of {format_size(max(p.bytes_per_block))} "
                     "(--kv-cache-memory-bytes in whole blocks)"),
        ("runtime", f"CUDA context, NCCL, a step's activations, CUDA graphs, allocator slack: "
                    f"{RUNTIME_BYTES / MIB:,.0f} MiB a rank, seed 000's measurement (§3.5)"
                    + (f"; + the vision encoder's activations on rank 0 (~{format_size(activations)}, an estimate)"
                       if activations else "")),
        ("flashnext", "flashnext's own allocations at their serving peak (the memory ledger, `--ledger`): "
                      + (", ".join(own) or "none") + (f"; {', '.join(within)}" if within else "")),
    ]
    if table.card_bytes is not None:
        legend.append(("card", f"{table.gpu_memory_bytes / GIB:g} GiB a GPU ({card_from}) less the "
                               f"{DEVICE_RESERVED_BYTES / MIB:,.0f} MiB its driver keeps (a 3090's, seed 000 §3.5)"))
    else:
        legend.append(("card", "not known: the profile gives no gpu_memory_gib; `--gpu-memory GiB` adds the card "
                               "and what is free"))
    width = max(len(name) for name, _ in legend)
    for name, text in legend:
        # "seed 000 (§3.5)" stays on one line: its words are joined while the text is wrapped
        joined = re.sub(r"seed 000( \(?§[\d.]+\)?)?", lambda m: m[0].replace(" ", "\0"), text)
        lines = [line.replace("\0", " ") for line in
                 textwrap.wrap(joined, LEGEND_WIDTH - width - 4, break_on_hyphens=False)]
        click.echo(f"  {name.ljust(width)}  {lines[0]}")
        for line in lines[1:]:
            click.echo(f"  {' ' * width}  {line}")
    for note in table.notes:
        click.echo(f"note: {note}")


def _print_facts(p) -> None:
    """The plan's other facts, after the table."""
    click.echo(f"  QSA layers per rank  {', '.join(map(str, p.qsa_layers_per_rank))}")
    click.echo(f"  attention block size {p.block_size:,} tokens")
    click.echo(f"  state page           {format_size(p.state_page_bytes)}; a block is "
               f"{format_size(max(p.bytes_per_block))} per rank")
    click.echo(f"  blocks per rank      {p.blocks:,}")
    kinds: dict[str, list] = {}
    for g in p.groups:
        kinds.setdefault(g.kind, []).append(g)
    parts = " + ".join(f"{len(gs)} {kind} x {gs[0].blocks_per_request}" for kind, gs in kinds.items())
    click.echo(f"  blocks per request   {p.blocks_per_request} = {parts}  (one {p.max_model_len:,}-token request)")
    click.echo(f"  capacity             {p.capacity_tokens:,} tokens ({p.concurrency:.2f}x)")
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
    else:
        click.echo("  vision tower         none (text only)")
    click.echo(f"  pinned host K/V      {format_size(p.pinned_host_bytes)} exact-size; {format_size(p.pinned_host_bytes_pow2)} "
               "with PyTorch's power-of-two rounding")
    click.echo(f"  marginal             {p.tokens_per_mib_vram:,.0f} tokens per MiB of VRAM, "
               f"{p.tokens_per_gib_host:,.0f} per GiB of host RAM")
    for note in p.notes:
        click.echo(f"note: {note}")


def _settings(p) -> str:
    mode = "on (mamba align)" if p.prefix_caching else "off"
    spec = f", {p.num_speculative_tokens} draft token(s)" if p.num_speculative_tokens else ""
    return f"prefix caching {mode}{spec}"


def _print_plan(label: str, p, table, ledger, card_from: str) -> None:
    """A profile's plan: the one line of its settings, the VRAM table (where the family has one),
    then the other facts."""
    click.echo(f"{label}: --kv-cache-memory-bytes {p.kv_cache_memory_bytes:,} "
               f"({format_size(p.kv_cache_memory_bytes)}), {_settings(p)}")
    if table is not None:
        _print_table(table, p, ledger, card_from)
    _print_facts(p)


def _vram_reasons(table) -> list[str]:
    return [f"rank {r.rank} needs {format_size(r.total)} of the {format_size(r.card)} its GPU gives "
            f"({format_size(-r.free)} over)" for r in table.ranks if r.free is not None and r.free < 0]


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
              help="Each GPU's memory in GiB (24 for an RTX 3090): with --gpus, the rig's; with --profile, in place "
                   "of the profile's gpu_memory_gib (the VRAM table's card and free columns).")
@click.option("--mtp", is_flag=True, help="With --gpus: serve the MTP draft head (1 draft token) too.")
@click.option("--context", type=int, default=None,
              help="With --gpus: the context (--max-model-len) each sequence gets; default 262,144.")
@click.option("--write-profile", type=click.Path(path_type=Path), default=None,
              help="With --gpus: write the rig's profile to this new NAME.json (never replaced), for "
                   "`serve --profile NAME.json`.")
@click.option("--ledger", "show_ledger", is_flag=True,
              help="Also print the memory ledger: per rank, every allocation of flashnext's patches (the VRAM "
                   "table's flashnext column, entry by entry) and vLLM's pool and tower beside them, on the GPU "
                   "and in pinned host memory. --json always has it.")
@json_option
@user_errors
def main(profile: str | None, kv_cache_memory_bytes: int | None, prefix_caching: bool | None, model: Path | None,
         ple_format: str | None, host_ram: float | None, gpus: int | None, gpu_memory: float | None, mtp: bool,
         context: int | None, write_profile: Path | None, show_ledger: bool, as_json: bool) -> None:
    """KV cache and memory plan for a profile. It leads with one table, a row per pipeline rank, in
    MiB: weights + KV cache + runtime + flashnext's own = total, against the card (the GPU's memory
    less what its driver keeps; from the profile's gpu_memory_gib or --gpu-memory), and what is free;
    the lines under it say what each column holds (--ledger adds the memory ledger, the flashnext
    column entry by entry). Then the attention block size, state page, blocks
    per rank and for one max-length request, token capacity and concurrency, and pinned host memory.
    The grouping is vLLM 0.34.0's own, so plan needs vLLM installed (`pip install --no-deps
    vllm==0.34.0 && pip install 'flashnext[serve]'`). With --model the weights are the snapshot's
    own tensors; without it, seed 000's measurements of the release checkpoint.

    With --gpus N --gpu-memory GiB --host-ram GiB it plans a rig of N equal GPUs instead: the same
    table, the layer partition, --max-num-seqs and the KV memory that fit, pinned host memory, and
    whether it fits (if not, why, in numbers, and exit 1); --write-profile writes that profile.
    A profile whose table shows a rank over its card, or (with --host-ram) whose pinned host memory
    does not fit, exits 1 too.

    \b
    Examples:
      flashnext plan --profile 3x3090
      flashnext plan --gpus 4 --gpu-memory 24 --host-ram 125 --mtp
      flashnext plan --gpus 4 --gpu-memory 24 --host-ram 96 --write-profile my-rig.json
    """
    rig_options = {"--context": context, "--write-profile": write_profile, "--mtp": mtp or None}
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
        return _rig(gpus, gpu_memory, host_ram, mtp, context, ple_format, write_profile, show_ledger, as_json)
    if profile is None:
        raise UsageError("plan needs --profile NAME, or --gpus N --gpu-memory GiB --host-ram GiB")
    given = [name for name, value in rig_options.items() if value is not None]
    if given:
        raise UsageError(f"{given[0]} is for a rig plan: give --gpus N too")
    if host_ram is not None and not (math.isfinite(host_ram) and host_ram > 0):
        raise FlashnextError(f"--host-ram must be a positive number of GiB, got {host_ram:g}")
    from flashnext.serving.capacity.vram import check_gpu_memory
    from flashnext.serving.deployment import resolve_deployment

    if gpu_memory is not None:
        check_gpu_memory(gpu_memory, "gpu_memory")
    # before the profile is resolved: its vllm_args go through vLLM's own parser, which imports vLLM
    begin(f"planning {profile} with vLLM's own config classes and KV planner (vLLM loads first)")
    deployment = resolve_deployment(profile, model, kv_cache_memory_bytes=kv_cache_memory_bytes,
                                    prefix_caching=prefix_caching)
    loaded = deployment.profile
    if ple_format is not None and model is not None:
        raise UsageError("--ple-format is for the pinned base checkpoint; with --model the snapshot's config says "
                         "how its table is stored")
    with held_back_output():  # vLLM's and torch's import-time notes: the plan is the first line
        result = deployment.plan
        host = _host(deployment, ple_format, host_ram) if ple_format or host_ram else None
        ledger = _ledger(deployment, ple_format)
        card = gpu_memory if gpu_memory is not None else loaded.gpu_memory_gib
        table = _profile_table(deployment, ledger, card)
    if as_json:
        emit_json({"profile": loaded.name, **result.to_json(), **({"host": host} if host else {}),
                   **({"ledger": ledger.to_json()} if ledger else {}),
                   **({"vram": table.to_json()} if table else {})})
    else:
        card_from = "--gpu-memory" if gpu_memory is not None else "the profile's gpu_memory_gib"
        _print_plan(f"profile {loaded.name}", result, table, ledger, card_from)
        if host:
            _print_host(host)
        if ledger and show_ledger:
            _print_ledger(ledger)
    # the plan is printed; the exit status says it does not fit, and the first reason why
    reasons = (_vram_reasons(table) if table else []) + ([_host_reason(host)] if host and not host["fits"] else [])
    if reasons:
        more = len(reasons) - 1
        raise FlashnextError(f"profile {loaded.name} does not fit: {reasons[0]}"
                             + (f" (and {more} more reason(s) in the plan)" if more > 0 else ""))


def _profile_table(deployment, ledger, card_gib: float | None):
    """The VRAM table of a deployment's plan (serving/capacity/vram.py); None for a family without a ledger."""
    from flashnext.serving.capacity.vram import profile_vram

    if ledger is None:
        return None
    return profile_vram(deployment.profile, deployment.plan, ledger, None if card_gib is None else int(card_gib * GIB),
                        deployment)


def _rig(gpus: int, gpu_memory: float, host_ram: float, mtp: bool, context: int | None, ple_format: str | None,
         write_profile: Path | None, show_ledger: bool, as_json: bool) -> None:
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
    ledger = result.table.ledger
    if as_json:
        emit_json({**result.to_json(), **({"profile_written": str(write_profile)} if profile else {}),
                   "ledger": ledger.to_json()})
    else:
        _print_rig(result)
        if show_ledger:
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
    _print_table(r.table, p, r.table.ledger, "--gpu-memory")
    split = "vLLM's even split" if r.even_split else f"{PP_LAYER_PARTITION}={','.join(map(str, r.partition))}"
    click.echo(f"  layer partition      {'/'.join(map(str, r.partition))} ({split})")
    # Where not one request fits, the numbers that follow are one request's (plan_rig's last try):
    # no setting to take, and said so, rather than "--max-num-seqs 0" beside "1 x N blocks".
    seqs = f"{r.max_num_seqs}" if r.max_num_seqs else "none: not one request fits; what follows is for one"
    click.echo(f"  --max-num-seqs       {seqs} (at most {r.max_num_seqs_limit}: the CUDA graphs' "
               f"{r.max_num_seqs_limit * (1 + p.num_speculative_tokens)} tokens a step)")
    click.echo(f"  --kv-cache-memory-bytes {r.kv_cache_memory_bytes:,} = {max(r.max_num_seqs, 1)} x "
               f"{p.blocks_per_request} blocks x {format_size(max(p.bytes_per_block))}"
               f"{'' if r.max_num_seqs else ' (one request)'}")
    click.echo(f"  settings             {_settings(p)}")
    _print_facts(p)
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


def _ledger(deployment, ple_format: str | None):
    """The memory ledger of ``deployment``'s plan (serving/capacity/ledger.py); None for a family it
    does not cover."""
    from flashnext.serving.capacity.ledger import profile_ledger

    if deployment.profile.model_family != "qwen4_exp":
        return None
    return profile_ledger(deployment.profile, deployment.plan, deployment=deployment, ple_format=ple_format)


def _print_ledger(ledger) -> None:
    from flashnext.serving.capacity.ledger import markdown

    click.echo("memory ledger (MiB; `inside`: which of vLLM's numbers holds it; serving/capacity/ledger.py):")
    for line in markdown(ledger).splitlines():
        click.echo(f"  {line}" if line else "")


def _host(deployment, ple_format: str | None, host_ram: float | None) -> dict:
    """Every pinned host byte of the deployment (the preflight's terms) against a host of ``host_ram`` GiB.
    A profile that serves the PLE table from a file (``serve`` refuses it without ``--ple-table``)
    is counted with the file unless ``ple_format`` says otherwise, as its ledger is."""
    from flashnext.serving import capacity
    from flashnext.serving.capacity.ledger import host_fit, pinned_host_terms

    profile, plan = deployment.profile, deployment.plan
    if ple_format is None and profile.uses_ple_table:
        ple_format = "file"
    shape = capacity.ServingShape.from_profile(profile, plan.kv_cache_memory_bytes)
    terms = pinned_host_terms(shape, plan, deployment, ple_format=ple_format)
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
