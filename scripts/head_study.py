"""The shipped default heads' recipe (hf_selfspec/default_heads), as `hf-selfspec train-heads` steps.

    python scripts/head_study.py --out /tmp/my_default_heads              # all 12 steps, ~3 h on 2 cores
    python scripts/head_study.py --out /tmp/my_default_heads --dry-run    # print them
    python scripts/head_study.py --out /tmp/my_default_heads --from 8     # resume at step 8

Teacher-forced heads of depth 2 first (cheap positions), fine-tuned on the model's own
replies, deepened to 3 training the new step alone, then every step fine-tuned on four
more parts of own replies. The replies are cached under --work (one folder per kind of
text; each collect step adds one part), the intermediate heads too. Every step is the
package trainer (hf_selfspec/training); the minutes are the seconds the shipped heads'
steps took on a 2-core Xeon, so the positions collected depend on the machine.

The study modes that chose this recipe (teacher-forced vs own data, trees, dynamic trees,
Medusa heads, soft targets) were removed; their findings are in docs/head_study.md.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hf_selfspec.defaults import cache_dir
from hf_selfspec.training.cli import main as train_heads

FIT = ["--train-batch", "512"]


def recipe(out: Path, work: Path) -> list[list[str]]:
    """The steps, each the arguments of `hf-selfspec train-heads default`."""
    tf, own = ["--teacher-forced", "--work", str(work / "tf")], ["--work", str(work / "own")]
    heads = {name: str(work / f"heads_{name}") for name in ("tf", "own2", "own3")}
    collect_own = [own + ["--out", heads["own3"], "--only", "collect", "--minutes", m]
                   for m in ("20", "18", "20", "20")]  # parts 2-5
    return [
        tf + ["--out", heads["tf"], "--only", "collect", "--minutes", "13"],  # part 0 (+ held-out)
        tf + ["--out", heads["tf"], "--only", "collect", "--minutes", "10"],  # part 1
        tf + ["--out", heads["tf"], "--only", "train", "--minutes", "10", "--depth", "2", "--epochs", "3", *FIT],
        own + ["--out", heads["own2"], "--only", "collect", "--minutes", "20"],  # part 0 (+ held-out)
        own + ["--out", heads["own2"], "--only", "collect", "--minutes", "25"],  # part 1
        own + ["--out", heads["own2"], "--only", "train", "--minutes", "5", "--init", heads["tf"],
               "--epochs", "3", "--lr", "3e-4", *FIT],
        own + ["--out", heads["own3"], "--only", "train", "--minutes", "7", "--init", heads["own2"],
               "--depth", "3", "--new-steps-only", "--epochs", "3", "--lr", "1e-3", *FIT],
        *collect_own,
        own + ["--out", str(out), "--only", "train", "--minutes", "12", "--init", heads["own3"],
               "--parts", "2-5", "--epochs", "2", "--lr", "3e-4", *FIT],
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path, help="folder for the final heads")
    ap.add_argument("--work", type=Path, default=cache_dir() / "head_recipe",
                    help="replies and intermediate heads (default: %(default)s)")
    ap.add_argument("--from", dest="first", type=int, default=1, help="start at this step (resume)")
    ap.add_argument("--dry-run", action="store_true", help="print the steps, run nothing")
    ap.add_argument("--threads", default="2", help="CPU threads")
    args = ap.parse_args(argv)
    steps = recipe(args.out, args.work)
    if not 1 <= args.first <= len(steps):
        ap.error(f"--from must be 1..{len(steps)}, got {args.first}")
    command = "python scripts/head_study.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    for number, step in enumerate(steps, 1):
        if number < args.first:
            continue
        step = ["default", *step, "--threads", args.threads]
        print(f"[{number}/{len(steps)}] hf-selfspec train-heads {shlex.join(step)}", flush=True)
        if not args.dry_run and train_heads(step, command=command if number == len(steps) else None) != 0:
            print(f"step {number} failed: fix it, then resume with --from {number}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
