"""The plan-vs-fixed-policy comparison: per memory budget, which fixed policy
is fastest within it, and how ``auto`` compares to that policy and to
``save_on_cpu`` (see [Note: peak memory and budgets] in
tierd/bench/activations.py)."""

from __future__ import annotations

FIXED = ("none", "offload", "recompute")
WITHIN = 1.05    # auto is "within 5 %" of the best fixed policy at or below this ratio


def verdicts(rows: list[dict]) -> list[dict]:
    """Per (batch, budget): the fixed policies that fit, the fastest of them,
    and how ``auto`` compares to it and to save_on_cpu."""
    out = []
    autos = sorted((r for r in rows if r["policy"] == "auto"),
                   key=lambda r: (r["batch"], r["fraction"]))
    for auto in autos:
        batch, cap = auto["batch"], auto["budget_bytes"]
        ok = {r["policy"]: r for r in rows if r["batch"] == batch and r["status"] == "ok"
              and r["policy"] != "auto"}
        fits = {p: cap is not None and r["peak_bytes"] <= cap for p, r in ok.items()}
        fitting = [ok[p] for p in FIXED if fits.get(p)]
        best = min(fitting, key=lambda r: r["step_s"], default=None)
        ran = auto["status"] == "ok"
        auto_fits = ran and cap is not None and auto["peak_bytes"] <= cap
        ratio = auto["step_s"] / best["step_s"] if ran and best else None
        soc = ok.get("save_on_cpu")
        both = auto_fits and soc is not None and fits["save_on_cpu"]
        out.append(dict(
            batch=batch, fraction=auto["fraction"], budget_bytes=cap, fits=fits,
            best_fixed=best["policy"] if best else None,
            best_fixed_step_s=best["step_s"] if best else None,
            auto_status=auto["status"], auto_step_s=auto.get("step_s"),
            auto_peak_bytes=auto.get("peak_bytes"), auto_fits=auto_fits,
            auto_vs_best=ratio,
            auto_within_5pct=(auto_fits and ratio <= WITHIN) if ratio is not None else None,
            save_on_cpu_fits=fits.get("save_on_cpu"),
            auto_faster_than_save_on_cpu=auto["step_s"] < soc["step_s"] if both else None))
    return out
