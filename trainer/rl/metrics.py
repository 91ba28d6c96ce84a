"""Per-step metrics: JSONL and TensorBoard event files in the run folder, a rich progress bar, and a PNG plot at the
end (process 0 only)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "metrics.png"
# Where each step's time goes (train.py): keys of the record, seconds, in the order they happen.
PHASES = ("sample", "score", "reference", "proximal", "update", "push", "checkpoint", "eval")
EVAL_PREFIX = "eval/"  # the held-out eval's scores (trainer/rl/evaluate.py), in the records of the steps it follows


def phase_key(phase: str) -> str:
    return f"time/{phase}_s"


def slot_efficiency(tokens: int, steps: int, slots: int) -> float:
    """Generated tokens / (decode steps x slots): the share of the sampler's row-steps that produced a token (the
    sampler counts its steps: trainer.rl.sampler.Samples.steps)."""
    return float(tokens / max(steps * slots, 1))


# The record's wall-clock fields: everything else of a step is determined by the seed (resume is exact).
CLOCK_KEYS = frozenset({"step_time_s", "tokens_per_s", *(phase_key(p) for p in PHASES)})


def _summary_writer() -> Any:
    """tensorboardX's SummaryWriter, imported without torch: tensorboardX imports torch whenever it is installed (a
    laptop's environment, not the trainer's image), only to accept torch tensors, which this logger never writes; that
    import is about a CPU-second of every start. A None in sys.modules makes `import torch` fail for that one import."""
    if "torch" in sys.modules:
        from tensorboardX import SummaryWriter

        return SummaryWriter
    sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def truncate_metrics(run_dir: str | Path, first_step: int) -> None:
    """Drop records at or after `first_step` (left by a run that died after its last checkpoint)."""
    path = Path(run_dir) / METRICS_FILE
    if path.exists():
        keep = [r for r in read_metrics(run_dir) if r["step"] < first_step]
        path.write_text("".join(json.dumps(r) + "\n" for r in keep))


class MetricsLogger:
    def __init__(self, run_dir: str | Path, total_steps: int, start_step: int, *, enabled: bool, progress: bool,
                 log_every: int = 1) -> None:
        self.enabled = enabled
        self.log_every = log_every
        self.path = Path(run_dir) / METRICS_FILE
        self.console = Console(stderr=False)
        self._board: Any = None
        if enabled:
            SummaryWriter = _summary_writer()
            # purge_step: on a resume, TensorBoard drops what an earlier writer logged from this step on (the steps
            # redone after the last checkpoint), as truncate_metrics does for the JSONL. The suffix keeps a writer
            # started in the same second as the last one (its file is named by the second and the host) from
            # overwriting that file, and sorts the two in order.
            self._board = SummaryWriter(str(run_dir), purge_step=start_step if start_step else None,
                                        filename_suffix=f".step{start_step:09d}")
        self._progress: Progress | None = None
        if enabled and progress and self.console.is_terminal:
            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=self.console,
            )
            self._task = self._progress.add_task("train", total=total_steps, completed=start_step, info="")
            self._progress.start()

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self._board is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, int | float) and math.isfinite(value):
                    self._board.add_scalar(key, value, record["step"])
            self._board.flush()
        phases = "/".join(f"{record[phase_key(p)]:.1f}" for p in PHASES if phase_key(p) in record)
        info = (f"reward {record['reward_mean']:.3f}  loss {record['loss']:+.4f}  "
                f"len {record['completion_len']:.1f}  {record['tokens_per_s']:.0f} tok/s"
                + (f"  {'/'.join(p[:3] for p in PHASES if phase_key(p) in record)} {phases}s" if phases else ""))
        if self._progress is not None:
            self._progress.update(self._task, completed=record["step"] + 1, info=info)
        elif record["step"] % self.log_every == 0:
            # soft_wrap: one line per step in a pod's log or a pipe, where rich would otherwise wrap at 80 columns.
            self.console.print(f"step {record['step']:>5}  {info}  ({record['step_time_s']:.2f}s)", highlight=False,
                               soft_wrap=True)
        scores = eval_line(record)
        if scores:
            self.console.print(f"eval after step {record['step']:>5}  {scores}", highlight=False, soft_wrap=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self._board is not None:
            self._board.close()
            self._board = None


def eval_scores(record: dict[str, Any]) -> dict[str, float]:
    """The eval's scores in a record (none when no eval followed its step)."""
    return {k: v for k, v in record.items() if k.startswith(EVAL_PREFIX)}


