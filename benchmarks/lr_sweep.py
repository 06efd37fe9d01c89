"""Learning-rate sweep around each optimizer's recommended default: ``python -m benchmarks.lr_sweep``.

For every optimizer and factor f (default x{1/3, 1, 3}) runs ``matrixfsdp train --optimizer X
--set lr=<f x default>`` on the default task (everything else at its default, so the tail and
the other hyperparameters are the optimizer's recommended ones), one run after another, each in
``OUT/<optimizer>_x<f>``; a finished run is not rerun, so an interrupted sweep continues. Prints
(and writes to ``OUT/sweep.md``) the final validation loss of every run, the best of each
optimizer's sweep and the gap of its default to that best. See [Note: recommended
hyperparameters] in ``matrixfsdp.optim.defaults``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from matrixfsdp.launch.config import OPTIMIZER_NAMES
from matrixfsdp.optim.defaults import recommended_hyperparameters

__all__ = ["main", "sweep_table"]


def _final_val_loss(out: Path) -> float | None:
    path = out / "metrics.jsonl"
    if not (out / "summary.txt").is_file() or not path.is_file():
        return None
    vals = [json.loads(line).get("val_loss") for line in path.read_text().splitlines() if line]
    vals = [v for v in vals if v is not None]
    return vals[-1] if vals else None


def sweep_table(results: dict[str, dict[float, tuple[float, float | None]]]) -> str:
    """``results[optimizer][factor] = (lr, final val loss)`` as a markdown table."""
    factors = sorted({f for runs in results.values() for f in runs})
    head = " | ".join(f"x{f:g}" for f in factors)
    lines = [f"| optimizer | default lr | {head} | best | default - best |",
             "|---|---:|" + "---:|" * len(factors) + "---|---:|"]
    for name, runs in results.items():
        done = {f: v for f, (_, v) in runs.items() if v is not None}
        cells = [f"{runs[f][1]:.4f} (lr {runs[f][0]:.4g})" if runs.get(f, (0, None))[1] is not None
                 else "—" for f in factors]
        best = min(done, key=done.__getitem__) if done else None
        gap = f"{done[1.0] - done[best]:+.4f}" if best is not None and 1.0 in done else "—"
        best_text = f"x{best:g}" if best is not None else "—"
        lines.append(f"| {name} | {recommended_hyperparameters(name).lr:g} | {' | '.join(cells)} | "
                     f"{best_text} | {gap} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, dict[float, tuple[float, float | None]]]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.lr_sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--optimizers", default=",".join(OPTIMIZER_NAMES))
    p.add_argument("--factors", default="0.3333,1,3", help="multiples of each default lr")
    p.add_argument("--out", type=Path, default=Path("runs/lr_sweep"))
    p.add_argument("--dry-run", action="store_true", help="tabulate finished runs, start none")
    p.add_argument("train_args", nargs="*", help="after --: extra `matrixfsdp train` flags")
    args = p.parse_args(argv)
    factors = [float(f) for f in args.factors.split(",")]
    results: dict[str, dict[float, tuple[float, float | None]]] = {}
    for name in args.optimizers.split(","):
        default = recommended_hyperparameters(name).lr
        results[name] = {}
        for factor in factors:
            lr = default if factor == 1 else float(f"{default * factor:.3g}")
            out = args.out / f"{name}_x{factor:g}"
            if _final_val_loss(out) is None and not args.dry_run:
                cmd = [sys.executable, "-m", "matrixfsdp", "train", "--optimizer", name,
                       "--set", f"lr={lr}", "--out", str(out), *args.train_args]
                print("+", " ".join(cmd[1:]), file=sys.stderr, flush=True)
                subprocess.run(cmd, check=False)
            results[name][factor] = (lr, _final_val_loss(out))
    text = sweep_table(results)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sweep.md").write_text(text)
    print(text)
    return results


if __name__ == "__main__":
    main()
