"""Latency against load for a sweep of rates, concurrencies or both (matplotlib, Agg: no display needed)."""

from __future__ import annotations

import itertools


def plot_sweep(reports: list[dict], path: str, baseline: list[dict] | None = None,
               names: tuple[str, str] = ("", "")) -> None:
    """`baseline` (bench serve --compare-url): the second server's runs at the same loads, drawn in
    a colour of their own beside `reports`; `names` labels the two."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = [(reports, names[0], "tab:blue")] + ([(baseline, names[1], "tab:orange")] if baseline else [])
    by_rate = len({r["request_rate"] for r in reports}) > 1
    by_cap = len({r["concurrency"] for r in reports}) > 1
    what = " / ".join(["offered rate"] * by_rate + ["concurrency"] * by_cap) or "offered rate"

    def label(r: dict) -> str:
        rate = "inf" if r["request_rate"] is None else f"{r['request_rate']:g}"
        return "/".join([rate] * (by_rate or not by_cap) + [str(r["concurrency"])] * by_cap)

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, metric, title in zip(axes, ("ttft", "tpot", "e2e"), ("time to first token", "time per output token",
                                                                  "end-to-end latency")):
        stats = [k for k in reports[0][metric] if k != "mean_ms"]  # the run's percentiles, lowest first
        for runs, name, colour in series:
            x = [r["request_throughput"] for r in runs]
            for stat, style in zip(stats, itertools.cycle(("o-", "s--", "^:", "d-."))):  # None (nothing measured): a gap
                ys = [float("nan") if r[metric][stat] is None else r[metric][stat] for r in runs]
                ax.plot(x, ys, style, label=" ".join(filter(None, (name, stat.replace("_ms", "")))),
                        **({"color": colour} if baseline else {}))
            for r, xi in zip(runs, x):
                if r[metric][stats[0]] is not None:
                    ax.annotate(label(r), (xi, r[metric][stats[0]]), fontsize=7, textcoords="offset points",
                                xytext=(3, 3))
        ax.set(title=title, xlabel=f"achieved requests/s (labels: {what})", ylabel="ms")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