def _headline(key: str) -> bool:
    """An eval score shown on its line and in the plot: the mean rewards and the pass rates."""
    return key.endswith(("_reward", "_pass")) or key.startswith(f"{EVAL_PREFIX}pass_at_")


def eval_line(record: dict[str, Any]) -> str:
    """The headline scores of a record's eval, on one line: mean rewards and pass rates."""
    scores = eval_scores(record)
    keys = [k for k in scores if _headline(k)]
    return "  ".join(f"{k.removeprefix(EVAL_PREFIX)} {scores[k]:.3f}" for k in keys)


def _finite(xs: list[Any]) -> list[float]:
    return [float(x) if x is not None and math.isfinite(float(x)) else float("nan") for x in xs]


def plot_metrics(records: list[dict[str, Any]], path: str | Path) -> Path:
    """Reward (mean +- std, per reward fn) and loss per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    evals = [r for r in records if eval_scores(r)]
    fig, axes = plt.subplots(3 if evals else 2, 1, figsize=(8, 9 if evals else 6), sharex=True)
    ax_r, ax_l = axes[0], axes[1]
    mean = _finite([r["reward_mean"] for r in records])
    std = _finite([r["reward_std"] for r in records])
    ax_r.plot(steps, mean, label="reward (sum)", color="C0", alpha=0.6)
    window = max(1, len(mean) // 12)
    if window > 1:
        # Trailing mean over the steps seen so far (shorter at the start).
        csum = np.cumsum([0.0, *mean])
        smooth = [(csum[i + 1] - csum[max(0, i + 1 - window)]) / min(i + 1, window) for i in range(len(mean))]
        ax_r.plot(steps, smooth, label=f"reward ({window}-step mean)", color="C0", lw=2)
    lo, hi = np.asarray(mean) - np.asarray(std), np.asarray(mean) + np.asarray(std)
    ax_r.fill_between(steps, lo, hi, alpha=0.15, color="C0")
    names = sorted({k.removeprefix("reward/") for r in records for k in r
                    if k.startswith("reward/") and not k.endswith("_std")})
    if len(names) > 1:
        for i, name in enumerate(names):
            ax_r.plot(steps, _finite([r.get(f"reward/{name}") for r in records]), label=name, color=f"C{i + 2}",
                      lw=1)
    ax_r.set_ylabel("reward")
    ax_r.legend(loc="best", fontsize="small")
    ax_r.grid(alpha=0.3)
    ax_l.plot(steps, _finite([r["loss"] for r in records]), color="C1")
    ax_l.set_ylabel("loss")
    ax_l.grid(alpha=0.3)
    if evals:
        # Rewards and pass rates of the held-out eval at the steps it followed (lengths and per-reward parts stay in
        # the JSONL and TensorBoard).
        ax_e = axes[2]
        keys = sorted({k for r in evals for k in eval_scores(r) if _headline(k)})
        for i, key in enumerate(keys):
            ax_e.plot([r["step"] for r in evals], _finite([r.get(key) for r in evals]), marker="o", ms=3,
                      label=key.removeprefix(EVAL_PREFIX), color=f"C{i}")
        ax_e.set_ylabel("held-out eval")
        ax_e.legend(loc="best", fontsize="small")
        ax_e.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
