"""SLURM hostlist expressions (``SLURM_JOB_NODELIST``) expanded in Python, as
``scontrol show hostnames`` does, so no rank needs the SLURM client (a container image has
none, and binding it needs libslurm, munge and /etc/slurm as well).

- Items are separated by commas or whitespace outside brackets; empty items are skipped,
  duplicates and order kept.
- ``prefix[ranges]``: ``ranges`` is a comma list of ``N`` or ``LO-HI`` (digits, LO <= HI); each
  number is zero-padded to the width LO is written with (``n[098-101]``: n098 ... n101,
  ``n[8-11]``: n8 ... n11, ``n[1-03]``: n1 n2 n3).
- Several bracket groups in one item (``rack[1-2]-n[01-02]``) expand to every combination, the
  first group varying slowest.

Checked against ``scontrol show hostnames`` (SLURM 22.05) for many patterns in
tests/test_hostlist.py. Text after the last bracket (``a[1-2]b``) is refused by SLURM 22.05's
parser; it is expanded here the natural way (a1b a2b), as SLURM never hands a job a nodelist
its own parser cannot read.
"""

from __future__ import annotations

import itertools
import re

_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


def _items(nodelist: str) -> list[str]:
    """Split on commas and whitespace outside brackets."""
    items, current, depth = [], [], 0
    for char in nodelist:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        if depth < 0 or depth > 1:
            raise ValueError(f"invalid SLURM hostlist {nodelist!r}: unbalanced brackets")
        if depth == 0 and (char == "," or char.isspace()):
            items.append("".join(current))
            current = []
        else:
            current.append(char)
    if depth != 0:
        raise ValueError(f"invalid SLURM hostlist {nodelist!r}: unbalanced brackets")
    items.append("".join(current))
    return [item for item in items if item]


def _numbers(ranges: str, nodelist: str) -> list[str]:
    out = []
    for part in ranges.split(","):
        match = _RANGE.fullmatch(part)
        low, high = (match.group(1), match.group(2) or match.group(1)) if match else (None, None)
        if low is None or int(low) > int(high):
            raise ValueError(f"invalid SLURM hostlist {nodelist!r}: bad range {part!r}")
        out += [str(n).zfill(len(low)) for n in range(int(low), int(high) + 1)]
    return out


def expand_hostlist(nodelist: str) -> list[str]:
    """Host names of a SLURM hostlist expression, in order (see the module's rules)."""
    hosts = []
    for item in _items(nodelist):
        # Literal text and bracket groups, alternating: text [g1] text [g2] ... text
        parts = re.split(r"\[([^\]]*)\]", item)
        choices = [
            [part] if i % 2 == 0 else _numbers(part, nodelist) for i, part in enumerate(parts)
        ]
        hosts += ["".join(combination) for combination in itertools.product(*choices)]
    return hosts
