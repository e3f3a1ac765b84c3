"""Ablation 12 (issue 38, item 2): can RL lift a weak SFT start, and what does the length penalty do there?

The report's central claim is that RL finds solutions the SFT policy rarely samples (pass@k rises with avg@1),
so a weak but non-zero start is the case that matters. This study makes such a start with the demo's stages (a
noisier teacher: `sft.teacher_error`), then runs RL from that same SFT model once per length-penalty variant
(`experiments.demo --sft-from`), over `seeds`. Per seed and variant: the paired after-minus-before held-out
avg@1, best-of-2 and pass@2 with their within-seed 95% intervals; per variant: the mean over seeds with a 95%
interval over seeds and a two-level interval (seeds, then tasks within each seed).

    python -m experiments.ablations.12_rl_from_weak_start.run [--config FILE] [--out DIR] [--quick] [--summary-only]

--summary-only runs nothing and summarises the (seed, variant) runs that finished.

Runs resume: a (seed, variant) that finished before is not run again (experiments.seeds).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import matplotlib

from experiments.ablations.provenance import ablation_args, write_result

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
FIGURES = ("rl_effect/avg@1", "rl_effect/best_of_2", "rl_effect/pass@2")


def demo_flags(overrides: dict) -> list[str]:
    """{field: value} -> experiments.demo flags (--field-name value)."""
    from experiments.demo.pipeline import DemoConfig

    known = {f.name for f in dataclasses.fields(DemoConfig)}
    flags = []
    for name, value in (overrides or {}).items():
        if name not in known or name in ("seed", "out", "until", "sft_from"):
            raise ValueError(f"config: {name!r} is not a demo setting this study may set")
        flags += [f"--{name.replace('_', '-')}", str(value).lower() if isinstance(value, bool) else str(value)]
    return flags


def plan(raw: dict, out: Path, quick: bool) -> list[tuple[str, list[str]]]:
    """(study directory, experiments.seeds argv) of the SFT starts, then of each variant."""
    seeds = ",".join(str(s) for s in raw["seeds"])
    quick_flags = ["--quick"] if quick else []
    sft = [str(out / "sft"), ["--seeds", seeds, "--out", str(out / "sft"), "demo", "--until", "eval", *quick_flags,
                              *demo_flags(raw.get("sft"))]]
    steps = [tuple(sft)]
    for name, flags in raw["variants"].items():
        cmd = [sys.executable, "-m", "experiments.demo", "--seed", "{seed}", "--out", "{out}", "--sft-from",
               str(out / "sft" / "seed-{seed}"), *quick_flags, *demo_flags(raw.get("sft")),
               *demo_flags({**(raw.get("rl") or {}), **(flags or {})})]
        steps.append((str(out / f"rl-{name}"), ["--seeds", seeds, "--out", str(out / f"rl-{name}"), "--figures",
                                                "demo", "--", *cmd]))
    return steps


def summarise(raw: dict, out: Path) -> dict:
    starts = json.loads((out / "sft" / "seeds.json").read_text())
    crit = raw.get("weak_start") or {}
    per_seed_start = {}
    for row in starts["per_seed"]:
        f = row.get("figures") or {}
        a1, p4 = f.get("before/avg@1"), f.get("before/pass@4")
        per_seed_start[row["seed"]] = {"avg@1": a1, "pass@4": p4, "best_of_2": f.get("before/best_of_2"),
                                       # None where the eval had fewer than 4 samples per task (--quick)
                                       "weak": None if a1 is None or p4 is None else
                                       bool(a1 <= crit.get("max_avg1", 0.1) and p4 >= crit.get("min_pass4", 0.2))}
    variants = {}
    for name in raw["variants"]:
        path = out / f"rl-{name}" / "seeds.json"
        if not path.is_file():
            continue
        res = json.loads(path.read_text())
        variants[name] = {
            "summary": {k: res["summary"][k] for k in FIGURES if k in res["summary"]},
            "per_seed": {row["seed"]: {"status": row["status"], "wall_s": row["wall_s"],
                                       **{k: (row.get("figures") or {}).get(k) for k in FIGURES},
                                       **{f"{k}/ci": (row.get("within_seed_ci") or {}).get(k) for k in FIGURES}}
                         for row in res["per_seed"]}}
    return {"seeds": raw["seeds"], "sft": raw.get("sft"), "rl": raw.get("rl"), "sft_start": per_seed_start,
            "variants": variants}


def plot(result: dict, path: Path) -> Path:
    names = list(result["variants"])
    fig, axes = plt.subplots(1, len(FIGURES), figsize=(4.2 * len(FIGURES), 3.8), sharey=True)
    for ax, key in zip(axes, FIGURES):
        for i, name in enumerate(names):
            v = result["variants"][name]
            s = v["summary"].get(key)
            if not s:
                continue
            ci = s.get("ci_seeds_and_tasks") or s.get("ci_over_seeds") or (s["mean"], s["mean"])
            ax.errorbar([i], [s["mean"]], yerr=[[s["mean"] - ci[0]], [ci[1] - s["mean"]]], fmt="o", color="k",
                        capsize=4)
            pts = [r[key] for r in v["per_seed"].values() if r.get(key) is not None]
            ax.scatter([i + 0.15] * len(pts), pts, s=14, alpha=0.6)
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_xticks(range(len(names)), names, rotation=20)
        ax.set_title(f"after - before RL: {key.split('/', 1)[1]}")
    axes[0].set_ylabel("held-out change")
    fig.suptitle("mean over seeds, 95% CI over seeds then tasks; dots: each seed", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> dict:
    from experiments.seeds.runner import main as seeds_main

    summary_only = "--summary-only" in (argv := list(sys.argv[1:] if argv is None else argv))
    argv = [a for a in argv if a != "--summary-only"]
    args, raw = ablation_args(argv, __doc__, HERE, "tiny demo sizes (--quick): every stage runs, nothing is learned")
    if args.quick:
        raw = {**raw, "seeds": raw["seeds"][:1], "variants": dict(list(raw["variants"].items())[:2])}
    out = Path(args.out).resolve()
    failed = []
    for study, argv_ in plan(raw, out, args.quick):
        if summary_only:  # tabulate the (seed, variant) runs found, run nothing
            if Path(study, "seeds.json").is_file():
                seeds_main(["--summary-only", *argv_])
            continue
        print(f"== {study}", flush=True)
        if seeds_main(argv_) != 0:
            failed.append(study)
        if study.endswith("/sft") and failed:
            raise SystemExit(f"the SFT starts failed ({study}/seed-*/log.txt); no RL variant can run")
    result = summarise(raw, out)
    result["failed"] = failed
    result["plot"] = plot(result, out / "weak_start.png").name  # beside results.json
    write_result(out, result, args.machine)
    print(json.dumps({n: {k: round(v["summary"][k]["mean"], 3) for k in v["summary"]}
                      for n, v in result["variants"].items()}, indent=1))
    if failed:
        raise SystemExit(f"failed: {failed}")
    return result


if __name__ == "__main__":
    main()
