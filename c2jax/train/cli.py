"""`c2jax pretrain --config experiments/configs/cpt_small.yaml key=value ...`: run (or resume) a
continued-pretraining run, in one process or, with `distributed.enabled=true`, as one process of a
multi-process job (c2jax/distributed.py has the launch recipes). `--config <run>/config.yaml` resumes that run
on this device's MoE kernel where the saved one is another device's (loop.resumed_config)."""

from __future__ import annotations


def add_parser(subparsers):
    p = subparsers.add_parser("pretrain", help="continued pretraining: phases, MTP, checkpoints, eval")
    p.add_argument("--config", required=True, help="YAML file of a PretrainConfig")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. optimizer.lr=1e-3")
    p.add_argument("--stop-after", type=int, default=None, help="stop after this many steps (resumable)")
    return p


def run(args) -> int:
    from c2jax import distributed
    from c2jax.config import load
    from c2jax.train.config import PretrainConfig

    cfg = load(PretrainConfig, args.config, args.overrides)
    distributed.initialize(cfg.distributed)  # before anything asks JAX for devices; no-op unless enabled
    from c2jax.train.loop import Trainer, resumed_config

    # resuming from the run directory's saved config.yaml: a saved MoE kernel of another device is re-resolved
    cfg = resumed_config(cfg, args.config, args.overrides)
    trainer = Trainer(cfg)
    try:
        out = trainer.run(stop_after=args.stop_after)
    finally:
        trainer.close()
    if not distributed.is_primary():
        return 0
    print(f"{cfg.name}: step {out['step']}/{cfg.total_steps}, last loss {out['losses'][-1]:.4f}"
          if out["losses"] else f"{cfg.name}: nothing to do at step {out['step']}")
    return 0
