"""`c2jax plan` against reality: the planned per-device bytes of small configs against XLA's compiled memory
analysis of the real train step on 8 fake CPU devices, and the device-count search on the paper configs."""

import dataclasses

import pytest

from c2jax.config import ConfigError, MeshConfig
from c2jax.models.config import preset
from c2jax.plan import GPUS_PER_NODE, compiled_memory, plan, smallest_fit

SMALL = preset("small").replace(num_hidden_layers=3, num_nextn_predict_layers=0)

CASES = [  # (mesh, seq, global batch, model overrides): different S, remat policies, meshes, MTP
    (dict(fsdp=8), 2048, 8, dict(remat_policy="full")),
    (dict(fsdp=8), 1024, 8, dict(remat_policy="none")),
    (dict(fsdp=4, expert=2), 2048, 8, dict(remat_policy="full")),
    (dict(fsdp=4, context=2), 4096, 4, dict(remat_policy="full")),
    (dict(data=2, fsdp=4), 2048, 8, dict(remat_policy="full", num_nextn_predict_layers=1)),
]


@pytest.mark.parametrize("sizes,seq,batch,overrides", CASES,
                         ids=lambda v: "x".join(f"{k}{n}" for k, n in v.items()) if isinstance(v, dict) else str(v))
def test_planned_bytes_match_xla_memory_analysis(sizes, seq, batch, overrides):
    model = SMALL.replace(max_position_embeddings=max(seq, 4096), **overrides)
    mesh = MeshConfig(**sizes)
    planned = plan(model, mesh, seq, batch)
    xla = compiled_memory(model, mesh, seq, batch, train_mtp=model.num_nextn_predict_layers > 0)
    # the state is exact (parameters, Adam moments, router biases from the sharding rules)
    assert planned.state_bytes == pytest.approx(xla.state_bytes, rel=0.01)
    # gradients, gathered weights and activations: an itemised estimate, within 25% of XLA's temporaries
    ratio = planned.step_bytes / xla.temp_bytes
    assert 0.75 <= ratio <= 1.25, f"plan {planned.step_bytes / 2**20:.0f} MiB vs XLA {xla.temp_bytes / 2**20:.0f} MiB"


def test_remat_full_keeps_only_layer_inputs_and_chunking_bounds_the_head():
    model = preset("small").replace(num_nextn_predict_layers=0, max_position_embeddings=32768)
    full, none = (plan(model.replace(remat_policy=r), MeshConfig(), 32768, 1) for r in ("full", "none"))
    assert full.activation_terms["saved per layer"] == 4 * 32768 * 512 * 4  # L x T x d x fp32
    assert none.activation_terms["saved per layer"] > 10 * full.activation_terms["saved per layer"]
    # save_attn_kernel: also the kernel's output [T, H, Dv] and fp32 log-sum-exp [T, H] (XLA's temporaries at
    # 32k grew by 0.10 GiB over "full" in experiments/bench/long_context.py; planned 0.13 GiB)
    kept = plan(model.replace(remat_policy="save_attn_kernel"), MeshConfig(), 32768, 1)
    assert kept.activation_terms["saved per layer"] == 4 * 32768 * (512 * 4 + 8 * 32 * 4 + 8 * 4)
    assert not any("save_attn_kernel" in n for n in kept.notes)
    chunked = full.activation_terms["head + loss"]
    whole = plan(model.replace(remat_policy="full", loss_chunk_tokens=0), MeshConfig(), 32768, 1)
    assert whole.activation_terms["head + loss"] > 3.5 * chunked  # 32k x 8k logits vs 8k-token chunks


def test_optimizer_offload_moves_the_moments_to_the_host():
    model = preset("kimi-k2.5")
    mesh = MeshConfig(fsdp=8, expert=8, context=8)
    on_device, offloaded = (plan(model, mesh, 32768, 64, offload_optimizer=o) for o in (False, True))
    assert offloaded.optimizer_bytes == 0 and offloaded.optimizer_host_bytes == on_device.optimizer_bytes
    assert on_device.total_bytes - offloaded.total_bytes == pytest.approx(on_device.optimizer_bytes)


def test_smallest_fit_is_minimal_whole_nodes_and_raises_an_unsplittable_batch():
    model = preset("kimi-k2.5").replace(moe_chunk_tokens=2048)
    template = MeshConfig(fsdp=-1, expert=8, context=8)
    fit = smallest_fit(model, template, 262144, 32, "H200")
    assert fit is not None and fit.devices % GPUS_PER_NODE == 0 and fit.plan.fits(141.0)
    ways = fit.mesh["data"] * fit.mesh["fsdp"] * fit.mesh["expert"]
    assert fit.global_batch % ways == 0 and fit.global_batch >= 32
    step = 64  # lcm(8 per node, expert x context)
    for devices in range(step, fit.devices, step):  # nothing smaller fits
        mesh = template.resolve(devices)
        ways = mesh.sizes["fsdp"] * mesh.sizes["expert"]
        try:
            smaller = plan(model, mesh, 262144, -(-32 // ways) * ways)
        except ConfigError:
            continue
        assert not smaller.fits(141.0), devices
    with pytest.raises(ConfigError, match="inferred"):
        smallest_fit(model, dataclasses.replace(template, fsdp=8), 32768, 64, "H200")
