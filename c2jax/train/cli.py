"""`c2jax pretrain --config experiments/configs/cpt_small.yaml key=value ...`: run (or resume) a
continued-pretraining run locally."""

from __future__ import annotations


def add_parser(subparsers):
    p = subparsers.add_parser("pretrain", help="continued pretraining: phases, MTP, checkpoints, eval")
    p.add_argument("--config", required=True, help="YAML file of a PretrainConfig")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. optimizer.lr=1e-3")
    p.add_argument("--stop-after", type=int, default=None, help="stop after this many steps (resumable)")
    return p


def run(args) -> int:
    from c2jax.train.config import load_pretrain_config
    from c2jax.train.loop import Trainer

    cfg = load_pretrain_config(args.config, args.overrides)
    trainer = Trainer(cfg)
    try:
        out = trainer.run(stop_after=args.stop_after)
    finally:
        trainer.close()
    print(f"{cfg.name}: step {out['step']}/{cfg.total_steps}, last loss {out['losses'][-1]:.4f}"
          if out["losses"] else f"{cfg.name}: nothing to do at step {out['step']}")
    return 0
