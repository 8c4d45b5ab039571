"""The pipeline report: a Markdown table of every pipeline's metrics and a PNG bar chart."""

from __future__ import annotations

from pathlib import Path

from ckray.evaluate import format_table


def write_report(results: dict[str, dict[str, float]], workdir: str | Path, split: str,
                 timings: dict | None = None) -> str:
    workdir = Path(workdir)
    measures = list(next(iter(results.values()))) if results else []
    md = [f"# ckray report ({split})", "", "| pipeline | " + " | ".join(measures) + " |",
          "|---|" + "---|" * len(measures)]
    md += [f"| {name} | " + " | ".join(f"{m[k]:.4f}" for k in measures) + " |" for name, m in results.items()]
    if timings:
        md += ["", "| stage | wall time (s) |", "|---|---|"] + [f"| {k} | {v:.1f} |" for k, v in timings.items()]
    (workdir / "report.md").write_text("\n".join(md) + "\n")
    _chart(results, workdir / "report.png", split)
    return format_table(results, split) + f"\n\nreport: {workdir / 'report.md'}, chart: {workdir / 'report.png'}"


def _chart(results: dict[str, dict[str, float]], path: Path, split: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    measures = list(next(iter(results.values()))) if results else []
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(names) * max(1, len(measures)) / 2), 4))
    width = 0.8 / max(1, len(measures))
    for i, m in enumerate(measures):
        ax.bar([j + i * width for j in range(len(names))], [results[n][m] for n in names], width, label=m)
    ax.set_xticks([j + width * (len(measures) - 1) / 2 for j in range(len(names))], names, rotation=20, ha="right")
    ax.set_ylim(0, 1)
    ax.set_title(f"ckray pipelines on {split}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
