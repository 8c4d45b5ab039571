"""The pipeline report: Markdown tables (every pipeline's metrics, training, per-stage wall times)
and a PNG chart (metrics per pipeline; wall time per stage)."""

from __future__ import annotations

from pathlib import Path

from ckray.evaluate import format_table


def _measures(results: dict[str, dict[str, float]]) -> list[str]:
    return list(next(iter(results.values()))) if results else []


def training_rows(training: dict[str, dict]) -> list[list[str]]:
    rows = []
    for model, t in training.items():
        status = f"trained {t['steps_this_run']} steps" if t.get("trained") else "already trained: skipped"
        rows.append([model, str(t["steps"]), status, f"{t['best_dev_ndcg@10']:.4f}", f"{t['wall_time_s']:.1f}"])
    return rows


def write_report(results: dict[str, dict[str, float]], workdir: str | Path, split: str,
                 timings: dict | None = None, training: dict[str, dict] | None = None,
                 notes: list[str] | None = None) -> str:
    """Write ``W/report.md`` and ``W/report.png``; return the text to print (tables + paths)."""
    workdir = Path(workdir)
    measures = _measures(results)
    md = [f"# ckray report ({split})", ""]
    md += [f"{n}" for n in notes or []] + ([""] if notes else [])
    md += ["| pipeline | " + " | ".join(measures) + " |", "|---|" + "---|" * len(measures)]
    md += [f"| {name} | " + " | ".join(f"{m[k]:.4f}" for k in measures) + " |" for name, m in results.items()]
    text = [format_table(results, split)]
    if training:
        header = ["model", "steps", "this run", "best dev nDCG@10", "wall time (s)"]
        rows = training_rows(training)
        md += ["", "## Training (dev = held-back training queries)", "",
               "| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
        md += ["| " + " | ".join(r) + " |" for r in rows]
        text += ["", "training:"] + [f"  {r[0]:<10} {r[1]:>5} steps  {r[2]:<26} dev nDCG@10 {r[3]}  {r[4]:>7} s"
                                     for r in rows]
    if timings:
        md += ["", "## Stages", "", "| stage | wall time (s) |", "|---|---|"]
        md += [f"| {k} | {v:.1f} |" for k, v in timings.items()]
        text += ["", "stage wall times:"] + [f"  {k:<24} {v:>8.1f} s" for k, v in timings.items()]
    (workdir / "report.md").write_text("\n".join(md) + "\n")
    _chart(results, workdir / "report.png", split, timings)
    text += ["", f"report: {workdir / 'report.md'}, chart: {workdir / 'report.png'}"]
    return "\n".join(text)


def _chart(results: dict[str, dict[str, float]], path: Path, split: str, timings: dict | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    measures = _measures(results)
    stages = {k: v for k, v in (timings or {}).items() if k != "total"}
    width_in = max(7, 0.5 * len(names) * max(1, len(measures)) / 2 + 3)
    fig, axes = plt.subplots(1, 2 if stages else 1, figsize=(width_in + (5 if stages else 0), 4.5),
                             gridspec_kw={"width_ratios": [width_in, 5]} if stages else None, squeeze=False)
    ax = axes[0][0]
    width = 0.8 / max(1, len(measures))
    for i, m in enumerate(measures):
        ax.bar([j + i * width for j in range(len(names))], [results[n][m] for n in names], width, label=m)
    ax.set_xticks([j + width * (len(measures) - 1) / 2 for j in range(len(names))], names, rotation=25, ha="right")
    ax.set_ylim(0, 1)
    ax.set_title(f"ckray pipelines on {split}")
    ax.legend(fontsize=8)
    if stages:
        ax = axes[0][1]
        ax.barh(list(stages)[::-1], list(stages.values())[::-1], color="gray")
        ax.set_xlabel("wall time (s)")
        ax.set_title(f"stages (total {(timings or {}).get('total', sum(stages.values())):.0f} s)")
        ax.tick_params(axis="y", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
