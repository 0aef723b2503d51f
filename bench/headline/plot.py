"""The headline figure: throughput per plan (measured bars, predicted marks) and loss against wall-clock time.

Matplotlib with the non-interactive Agg backend, so it draws on a machine without a display.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen before pyplot is imported

from bench.headline.report import RunSummary  # noqa: E402

COLOURS = {"scheduled": "#1b9e77", "random": "#d95f02", "rank_order": "#7570b3"}
TITLES = {"scheduled": "scheduled", "random": "random (median seed)", "rank_order": "rank order"}


def write_png(path: str | Path, reps: dict[str, RunSummary], runs: list[RunSummary], tokens_per_step: int,
              subtitle: str) -> Path:
    """Draw both panels into ``path`` (parents created); returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig, (bars, curves) = plt.subplots(1, 2, figsize=(11, 4.2))
    names = list(reps)
    xs = range(len(names))
    measured = [reps[n].tokens_per_s for n in names]
    predicted = [tokens_per_step / reps[n].predicted_step_s for n in names]
    bars.bar(xs, measured, color=[COLOURS[n] for n in names], label="measured")
    bars.scatter(xs, predicted, marker="_", s=900, color="black", linewidths=2, zorder=3,
                 label="predicted (full cost model)")
    for x, m in zip(xs, measured, strict=True):  # inside the bar, clear of the predicted mark
        bars.annotate(f"{m:.0f}", (x, m / 2), ha="center", va="center", fontsize=10, color="white",
                      fontweight="bold")
    bars.set_xticks(list(xs), [TITLES[n] for n in names])
    bars.set_ylabel("tokens / s")
    bars.set_title("throughput per plan")
    bars.set_ylim(0, 1.3 * max(measured + predicted))  # headroom for the legend above the bars
    bars.legend(loc="upper right", fontsize=8)

    others = [r for r in runs if r.name == "random" and r is not reps["random"]]
    for i, r in enumerate(others):
        curves.plot(r.ended_at_s, r.losses, color=COLOURS[r.name], alpha=0.35, lw=1, marker=".",
                    label="other random seeds" if i == 0 else None)
    for n in names:
        r = reps[n]
        curves.plot(r.ended_at_s, r.losses, color=COLOURS[n], lw=2, marker="o", label=TITLES[n])
    curves.set_xlabel("wall-clock time since step 0 began (s)")
    curves.set_ylabel("training loss (mean over micro-batches)")
    curves.set_title("loss against wall-clock time")
    curves.legend(fontsize=8)
    curves.grid(alpha=0.3)
    fig.suptitle(subtitle, fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
