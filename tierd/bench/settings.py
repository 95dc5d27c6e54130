"""``--set KEY=VALUE``: an attach or optimizer setting tried beside the defaults.

A benchmark that takes ``--set`` runs its cases with the settings added and
names each row for them, so a results file keeps them apart from the rows at
the defaults (``--merge`` replaces a row by its name).

    >>> given = parse(["resident_below_bytes=1048576", "optim.prefetch_bytes=1 << 30"])
    Traceback (most recent call last):
    ...
    ValueError: --set 'optim.prefetch_bytes=1 << 30': '1 << 30' is not a Python literal
    >>> given = parse(["resident_below_bytes=1048576", "optim.prefetch_bytes=4294967296"])
    >>> split(given)
    ({'resident_below_bytes': 1048576}, {'prefetch_bytes': 4294967296})
    >>> "lora-24g" + suffix(given)
    'lora-24g, resident_below_bytes=1048576, optim.prefetch_bytes=4294967296'
"""

from __future__ import annotations

import ast
import dataclasses

#: a key with this prefix is the optimizer's (``tierd.optim.AdamW``), not attach's
OPTIM = "optim."

HELP = ("an attach argument (repeatable; e.g. resident_below_bytes=1048576); "
        f"{OPTIM}KEY: the optimizer's (e.g. {OPTIM}prefetch_bytes=4294967296); "
        "the rows are named for them")


def parse(items: list[str]) -> dict:
    """``KEY=VALUE`` items (VALUE a Python literal) as ``{KEY: value}``, in order;
    a malformed item raises ValueError naming it."""
    given = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.removeprefix(OPTIM).isidentifier():
            raise ValueError(f"--set {item!r}: expected KEY=VALUE, e.g. forward_update_share=0.33 "
                             f"(an attach argument) or {OPTIM}prefetch_bytes=4294967296 (the "
                             "optimizer's)")
        try:
            given[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            raise ValueError(f"--set {item!r}: {value!r} is not a Python literal") from None
    return given


def split(options: dict) -> tuple[dict, dict]:
    """``options`` as (attach's, the optimizer's without the prefix)."""
    return ({k: v for k, v in options.items() if not k.startswith(OPTIM)},
            {k.removeprefix(OPTIM): v for k, v in options.items() if k.startswith(OPTIM)})


def suffix(given: dict) -> str:
    """What a row's name gains for ``given``: ``", KEY=value"`` each."""
    return "".join(f", {k}={v}" for k, v in given.items())


def with_settings(cases: list, items: list[str]) -> list:
    """``cases`` (dataclasses with ``name`` and ``options``) with the
    ``--set`` ``items`` added where a case does not name the key itself,
    each such row named for them."""
    given = parse(items)
    out = []
    for c in cases:
        extra = {k: v for k, v in given.items() if k not in c.options}
        out.append(dataclasses.replace(c, name=c.name + suffix(extra),
                                       options={**c.options, **extra}))
    return out
