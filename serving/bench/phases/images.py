"""The images phase: generated images sent while a long text prompt prefills (seed 000 section 6).

Seed 000 streamed the ViT's blocks from host memory and checked that images are still answered
while a new long prompt prefills: 45/45 at 2 MP (``max_pixels`` 2,097,152). This sends one long
prompt of text nobody sent before (so it prefills in full, with no prefix-cache hit), and right
after it ``--images`` image requests, ``--image-concurrency`` at a time; it reports how many were
answered, each one's TTFT and when it was sent against the long prompt's first token (the images
sent before it went in while the prefill ran), and each failure.

The images are drawn here (PIL, matplotlib's dependency; nothing is downloaded), all of them before
the long prompt goes out, so that encoding them costs the timed requests nothing. Each one differs,
so that none is answered from vLLM's multi-modal cache. A text-only server refuses them: that is
reported as failed requests, with the server's answer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flashnext.serving.bench import plots
from flashnext.serving.bench.defaults import IMAGES as DEFAULTS  # seed 000 section 6's; Settings' defaults too
from flashnext.serving.bench.phases.base import Int, Option, PhaseDefaults, Size, summary_of
from flashnext.serving.bench.plots import Column, ms, table

if TYPE_CHECKING:
    from flashnext.serving.bench.report import ImagesResult


class Images(PhaseDefaults):
    name = "images"
    help = ("--images generated images sent while a --image-prefill-tokens text prompt prefills\n"
            "(seed 000: 45/45 at 2 MP); answered count, TTFT per image, errors; not in the default\n"
            "--phases (a text-only server refuses images)")
    report_field = "images"
    by_default = False
    server_text = frozenset({"error", "prefill_error"})
    options = (
        Option("--images", "images", Int(1, 10000), DEFAULTS["images"], "Image requests in the images phase."),
        Option("--image-size", "image_size", Size(16, 16384), "x".join(map(str, DEFAULTS["image_size"])),
               "WIDTHxHEIGHT of each generated image (the seed's max_pixels is 2097152)."),
        Option("--image-concurrency", "image_concurrency", Int(1, 1024), DEFAULTS["image_concurrency"],
               "Image requests in flight at once."),
        Option("--image-prefill-tokens", "image_prefill_tokens", Int(1), DEFAULTS["image_prefill_tokens"],
               "Length of the text prompt that prefills while the images are sent."),
        Option("--image-max-tokens", "image_max_tokens", Int(1), DEFAULTS["image_max_tokens"],
               "Answer length for each image and for the long prompt."),
    )

    def planned_requests(self, s) -> int:
        return s.images + 1

    async def run(self, bench) -> None:
        import asyncio

        from flashnext.serving.bench import workloads
        from flashnext.serving.bench.report import ImageRequest, ImagesResult

        s = bench.settings
        width, height = s.image_size
        for ep in bench.endpoints:
            urls = [workloads.image_data_url(i, width, height, s.seed) for i in range(s.images)]
            # seed None: text nobody sent before, so the whole prompt is prefilled.
            long = bench.body(ep, workloads.latency_prompt(s.image_prefill_tokens, ep.text_scale, 0, None),
                              s.image_max_tokens)
            prefill = asyncio.create_task(bench.send(ep, self.name, [long]))
            await asyncio.sleep(0)  # the long prompt's request goes out before the first image's
            gate = asyncio.Semaphore(s.image_concurrency)

            async def one(url: str):
                async with gate:
                    [done] = await bench.send(ep, self.name, [bench.body(ep, workloads.image_messages(url),
                                                                         s.image_max_tokens)])
                    return done

            answers = await asyncio.gather(*(one(u) for u in urls))
            [lp] = await prefill
            first_token = lp.sent_at + lp.ttft_s if lp.ok and lp.ttft_s is not None else None
            requests = [ImageRequest(
                index=i, sent_after_s=max(c.sent_at - lp.sent_at, 0.0),
                during_prefill=None if first_token is None else c.sent_at < first_token,
                ttft_s=c.ttft_s if c.ok else None, e2e_s=c.e2e_s,
                error=None if c.ok else f"{c.error}: {c.error_detail}") for i, c in enumerate(answers)]
            answered = [r for r in requests if r.error is None]
            ep.results[self.report_field] = ImagesResult(
                images=s.images, width=width, height=height, answered=len(answered),
                failed=len(requests) - len(answered), during_prefill=sum(bool(r.during_prefill) for r in requests),
                prefill_prompt_tokens=s.image_prefill_tokens, prefill_measured_prompt_tokens=lp.prompt_tokens,
                prefill_ttft_s=lp.ttft_s if lp.ok else None,
                prefill_error=None if lp.ok else f"{lp.error}: {lp.error_detail}",
                ttft_s=summary_of([r.ttft_s for r in answered if r.ttft_s is not None]), requests=requests)

    def problems(self, e) -> list[str]:
        im = e.images
        if im is None or not im.answered or im.prefill_ttft_s is None or im.during_prefill:
            return []
        # Every image went out after the prefill's first token: the run did not test what it names.
        return [f"{e.label}: images: no image was sent during the long prompt's prefill (it took "
                f"{im.prefill_ttft_s * 1000:.0f} ms): raise --image-prefill-tokens"]

    def summary(self, e) -> dict:
        im = e.images
        if im is None:
            return {}
        return {"images_answered": im.answered, "images_total": im.images, "images_during_prefill": im.during_prefill,
                "images_ttft_p50_s": im.ttft_s and im.ttft_s.p50}

    def summary_lines(self, e) -> list[str]:
        im = e.images
        if im is None:
            return []
        ttft = f", TTFT p50 {im.ttft_s.p50 * 1000:.0f} ms, max {im.ttft_s.max * 1000:.0f} ms" if im.ttft_s else ""
        prefill = (f"; the {im.prefill_prompt_tokens}-token prompt's TTFT {im.prefill_ttft_s * 1000:.0f} ms"
                   if im.prefill_ttft_s is not None else f"; the long prompt failed ({im.prefill_error})")
        return [f"  images {im.width}x{im.height}: answered {im.answered} of {im.images} "
                f"({im.during_prefill} sent during the prefill){ttft}{prefill}"]

    def html(self, e) -> list[str]:
        im = e.images
        if im is None:
            return []
        prefill = (f"the {im.prefill_prompt_tokens}-token prompt's TTFT {im.prefill_ttft_s * 1000:.0f} ms"
                   if im.prefill_ttft_s is not None else "the long prompt failed")
        return [f"<h3>Images beside a long prefill ({im.width}x{im.height}): answered {im.answered} of "
                f"{im.images}, {im.during_prefill} sent during the prefill; {prefill}</h3>" + table(
                    [Column("image"), Column("sent after the long prompt", "ms"), Column("during prefill"),
                     Column("TTFT", "ms"), Column("end to end", "ms"), Column("failure")],
                    [[r.index, ms(r.sent_after_s), r.during_prefill, ms(r.ttft_s), ms(r.e2e_s), r.error]
                     for r in im.requests])]

    def plots(self, report) -> dict[str, bytes | None]:
        return {"images.png": images_plot(report)}


def images_plot(report) -> bytes | None:
    if not any(e.images and e.images.answered for e in report.endpoints):
        return None
    plt, fig, ax = plots.figure()
    for color, e in zip(plots.COLORS, report.endpoints):
        im = e.images
        if not im:
            continue
        ok = [r for r in im.requests if r.ttft_s is not None]
        ax.plot([r.sent_after_s * 1000 for r in ok], [r.ttft_s * 1000 for r in ok], "o", color=color,
                label=f"{e.label}: image TTFT ({im.answered} of {im.images} answered)")
        lost = [r.sent_after_s * 1000 for r in im.requests if r.error is not None]
        if lost:
            ax.plot(lost, [0] * len(lost), "X", color=color, markersize=9, clip_on=False,
                    label=f"{e.label}: failed ({len(lost)})")
        if im.prefill_ttft_s is not None:
            ax.axvline(im.prefill_ttft_s * 1000, color=color, linestyle="--", alpha=0.6,
                       label=f"{e.label}: the long prompt's first token")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    plots.finish_axes(ax, "sent after the long prompt (ms)", "TTFT, client side (ms)",
                      "Images sent while a long prompt prefills")
    return plots.png(plt, fig)


PHASE = Images()
