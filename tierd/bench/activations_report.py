"""Rendering the activation bench's results: the progress line per case, the
Markdown tables and the peak-memory vs step-time PNG."""

from __future__ import annotations

from pathlib import Path

from tierd.bench.activations_measure import AUTO_STEPS, GiB
from tierd.bench.activations_verdicts import FIXED


def _size(n: int | None, unit: str) -> str:
    return "-" if n is None else f"{n / (GiB if unit == 'GiB' else 1 << 20):.2f}"


def _flag(v: bool | None) -> str:
    return "-" if v is None else ("yes" if v else "NO")


def describe(row: dict, unit: str) -> str:
    what = f"B={row['batch']} {row['policy']}" + (
        f" f={row['fraction']}" if row["fraction"] is not None else "")
    if row["status"] != "ok":
        return f"{what}: {row['status']} ({row['reason']})"
    return (f"{what}: {row['step_s']:.3f} s (median of {row['steps_timed']}), "
            f"peak {_size(row['peak_bytes'], unit)} {unit}")


def summary(budgets: list[dict]) -> str:
    """One line: how often auto met each of its two targets."""
    judged = [v for v in budgets if v["auto_within_5pct"] is not None]
    near = sum(v["auto_within_5pct"] for v in judged)
    both = [v for v in budgets if v["auto_faster_than_save_on_cpu"] is not None]
    faster = sum(v["auto_faster_than_save_on_cpu"] for v in both)
    return (f"auto fits and is within 5 % of the best fixed policy that fits at {near} of "
            f"{len(judged)} budgets (where some fixed policy fits and auto ran); faster than "
            f"save_on_cpu at {faster} of {len(both)} budgets where both fit.")


def markdown(results: dict) -> str:
    meta, unit = results["meta"], results["meta"]["unit"]
    none = {r["batch"]: r for r in results["rows"] if r["policy"] == "none"
            and r["status"] == "ok"}
    out = [f"# Activation tiering: peak memory vs step time ({meta['device']})", "",
           f"{meta['model']}, T={meta['seq']}, autocast {meta['autocast']}, "
           f"min_bytes {meta['min_bytes']}, median of up to {meta['steps']} steps after "
           f"{meta['warmup']} warm-up (auto: +{AUTO_STEPS}); wall {meta['wall_s']} s of "
           f"--budget-s {meta['budget_s']}; `{meta['command']}`", "",
           "Peak: above the weights, over a step (see [Note: peak memory and budgets] in "
           "tierd/bench/activations.py). Budget cap = overhead + f x saved.", "",
           f"| B | policy | f | cap {unit} | peak {unit} | reserved {unit} | step s | x none | "
           f"to pool {unit}/step | status |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        f = "-" if r["fraction"] is None else r["fraction"]
        cells = [r["batch"], r["policy"], f, _size(r["budget_bytes"], unit)]
        base = none.get(r["batch"])
        if r["status"] == "ok":
            cells += [_size(r["peak_bytes"], unit), _size(r["peak_reserved_bytes"], unit),
                      f"{r['step_s']:.3f}",
                      f"{r['step_s'] / base['step_s']:.2f}" if base else "-",
                      _size(r.get("d2h_bytes_per_step"), unit), "ok"]
        else:
            cells += ["-"] * 5 + [f"{r['status']}: {r['reason']}"]
        out.append("| " + " | ".join(str(c) for c in cells) + " |")
    out += ["", "## Per budget", "",
            f"| B | f | cap {unit} | fixed policies that fit | best fixed (s) | auto s | "
            f"auto peak {unit} | auto fits | auto / best | within 5 % | save_on_cpu fits | "
            "auto faster than save_on_cpu |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for v in results["budgets"]:
        fitting = ", ".join(p for p in FIXED if v["fits"].get(p)) or "(no fixed policy)"
        best = "-" if v["best_fixed"] is None else \
            f"{v['best_fixed']} ({v['best_fixed_step_s']:.3f})"
        auto_s = "-" if v["auto_step_s"] is None else f"{v['auto_step_s']:.3f}"
        ratio = "-" if v["auto_vs_best"] is None else f"{v['auto_vs_best']:.2f}"
        out.append(f"| {v['batch']} | {v['fraction']} | {_size(v['budget_bytes'], unit)} | "
                   f"{fitting} | {best} | {auto_s} | {_size(v['auto_peak_bytes'], unit)} | "
                   f"{_flag(v['auto_fits'] if v['auto_status'] == 'ok' else None)} | {ratio} | "
                   f"{_flag(v['auto_within_5pct'])} | {_flag(v['save_on_cpu_fits'])} | "
                   f"{_flag(v['auto_faster_than_save_on_cpu'])} |")
    out += ["", summary(results["budgets"])]
    plans = [r for r in results["rows"] if r.get("plan")]
    if plans:
        out += ["", "## auto plans", ""]
        out += [f"- B={r['batch']} f={r['fraction']}: {r['plan']}" + _checked(r, unit)
                for r in plans]
    return "\n".join(out) + "\n"


def _checked(row: dict, unit: str) -> str:
    c = row.get("memory_check")
    if c is None:
        return ""
    made = f"made again; first: {c['first_plan']}" if c["replanned"] else "kept"
    return (f". First step: {_size(c['measured_bytes'], unit)} {unit} above keep-all's "
            f"overhead ({_size(c['baseline_bytes'], unit)}) at peak, "
            f"{_size(c['predicted_bytes'], unit)} planned: {made}")


def plot(results: dict, path: Path) -> str | None:
    """The curve: peak memory vs step time per batch; returns why not if not drawn."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed"
    unit = results["meta"]["unit"]
    scale = GiB if unit == "GiB" else 1 << 20
    rows = [r for r in results["rows"] if r["status"] == "ok"]
    batches = sorted({r["batch"] for r in rows})
    if not batches:
        return "no figures to plot"
    fig, axes = plt.subplots(1, len(batches), figsize=(6.5 * len(batches), 5), squeeze=False)
    style = {"none": ("k", "o"), "offload": ("tab:blue", "s"), "recompute": ("tab:green", "^"),
             "save_on_cpu": ("tab:red", "X")}
    for ax, batch in zip(axes[0], batches):
        mine = [r for r in rows if r["batch"] == batch]
        for r in mine:
            if r["policy"] in style:
                color, marker = style[r["policy"]]
                ax.scatter(r["step_s"], r["peak_bytes"] / scale, c=color, marker=marker,
                           s=60, label=r["policy"], zorder=3)
        autos = sorted((r for r in mine if r["policy"] == "auto"), key=lambda r: r["fraction"])
        if autos:
            ax.plot([r["step_s"] for r in autos], [r["peak_bytes"] / scale for r in autos],
                    "-o", c="tab:purple", label="auto (budget f)", zorder=2)
            for r in autos:
                ax.annotate(f"f={r['fraction']}", (r["step_s"], r["peak_bytes"] / scale),
                            fontsize=7, xytext=(4, 4), textcoords="offset points")
                ax.axhline(r["budget_bytes"] / scale, c="tab:purple", lw=0.6, ls=":")
        ax.set_xlabel("median step time (s)")
        ax.set_ylabel(f"peak memory above weights ({unit})")
        ax.set_title(f"B={batch}, T={results['meta']['seq']} (dotted: budgets)", fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(f"tierd activation tiering, {results['meta']['model']}, "
                 f"{results['meta']['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
