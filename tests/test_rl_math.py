"""RL math against hand-computed values (each expected number is worked out in the comment next to it)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from c2jax.config import from_dict, parse_yaml
from c2jax.models.config import ConfigError
from c2jax.rl.advantages import chain_rewards, group_advantages, token_advantages, zero_variance_fraction
from c2jax.rl.config import AdvantageConfig, LengthPenaltyConfig, LossConfig, RewardConfig, RLConfig
from c2jax.rl.kl import kl_estimate
from c2jax.rl.length_penalty import concave_length_cost, effort, length_penalty
from c2jax.rl.losses import aggregate, aggregation_weights, policy_token_loss
from c2jax.rl.rewards import compute_reward

# jitted once per config: eager dispatch of many tiny ops costs more than these compiles
_token_loss = jax.jit(policy_token_loss, static_argnames=("num_sequences", "cfg"))
_agg_weights = jax.jit(aggregation_weights, static_argnames=("num_sequences", "mode"))

REWARDS = np.array([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])


def test_group_mean_rloo_and_std_advantages():
    # group 1 mean 0.5 -> +-0.5; group 2 is all equal -> 0
    np.testing.assert_allclose(group_advantages(REWARDS), [[0.5, -0.5, -0.5, 0.5], [0, 0, 0, 0]])
    # RLOO: 1 - (0 + 0 + 1)/3 = 2/3 ; 0 - (1 + 0 + 1)/3 = -2/3
    rloo = group_advantages(REWARDS, AdvantageConfig(baseline="rloo"))
    np.testing.assert_allclose(rloo[0], [2 / 3, -2 / 3, -2 / 3, 2 / 3], rtol=1e-6)
    # GRPO std (ddof=1) of [1,0,0,1] = sqrt(4 * 0.25 / 3) = 0.57735 -> 0.5 / 0.57735 = 0.866025
    std = group_advantages(REWARDS, AdvantageConfig(std_normalize=True, eps=0.0))
    np.testing.assert_allclose(std[0], [0.866025, -0.866025, -0.866025, 0.866025], rtol=1e-5)
    # the Dr. GRPO failure case: a tiny reward difference is blown up to O(1) by the std
    tiny = group_advantages(np.array([[1.0, 1.0, 1.0, 1.001]]), AdvantageConfig(std_normalize=True))
    assert tiny.max() > 1.0
    assert float(zero_variance_fraction(REWARDS)) == 0.5
    np.testing.assert_allclose(group_advantages(np.array([[3.0]]), AdvantageConfig(baseline="rloo")), [[0.0]])


def test_token_advantages_length_normalisation_and_chains():
    seq_adv = jnp.array([1.0, -2.0])
    ids = jnp.array([[0, 0, 0, 1, 1, -1]])
    mask = jnp.array([[0, 1, 1, 1, 1, 0]], bool)  # sequence 0 has 2 loss tokens, sequence 1 has 2
    np.testing.assert_allclose(token_advantages(seq_adv, ids, mask), [[0, 1, 1, -2, -2, 0]])
    np.testing.assert_allclose(token_advantages(seq_adv, ids, mask, length_normalize=True),
                               [[0, 0.5, 0.5, -1, -1, 0]])
    # segments 0, 1 belong to chain 0 (final reward 1), segment 2 to chain 1 (final reward 0)
    np.testing.assert_allclose(chain_rewards(jnp.array([0, 0, 1]), jnp.array([1.0, 0.0])), [1, 1, 0])


def _loss(ratio, adv, cfg, mask=None):
    ratio, adv = jnp.asarray(ratio, jnp.float32)[None], jnp.asarray(adv, jnp.float32)[None]
    mask = jnp.ones(ratio.shape, bool) if mask is None else jnp.asarray(mask)[None]
    ids = jnp.zeros(ratio.shape, jnp.int32)
    return _token_loss(jnp.log(ratio), jnp.zeros_like(ratio), adv, mask, ids, 1, cfg)


def test_ppo_clip_dual_clip_and_clip_higher():
    # eps 0.2: r=0.5,A=1 -> -min(.5,.8)=-.5 ; r=1,A=-1 -> 1 ; r=1.5,A=1 -> -min(1.5,1.2)=-1.2 (clipped);
    # r=1.1,A=-1 -> -min(-1.1,-1.1)=1.1 ; r=4,A=-1 -> -min(-4,-1.2)=4
    out = _loss([0.5, 1.0, 1.5, 1.1, 4.0], [1, -1, 1, -1, -1], LossConfig(policy_loss="ppo"))
    np.testing.assert_allclose(out.loss[0], [-0.5, 1.0, -1.2, 1.1, 4.0], rtol=1e-6)
    np.testing.assert_array_equal(out.clipped[0], [False, False, True, False, False])
    # dual clip c=3 caps the A<0, r=4 token at -c*A = 3
    dual = _loss([4.0, 1.5], [-1, 1], LossConfig(policy_loss="ppo", dual_clip=3.0))
    np.testing.assert_allclose(dual.loss[0], [3.0, -1.2], rtol=1e-6)
    # DAPO clip-higher eps_hi=0.28: r=1.5, A=1 -> -1.28 ; the low side is unchanged (r=0.5, A=-1 -> 0.8)
    dapo = _loss([1.5, 0.5], [1, -1], LossConfig(policy_loss="ppo", clip_high=0.28))
    np.testing.assert_allclose(dapo.loss[0], [-1.28, 0.8], rtol=1e-6)


def test_cispo_keeps_gradient_on_clipped_tokens_and_gspo_uses_sequence_ratio():
    cfg = LossConfig(policy_loss="cispo")
    # l = -sg(clip(1.5, .8, 1.2)) * A * logp -> d l / d logp = -1.2 even though the ratio is clipped
    grad = jax.grad(lambda lp: _token_loss(lp, jnp.zeros((1, 1)), jnp.ones((1, 1)), jnp.ones((1, 1), bool),
                                                 jnp.zeros((1, 1), jnp.int32), 1, cfg).loss.sum())
    np.testing.assert_allclose(grad(jnp.log(jnp.full((1, 1), 1.5))), [[-1.2]], rtol=1e-6)

    def gspo(lp, eps):
        return _token_loss(lp, jnp.zeros((1, 2)), jnp.ones((1, 2)), jnp.ones((1, 2), bool),
                                 jnp.zeros((1, 2), jnp.int32), 1, LossConfig(policy_loss="gspo", gspo_clip=eps))

    lp = jnp.array([[0.1, 0.3]])  # sequence log-ratio = mean = 0.2 -> s = exp(0.2) = 1.221403
    np.testing.assert_allclose(gspo(lp, 1.0).loss, [[-1.221403, -1.221403]], rtol=1e-6)
    # GSPO-token averaged over the sequence has the gradient of the sequence objective -A exp(mean(logp)):
    # d/d logp_t = -exp(0.2) / 2 = -0.610701
    np.testing.assert_allclose(jax.grad(lambda x: gspo(x, 1.0).loss.mean())(lp), [[-0.610701, -0.610701]],
                               rtol=1e-5)
    clipped = gspo(lp, 1e-4)  # s clipped to 1.0001: value -1.0001 per token, no gradient
    np.testing.assert_allclose(clipped.loss, [[-1.0001, -1.0001]], rtol=1e-6)
    np.testing.assert_allclose(jax.grad(lambda x: gspo(x, 1e-4).loss.sum())(lp), [[0.0, 0.0]])


def test_truncated_and_masked_importance_sampling():
    logp, behav = jnp.zeros((1, 2)), jnp.log(jnp.array([[1 / 3, 0.8]]))  # w = pi/mu = 3, 1.25
    args = (jnp.ones((1, 2)), jnp.ones((1, 2), bool), jnp.zeros((1, 2), jnp.int32), 1)
    tis = _token_loss(logp, behav, *args, LossConfig(importance_correction="tis", is_cap=2.0))
    np.testing.assert_allclose(tis.is_weight, [[2.0, 1.25]], rtol=1e-6)
    mis = _token_loss(logp, behav, *args, LossConfig(importance_correction="mis", is_cap=2.0))
    np.testing.assert_allclose(mis.is_weight, [[0.0, 1.25]], rtol=1e-6)
    np.testing.assert_array_equal(mis.clipped, [[True, False]])
    with pytest.raises(ConfigError, match="twice"):
        LossConfig(policy_loss="ppo", importance_correction="tis")


def test_aggregation_modes():
    loss = jnp.array([[1.0, 2.0, 3.0, jnp.nan], [4.0, jnp.nan, jnp.nan, jnp.nan]])
    mask = jnp.array([[1, 1, 1, 0], [1, 0, 0, 0]], bool)
    ids = jnp.array([[0, 0, 0, -1], [1, -1, -1, -1]])
    expected = {"token_mean": 10 / 4, "seq_mean_token_sum": (6 + 4) / 2, "seq_mean_token_mean": (2 + 4) / 2,
                "constant": 10 / 8}
    for mode, value in expected.items():
        w, d = _agg_weights(mask, ids, 8, mode, constant=8.0)
        assert float(aggregate(loss, w) / d) == pytest.approx(value), mode


@pytest.mark.parametrize("kind", ["reinforce", "ppo", "gspo", "cispo"])
def test_masked_tokens_get_zero_gradient_and_nan_does_not_leak(kind):
    mask = jnp.array([[1, 1, 0, 1, 0]], bool)
    nan = jnp.array([[0.0, 0.0, jnp.nan, 0.0, jnp.inf]])
    logp = jnp.array([[-1.0, -2.0, -3.0, -0.5, -1.5]]) + nan
    behav = jnp.array([[-1.1, -1.9, 0.0, -0.4, 0.0]]) + nan
    adv = jnp.array([[1.0, -1.0, 0.0, 0.5, 0.0]]) + nan
    ids = jnp.zeros((1, 5), jnp.int32)
    cfg = LossConfig(policy_loss=kind, gspo_clip=0.5)
    w, d = _agg_weights(mask, ids, 1, "token_mean")

    def total(lp):
        return aggregate(_token_loss(lp, behav, adv, mask, ids, 1, cfg).loss, w) / d

    value, grad = jax.value_and_grad(total)(logp)
    assert np.isfinite(float(value))
    assert np.all(np.isfinite(grad))
    np.testing.assert_array_equal(np.asarray(grad)[0, [2, 4]], [0.0, 0.0])
    assert np.all(np.asarray(grad)[0, [0, 1, 3]] != 0.0)


def test_ppo_gradient_equals_reinforce_at_ratio_one():
    logp = jnp.array([[-1.0, -2.0, -0.3], [-0.7, -1.2, -4.0]])
    adv = jnp.array([[1.0, 1.0, 1.0], [-0.5, -0.5, 2.0]])
    mask = jnp.array([[1, 1, 0], [1, 1, 1]], bool)
    ids = jnp.array([[0, 0, 0], [1, 1, 1]])

    def grad(kind):
        cfg = LossConfig(policy_loss=kind)
        return jax.grad(lambda lp: _token_loss(lp, logp, adv, mask, ids, 2, cfg).loss.sum())(logp)

    np.testing.assert_allclose(grad("ppo"), grad("reinforce"), rtol=1e-6)
    np.testing.assert_allclose(grad("reinforce"), -adv * mask)


def test_kl_estimator_values():
    # pi = 0.5, ref = 0.25: log r = log 0.5 ; k1 = log 2 ; k2 = (log 2)^2 / 2 ; k3 = 0.5 - 1 + log 2
    logp, ref = jnp.log(0.5), jnp.log(0.25)
    assert float(kl_estimate(logp, ref, "k1")) == pytest.approx(0.693147, rel=1e-5)
    assert float(kl_estimate(logp, ref, "k2")) == pytest.approx(0.240227, rel=1e-5)
    assert float(kl_estimate(logp, ref, "k3")) == pytest.approx(0.193147, rel=1e-5)


def test_kl_estimators_on_a_categorical_exact_expectations():
    q = np.array([0.7, 0.2, 0.1])  # the sampling policy
    p = np.array([0.2, 0.3, 0.5])  # the reference
    kl = float(np.sum(q * np.log(q / p)))
    expect = {e: float(np.sum(q * np.asarray(kl_estimate(jnp.log(q), jnp.log(p), e)))) for e in ("k1", "k2", "k3")}
    assert expect["k1"] == pytest.approx(kl, rel=1e-5)
    assert expect["k3"] == pytest.approx(kl, rel=1e-5)
    assert abs(expect["k2"] - kl) > 0.05 * kl  # biased


def test_kl_estimators_on_two_gaussians_reproduce_fig4_ordering():
    """q = N(0, 1) samples, p = N(mu, 1): log r = mu x - mu^2/2, KL = mu^2/2. Closed forms: Var k1 = mu^2;
    E k2 = mu^2/2 + mu^4/8 (bias mu^4/8); E k3 = KL with Var k3 = exp(mu^2) - 1 - mu^2 (explodes)."""
    x = jax.random.normal(jax.random.key(0), (400_000,))
    stats = {}
    for mu in (0.2, 1.0, 3.0):
        logp, ref = -0.5 * x**2, -0.5 * (x - mu) ** 2
        stats[mu] = {e: kl_estimate(logp, ref, e) for e in ("k1", "k2", "k3")}
    n = x.shape[0]
    for mu, est in stats.items():
        kl = mu**2 / 2
        k1 = est["k1"]
        assert abs(float(k1.mean()) - kl) < 4 * float(k1.std()) / math.sqrt(n)  # k1 unbiased
        assert float(k1.var()) == pytest.approx(mu**2, rel=0.02)
        if mu >= 1.0:  # at mu = 0.2 the bias (2e-4) is below the Monte-Carlo noise
            k2_bias = float(est["k2"].mean()) - kl
            assert k2_bias == pytest.approx(mu**4 / 8, rel=0.05)  # k2 biased, growing with divergence
    # near p = q, k3 is the low-variance unbiased choice
    assert float(stats[0.2]["k3"].var()) < 0.1 * float(stats[0.2]["k1"].var())
    assert abs(float(stats[1.0]["k3"].mean()) - 0.5) < 0.02
    # far apart its variance explodes past k1's (exact: e^9 - 10 = 8093 vs 9; the heavy tail makes the sample
    # variance of 4e5 draws far smaller, ~530 here), while k2 stays bounded but biased
    assert float(stats[3.0]["k3"].var()) > 20 * float(stats[3.0]["k1"].var())
    assert float(stats[3.0]["k2"].mean()) > 2 * 4.5


def test_length_penalty_shape_and_limits():
    x = np.linspace(0.0, 1000.0, 201)
    for q in (0.0, 0.5, 1.0, 2.0):
        c = concave_length_cost(x, 0.01, q)
        assert c[0] == 0.0
        assert np.all(np.diff(c) > 0)  # increasing
        if q > 0:
            assert np.all(np.diff(c, 2) < 0)  # concave
    # hand values: k=1, q=.5, x=3: ((1+3)^.5 - 1)/.5 = 2 ; q=0 is linear ; q=2: 1 - 1/(1+x) = .75
    assert concave_length_cost(3.0, 1.0, 0.5) == pytest.approx(2.0)
    assert concave_length_cost(3.0, 1.0, 0.0) == pytest.approx(3.0)
    assert concave_length_cost(3.0, 1.0, 2.0) == pytest.approx(0.75)
    # q -> 1: log(1 + kx)/k (= log(4) for k=1, x=3)
    assert concave_length_cost(3.0, 1.0, 1.0) == pytest.approx(math.log(4.0))
    assert concave_length_cost(3.0, 1.0, 1.0 - 1e-4) == pytest.approx(math.log(4.0), rel=1e-3)
    np.testing.assert_allclose(concave_length_cost(jnp.asarray(x), 0.01, 0.5), concave_length_cost(x, 0.01, 0.5),
                               rtol=1e-5)


def test_reward_composition_logs_every_component():
    lp = LengthPenaltyConfig(scale=0.1, k=1.0, q=0.5, thinking_tokens=1.0, tool_calls=1.0, turns=0.0,
                             tool_call_tokens=0.0, tool_output_tokens=0.0, final_message_tokens=0.0)
    summary = {"correctness": 1.0, "thinking_tokens": 2, "tool_calls": 4, "tool_call_errors": 1,
               "todos_created": 4, "todos_completed": 3, "terminal_tool_calls": 4, "cot_comment_lines": 0}
    assert effort(summary, lp) == 6.0  # 1 * 2 thinking tokens + 1 * 4 tool calls
    # 0.1 * ((1 + 6)^0.5 - 1) / 0.5 = 0.2 * (sqrt(7) - 1) = 0.329150
    assert length_penalty(summary, lp) == pytest.approx(0.329150, rel=1e-5)
    cfg = RewardConfig(length_penalty=lp, auxiliary={"unfinished_todos": 0.5, "tool_call_errors": 0.0,
                                                     "terminal_only": 0.2, "cot_in_comments": 1.0})
    total, parts = compute_reward(summary, cfg)
    assert parts == pytest.approx({"correctness": 1.0, "length_penalty": 0.329150, "aux/unfinished_todos": -0.25,
                                   "aux/tool_call_errors": -0.25, "aux/terminal_only": -1.0,
                                   "aux/cot_in_comments": 0.0}, rel=1e-5)
    # 1 - 0.329150 + 0.5 * -0.25 + 0 * -0.25 + 0.2 * -1 + 1 * 0
    assert total == pytest.approx(0.345850, rel=1e-5)
    with pytest.raises(ValueError, match="unknown auxiliary"):
        compute_reward(summary, RewardConfig(auxiliary={"typo": 1.0}))
    with pytest.raises(ValueError, match="thinking_tokens"):
        effort({"thinking_tokens": -1}, lp)


def test_rl_config_from_yaml_checks_types_and_names():
    text = """
    learning_rate: 3e-6
    micro_batches: 4
    loss: {policy_loss: ppo, clip_high: 0.28, aggregation: token_mean}
    kl: {coef: 0.001, estimator: k1, refresh_every: 100}
    reward: {auxiliary: {unfinished_todos: 0.1}, length_penalty: {scale: 0.01, q: 0.5}}
    """
    cfg = from_dict(RLConfig, parse_yaml(text))
    assert cfg.loss.clip_high == 0.28 and cfg.kl.refresh_every == 100 and cfg.learning_rate == 3e-6
    assert cfg.advantage == AdvantageConfig()  # Dr. GRPO defaults: no std, no length normalisation
    assert not cfg.advantage.std_normalize and not cfg.advantage.length_normalize
    assert cfg.loss.aggregation == "token_mean"
    with pytest.raises(ConfigError, match="loss.policy_loss"):
        from_dict(RLConfig, {"loss": {"policy_loss": "trpo"}})
    with pytest.raises(ConfigError, match="kl.estimater: unknown key; did you mean estimator"):
        from_dict(RLConfig, {"kl": {"estimater": "k3"}})
