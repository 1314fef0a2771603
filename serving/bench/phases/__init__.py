"""The bench's phases, one module each, and :data:`PHASES`, the one list of them.

The runner runs, the plan counts, the summary, the page and the plots say, and ``flashnext bench``
offers (``--phases`` and each phase's options) what this registry holds, in its order. A new phase
is a module here with a ``PHASE`` that follows :class:`~.base.Phase`, named in the tuple below
(docs/extending.md, "A bench phase").
"""

from __future__ import annotations

from flashnext.serving.bench.phases import decode, images, latency, multiturn, needle, structured
from flashnext.serving.bench.phases.base import ROUND_OPTIONS, RUN_OPTIONS, Option, Phase, Text

PHASES: dict[str, Phase] = {p.name: p for p in (latency.PHASE, decode.PHASE, needle.PHASE, structured.PHASE,
                                                  multiturn.PHASE, images.PHASE)}


def phases_option() -> Option:
    """``--phases``: its default is every registered phase that runs by default (``by_default``),
    so it is made when asked for."""
    return Option("--phases", "phases", Text(), ",".join(p.name for p in PHASES.values() if p.by_default),
                  "Which phases to run (comma-separated).")


def setting_options() -> list[Option]:
    """Every option that fills a ``Settings`` field, in the order ``--help`` shows them: the phases,
    each phase's own, the rounds latency and decode share, then the run's."""
    return [phases_option(), *(o for p in PHASES.values() for o in p.options), *ROUND_OPTIONS, *RUN_OPTIONS]


__all__ = ["PHASES", "Phase", "phases_option", "setting_options"]
