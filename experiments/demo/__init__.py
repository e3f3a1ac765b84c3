"""`make demo`: c2jax end to end on CPU with embedded defaults and local Ray.

1. `c2jax info` for the full Kimi K2.5 preset (abstract shapes only).
2. A small byte-level base model pretrained on this machine's standard-library docs, then continued
   pretraining on standard-library code (short context, then long context with YaRN), then SFT on tool-use
   transcripts that the scripted oracle agent produces on the fly on TRAIN ladder tasks.
3. Asynchronous RL on the ladder's `answer` rung with c2jax.rl.system (Ray: learner, rollout and environment workers).
4. Evaluation before and after RL (avg@1, best-of-K) on HELD-OUT ladder tasks with c2jax.rl.eval.
5. Hugging Face export of the final model, reloaded with transformers, logits compared.
6. runs/demo/REPORT.md with plots, and TensorBoard logs of every run (`tensorboard --logdir runs/demo`).

    python -m experiments.demo              # the full demo
    python -m experiments.demo --quick      # tiny sizes (the test)
    python -m experiments.demo --help       # every size
"""

from experiments.demo.pipeline import DemoConfig, main

__all__ = ["DemoConfig", "main"]
