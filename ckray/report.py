"""The pipeline report: Markdown tables (every pipeline's metrics, training, per-stage wall times)
and a PNG chart (metrics per pipeline; wall time per stage).

A stage's time is shown twice: its time in the last run that did its work (what the stage costs) and
its time in this run, which for a stage that found its work done is the time it took to see that."""

from __future__ import annotations

from pathlib import Path

from ckray.evaluation import format_table


def _measures(results: dict[str, dict[str, float]]) -> list[str]:
    return list(next(iter(results.values()))) if results else []


def training_rows(training: dict[str, dict]) -> list[list[str]]:
    rows = []
    for model, t in training.items():
        status = f"trained {t['steps_this_run']} steps" if t.get("trained") else "already trained: skipped"
        rows.append([model, str(t["steps"]), status, f"{t['best_dev_ndcg@10']:.4f}", f"{t['wall_time_s']:.1f}"])
    return rows


def stage_rows(timings: dict[str, float], work_times: dict[str, float | None] | None = None,
               did_work: dict[str, bool] | None = None) -> list[list[str]]:
    """[stage, work time, this run's time] per stage of ``timings`` (this run's, with its ``total``).
    ``work_times``: each stage's time in the last run that did its work (``ckray.full_pipeline.stage_work_times``;
    None: not known); ``did_work``: whether the stage did it in this run (a stage that did not shows
    "(up to date)" after its time). Without them every stage did its work in this run. The total's work
    time is the sum of the stages' (when each is known)."""
    did_work = did_work or {}
    work_times = {k: v for k, v in timings.items() if k != "total"} if work_times is None else work_times
    rows = []
    for name, seconds in timings.items():
        if name == "total":
            known = [work_times.get(k) for k in timings if k != "total"]
            work = sum(known) if None not in known else None
        else:
            work = work_times.get(name)
        note = "" if did_work.get(name, True) else " (up to date)"
        rows.append([name, "–" if work is None else f"{work:.1f}", f"{seconds:.1f}{note}"])
    return rows


def write_report(results: dict[str, dict[str, float]], workdir: str | Path, split: str,
                 timings: dict | None = None, training: dict[str, dict] | None = None,
                 notes: list[str] | None = None, work_times: dict[str, float | None] | None = None,
                 did_work: dict[str, bool] | None = None) -> str:
    """Write ``W/report.md`` and ``W/report.png``; return the text to print (tables + paths). ``timings``:
    this run's wall time per stage and in ``total``; ``work_times``, ``did_work``: see :func:`stage_rows`."""
    workdir = Path(workdir)
    measures = _measures(results)
    md = [f"# ckray report ({split})", ""]
    md += [f"{n}" for n in notes or []] + ([""] if notes else [])
    md += ["| pipeline | " + " | ".join(measures) + " |", "|---|" + "---|" * len(measures)]
    md += [f"| {name} | " + " | ".join(f"{m[k]:.4f}" for k in measures) + " |" for name, m in results.items()]
    text = [format_table(results, split)]
    if training:
        header = ["model", "steps", "this run", "best dev nDCG@10", "this run (s)"]
        rows = training_rows(training)
        md += ["", "## Training (dev = held-back training queries)", "",
               "| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
        md += ["| " + " | ".join(r) + " |" for r in rows]
        text += ["", "training:"] + [f"  {r[0]:<10} {r[1]:>5} steps  {r[2]:<26} dev nDCG@10 {r[3]}  {r[4]:>7} s"
                                     for r in rows]
    if timings:
        rows = stage_rows(timings, work_times, did_work)
        md += ["", "## Stages", "", "Wall time of each stage in the last run that did its work (total: their sum), "
               "and in this run (total: start to end).", "", "| stage | work (s) | this run (s) |", "|---|---|---|"]
        md += ["| " + " | ".join(r) + " |" for r in rows]
        text += ["", "stage wall times (work; this run):"] + [f"  {r[0]:<24} {r[1]:>8} s   {r[2]} s" for r in rows]
    (workdir / "report.md").write_text("\n".join(md) + "\n")
    _chart(results, workdir / "report.png", split, timings, work_times)
    text += ["", f"report: {workdir / 'report.md'}, chart: {workdir / 'report.png'}"]
    return "\n".join(text)


def _chart(results: dict[str, dict[str, float]], path: Path, split: str, timings: dict | None = None,
           work_times: dict[str, float | None] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    measures = _measures(results)
    stages = {k: v for k, v in (timings or {}).items() if k != "total"}
    work = {k: (work_times or stages).get(k) for k in stages}
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
        names = list(stages)[::-1]
        ys = range(len(names))
        ax.barh([y + 0.2 for y in ys], [work[n] or 0.0 for n in names], 0.4, color="gray",
                label="last run that did the work")
        ax.barh([y - 0.2 for y in ys], [stages[n] for n in names], 0.4, color="tab:blue", label="this run")
        ax.set_yticks(list(ys), names)
        ax.set_xlabel("wall time (s)")
        total = (timings or {}).get("total", sum(stages.values()))
        ax.set_title(f"stages: {sum(w for w in work.values() if w is not None):.0f} s of work; "
                     f"this run {total:.0f} s", fontsize=10)
        ax.legend(fontsize=7)
        ax.tick_params(axis="y", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
