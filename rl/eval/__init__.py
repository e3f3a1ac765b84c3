"""The evaluation suite: c2bench manifests, the resumable runner, metrics, behaviour evals, reports.

See docs/eval.md. Online evaluation from the RL loop calls `evaluate(tasks, agent_factory, samples)`.
"""

from c2jax.rl.eval.config import AgentConfig, EvalConfig, PricingConfig
from c2jax.rl.eval.metrics import best_of_k, bootstrap_ci, pass_at_k, pass_hat_k
from c2jax.rl.eval.runner import EvalResults, evaluate
from c2jax.rl.eval.store import ResultStore, SampleResult
from c2jax.rl.eval.suite import SuiteError, load_suite

__all__ = ["AgentConfig", "EvalConfig", "EvalResults", "PricingConfig", "ResultStore", "SampleResult",
           "SuiteError", "best_of_k", "bootstrap_ci", "evaluate", "load_suite", "pass_at_k", "pass_hat_k"]
