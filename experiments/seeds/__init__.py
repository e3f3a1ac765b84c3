"""Seeds as an axis: run a demo, an ablation or any command over N seeds and report each seed's figures and
their mean with 95% intervals over seeds (and over seeds and tasks together).

    python -m experiments.seeds --seeds 0-4 --out runs/seeds/demo demo [demo flags]
    python -m experiments.seeds --seeds 0-2 --out runs/seeds/abl02 ablation02 [--quick]
    python -m experiments.seeds --seeds 0,1 --out DIR --figures json -- python my_exp.py --seed {seed} --out {out}

See experiments/seeds/runner.py (running) and experiments/seeds/figures.py (what is read from each run).
"""
