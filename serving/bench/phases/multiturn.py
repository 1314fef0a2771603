"""The multiturn phase: agent sessions whose conversation grows turn by turn (seed 004's workload).

Each session re-sends its whole conversation every turn, as an agent (OpenHands, qwen-code) does: a
long first turn (the task and the files read), then tool output and the model's answers appended
turn by turn. ``--sessions`` sessions run at once; the sweep over ``--sessions`` gives the seed's
interactivity (each user's decode tok/s) against throughput (every session's tokens per second)
Pareto curve, and vLLM's ``/metrics`` the average number of concurrently running requests, the
number seed 004 compared HiSparse and the plain offload baseline by.

Every session's text is its own, drawn from (seed, sessions, session, side): sessions that shared a
first turn would hit the prefix cache as no real agents do. A failed turn ends its session (there
is no answer to continue from); the rest go on. Each point is measured once, with no warm-up round:
13 turns from 74,160 tokens up are an hour of a small rig, and the prefix cache a warm-up would fill
is part of what is measured. With ``--against`` the points alternate: this run at 1 session, the
other side at 1, this run at 2, and so on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flashnext.serving.bench import plots
from flashnext.serving.bench.defaults import MULTITURN as DEFAULTS  # seed 004's; Settings' defaults too
from flashnext.serving.bench.phases.base import Int, Ints, Option, PhaseDefaults, summary_of
from flashnext.serving.bench.plots import Column, ms, table

if TYPE_CHECKING:
    from flashnext.serving.bench.client import Completion
    from flashnext.serving.bench.report import MultiturnPoint, TurnStats


class Multiturn(PhaseDefaults):
    name = "multiturn"
    help = ("agent sessions that re-send their growing conversation every turn (seed 004: 13 turns,\n"
            "74,160 tokens first, 753 in / 753 out after); per-turn TTFT and ITL, per-user tok/s\n"
            "against throughput per --sessions; not in the default --phases (hours at the seed's sizes)")
    report_field = "multiturn"
    by_default = False
    options = (
        Option("--sessions", "multiturn_sessions", Ints(1, 1024), ",".join(map(str, DEFAULTS["multiturn_sessions"])),
               "Agent sessions at once, one multiturn point each."),
        Option("--turns", "multiturn_turns", Int(1), DEFAULTS["multiturn_turns"], "Turns per session."),
        Option("--first-turn-tokens", "multiturn_first_tokens", Int(1), DEFAULTS["multiturn_first_tokens"],
               "Length of a session's first message."),
        Option("--turn-tokens", "multiturn_turn_tokens", Int(1), DEFAULTS["multiturn_turn_tokens"],
               "Length of each later message (tool output)."),
        Option("--turn-output-tokens", "multiturn_output_tokens", Int(1), DEFAULTS["multiturn_output_tokens"],
               "Tokens each turn's answer generates (ignore_eos where the server accepts it)."),
    )

    def empty_result(self) -> list[MultiturnPoint]:
        return []

    def planned_requests(self, s) -> int:
        return sum(s.multiturn_sessions) * s.multiturn_turns

    async def run(self, bench) -> None:
        for sessions in bench.settings.multiturn_sessions:
            for ep in bench.endpoints:
                ep.results[self.report_field].append(await self._point(bench, ep, sessions))

    async def _point(self, bench, ep, sessions: int) -> MultiturnPoint:
        import asyncio
        import random

        from flashnext.serving.bench import workloads
        from flashnext.serving.bench.report import MultiturnPoint

        s = bench.settings
        turns: list[list[Completion]] = [[] for _ in range(s.multiturn_turns)]

        async def session(index: int) -> bool:
            rng = random.Random(f"multiturn/{s.seed}/{sessions}/{index}/{ep.label}")
            conversation = workloads.agent_first_turn(s.multiturn_first_tokens, ep.text_scale, rng)
            for turn in range(s.multiturn_turns):
                body = bench.body(ep, conversation, s.multiturn_output_tokens, run_to_length=True)
                [done] = await bench.send(ep, self.name, [body])
                turns[turn].append(done)
                if not done.ok:
                    bench.progress(s.multiturn_turns - turn - 1)  # the turns it will not send
                    return False
                conversation = [*conversation, {"role": "assistant", "content": done.text},
                                workloads.agent_next_turn(s.multiturn_turn_tokens, ep.text_scale, rng)]
            return True

        start = await bench.window_start(ep)
        completed = await asyncio.gather(*(session(i) for i in range(sessions)))
        server = await bench.window_end(ep, start)
        every = [c for t in turns for c in t]
        good = [c for c in every if c.ok and c.ttft_s is not None]
        wall = (max(c.sent_at + c.e2e_s for c in every) - min(c.sent_at for c in every)) if every else 0.0
        generated = sum(c.n_tokens for c in good)
        return MultiturnPoint(
            sessions=sessions, sessions_completed=sum(completed), failed=len(every) - len(good), wall_s=wall,
            generated_tokens=generated, throughput_tok_s=generated / wall if wall > 0 and good else None,
            per_user_tok_s=summary_of([t for c in good if (t := c.decode_tok_s) is not None]),
            ttft_s=summary_of([c.ttft_s for c in good]), itl_s=summary_of([x for c in good for x in c.itl_s]),
            # Each request is open from its sending to its last byte: their sum over the wall time.
            client_in_flight_mean=sum(c.e2e_s for c in every) / wall if wall > 0 else None,
            server=server, turns=[_turn_stats(i + 1, t) for i, t in enumerate(turns)])

    def summary(self, e) -> dict:
        if not e.multiturn:
            return {}
        return {"multiturn": [{"sessions": p.sessions, "throughput_tok_s": p.throughput_tok_s,
                               "per_user_tok_s_p50": p.per_user_tok_s and p.per_user_tok_s.p50,
                               "ttft_p50_s": p.ttft_s and p.ttft_s.p50,
                               "running_mean": p.server and p.server.running_mean,
                               "preemptions": p.server and p.server.preemptions,
                               "sessions_completed": p.sessions_completed} for p in e.multiturn]}

    def summary_lines(self, e) -> list[str]:
        lines = []
        for p in e.multiturn:
            speed = (f"{p.throughput_tok_s:.1f} tok/s in all, per user p50 {p.per_user_tok_s.p50:.1f} tok/s"
                     if p.throughput_tok_s and p.per_user_tok_s else "no answer measured")
            first = p.turns[0].ttft_s if p.turns else None
            later = summary_of([x for t in p.turns[1:] if t.ttft_s for x in [t.ttft_s.p50]])
            ttft = (f", TTFT turn 1 p50 {first.p50 * 1000:.0f} ms" if first else "") + (
                f", later turns p50 {later.p50 * 1000:.0f} ms" if later else "")
            running = (f", {p.server.running_mean:.2f} running on average (server)"
                       if p.server and p.server.running_mean is not None else "")
            preempted = (f", {p.server.preemptions} preemptions"
                         if p.server and p.server.preemptions is not None else "")
            ended = (f", {p.sessions - p.sessions_completed} sessions ended early"
                     if p.sessions_completed < p.sessions else "")
            lines.append(f"  multiturn x{p.sessions} sessions: {speed}{ttft}{running}{preempted}{ended}")
        return lines

    def html(self, e) -> list[str]:
        if not e.multiturn:
            return []
        parts = ["<h3>Multiturn agent sessions</h3>" + table(
            [Column("sessions", "at once"), Column("completed", "sessions"), Column("throughput", "tok/s"),
             Column("per user p50", "tok/s"), Column("TTFT p50", "ms"), Column("ITL p50", "ms"),
             Column("ITL p99", "ms"), Column("running, server mean", "requests"),
             Column("in flight, client mean", "requests"), Column("waiting, server max", "requests"),
             Column("KV cache max", "fraction"), Column("preemptions", "count"),
             Column("prefix cache hit rate", "fraction"), Column("wall", "s"), Column("failed", "requests")],
            [[p.sessions, p.sessions_completed, p.throughput_tok_s, p.per_user_tok_s and p.per_user_tok_s.p50,
              ms(p.ttft_s and p.ttft_s.p50), ms(p.itl_s and p.itl_s.p50), ms(p.itl_s and p.itl_s.p99),
              p.server and p.server.running_mean, p.client_in_flight_mean, p.server and p.server.waiting_max,
              p.server and p.server.kv_cache_usage_max, p.server and p.server.preemptions,
              p.server and p.server.prefix_cache_hit_rate, p.wall_s, p.failed] for p in e.multiturn])]
        parts.append("<h4>Per turn</h4>" + table(
            [Column("sessions", "at once"), Column("turn"), Column("measured prompt p50", "tokens"),
             Column("TTFT p50", "ms"), Column("TTFT p90", "ms"), Column("ITL p50", "ms"), Column("ITL p90", "ms"),
             Column("answered", "requests"), Column("failed", "requests")],
            [[p.sessions, t.turn, t.measured_prompt_tokens, ms(t.ttft_s and t.ttft_s.p50),
              ms(t.ttft_s and t.ttft_s.p90), ms(t.itl_s and t.itl_s.p50), ms(t.itl_s and t.itl_s.p90),
              t.answered, t.failed] for p in e.multiturn for t in p.turns]))
        return parts

    def plots(self, report) -> dict[str, bytes | None]:
        return {"multiturn_pareto.png": pareto_plot(report), "multiturn_ttft.png": turn_ttft_plot(report)}


def _turn_stats(turn: int, done: list[Completion]) -> TurnStats:
    import statistics

    from flashnext.serving.bench.report import TurnStats

    good = [c for c in done if c.ok and c.ttft_s is not None]
    prompts = [c.prompt_tokens for c in good if c.prompt_tokens]
    return TurnStats(turn=turn, answered=len(good), failed=len(done) - len(good),
                     measured_prompt_tokens=int(statistics.median(prompts)) if prompts else None,
                     ttft_s=summary_of([c.ttft_s for c in good]), itl_s=summary_of([x for c in good for x in c.itl_s]))


def pareto_plot(report) -> bytes | None:
    """Seed 004's picture: per-user tok/s (interactivity) against every session's tok/s, one point
    per --sessions; up and to the right is better, and a side whose curve lies outside the other's wins."""
    if not any(p.throughput_tok_s and p.per_user_tok_s for e in report.endpoints for p in e.multiturn):
        return None
    plt, fig, ax = plots.figure()
    for color, e in zip(plots.COLORS, report.endpoints):
        pts = [p for p in e.multiturn if p.throughput_tok_s and p.per_user_tok_s]
        if not pts:
            continue
        ax.plot([p.throughput_tok_s for p in pts], [p.per_user_tok_s.p50 for p in pts], marker="o", color=color,
                label=f"{e.label}: per-user p50, one point per --sessions")
        for p in pts:
            running = (f", {p.server.running_mean:.1f} running"
                       if p.server and p.server.running_mean is not None else "")
            ax.annotate(f"{p.sessions} sessions{running}", (p.throughput_tok_s, p.per_user_tok_s.p50),
                        textcoords="offset points", xytext=(5, 5), fontsize=7, color=color)
    # Room above and to the right of the last point for its label.
    ax.set_xlim(left=0, right=ax.get_xlim()[1] * 1.12)
    ax.set_ylim(bottom=0, top=ax.get_ylim()[1] * 1.12)
    plots.finish_axes(ax, "throughput, every session (tok/s)", "interactivity, per user (tok/s)",
                      "Multiturn agent sessions: interactivity against throughput")
    return plots.png(plt, fig)


def turn_ttft_plot(report) -> bytes | None:
    if not any(t.ttft_s for e in report.endpoints for p in e.multiturn for t in p.turns):
        return None
    plt, fig, ax = plots.figure()
    for color, e in zip(plots.COLORS, report.endpoints):
        for style, p in zip(("-", "--", ":", "-.") * 64, e.multiturn):
            pts = [(t.turn, t.ttft_s.p50 * 1000) for t in p.turns if t.ttft_s]
            if pts:
                ax.plot(*zip(*pts), style, marker="o", color=color, label=f"{e.label}: {p.sessions} sessions")
    ax.set_yscale("log")
    plots.finish_axes(ax, "turn", "TTFT p50, client side (ms)", "Time to first token by turn", legend_size=7)
    return plots.png(plt, fig)


PHASE = Multiturn()
