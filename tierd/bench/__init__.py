"""``tierd bench``: the benchmark suite, runnable from an installed package.

This module holds only the suite's options, so ``tierd --help`` and the other
commands never import torch; :mod:`tierd.bench.run` measures. The other
benchmarks are modules run with ``python -m tierd.bench.<name>``
(``attach``, ``attach_step``, ``activations``, ``distributed``, ``durability``,
``placement``, ``bigmodel``, ``nvme``, ``cpu_update``, ``compiled``, ``compact``,
``lora70b``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

#: the suite's sections in the order they run (``--only`` takes names or numbers)
SECTION_NAMES = ("limits", "dataplane", "training", "forward", "control", "multijob")
#: where results go without ``--out``: the current directory, never the package
DEFAULT_OUT = Path("tierd-bench-results")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The suite's options, shared by ``tierd bench`` and ``python -m tierd.bench.run``."""
    p.add_argument("--quick", action="store_true", help="small sizes (CPU: well under a minute)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help=f"where the JSON, PNG and Markdown go (default ./{DEFAULT_OUT})")
    p.add_argument("--only", type=sections, default=SECTION_NAMES, metavar="SECTIONS",
                   help="comma-separated sections by name or number (default all): "
                        + section_list())
    p.add_argument("--nvme", type=Path, default=None,
                   help="directory for the disk tests and the daemon's NVMe file "
                        "(default: a temp dir under ~/.cache/tierd)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="stop starting work after this many seconds (default 50 quick, 470 full)")


def section_list() -> str:
    return ", ".join(f"{i} {name}" for i, name in enumerate(SECTION_NAMES, 1))


def sections(only: str) -> tuple[str, ...]:
    """``--only``'s value: the named or numbered sections, in the suite's order.

    >>> sections("3,limits")
    ('limits', 'training')
    """
    chosen = set()
    for item in filter(None, (x.strip() for x in only.split(","))):
        n = len(SECTION_NAMES)
        name = SECTION_NAMES[int(item) - 1] if item.isdigit() and 0 < int(item) <= n else item
        if name not in SECTION_NAMES:
            raise argparse.ArgumentTypeError(
                f"unknown section {item!r}; the sections are: {section_list()}")
        chosen.add(name)
    if not chosen:
        raise argparse.ArgumentTypeError(f"no section named; the sections are: {section_list()}")
    return tuple(n for n in SECTION_NAMES if n in chosen)
