"""`python -m experiments.bench.gpu_check --lower-only`: every device program lowered for CUDA on this machine,
at real shapes, from abstract arguments (nothing is allocated, no GPU needed), and the lowered StableHLO checked
for what must be in it, so that a lowering error or a silent fallback is found here rather than in the 15
minutes a device is lent.

Programs (PROGRAMS below): the `medium` training step with the MXFP8 MoE recipe, the RL learner step with router
replay, the sampler's prefill and decode steps, each Pallas kernel (grouped GEMM on Triton, its MXFP8 and NVFP4
block-scaled forms, the grouped weight gradient, the Mosaic GPU sm90 grouped GEMM, the fused permute + quantize), the
training and RL steps with moe_impl "grouped" / "auto" as on an H100, H200 or B200 (each kernel found by name in
the backward too), the cuDNN attention call through the
attention registry (MLA's head dims and GQA's grouped K/V), and context-parallel attention and the expert-parallel
training step on an 8-device mesh. Each has the markers its lowered text must contain: a kernel's custom call
(`__gpu$xla.gpu.triton`, `mosaic_gpu_v2`, `__cudnn$fmha...`) or the collectives of its shard_map.

What lowering proves and what it does not: JAX's CUDA lowering rules accept the program (shapes, dtypes,
layouts, Pallas block specs, the custom calls' configurations) and nothing fell back; whether XLA and Triton
compile it for a given sm_90 / sm_100 part, and how fast it runs, only a device shows (docs/gpu_check.md).

cuDNN: JAX asks the installed cuDNN for its version and the device for its compute capability while it traces
`dot_product_attention(implementation="cudnn")` (it picks the kernel's features from them), and refuses with "cuDNN
is not detected" where there is none. There is no public switch for a target; `pinned_cudnn` supplies the two
answers for the duration of the lowering (CUDNN_VERSION, COMPUTE_CAPABILITY: the GPU image's cuDNN 9 and Hopper),
so the lowering rule that emits the custom call runs unchanged.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

CUDNN_VERSION = 90800  # cuDNN 9.8, as in the CUDA 12 JAX wheels' requirement
COMPUTE_CAPABILITY = "9.0"  # Hopper (H100 / H200)
# the Pallas kernels' names in their Triton custom calls' backend config: which kernel, not just "some Triton"
MX_GEMM_MARKER = 'name = "grouped_matmul_mx"'  # kernels/pallas_grouped.py MX_KERNEL_NAME
NVFP4_GEMM_MARKER = 'name = "grouped_matmul_nvfp4"'  # kernels/pallas_grouped.py NVFP4_KERNEL_NAME
WGRAD_MARKER = 'name = "grouped_wgrad"'  # kernels/grouped_wgrad.py KERNEL_NAME
PERMUTE_MARKER = 'name = "permute_quantize_mx"'  # kernels/permute.py
CUSTOM_CALL = re.compile(r"custom_call @([^\s(]+)")
COLLECTIVE = re.compile(r"stablehlo\.(all_gather|all_reduce|reduce_scatter|all_to_all|collective_permute)")


@dataclass(frozen=True)
class Program:
    name: str
    build: Callable[[], tuple[Callable, tuple]]  # -> (jitted function, abstract arguments)
    expect: tuple[str, ...] = ()  # substrings the lowered text must contain
    devices: int = 1  # devices the program's mesh needs in this process
    cudnn: bool = False  # lower under pinned_cudnn
    device_kind: str = ""  # choose kernels (kernels.dispatch) as on this GPU; empty: as on this machine
    note: str = ""


@dataclass
class Lowered:
    name: str
    ok: bool
    seconds: float
    custom_calls: list[str] = field(default_factory=list)
    collectives: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    error: str | None = None
    chars: int = 0


@contextlib.contextmanager
def pinned_cudnn(version: int = CUDNN_VERSION, capability: str = COMPUTE_CAPABILITY):
    """JAX's cuDNN attention asks the runtime for the cuDNN version and the GPU's compute capability while it
    traces; answer both for a GPU-less lowering (see the module docstring)."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    target = tuple(int(x) for x in capability.split("."))
    saved = fa.check_cudnn_version, fa.check_compute_capability, fa.is_cuda_compute_capability_equal
    fa.check_cudnn_version = lambda: version
    fa.check_compute_capability = lambda c: target >= tuple(int(x) for x in c.split("."))
    fa.is_cuda_compute_capability_equal = lambda c: target == tuple(int(x) for x in c.split("."))
    try:
        yield
    finally:
        fa.check_cudnn_version, fa.check_compute_capability, fa.is_cuda_compute_capability_equal = saved


