"""The benchmark suite: ``tierd bench [--quick] [--out DIR] [--only a,b]``
(also ``python -m tierd.bench.run``).

Measures the limits (pinned copies, raw O_DIRECT), tierd's data plane, the
training step and forward pass against the all-on-GPU reference and the peers
(FSDP2 CPU offload, accelerate cpu_offload), the control plane's share of a
step and two jobs on one daemon, all in one run so every ratio compares
figures measured side by side. Prints a table and writes
``<out>/<gpu-or-cpu>-<yyyy-mm-dd>.json`` (``-quick`` added with ``--quick``)
plus a PNG and a Markdown table of the same figures. Exits 1, naming them,
when a section failed (an error, a timeout, a row whose worker failed).

Sections (``--only`` takes names or numbers): 1 limits, 2 dataplane,
3 training, 4 forward, 5 control, 6 multijob.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

import tierd
from tierd.bench import (SECTION_NAMES, add_arguments, dataplane, limits, multijob, report,
                         training)
from tierd.bench.common import FULL, QUICK, ROOT, Context, SectionTimeout, Skip, time_limit
from tierd.bench.progress import Progress

_MEASURE = {   # name: (title, function, share of the time budget it may take)
    "limits": ("1 limits", limits.run, 0.15),
    "dataplane": ("2 tierd data plane", dataplane.run, 0.2),
    "training": ("3 training step", training.train_rows, 0.75),
    "forward": ("4 forward only", training.forward_rows, 0.3),
    "control": ("5 control plane share", training.control_rows, 0.35),
    "multijob": ("6 multi-job", multijob.run, 0.5),
}
SECTIONS = {name: _MEASURE[name] for name in SECTION_NAMES}   # in --only's order


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m tierd.bench.run",
                                description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return p.parse_args(argv)


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return "cpu"


def git_commit() -> str | None:
    """The measured tree's commit ($TIERD_BENCH_COMMIT for a copy without .git);
    None for an installed package (its version is in the results instead)."""
    if os.environ.get("TIERD_BENCH_COMMIT"):
        return os.environ["TIERD_BENCH_COMMIT"]
    if not (ROOT / ".git").exists():   # site-packages, perhaps inside someone's checkout
        return None
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                             capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-") or "cpu"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return run(parse(argv), "python -m tierd.bench.run " + " ".join(argv))


def cmd_bench(args: argparse.Namespace) -> int:
    """``tierd bench``'s body (``tierd.cli`` parses, this measures)."""
    return run(args, "tierd " + " ".join(sys.argv[1:]))


def run(args: argparse.Namespace, command: str) -> int:
    """Measure the selected sections, print the table, write JSON, Markdown, PNG."""
    try:   # before anything is measured: a bad --out must not waste the run
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SystemExit(f"--out {args.out}: cannot write results there ({exc})") from None
    sizes = QUICK if args.quick else FULL
    if sizes.quick and not torch.cuda.is_available():   # the CI smoke run: one batch size
        sizes = dataclasses.replace(sizes, batches=sizes.batches[:1], train_steps=2)
    budget = args.budget_s or (50 if args.quick else 470)
    from tierd.client.embedded import cache_dir
    base = args.nvme or cache_dir()
    base.mkdir(parents=True, exist_ok=True)
    nvme_dir = Path(tempfile.mkdtemp(prefix="bench-", dir=base))
    names = list(args.only)
    ctx = Context(sizes=sizes, out=args.out, nvme_dir=nvme_dir,
                  deadline=time.monotonic() + budget, cuda=torch.cuda.is_available(),
                  device_name=device_name(), selected=tuple(names))
    today = datetime.date.today().isoformat()
    results = {"meta": {
        "device": ctx.device_name, "date": today, "command": command.strip(),
        "quick": sizes.quick, "tierd": tierd.__version__, "torch": torch.__version__,
        "python": platform.python_version(), "cpus": os.cpu_count(), "host": platform.node(),
        "nvme_dir": str(nvme_dir), "commit": git_commit(),
        "sizes": {k: v for k, v in sizes.__dict__.items()}}, "sections": {}}
    started = time.monotonic()
    progress = Progress(names)
    try:
        for name in names:
            progress.start(name)
            results["sections"][name] = run_section(ctx, name, budget)
            progress.done(name, status_text(results["sections"][name]))
    finally:
        progress.close()
        ctx.stop()
        shutil.rmtree(nvme_dir, ignore_errors=True)
    for name in SECTIONS:
        results["sections"].setdefault(name, {"title": SECTIONS[name][0], "status": "skipped",
                                              "reason": "not selected (--only)", "rows": []})
    results["sections"] = {n: results["sections"][n] for n in SECTIONS}
    results["meta"]["elapsed_s"] = time.monotonic() - started
    write(results, args.out, slug(ctx.device_name) + "-" + today + ("-quick" if args.quick else ""))
    failed = failed_sections(results)
    if failed:
        print(f"tierd bench: {len(failed)} section{'s' if len(failed) != 1 else ''} failed: "
              + "; ".join(f"{n} ({status_text(results['sections'][n])})" for n in failed),
              file=sys.stderr)
        return 1
    return 0


def failed_sections(results: dict) -> list[str]:
    """Names of the sections that did not measure what they should: an error,
    a timeout, or a row that failed (a worker that crashed)."""
    return [n for n, sec in results["sections"].items()
            if sec["status"] in ("error", "timeout", "failed")]


def status_text(sec: dict) -> str:
    return sec["status"] + (f" ({sec['reason']})" if sec.get("reason") else "")


def run_section(ctx: Context, name: str, budget: float) -> dict:
    title, fn, share = SECTIONS[name]
    sec = {"title": title, "status": "ok", "rows": []}
    t0 = time.monotonic()
    try:
        with time_limit(min(share * budget, ctx.remaining())):
            sec["rows"] = fn(ctx)
    except Skip as exc:
        sec.update(status="skipped", reason=str(exc))
    except SectionTimeout as exc:
        sec.update(status="timeout", reason=str(exc))
    except Exception as exc:   # a broken section must not lose the others' figures
        sec.update(status="error", reason=f"{type(exc).__name__}: {exc}",
                   traceback=traceback.format_exc()[-3000:])
    failed = [r for r in sec["rows"] if "error" in r]
    if failed and sec["status"] == "ok":   # a row's worker failed: the section did too
        sec.update(status="failed", reason=f"{len(failed)} of {len(sec['rows'])} rows failed: "
                                           f"{failed[0]['what']}: {failed[0]['error']}")
    sec["elapsed_s"] = time.monotonic() - t0
    ctx.results[name] = sec
    return sec


def write(results: dict, out: Path, stem: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{stem}.json"
    path.write_text(json.dumps(results, indent=1, default=str) + "\n")
    (out / f"{stem}.md").write_text(report.markdown(results) + "\n")
    why = report.plot(results, out / f"{stem}.png")
    print(report.table(results))
    print(f"\nwrote {path}" + (f" (no PNG: {why})" if why else f", {stem}.png, {stem}.md"))


if __name__ == "__main__":
    sys.exit(main())
