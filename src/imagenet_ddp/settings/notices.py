"""The dry-run's warnings, one line per kind naming the runs it applies to (a 12-run sweep
sharing a problem gets one line): producers return :class:`Notice` records,
:func:`summarised` joins those of one kind.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

__all__ = ["Notice", "summarised"]


class Notice(NamedTuple):
    """One run's warning or note. ``kind``: what is wrong and what to do, the same words for
    every run it applies to; ``detail``: this run's own figure (shown after its name)."""

    kind: str
    run: str
    detail: str = ""

    def __str__(self) -> str:  # the run's line on its own
        return summarised([self])[0]


def summarised(notices: Iterable[Notice], shown: int = 3) -> list[str]:
    """One line per kind, in the order first met: ``config.yaml: runs 'a' (detail), 'b'
    (detail) and 10 more: <kind>``, the first ``shown`` runs named; a detail all its runs share
    said once, after the names."""
    groups: dict[str, list[Notice]] = {}
    for notice in notices:
        groups.setdefault(notice.kind, []).append(notice)
    lines = []
    for kind, group in groups.items():
        details = {n.detail for n in group}
        shared = details.pop() if len(details) == 1 else None  # said once, after the names
        names = [f"{n.run!r}" + (f" ({n.detail})" if n.detail and shared is None else "")
                 for n in group[:shown]]  # fmt: skip
        more = f" and {len(group) - shown} more" if len(group) > shown else ""
        runs = f"run{'s' * (len(group) > 1)} {', '.join(names)}{more}"
        lines.append(f"config.yaml: {runs}{f' ({shared})' if shared else ''}: {kind}")
    return lines
