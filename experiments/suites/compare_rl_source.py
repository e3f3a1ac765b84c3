"""Does RL through the suite source reproduce the ladder kind? (issue 40's first acceptance criterion)

    python -m experiments.seeds --seeds 0-2 --out runs/seeds/demo_ladder demo
    python -m experiments.seeds --seeds 0-2 --out runs/seeds/demo_suite demo --rl-source suite \
        --sft-from runs/seeds/demo_ladder/seed-{seed}
    python -m experiments.suites.compare_rl_source runs/seeds/demo_ladder runs/seeds/demo_suite --out DIR

Both studies start RL from the same SFT agents (the suite study reuses the ladder study's, seed by seed) and
train on the same tasks (the suite study reads them from task directories on disk); the held-out eval before RL
is the same run. Per seed: each variant's RL effect (avg@1, best-of-2, pass@2 after RL minus before, with the
demo's own interval over tasks), and the paired difference suite - ladder of the after-RL figures per held-out
task, pooled over seeds and tasks (hierarchical bootstrap: seeds, then tasks within them). Writes
DIR/rl_source.json and DIR/RL_SOURCE.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from experiments.seeds.figures import demo_figures

KEYS = ("avg@1", "best_of_2", "pass@2")


def compare(ladder: Path, suite: Path) -> dict:
    from c2jax.rl.eval.metrics import hierarchical_bootstrap_ci

    seeds = sorted(int(p.name.split("-")[1]) for p in ladder.glob("seed-*")
                   if (suite / p.name / "results.json").is_file() and (p / "results.json").is_file())
    if not seeds:
        raise SystemExit(f"no seed finished in both {ladder} and {suite}")
    rows, paired = [], {k: [] for k in KEYS}
    for s in seeds:
        a, b = demo_figures(ladder / f"seed-{s}"), demo_figures(suite / f"seed-{s}")
        if a.scalars["before/avg@1"] != b.scalars["before/avg@1"]:
            raise SystemExit(f"seed {s}: the two studies start from different SFT agents (before-RL avg@1 "
                             f"{a.scalars['before/avg@1']} vs {b.scalars['before/avg@1']})")
        row = {"seed": s, "before/avg@1": a.scalars["before/avg@1"]}
        for k in KEYS:
            for name, f in (("ladder", a), ("suite", b)):
                row[f"{name}/rl_effect/{k}"] = f.scalars[f"rl_effect/{k}"]
                row[f"{name}/rl_effect/{k}/ci"] = list(f.within[f"rl_effect/{k}"])
            # the RL effects' per-task values share `before`, so their difference is that of the after-RL values
            la, su = a.per_task[f"rl_effect/{k}"], b.per_task[f"rl_effect/{k}"]
            paired[k].append([y - x for x, y in zip(la, su, strict=True)])
        rows.append(row)
    summary = {}
    for k in KEYS:
        flat = [v for seed in paired[k] for v in seed]
        lo, hi = hierarchical_bootstrap_ci(paired[k], seed=0)
        summary[f"suite_minus_ladder/{k}"] = {"mean": sum(flat) / len(flat), "ci_low": lo, "ci_high": hi}
    return {"seeds": seeds, "per_seed": rows, "pooled": summary}


def markdown(res: dict, machine: str) -> str:
    lines = ["# RL through the suite source vs the ladder kind", "", f"machine: {machine}", "",
             "| seed | before avg@1 | " + " | ".join(f"{v} RL effect {k}" for k in KEYS for v in ("ladder", "suite"))
             + " |", "|---" * (2 + 2 * len(KEYS)) + "|"]
    for r in res["per_seed"]:
        cells = [f"{r[f'{v}/rl_effect/{k}']:+.3f} [{r[f'{v}/rl_effect/{k}/ci'][0]:+.3f}, "
                 f"{r[f'{v}/rl_effect/{k}/ci'][1]:+.3f}]" for k in KEYS for v in ("ladder", "suite")]
        lines.append(f"| {r['seed']} | {r['before/avg@1']:.3f} | " + " | ".join(cells) + " |")
    lines += ["", "Paired, after RL, suite - ladder, pooled over seeds and held-out tasks (hierarchical bootstrap):",
              ""]
    for k, v in res["pooled"].items():
        lines.append(f"- {k}: {v['mean']:+.3f} [{v['ci_low']:+.3f}, {v['ci_high']:+.3f}]")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("ladder", type=Path)
    p.add_argument("suite", type=Path)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    from c2jax.machine import summary_line

    res = compare(args.ladder, args.suite)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "rl_source.json").write_text(json.dumps(res, indent=1))
    text = markdown(res, summary_line())
    (args.out / "RL_SOURCE.md").write_text(text)
    print(text)
    return res


if __name__ == "__main__":
    main()
