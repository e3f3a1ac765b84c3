"""The asynchronous RL system on Ray: learner, rollout, environment and evaluator actors, a reconciler that
owns the sample lifecycle, staleness control and delta-compressed weight sync. See docs/rl_system.md."""
