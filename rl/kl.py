"""Per-token KL(pi_theta || pi_ref) estimators on tokens sampled from pi_theta (Schulman 2020, "Approximating
KL divergence"; Composer 2 sec. 4.3 and Fig. 4).

With log r = log pi_ref(x) - log pi_theta(x) for x ~ pi_theta:
  k1 = -log r                 unbiased, high variance, can be negative per sample (Composer 2's choice)
  k2 = (log r)^2 / 2          biased (low variance; its expectation is not the KL once the policies differ)
  k3 = (r - 1) - log r        unbiased and >= 0, but its variance explodes as the policies diverge (r has
                              heavy tails: E_q[r^2] = exp(KL_2(p||q)) can be huge; Amini et al. 2025 Fig. 1)

Where they enter (rl/config.KLConfig.placement):
  reward: R_i <- R_i - beta * sg(sum_t k_t) (a detached penalty carried by the score-function gradient).
          This is how k1 must be used: as a differentiable loss, grad E_q[k1] = E_q[grad log q] = 0 on-policy.
  loss:   L <- L + beta * k_t per token (what verl's use_kl_loss does; sensible for k2/k3, whose gradient at
          r near 1 approximates grad KL).
"""

from __future__ import annotations

import jax.numpy as jnp


def kl_estimate(logp: jnp.ndarray, ref_logp: jnp.ndarray, estimator: str = "k1") -> jnp.ndarray:
    """Elementwise estimator of KL(pi || pi_ref) given log pi(x) and log pi_ref(x) at x ~ pi (see module)."""
    log_r = ref_logp - logp
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * jnp.square(log_r)
    if estimator == "k3":
        return jnp.expm1(log_r) - log_r
    raise ValueError(f"unknown KL estimator {estimator!r}; expected k1, k2 or k3")