def _sds(shape, dtype):
    import jax

    return jax.ShapeDtypeStruct(shape, dtype)


# --- the programs ------------------------------------------------------------------------------------------

def _train_step(preset_name: str, recipe: str, batch: int, seq: int, mesh_sizes: dict | None = None,
                moe_impl: str | None = None):
    def build():
        import jax
        import jax.numpy as jnp
        import optax
        from flax import nnx

        from c2jax.models.config import preset
        from c2jax.models.transformer import init
        from c2jax.train.step import init_train_state, make_train_step

        cfg = preset(preset_name).replace(moe_quant=recipe, dtype="bfloat16", num_nextn_predict_layers=0)
        if moe_impl is not None:
            cfg = cfg.replace(moe_impl=moe_impl)
        tx = optax.adamw(1e-4)
        graphdef = nnx.eval_shape(lambda: init_train_state(init(cfg), tx))[0]
        abstract = jax.eval_shape(lambda: init_train_state(init(cfg), tx)[1])
        tokens = _sds((batch, seq + 1), jnp.int32)
        if mesh_sizes is None:
            return jax.jit(make_train_step(graphdef, tx)), (abstract, tokens)
        from c2jax.mesh import MeshConfig, activation_rules, make_mesh, param_rules, state_shardings

        mesh_cfg = MeshConfig(**mesh_sizes)
        mesh = make_mesh(mesh_cfg)
        shardings = state_shardings(abstract, mesh, param_rules(mesh_cfg))
        step = make_train_step(graphdef, tx, state_shardings=shardings, mesh=mesh, rules=activation_rules(mesh_cfg))
        abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
        return step, (abstract, tokens)

    return build


def _rl_step(preset_name: str, rows: int, seq: int):
    def build():
        import jax
        import jax.numpy as jnp
        from flax import nnx

        from c2jax.models.config import preset
        from c2jax.models.transformer import init
        from c2jax.rl.batch import RLBatch
        from c2jax.rl.config import RLConfig
        from c2jax.rl.learner import init_rl_state, make_optimizer, make_rl_step

        cfg = preset(preset_name).replace(dtype="bfloat16", num_nextn_predict_layers=0,
                                          router_replay_filter_ratio=0.5)
        rcfg = RLConfig()
        tx = make_optimizer(rcfg)
        graphdef = nnx.eval_shape(lambda: init_rl_state(init(cfg), tx, rcfg))[0]
        abstract = jax.eval_shape(lambda: init_rl_state(init(cfg), tx, rcfg)[1])
        i32, f32 = jnp.int32, jnp.float32
        batch = RLBatch(input_ids=_sds((rows, seq), i32), targets=_sds((rows, seq), i32),
                        loss_mask=_sds((rows, seq), jnp.bool_), positions=_sds((rows, seq), i32),
                        segment_ids=_sds((rows, seq), i32), sequence_ids=_sds((rows, seq), i32),
                        advantages=_sds((rows, seq), f32), behavior_logprobs=_sds((rows, seq), f32),
                        policy_versions=_sds((rows, seq), i32),
                        replay_ids=_sds((rows, seq, cfg.num_moe_layers, cfg.num_experts_per_tok), i32))
        return jax.jit(make_rl_step(graphdef, tx, rcfg)), (abstract, batch)

    return build


