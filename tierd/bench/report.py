"""Printing the table, and the PNG and Markdown of the same figures."""

from __future__ import annotations

from pathlib import Path

GB = 1e9


def figure(r: dict) -> str:
    """The row's headline figures as text."""
    if "error" in r:
        return f"FAILED: {r['error']}"
    if "skipped" in r:
        return f"skipped: {r['skipped']}"
    if "GBps" in r:
        return f"{r['GBps']:.2f} GB/s"
    if "req_per_s" in r:
        return f"{r['req_per_s']:.0f} req/s"
    if "p50_us" in r:
        return (f"p50 {r['p50_us']:.0f} us, p99 {r['p99_us']:.0f} us, "
                f"{r['ops_per_s']:.0f} ops/s, {r['requests_per_s']:.0f} req/s")
    if "share" in r:
        work = r.get("hook_work_share")
        return (f"{100 * r['share']:.1f} % of {r['instrumented_step_s']:.3f} s "
                f"(hooks {r['hook_s']:.3f} s, {r['requests']} requests"
                + ("" if work is None else f"; hooks less waits {100 * work:.1f} %") + ")")
    if "step_s" in r:
        text = f"{r['step_s']:.3f} s"
        if "tokens_per_s" in r:
            text += f", {r['tokens_per_s']:.0f} tok/s"
        if r.get("peak_gpu_bytes"):
            text += f", peak {r['peak_gpu_bytes'] / GB:.1f} GB"
        if r.get("h2d_bytes") or r.get("d2h_bytes"):
            text += f", PCIe {r['h2d_bytes'] / GB:.1f}+{r['d2h_bytes'] / GB:.1f} GB"
        return text
    return ""


def ratio_text(r: dict) -> str:
    if r.get("ratio") is None:
        return ""
    text = f"{r['ratio']:.2f}x" if "step_s" in r else f"{100 * r['ratio']:.0f} %"
    if r.get("target"):
        t = r["target"]
        ok = r["ratio"] <= t if "step_s" in r else r["ratio"] >= t
        text += f" ({'<=' if 'step_s' in r else '>='} {t if 'step_s' in r else f'{100 * t:.0f} %'}"
        text += f"{'x' if 'step_s' in r else ''}: {'ok' if ok else 'MISS'})"
    return text


def control_text(r: dict) -> str:
    if "share" in r and r.get("target_max"):
        ok = r["share"] < r["target_max"]
        return f"< {100 * r['target_max']:.0f} %: {'ok' if ok else 'MISS'}"
    return ""


def table(results: dict) -> str:
    lines = []
    for name, sec in results["sections"].items():
        head = f"== {sec['title']}"
        if sec["status"] != "ok":
            head += f"  [{sec['status']}: {sec.get('reason', '')}]"
        lines.append(head)
        for r in sec.get("rows", []):
            lines.append(f"  {r['what']:<52} {figure(r):<62} {ratio_text(r) or control_text(r)}")
            if "skipped" not in r:   # a peer that cannot run here: one line, why
                lines.append(f"      {r['config']}")
    bounds = [(r["what"], r["bound"]) for s in results["sections"].values()
              for r in s.get("rows", []) if r.get("bound")]
    if bounds:
        lines.append("== What bounds tierd where it misses")
        lines += [f"  {w}: {b}" for w, b in bounds]
    return "\n".join(lines)


def markdown(results: dict) -> str:
    out = ["| section | what | figure | vs limit / reference (target) |", "|---|---|---|---|"]
    for sec in results["sections"].values():
        if sec["status"] != "ok":
            out.append(f"| {sec['title']} | {sec['status']}: {sec.get('reason', '')} | | |")
        for r in sec.get("rows", []):
            out.append(f"| {sec['title']} | {r['what']} | {figure(r)} | "
                       f"{ratio_text(r) or control_text(r)} |")
    return "\n".join(out)


def plot(results: dict, path: Path) -> str | None:
    """Write the PNG; returns why not when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed"
    rows = [r for s in results["sections"].values() for r in s.get("rows", [])
            if "error" not in r and "skipped" not in r]
    panels = [("bandwidth (GB/s)", [r for r in rows if "GBps" in r], "GBps"),
              ("step time (s)", [r for r in rows if "step_s" in r], "step_s"),
              ("round-trip latency p50 (us)", [r for r in rows if "p50_us" in r], "p50_us")]
    panels = [p for p in panels if p[1]]
    if not panels:
        return "no figures to plot"
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 3 + 0.32 * len(rows)), squeeze=False)
    for ax, (title, rs, key) in zip(axes[:, 0], panels):
        labels = [r["what"] for r in rs][::-1]
        values = [r[key] for r in rs][::-1]
        bars = ax.barh(labels, values, color=["#4c72b0" if "tierd" in lab else "#999999"
                                              for lab in labels])
        for bar, r in zip(bars, rs[::-1]):
            note = ratio_text(r)
            ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2,
                    f" {r[key]:.3g} {note}", va="center", fontsize=7)
        ax.set_title(title, fontsize=9)
        ax.tick_params(labelsize=7)
    meta = results["meta"]
    fig.suptitle(f"tierd bench, {meta['device']}, {meta['date']} ({meta['command']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
