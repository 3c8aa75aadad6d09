"""Logging: one ``logging`` logger per topic under ``optcompile.*``, and ``set_logs``.

Each package logs under the topic it owns (the lower layers name their logger, they do not
import this module): ``optcompile.recompiles`` and ``optcompile.perf`` (the driver),
``optcompile.guards`` (optguard), ``optcompile.sidefx`` (optsidefx), ``optcompile.graph``
(opttrace), ``optcompile.kernels`` (optkernels), ``optcompile.cudagraphs`` (optcudagraph and
this package's CUDA graph glue). INFO is one line per event (a trace, a retrace and its
reason, a kernel plan, a recording); DEBUG adds the generated code.

``OPTCOMPILE_LOGS=recompiles,guards`` (read when optcompile is imported) or
``optcompile.set_logs("recompiles,guards")`` prints those topics to stderr, as ``TORCH_LOGS``
does for torch.compile: ``+topic`` for DEBUG, ``all`` for every topic. Otherwise the loggers
are left to the application's logging configuration (they propagate to the root logger).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from opttrace import TracedStep

    from optcompile.driver import Compiled

TOPICS = ("recompiles", "guards", "graph", "sidefx", "kernels", "cudagraphs", "perf")
ENV = "OPTCOMPILE_LOGS"

root = logging.getLogger("optcompile")
recompiles = logging.getLogger("optcompile.recompiles")
perf = logging.getLogger("optcompile.perf")
cudagraphs = logging.getLogger("optcompile.cudagraphs")

_handler: logging.Handler | None = None


def set_logs(topics: str | Iterable[str] | None = None) -> None:
    """Print these topics' logs to stderr (``"recompiles,+guards"``, ``["perf"]``, "all");
    ``None`` or "" turns optcompile's own handler off and resets the topics' levels."""
    global _handler
    names = topics.split(",") if isinstance(topics, str) else list(topics or [])
    levels: dict[str, int] = {}
    for raw in (n.strip() for n in names):
        if not raw:
            continue
        level = logging.DEBUG if raw.startswith("+") else logging.INFO
        topic = raw.lstrip("+")
        chosen = TOPICS if topic == "all" else (topic,)
        if topic != "all" and topic not in TOPICS:
            raise ValueError(
                f"unknown optcompile log topic {topic!r} (in {ENV} or set_logs); choose from "
                f"{', '.join(TOPICS)} or all, each optionally prefixed with + for DEBUG"
            )
        for t in chosen:
            levels[t] = min(level, levels.get(t, level))
    for topic in TOPICS:
        logging.getLogger(f"optcompile.{topic}").setLevel(levels.get(topic, logging.NOTSET))
    if levels and _handler is None:
        _handler = logging.StreamHandler(sys.stderr)
        _handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
        root.addHandler(_handler)
        root.propagate = False  # printed once, by this handler
    elif not levels and _handler is not None:
        root.removeHandler(_handler)
        root.propagate = True
        _handler = None


def entry_added(
    compiled: Compiled, traced: TracedStep, reason: str | None, lowering_s: float
) -> None:
    """A trace became an entry: one ``recompiles`` line for a retrace (naming the guard that
    failed, with its old and new value), one ``perf`` line with the times."""
    entries, limit = len(compiled.cache.entries), compiled.cache.limit
    if reason is not None:
        recompiles.info(
            "%s: retrace (entry %d, recompile_limit %d): %s",
            compiled.name,
            entries,
            limit,
            reason,
        )
    else:
        recompiles.debug("%s: first trace (entry %d)", compiled.name, entries)
    perf.info(
        "%s: entry %d: trace %.3f s, lowering and guard code %.3f s",
        compiled.name,
        entries,
        traced.seconds,
        lowering_s,
    )


def set_logs_from_env() -> None:
    """Apply ``$OPTCOMPILE_LOGS`` when it is set (at import)."""
    value = os.environ.get(ENV)
    if value:
        set_logs(value)