def _sampler_step(preset_name: str, slots: int, tokens: int, max_len: int, decode: bool, moe_impl: str | None = None):
    def build():
        import functools

        import jax
        import jax.numpy as jnp
        from flax import nnx

        from c2jax.models.config import preset
        from c2jax.models.inference.forward import extend, init_cache
        from c2jax.models.transformer import init

        cfg = preset(preset_name).replace(dtype="bfloat16", num_nextn_predict_layers=0)
        if moe_impl is not None:
            cfg = cfg.replace(moe_impl=moe_impl)
        graphdef = nnx.split(nnx.eval_shape(lambda: init(cfg)))[0]
        state = jax.eval_shape(lambda: nnx.split(init(cfg))[1])
        cache = jax.eval_shape(lambda: init_cache(cfg, slots, max_len))
        rows = slots if decode else 1
        fn = functools.partial(extend, cfg, graphdef, key_len=max_len, absorbed=decode)
        slot_idx = None if decode else _sds((rows,), jnp.int32)
        args = (state, cache, _sds((rows, tokens), jnp.int32), slot_idx, _sds((rows,), jnp.int32))
        return jax.jit(fn), args

    return build


def _grouped_gemm(kind: str, m: int = 4096, k: int = 1024, n: int = 2048, groups: int = 16):
    def build():
        import functools

        import jax
        import jax.numpy as jnp

        from c2jax.kernels import grouped_gemm, pallas_grouped

        sizes = _sds((groups,), jnp.int32)
        if kind == "pallas_triton":
            fn = functools.partial(pallas_grouped.grouped_matmul_pallas, interpret=False)
            return jax.jit(fn), (_sds((m, k), jnp.bfloat16), _sds((groups, k, n), jnp.bfloat16), sizes)
        if kind == "pallas_triton_mxfp8":
            fn = functools.partial(pallas_grouped.grouped_matmul_mx_pallas, interpret=False)
            e4m3, scale = jnp.float8_e4m3fn, jnp.float32
            return jax.jit(fn), (_sds((m, k), e4m3), _sds((m, k // 32), scale), _sds((groups, k, n), e4m3),
                                 _sds((groups, k // 32, n), scale), sizes)
        if kind == "pallas_triton_nvfp4":
            fn = functools.partial(pallas_grouped.grouped_matmul_nvfp4_pallas, interpret=False)
            f4, e4m3, f32 = jnp.float4_e2m1fn, jnp.float8_e4m3fn, jnp.float32
            return jax.jit(fn), (_sds((m, k), f4), _sds((m, k // 16), e4m3), _sds((m, 1), f32),
                                 _sds((groups, k, n), f4), _sds((groups, k // 16, n), e4m3), _sds((groups, 1, n), f32),
                                 sizes)
        if kind == "pallas_triton_wgrad":  # per group lhs^T dout: [M, K] x [M, N] -> [G, K, N]
            from c2jax.kernels import grouped_wgrad

            fn = functools.partial(grouped_wgrad.grouped_wgrad_pallas, interpret=False)
            return jax.jit(fn), (_sds((m, k), jnp.bfloat16), _sds((m, n), jnp.bfloat16), sizes)
        if kind == "mosaic_sm90":
            return jax.jit(grouped_gemm.grouped_matmul_mosaic_sm90), (
                _sds((m, k), jnp.bfloat16), _sds((groups, k, n), jnp.bfloat16), sizes)
        raise ValueError(kind)

    return build


def _permute_quantize(rows: int = 8192, d: int = 1024):
    def build():
        import functools

        import jax
        import jax.numpy as jnp

        from c2jax.kernels import permute

        fn = functools.partial(permute.permute_quantize_mx_pallas, interpret=False)
        return jax.jit(fn), (_sds((rows // 2, d), jnp.bfloat16), _sds((rows,), jnp.int32))

    return build


def _cudnn_attention(preset_name: str, batch: int, seq: int):
    def build():
        import jax
        import jax.numpy as jnp

        from c2jax.models.attention_backends import attention
        from c2jax.models.config import preset

        cfg = preset(preset_name)
        heads, kv_heads = cfg.num_attention_heads, (cfg.kv_heads if cfg.attention_type == "gqa" else
                                                    cfg.num_attention_heads)
        q = _sds((batch, seq, heads, cfg.qk_head_dim), jnp.bfloat16)
        k = _sds((batch, seq, kv_heads, cfg.qk_head_dim), jnp.bfloat16)
        v = _sds((batch, seq, kv_heads, cfg.value_head_dim), jnp.bfloat16)
        fn = jax.jit(lambda q, k, v: attention(q, k, v, scale=cfg.softmax_scale, backend="cudnn",
                                               platform="gpu"))
        return fn, (q, k, v)

    return build


def _context_parallel_attention(preset_name: str, cp: int, seq: int):
    def build():
        import jax
        import jax.numpy as jnp
        from flax import nnx

        from c2jax.mesh import MeshConfig, activation_rules, make_mesh
        from c2jax.models.attention import make_attention
        from c2jax.models.config import preset
        from c2jax.models.context_parallel import ContextParallelMask, balanced_order
        from c2jax.models.logical import logical_rules
        from c2jax.models.rope import rope_tables

        cfg = preset(preset_name).replace(dtype="bfloat16")
        attn = nnx.eval_shape(lambda: make_attention(cfg, nnx.Rngs(params=0)))
        graphdef, state = nnx.split(attn)
        mesh_cfg = MeshConfig(data=8 // cp, context=cp)
        mesh = make_mesh(mesh_cfg)
        order = balanced_order(seq, cp)
        batch = 8 // cp

        def run(state, x, segments):
            positions = jnp.broadcast_to(jnp.asarray(order), (batch, seq))
            cos, sin = rope_tables(cfg, positions)
            with logical_rules(mesh, activation_rules(mesh_cfg)):
                return nnx.merge(graphdef, state)(x, cos, sin, ContextParallelMask(segments, jnp.asarray(order)))

        return jax.jit(run), (state, _sds((batch, seq, cfg.hidden_size), jnp.bfloat16),
                              _sds((batch, seq), jnp.int32))

    return build


PROGRAMS: tuple[Program, ...] = (
    Program("kernel/grouped_gemm/pallas_triton", _grouped_gemm("pallas_triton"), ("__gpu$xla.gpu.triton",)),
    Program("kernel/grouped_gemm/pallas_triton_mxfp8", _grouped_gemm("pallas_triton_mxfp8"),
            ("__gpu$xla.gpu.triton",)),
    Program("kernel/grouped_gemm/pallas_triton_nvfp4", _grouped_gemm("pallas_triton_nvfp4"),
            ("__gpu$xla.gpu.triton", NVFP4_GEMM_MARKER)),
    Program("kernel/grouped_wgrad/pallas_triton", _grouped_gemm("pallas_triton_wgrad"),
            ("__gpu$xla.gpu.triton", WGRAD_MARKER)),
    Program("kernel/grouped_gemm/mosaic_sm90", _grouped_gemm("mosaic_sm90"), ("mosaic_gpu_v2",)),
    Program("kernel/permute_quantize_mx/pallas_triton", _permute_quantize(), ("__gpu$xla.gpu.triton",)),
    Program("attention/cudnn/mla(medium)", _cudnn_attention("medium", 2, 4096), ("__cudnn$fmha",), cudnn=True),
    Program("attention/cudnn/gqa(small-qwen3-moe)", _cudnn_attention("small-qwen3-moe", 2, 4096), ("__cudnn$fmha",),
            cudnn=True),
    Program("attention/context_parallel/cp8(medium)", _context_parallel_attention("medium", 8, 8192),
            ("stablehlo.all_gather",), devices=8),
    Program("attention/context_parallel/cp4(small-qwen3-moe)", _context_parallel_attention("small-qwen3-moe", 4, 8192),
            ("stablehlo.all_gather",), devices=8),
    Program("train_step/medium/mxfp8", _train_step("medium", "mxfp8", 8, 4096)),
    Program("train_step/medium/mxfp8 fsdp2 x expert4", _train_step("medium", "mxfp8", 8, 4096,
                                                                   dict(fsdp=2, expert=4)),
            ("stablehlo.all_gather", "stablehlo.reduce_scatter"), devices=8),
    # the MoE's grouped GEMMs through the kernel registry, chosen as on each GPU (forward and the dlhs backward)
    Program("train_step/medium/moe grouped (H100: mosaic_sm90)", _train_step("medium", "bf16", 8, 4096,
                                                                         moe_impl="grouped"),
            ("mosaic_gpu_v2", WGRAD_MARKER), device_kind="NVIDIA H100 80GB HBM3"),
    Program("train_step/medium/moe grouped (B200: pallas_triton)", _train_step("medium", "bf16", 8, 4096,
                                                                           moe_impl="grouped"),
            ("__gpu$xla.gpu.triton", WGRAD_MARKER), device_kind="NVIDIA B200"),
    # the MXFP8 recipe on the grouped path (kernels/grouped_qlinear.py): the fused permute + quantize and the
    # block-scaled grouped GEMM (forward and dgrad), each found by its Pallas kernel's name in the Triton call
    Program("train_step/medium/moe grouped mxfp8 (H100: pallas_triton)", _train_step("medium", "mxfp8", 8, 4096,
                                                                                 moe_impl="grouped"),
            ("__gpu$xla.gpu.triton", MX_GEMM_MARKER, PERMUTE_MARKER, WGRAD_MARKER),
            device_kind="NVIDIA H100 80GB HBM3"),
    # Composer 2's recipe on the grouped path: the NVFP4 forward GEMM, the MXFP8 dgrad GEMM, the wgrad kernel
    Program("train_step/medium/moe grouped nvfp4 per-token (B200: pallas_triton)",
            _train_step("medium", "nvfp4_per_token_fwd+mxfp8_bwd", 8, 4096, moe_impl="grouped"),
            ("__gpu$xla.gpu.triton", NVFP4_GEMM_MARKER, MX_GEMM_MARKER, WGRAD_MARKER), device_kind="NVIDIA B200"),
    Program("sampler/prefill/medium/moe grouped (H200)", _sampler_step("medium", 16, 2048, 4096, decode=False,
                                                                       moe_impl="grouped"),
            ("mosaic_gpu_v2",), device_kind="NVIDIA H200"),
    # moe_impl="auto" (the default) as on an H100: the grouped path, the Mosaic GPU kernel in each expert-parallel
    # rank's shard_map (models/expert_parallel.py) and in the RL learner's step (router replay; the sorted form of
    # the RL step is the one a CPU lowers, `moe_impl="sorted"` on a GPU: the same step minus the kernel)
    Program("train_step/medium/auto fsdp2 x expert4 (H100: grouped mosaic_sm90)",
            _train_step("medium", "bf16", 8, 4096, dict(fsdp=2, expert=4)),
            ("mosaic_gpu_v2", "stablehlo.all_gather", "stablehlo.reduce_scatter"), devices=8,
            device_kind="NVIDIA H100 80GB HBM3"),
    Program("rl_step/medium/router_replay auto (H100: grouped mosaic_sm90)", _rl_step("medium", 4, 4096),
            ("mosaic_gpu_v2",), device_kind="NVIDIA H100 80GB HBM3"),
    Program("sampler/prefill/medium", _sampler_step("medium", 16, 2048, 4096, decode=False)),
    Program("sampler/decode/medium", _sampler_step("medium", 16, 1, 4096, decode=True)),
    # the default moe_impl="auto" at decode sizes (16 slots x top-4 = 64 expert rows) as on an H100
    Program("sampler/decode/medium auto (H100: grouped mosaic_sm90)", _sampler_step("medium", 16, 1, 4096, decode=True),
            ("mosaic_gpu_v2",), device_kind="NVIDIA H100 80GB HBM3"),
)


def lower_one(program: Program, platform: str = "cuda") -> Lowered:
    """Lower `program` for `platform` and check its markers."""
    import jax

    start = time.perf_counter()
    try:
        if program.devices > len(jax.devices()):
            raise RuntimeError(f"needs {program.devices} devices, this process has {len(jax.devices())} (on CPU: "
                               f"XLA_FLAGS=--xla_force_host_platform_device_count={program.devices})")
        from c2jax.kernels import dispatch

        with contextlib.ExitStack() as stack:
            if program.cudnn:
                stack.enter_context(pinned_cudnn())
            if program.device_kind:
                stack.enter_context(dispatch.target("gpu", program.device_kind))
            fn, args = program.build()
            text = fn.trace(*args).lower(lowering_platforms=(platform,)).as_text()
    except Exception as e:  # a lowering error is this check's finding, not a crash of the check
        return Lowered(program.name, False, time.perf_counter() - start, error=f"{type(e).__name__}: {e}"[:2000])
    calls = sorted(set(CUSTOM_CALL.findall(text)))
    collectives = sorted(set(COLLECTIVE.findall(text)))
    missing = [m for m in program.expect if m not in text]
    return Lowered(program.name, not missing, time.perf_counter() - start, calls, collectives, missing,
                   chars=len(text))


def run(programs: tuple[Program, ...] = PROGRAMS, names: list[str] | None = None) -> list[Lowered]:
    chosen = [p for p in programs if not names or any(n in p.name for n in names)]
    results = []
    for program in chosen:
        result = lower_one(program)
        mark = "ok  " if result.ok else "FAIL"
        detail = result.error or (f"missing {result.missing}" if result.missing else
                                  f"custom calls {result.custom_calls or '-'}; collectives {result.collectives or '-'}")
        print(f"{mark} {program.name:<48} {result.seconds:6.1f} s  {detail}", flush=True)
        results.append(result)
    return results


def main(out: str | Path | None, names: list[str] | None = None) -> int:
    """Lower every program (or those whose name contains one of `names`); write lowering.json to `out`; 0 iff
    all lowered with their markers."""
    import dataclasses

    import jax

    from c2jax.machine import describe

    print(f"gpu_check --lower-only: JAX {jax.__version__}, lowering for cuda on {jax.default_backend()} "
          f"({len(jax.devices())} devices); cuDNN pinned at {CUDNN_VERSION}, sm {COMPUTE_CAPABILITY}", flush=True)
    from experiments.bench.gpu_check import triton_ptx

    results = run(names=names)
    ptx = triton_ptx.run() if not names else {"skipped": "--programs given"}
    triton_ptx.print_rows(ptx)
    report = {"jax": jax.__version__, "platform": "cuda", "cudnn_pinned": CUDNN_VERSION,
              "compute_capability_pinned": COMPUTE_CAPABILITY, "machine": describe(),
              "programs": [dataclasses.asdict(r) for r in results], "triton_ptx": ptx}
    if out is not None:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "lowering.json").write_text(json.dumps(report, indent=1))
    kernels = ptx.get("kernels", [])
    failed = [r.name for r in results if not r.ok] + [r["name"] for r in kernels if not r["ok"]]
    print(f"{len(results) + len(kernels) - len(failed)}/{len(results) + len(kernels)} programs lowered with their "
          f"markers ({len(kernels)} Triton -> PTX)" + (f"; FAILED: {failed}" if failed else ""))
    return 1 if failed else 0


def cli(argv=None) -> int:
    """python -m experiments.bench.gpu_check.lowering [--out DIR] [--programs a,b]: what `gpu_check --lower-only`
    runs, in a process of its own with JAX on the CPU and 8 host devices (set before JAX starts)."""
    import argparse
    import os

    p = argparse.ArgumentParser(prog="python -m experiments.bench.gpu_check --lower-only", description=cli.__doc__)
    p.add_argument("--out", default=None)
    p.add_argument("--programs", default="", help="comma-separated substrings of program names (default: all)")
    args = p.parse_args(argv)
    os.environ["JAX_PLATFORMS"] = "cpu"
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
    return main(args.out, [n for n in args.programs.split(",") if n] or None)


if __name__ == "__main__":
    raise SystemExit(cli())
