"""The GPU check's sections. Each runs in its own process (runner.py) as `run_worker(name, ...)`: it records
figures through a `Context`, which rewrites the section's result file after every sub-measurement, so a
section killed at its deadline still reports what it measured.

Every section has two sizes, GPU and dry run (`SIZES`); the dry run takes the same code path at tiny shapes on
the CPU, with the Pallas kernels in interpret mode, and skips (with the reason) only what cannot run on a CPU:
the cuDNN attention backend, the Mosaic GPU (Hopper) and jax-triton grouped GEMMs, FP8 hardware matmuls.

Peak: the H200's dense bf16 matmul rate as measured on this machine kind (an 8192^3 bf16 product through
PyTorch ran at 769-798 TFLOP/s on random data; /work/.library/device KINDS.md), 790 TFLOP/s; the `env`
section measures it again through XLA and reports both. On the CPU (dry run) percentages are against a
float32 matmul measured there and mean nothing.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
import traceback
from collections.abc import Callable
from pathlib import Path

PEAK_BF16_FLOPS = 790e12  # H200, dense bf16, measured on this machine kind (module docstring)
PEAK_NOTE = "790 TFLOP/s: H200 dense bf16 measured on this machine kind (device KINDS.md)"
TAIL_LINES = 25
# Dry run: the same model code with less to compile (one MoE layer, two capacity buckets instead of four).
DRY_MODEL = {"num_hidden_layers": 1, "first_k_dense_replace": 0, "moe_capacity_factors": (2.0,)}


class Skip(Exception):  # noqa: N818 - control flow, not an error
    """A sub-measurement that cannot run here; the message is the reason (recorded as 'skipped: ...')."""


# ------------------------------------------------------------------------------------------------ context


class Context:
    def __init__(self, name: str, path: Path, dry_run: bool, deadline_s: float | None):
        self.name, self.path, self.dry_run = name, path, dry_run
        self.start = time.monotonic()
        self.deadline = self.start + (deadline_s if deadline_s else 3600.0)
        self.record = {"status": "running", "results": {}, "checks": [], "targets": [], "headline": [],
                       "errors": [], "sub_seconds": {}}
        self._gpu = None
        self.flush()

    # the device ---------------------------------------------------------------------------------------
    @property
    def gpu(self) -> bool:
        if self._gpu is None:
            import jax

            self._gpu = jax.default_backend() == "gpu"
        return self._gpu

    def size(self, gpu, dry):
        return dry if self.dry_run else gpu

    def needs_gpu(self, what: str) -> None:
        if not self.gpu:
            raise Skip(f"needs GPU ({what})")

    # recording ----------------------------------------------------------------------------------------
    def left(self) -> float:
        return self.deadline - time.monotonic()

    def flush(self) -> None:
        self.record["cpu_s"] = round(time.process_time(), 1)  # this process's CPU seconds, every thread
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.record, default=_jsonable))
        os.replace(tmp, self.path)

    def set(self, key: str, value) -> None:
        node = self.record["results"]
        *parents, last = key.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
        self.flush()

    def check(self, name: str, passed: bool, detail: str = "") -> bool:
        self.record["checks"].append({"name": name, "passed": bool(passed), "detail": detail})
        self.flush()
        return bool(passed)

    def target(self, name: str, value: float | None, threshold: float, unit: str = "") -> None:
        met = None if value is None else bool(value >= threshold)
        shown = None if value is None else f"{value:.3g}{unit} (target >= {threshold:g}{unit})"
        self.record["targets"].append({"name": name, "value": shown, "met": met})
        self.flush()

    def headline(self, text: str) -> None:
        self.record["headline"].append(text)
        self.flush()

    def sub(self, key: str, fn: Callable[[], object], need_s: float = 0.0):
        """Run one sub-measurement: its value is recorded under `key`; Skip and exceptions are recorded there
        too (the section goes on); it is not started with less than `need_s` seconds to the deadline."""
        if self.left() < need_s:
            left = max(self.left(), 0)
            self.set(key, f"skipped: {left:.0f} s left before the section's deadline, needs ~{need_s:.0f}")
            return None
        self.record["current"] = key
        self.flush()
        start = time.monotonic()
        try:
            value = fn()
        except Skip as e:
            self.set(key, f"skipped: {e}")
            return None
        except Exception as e:  # noqa: BLE001 - recorded, the section goes on
            self.record["errors"].append(key)
            self.set(key, {"error": f"{type(e).__name__}: {str(e)[:500]}", "traceback": _tail(traceback.format_exc())})
            return None
        finally:
            self.record.pop("current", None)
            self.record["sub_seconds"][key] = round(time.monotonic() - start, 2)
        if value is not None:
            self.set(key, value)
        return value


def _timed_steps(step, state, batch, repeats: int):
    """Run `state, metrics = step(state, batch)` once (compile or warm-up) and `repeats` more times, each to
    completion: (state, metrics, first call's seconds, the repeats' seconds)."""
    import jax

    t0 = time.perf_counter()
    state, metrics = step(state, batch)
    jax.block_until_ready(metrics["loss"])
    first_s = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - t0)
    return state, metrics, first_s, times

def _jsonable(v):
    try:
        import numpy as np

        if isinstance(v, np.generic):
            return v.item()
        if isinstance(v, np.ndarray):
            return v.tolist()
    except ImportError:
        pass
    return str(v)


def _tail(text: str, lines: int = TAIL_LINES) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


# ------------------------------------------------------------------------------------------------ helpers


def timed(fn, *args, repeats: int = 5) -> float:
    """Median wall seconds of a call (compiled and warmed first); experiments/bench/moe_kernels.py's helper."""
    from experiments.bench.moe_kernels import timed as _timed

    return _timed(fn, *args, repeats=repeats)


def best_time(fn, *args, repeats: int = 5) -> float:
    import jax

    jax.block_until_ready(fn(*args))
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t)
    return best


def rel_err(a, b) -> float:
    """||a - b|| / ||b|| in float64 (0 when both are zero)."""
    import numpy as np

    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    den = np.linalg.norm(b)
    num = np.linalg.norm(a - b)
    return float(num / den) if den else float(num)


def tree_rel_err(a, b) -> tuple[float, float]:
    """(global relative L2 error over every leaf, worst leaf's relative error)."""
    import jax
    import numpy as np

    la = [np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(a)]
    lb = [np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(b)]
    worst = max((rel_err(x, y) for x, y in zip(la, lb)), default=0.0)
    return rel_err(np.concatenate(la), np.concatenate(lb)), worst


def peak_flops(ctx: Context) -> tuple[float, str]:
    if ctx.gpu:
        return PEAK_BF16_FLOPS, PEAK_NOTE
    from experiments.bench.model_throughput import matmul_peak_flops

    peak = matmul_peak_flops(n=256, repeats=3)
    return peak, f"{peak / 1e9:.1f} GFLOP/s: float32 256^3 matmul measured here (dry run, CPU)"


def copy_bandwidth(nbytes: int) -> float:
    """Bytes moved per second (read + write) by x + 1 over an nbytes bf16 array, best of 10."""
    import jax
    import jax.numpy as jnp

    x = jnp.zeros((nbytes // 2,), jnp.bfloat16)
    f = jax.jit(lambda a: a + 1)
    t = best_time(f, x, repeats=10)
    return 2 * nbytes / t


def _device_info() -> dict:
    import jax

    d = jax.devices()[0]
    return {"backend": jax.default_backend(), "device_kind": getattr(d, "device_kind", ""),
            "device_count": jax.device_count()}


# ------------------------------------------------------------------------------------------------ sections


def section_env(ctx: Context) -> None:
    import platform
    import subprocess

    import jax
    import jaxlib
    import numpy as np

    ctx.set("backend", jax.default_backend())
    d = jax.devices()[0]
    ctx.set("device_kind", getattr(d, "device_kind", ""))
    ctx.set("device_count", jax.device_count())
    ctx.set("jax", jax.__version__)
    ctx.set("jaxlib", getattr(jaxlib, "__version__", "?"))
    ctx.set("python", platform.python_version())
    ctx.set("numpy", np.__version__)
    ctx.set("env_vars", {k: os.environ[k] for k in ("JAX_PLATFORMS", "XLA_FLAGS", "XLA_PYTHON_CLIENT_PREALLOCATE",
                                                     "XLA_PYTHON_CLIENT_MEM_FRACTION", "CUDA_VISIBLE_DEVICES")
                         if k in os.environ})
    for mod in ("flax", "optax", "chex", "orbax.checkpoint", "triton", "jax_triton"):
        try:
            m = __import__(mod, fromlist=["__version__"])
            ctx.set(f"packages/{mod}", getattr(m, "__version__", "installed"))
        except Exception as e:  # noqa: BLE001
            ctx.set(f"packages/{mod}", f"not importable: {type(e).__name__}: {str(e)[:120]}")

    def cuda_versions():
        try:
            from jax._src.lib import cuda_versions as cv  # private; present in jax 0.10 and 0.11
        except ImportError as e:
            raise Skip(f"jax._src.lib.cuda_versions not importable: {e}") from None
        if cv is None:
            raise Skip("no CUDA plugin (CPU jaxlib)")
        out = {}
        for name in sorted(dir(cv)):
            if name.endswith("_get_version") and callable(getattr(cv, name)):
                try:
                    out[name.removesuffix("_get_version")] = getattr(cv, name)()
                except Exception as e:  # noqa: BLE001
                    out[name.removesuffix("_get_version")] = f"{type(e).__name__}: {e}"[:100]
        return out

    ctx.sub("cuda_versions", cuda_versions)

    def nvidia_smi():
        ctx.needs_gpu("nvidia-smi")
        q = "name,driver_version,memory.total,clocks.max.sm,clocks.max.mem,power.limit"
        out = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20)
        return out.stdout.strip() or out.stderr.strip()[:300]

    ctx.sub("nvidia_smi", nvidia_smi)
    try:
        print(jax.print_environment_info(return_string=True), flush=True)  # into gpu_check.log
    except Exception as e:  # noqa: BLE001
        print(f"jax.print_environment_info failed: {e}", flush=True)

    def matmul_peak():
        import jax.numpy as jnp

        n = 8192 if ctx.gpu else 256  # by the device, not the mode: a run without a GPU only reports it
        key = jax.random.key(0)
        a = jax.random.normal(key, (n, n), jnp.bfloat16)
        b = jax.random.normal(jax.random.fold_in(key, 1), (n, n), jnp.bfloat16)
        t = best_time(jax.jit(lambda x, y: x @ y), a, b, repeats=10)
        tflops = 2 * n**3 / t / 1e12
        return {"n": n, "ms": 1e3 * t, "tflops": tflops, "pct_of_790": 100 * tflops / 790}

    mm = ctx.sub("bf16_matmul", matmul_peak, need_s=5)
    bw = ctx.sub("copy_GBps", lambda: copy_bandwidth((2 << 30) if ctx.gpu else (8 << 20)) / 1e9, need_s=3)
    if mm:
        ctx.headline(f"bf16 {mm['n']}^3 matmul {mm['tflops']:.3g} TFLOP/s")
    if bw:
        ctx.headline(f"copy {bw:.0f} GB/s")
    from c2jax.machine import describe

    ctx.set("host", describe())


def section_model(ctx: Context) -> None:
    """Tiny model: loss, logits and every parameter gradient on the default device against the CPU, with the
    same experts replayed everywhere (router replay; routing is discontinuous: a near-tie flipping between
    devices would otherwise dominate the error and say nothing about the kernels)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from c2jax.models.config import preset
    from c2jax.models.transformer import init

    cpu = jax.devices("cpu")[0]
    dev = jax.devices()[0]
    batch, seq = ctx.size((2, 256), (1, 32))
    # head dims multiples of 8 (q.k 32, v 16): what cuDNN attention accepts, so bf16 on a GPU runs it
    base = preset("tiny").replace(num_nextn_predict_layers=0, qk_nope_head_dim=24, qk_rope_head_dim=8,
                                  v_head_dim=16, **ctx.size({}, DRY_MODEL))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, base.vocab_size, (batch, seq + 1)).astype(np.int32)
    ids, targets = tokens[:, :-1], tokens[:, 1:]
    ctx.set("shape", {"batch": batch, "seq": seq, "preset": "tiny, head dims q.k 32 / v 16", "device": str(dev),
                      "reference": str(cpu), "attention": "device default (GPU: cuDNN for bf16, blockwise for "
                                                          "fp32); CPU: auto (dense at these S)"})

    cache = {}

    def fns(cfg):
        if cfg in cache:  # one jitted function per config: jit caches its compilations per device
            return cache[cfg]
        graphdef, params, rest = nnx.split(init(cfg, seed=0), nnx.Param, ...)

        def loss(params, rest, ids, targets, replay):
            m = nnx.merge(graphdef, params, rest)
            out = m(ids, replay_ids=replay, return_mtp=False)
            return jnp.mean(m.token_losses(out.hidden, targets)), (out.logits, out.expert_ids)

        cache[cfg] = jax.jit(jax.value_and_grad(loss, has_aux=True)), params, rest
        return cache[cfg]

    def run(cfg, device, precision, replay):
        f, params, rest = fns(cfg)
        args = jax.device_put((params, rest, jnp.asarray(ids), jnp.asarray(targets), replay), device)
        with jax.default_matmul_precision(precision):
            (loss, (logits, experts)), grads = f(*args)
        grads = jax.tree.map(lambda g: np.asarray(g, np.float32), grads)
        return float(loss), np.asarray(logits, np.float32), np.asarray(experts), grads

    ref_cfg = base.replace(dtype="float32")
    # replayed experts: k distinct random experts per token and MoE layer (router replay takes them as given)
    k, e, layers = base.num_experts_per_tok, base.n_routed_experts, base.num_moe_layers
    replay = jnp.asarray(np.argsort(rng.random((layers, batch, seq, e)), axis=-1)[..., :k].astype(np.int32))
    ref = run(ref_cfg, cpu, "highest", replay)
    variants = {  # name: (cfg, precision, tolerance or None for "no worse than the CPU at the same dtype")
        "fp32_highest": (ref_cfg, "highest", 1e-4),
        "fp32_default_precision": (ref_cfg, "default", 2e-2),
        "bf16": (base.replace(dtype="bfloat16"), "default", None),
        "bf16_moe_mxfp8": (base.replace(dtype="bfloat16", moe_quant="mxfp8"), "default", None),
    }
    for name, (cfg, precision, tol) in variants.items():
        def one(cfg=cfg, precision=precision, tol=tol, name=name):
            if name == "fp32_default_precision" and not ctx.gpu:
                raise Skip("needs GPU (on the CPU default fp32 precision is full fp32: fp32_highest covers it)")
            if name == "bf16_moe_mxfp8" and ctx.dry_run:
                raise Skip("dry run: the bf16 variant's code with moe_quant='mxfp8', left out to keep the dry run "
                           "short (the recipe runs on the CPU in tests/test_moe.py and tests/test_kernels.py)")
            d = run(cfg, dev, precision, replay)
            # the CPU's default fp32 precision is full fp32: its run would be the reference again
            c = ref if name == "fp32_default_precision" else run(cfg, cpu, precision, replay)
            row = {"loss_device": d[0], "loss_cpu": c[0],
                   "logits_err_vs_cpu_same_dtype": rel_err(d[1], c[1]),
                   "grads_err_vs_cpu_same_dtype": tree_rel_err(d[3], c[3])[0],
                   "logits_err_vs_fp32_ref": rel_err(d[1], ref[1]),
                   "grads_err_vs_fp32_ref": tree_rel_err(d[3], ref[3])[0],
                   "cpu_logits_err_vs_fp32_ref": rel_err(c[1], ref[1]),
                   "cpu_grads_err_vs_fp32_ref": tree_rel_err(c[3], ref[3])[0]}
            finite = bool(np.isfinite(d[1]).all() and all(np.isfinite(g).all() for g in jax.tree.leaves(d[3])))
            if tol is not None:
                ok = finite and row["logits_err_vs_cpu_same_dtype"] <= tol and row["grads_err_vs_cpu_same_dtype"] <= tol
                detail = (f"rel L2 vs CPU: logits {row['logits_err_vs_cpu_same_dtype']:.2e}, grads "
                          f"{row['grads_err_vs_cpu_same_dtype']:.2e} (tol {tol:g})")
            else:  # low precision: the device may differ from the CPU, but must be no further from fp32
                # 3x + 2e-3: room for a GPU kernel keeping more in bf16 (cuDNN's P.V); a real bug is O(1)
                lim_l = 3 * row["cpu_logits_err_vs_fp32_ref"] + 2e-3
                lim_g = 3 * row["cpu_grads_err_vs_fp32_ref"] + 2e-3
                ok = finite and row["logits_err_vs_fp32_ref"] <= lim_l and row["grads_err_vs_fp32_ref"] <= lim_g
                detail = (f"rel L2 vs fp32 reference: logits {row['logits_err_vs_fp32_ref']:.2e} (<= {lim_l:.2e}: "
                          f"3x the CPU's + 2e-3), grads {row['grads_err_vs_fp32_ref']:.2e} (<= {lim_g:.2e})")
            ctx.check(f"model {name} fwd+grad on {dev.platform}", ok, detail)
            return row

        ctx.sub(name, one, need_s=ctx.size(8, 2))

    def ep_ragged_a2a():
        ctx.needs_gpu("XLA:CPU does not implement ragged-all-to-all; the path is lowered in tests/test_parallel.py")
        if jax.device_count() < 2:
            raise Skip(f"needs >= 2 devices for an expert-parallel mesh, this has {jax.device_count()} "
                       "(its lowering is checked in tests/test_parallel.py)")
        from c2jax.config import MeshConfig
        from c2jax.mesh import activation_rules, make_mesh, shard_state
        from c2jax.models.logical import logical_rules
        from c2jax.models.transformer import forward

        experts = 2 if jax.device_count() < 4 else 4
        out = {}
        for impl in ("allgather", "ragged_a2a"):
            cfg = ref_cfg.replace(moe_ep_impl=impl)
            graphdef, state = nnx.split(init(cfg, seed=0))
            mesh_cfg = MeshConfig(expert=experts, fsdp=-1)
            mesh = make_mesh(mesh_cfg)

            def loss(state, ids, graphdef=graphdef, mesh=mesh, mesh_cfg=mesh_cfg):
                with logical_rules(mesh, activation_rules(mesh_cfg)):
                    return jnp.mean(forward(graphdef, state, ids).logits ** 2)

            with jax.default_matmul_precision("highest"):
                out[impl] = float(jax.jit(loss)(shard_state(state, mesh), jnp.asarray(ids)))
        ctx.check("model EP ragged_a2a loss == allgather loss", abs(out["ragged_a2a"] - out["allgather"])
                  <= 1e-4 * abs(out["allgather"]) + 1e-6, str(out))
        return out

    ctx.sub("ep_ragged_a2a", ep_ragged_a2a, need_s=ctx.size(10, 2))
    bf = ctx.record["results"].get("bf16")
    if isinstance(bf, dict):
        ctx.headline(f"bf16 grads rel err {bf['grads_err_vs_fp32_ref']:.1e} "
                     f"(CPU {bf['cpu_grads_err_vs_fp32_ref']:.1e})")


def section_attention(ctx: Context) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from c2jax.models import attention_backends as ab

    b, s, h, dqk, dv = ctx.size((2, 1024, 8, 192, 128), (1, 128, 2, 48, 32))
    scale = dqk ** -0.5
    key = jax.random.key(0)
    kq, kk, kv, kc = jax.random.split(key, 4)
    # inputs exactly representable in bf16: one fp32 oracle serves the fp32 and the bf16 runs
    q32, k32, v32 = (jax.random.normal(kx, shape, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32)
                     for kx, shape in ((kq, (b, s, h, dqk)), (kk, (b, s, h, dqk)), (kv, (b, s, h, dv))))
    ct = jax.random.normal(kc, (b, s, h, dv), jnp.float32)
    seg = jnp.asarray(np.repeat(np.arange(4), s // 4)[None].repeat(b, 0), jnp.int32)  # 4 packed documents
    ctx.set("equality_shape", {"B": b, "S": s, "H": h, "Dqk": dqk, "Dv": dv})

    def fwd_bwd(fn, q, k, v, **kw):
        def loss(q, k, v):
            return jnp.sum(fn(q, k, v, scale=scale, **kw).astype(jnp.float32) * ct)

        out = fn(q, k, v, scale=scale, **kw)
        grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
        return out, grads

    oracle = {}
    with jax.default_matmul_precision("highest"):
        for case, kw in (("causal", {}), ("packed", {"q_segment_ids": seg, "kv_segment_ids": seg})):
            oracle[case] = jax.jit(lambda q, k, v, kw=kw: fwd_bwd(ab.get("dense").fn, q, k, v, **kw))(q32, k32, v32)

    for backend in ("blockwise", "cudnn"):
        for dtype in ("float32", "bfloat16"):
            for case, kw in (("causal", {}), ("packed", {"q_segment_ids": seg, "kv_segment_ids": seg})):
                def one(backend=backend, dtype=dtype, case=case, kw=kw):
                    if backend == "cudnn":
                        ctx.needs_gpu("cuDNN flash attention")
                    dt = jnp.dtype(dtype)
                    q, k, v = (x.astype(dt) for x in (q32, k32, v32))
                    fn = ab.get(backend).fn
                    try:
                        with jax.default_matmul_precision("highest" if dtype == "float32" else "default"):
                            out, grads = jax.jit(lambda q, k, v: fwd_bwd(fn, q, k, v, **kw))(q, k, v)
                    except NotImplementedError as e:  # the backend refuses: attention() would run blockwise
                        return f"refused (falls through to blockwise): {str(e)[:160]}"
                    ref_out, ref_grads = oracle[case]  # on the same values (bf16-representable inputs)
                    errs = {"out": rel_err(out, ref_out), "dq": rel_err(grads[0], ref_grads[0]),
                            "dk": rel_err(grads[1], ref_grads[1]), "dv": rel_err(grads[2], ref_grads[2])}
                    tol = 1e-4 if dtype == "float32" else 2e-2
                    worst = max(errs.values())
                    ctx.check(f"attention {backend} {dtype} {case} == dense oracle",
                              worst <= tol and np.isfinite(worst),
                              f"worst rel L2 {worst:.2e} (tol {tol:g})")
                    return errs

                ctx.sub(f"equality/{backend}/{dtype}/{case}", one, need_s=ctx.size(3, 1))

    bt, ht, dqkt, dvt = 1, 16, 192, 128
    seqs = ctx.size((8192, 32768), (256,))
    peak, note = peak_flops(ctx)
    ctx.set("throughput_shape", {"B": bt, "H": ht, "Dqk": dqkt, "Dv": dvt, "dtype": "bfloat16", "peak": note,
                                 "flops": "fwd 2 * S(S+1)/2 * H * (Dqk + Dv) (causal), fwd+bwd 3.5x fwd"})
    for s_t in seqs:
        for backend in ("cudnn", "blockwise"):
            def speed(backend=backend, s_t=s_t):
                if backend == "cudnn":
                    ctx.needs_gpu("cuDNN flash attention")
                kk_ = jax.random.split(jax.random.key(s_t), 4)
                q = jax.random.normal(kk_[0], (bt, s_t, ht, dqkt), jnp.bfloat16)
                k = jax.random.normal(kk_[1], (bt, s_t, ht, dqkt), jnp.bfloat16)
                v = jax.random.normal(kk_[2], (bt, s_t, ht, dvt), jnp.bfloat16)
                cot = jax.random.normal(kk_[3], (bt, s_t, ht, dvt), jnp.bfloat16)
                fn = ab.get(backend).fn

                def loss(q, k, v):
                    return jnp.sum(fn(q, k, v, scale=dqkt ** -0.5).astype(jnp.float32) * cot)

                step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
                fwd = jax.jit(lambda q, k, v: fn(q, k, v, scale=dqkt ** -0.5))
                try:
                    t = timed(step, q, k, v, repeats=ctx.size(5, 2))
                    tf = timed(fwd, q, k, v, repeats=ctx.size(5, 2))
                except NotImplementedError as e:
                    return f"refused: {str(e)[:160]}"
                flops_fwd = 2 * (s_t * (s_t + 1) / 2) * ht * (dqkt + dvt) * bt
                return {"fwd_bwd_ms": 1e3 * t, "tokens_per_s": bt * s_t / t, "tflops": 3.5 * flops_fwd / t / 1e12,
                        "pct_peak": 100 * 3.5 * flops_fwd / t / peak, "fwd_ms": 1e3 * tf,
                        "fwd_tflops": flops_fwd / tf / 1e12}

            r = ctx.sub(f"throughput/S{s_t}/{backend}", speed, need_s=ctx.size(8, 1))
            if isinstance(r, dict) and s_t == seqs[-1]:
                ctx.headline(f"{backend} S={s_t}: {r['tokens_per_s']:,.0f} tok/s fwd+bwd ({r['pct_peak']:.0f}% peak)")


def section_grouped_gemm(ctx: Context) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from c2jax.kernels.grouped_gemm import grouped_matmul, grouped_matmul_reference
    from c2jax.kernels.mxfp8 import dequantize_mx, quantize_mx
    from c2jax.kernels.pallas_grouped import grouped_matmul_mx_pallas

    peak, note = peak_flops(ctx)
    impls = ("xla", "pallas_triton", "mosaic_sm90", "jax_triton", "ragged_dot")

    def gpu_only(impl):
        if impl == "mosaic_sm90":
            ctx.needs_gpu("Mosaic GPU Hopper kernel, no interpreter")
            kind = jax.devices()[0].device_kind
            if not any(k in kind for k in ("H100", "H200", "H800", "H20")):
                raise Skip(f"needs a Hopper GPU, this is {kind!r}")
        if impl == "jax_triton":
            ctx.needs_gpu("raw Triton through jax-triton, no interpreter")
            try:
                import jax_triton  # noqa: F401
            except ImportError as e:
                raise Skip(f"jax-triton is not installed here ({e}); docs/gpu_check.md says how to carry it") from None

    def call(impl, a, w, g, **kw):
        return grouped_matmul(a, w, g, impl=impl, **kw)

    # equality: one empty group and rows past sum(group_sizes), which must come back zero
    m, k, n, groups = ctx.size((2048, 512, 1024, 8), (96, 64, 128, 4))
    rng = np.random.default_rng(0)
    sizes_np = rng.multinomial(m - 40, np.ones(groups) / groups)
    sizes_np[1] += sizes_np[2]
    sizes_np[2] = 0
    sizes = jnp.asarray(sizes_np, jnp.int32)
    lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((groups, k, n)) / np.sqrt(k), jnp.bfloat16)
    ref = np.asarray(grouped_matmul_reference(lhs.astype(jnp.float32), rhs.astype(jnp.float32), sizes), np.float32)
    ctx.set("equality/shape", {"M": m, "K": k, "N": n, "G": groups, "group_sizes": sizes_np.tolist()})
    for impl in impls:
        def eq(impl=impl):
            gpu_only(impl)
            out = np.asarray(jax.jit(lambda a, w, g: call(impl, a, w, g))(lhs, rhs, sizes), np.float32)
            err = rel_err(out, ref)
            tail_zero = bool((out[int(sizes_np.sum()):] == 0).all())
            ctx.check(f"grouped GEMM {impl} bf16 == reference", err <= 1e-2 and tail_zero,
                      f"rel L2 {err:.2e} (tol 1e-2), rows past the groups zero: {tail_zero}")
            return {"rel_err": err, "tail_rows_zero": tail_zero}

        ctx.sub(f"equality/bf16/{impl}", eq, need_s=ctx.size(5, 1))

    ql, qr = quantize_mx(lhs, axis=1), quantize_mx(rhs, axis=1)
    deq_l = dequantize_mx(ql, axis=1).astype(jnp.float32)
    deq_r = dequantize_mx(qr, axis=1).astype(jnp.float32)
    ref_q = np.asarray(grouped_matmul_reference(deq_l, deq_r, sizes), np.float32)

    def eq_mx_pallas():
        interpret = not ctx.gpu
        bm = ctx.size(64, 32)
        out = jax.jit(lambda a, sa, b_, sb, g: grouped_matmul_mx_pallas(a, sa, b_, sb, g, block_m=bm, block_n=bm,
                                                                        interpret=interpret))(
            ql.values, ql.scales, qr.values, qr.scales, sizes)
        err = rel_err(np.asarray(out, np.float32), ref_q)
        ctx.check("grouped GEMM pallas_triton MXFP8 == reference on dequantized operands", err <= 1e-2,
                  f"rel L2 {err:.2e} (tol 1e-2){' (interpret mode)' if interpret else ''}")
        return {"rel_err": err, "interpret": interpret}

    def eq_mx_jax_triton():
        gpu_only("jax_triton")
        from c2jax.kernels.jax_triton_grouped import grouped_matmul_mx_jax_triton

        out = jax.jit(grouped_matmul_mx_jax_triton)(ql.values, ql.scales, qr.values, qr.scales, sizes)
        err = rel_err(np.asarray(out, np.float32), ref_q)
        ctx.check("grouped GEMM jax_triton MXFP8 (tl.dot_scaled) == reference", err <= 1e-2, f"rel L2 {err:.2e}")
        return {"rel_err": err}

    ctx.sub("equality/mxfp8/pallas_triton", eq_mx_pallas, need_s=ctx.size(5, 1))
    ctx.sub("equality/mxfp8/jax_triton", eq_mx_jax_triton, need_s=ctx.size(5, 1))

    # throughput at DeepSeek-V3 expert shapes: R routed rows, d = 7168, f = 2048, G local experts
    rows, d, f, g = ctx.size((65536, 7168, 2048, 8), (256, 128, 128, 4))
    repeats = ctx.size(5, 2)
    flops = 2 * rows * d * f
    ctx.set("throughput/shape", {"rows": rows, "d": d, "f": f, "experts": g, "peak": note})
    key = jax.random.key(1)
    a = jax.random.normal(key, (rows, d), jnp.bfloat16)
    w = (jax.random.normal(jax.random.fold_in(key, 1), (g, d, f), jnp.float32) / np.sqrt(d)).astype(jnp.bfloat16)
    gs = jnp.asarray(rng.multinomial(rows, np.ones(g) / g), jnp.int32)

    def rate(t, peak_=peak):
        return {"ms": 1e3 * t, "tflops": flops / t / 1e12, "pct_peak_bf16": 100 * flops / t / peak_}

    bf16_rates, fp8_rates = {}, {}

    def dense():
        return rate(timed(jax.jit(lambda x, y: x @ y), a, w[0], repeats=repeats))

    ctx.sub("throughput/bf16/dense_equal_flops", dense, need_s=ctx.size(5, 1))
    for impl in ("mosaic_sm90", "xla", "pallas_triton", "jax_triton"):
        def speed(impl=impl):
            gpu_only(impl)
            r = rate(timed(jax.jit(lambda x, y, z: call(impl, x, y, z)), a, w, gs, repeats=repeats))
            bf16_rates[impl] = r["tflops"]
            if impl == "pallas_triton" and not ctx.gpu:
                r["note"] = "interpret mode (CPU): exercises the call, not a speed"
            return r

        ctx.sub(f"throughput/bf16/{impl}", speed, need_s=ctx.size(10, 1))

    moe = _moe_layer(ctx, peak)

    # FP8: MXFP8 operands (E4M3, E8M0 scales per 32 along K)
    qa = jax.jit(lambda x: quantize_mx(x, axis=1))(a)
    qw = jax.jit(lambda x: quantize_mx(x, axis=1))(w)

    def fp8_pallas():
        interpret = not ctx.gpu
        fn = jax.jit(lambda v, s, v2, s2, z: grouped_matmul_mx_pallas(v, s, v2, s2, z, block_m=128, block_n=128,
                                                                      interpret=interpret))
        r = rate(timed(fn, qa.values, qa.scales, qw.values, qw.scales, gs, repeats=repeats))
        fp8_rates["mxfp8_pallas_triton"] = r["tflops"]
        if interpret:
            r["note"] = "interpret mode (CPU): exercises the call, not a speed"
        return r

    def fp8_jax_triton():
        gpu_only("jax_triton")
        from c2jax.kernels.jax_triton_grouped import grouped_matmul_mx_jax_triton

        r = rate(timed(jax.jit(grouped_matmul_mx_jax_triton), qa.values, qa.scales, qw.values, qw.scales, gs,
                       repeats=repeats))
        fp8_rates["mxfp8_jax_triton"] = r["tflops"]
        return r

    def fp8_xla_batched():
        """The XLA fallback's capacity-padded batched einsum with E4M3 operands (per-tensor scaling: what XLA's
        FP8 GEMM offers without block scales): the hardware FP8 path through XLA, for comparison."""
        cap = int(1.25 * rows / g)
        x8 = jax.random.normal(jax.random.key(3), (g, cap, d), jnp.bfloat16).astype(jnp.float8_e4m3fn)
        w8 = w.astype(jnp.float8_e4m3fn)
        fn = jax.jit(lambda x, y: jnp.einsum("gck,gkn->gcn", x, y, preferred_element_type=jnp.bfloat16))
        t = timed(fn, x8, w8, repeats=repeats)
        r = rate(t)
        r["note"] = "capacity 1.25x balanced: useful FLOPs = rows x d x f x 2"
        fp8_rates["fp8_xla_batched_einsum"] = r["tflops"]
        return r

    def fp8_dense():
        x8, y8 = a.astype(jnp.float8_e4m3fn), w[0].astype(jnp.float8_e4m3fn)
        return rate(timed(jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.bfloat16)), x8, y8,
                          repeats=repeats))

    ctx.sub("throughput/fp8/mxfp8_pallas_triton", fp8_pallas, need_s=ctx.size(10, 1))
    ctx.sub("throughput/fp8/fp8_xla_batched_einsum", fp8_xla_batched, need_s=ctx.size(8, 1))
    ctx.sub("throughput/fp8/dense_equal_flops", fp8_dense, need_s=ctx.size(5, 1))
    ctx.sub("throughput/fp8/mxfp8_jax_triton", fp8_jax_triton, need_s=ctx.size(10, 1))
    ctx.sub("throughput/bf16/ragged_dot_oracle",
            lambda: rate(timed(jax.jit(lambda x, y, z: call("ragged_dot", x, y, z)), a, w, gs, repeats=2)),
            need_s=ctx.size(10, 1))

    best_bf16 = max(bf16_rates.values(), default=None)
    best_fp8 = max(fp8_rates.values(), default=None)
    ctx.set("summary", {"best_bf16_grouped_tflops": best_bf16, "best_fp8_grouped_tflops": best_fp8,
                        "bf16_by_impl": bf16_rates, "fp8_by_impl": fp8_rates})
    if best_bf16:
        ctx.headline(f"best bf16 grouped {best_bf16:.3g} TFLOP/s ({100 * best_bf16 * 1e12 / peak:.0f}% peak)")
    ctx.target("MoE layer (fwd+bwd) % of bf16 peak", moe, 50.0, "%")
    ctx.target("FP8 grouped GEMM / bf16 grouped GEMM", best_fp8 / best_bf16 if best_fp8 and best_bf16 else None,
               1.5, "x")


def _moe_layer(ctx: Context, peak: float) -> float | None:
    """The MoE layer (models/moe.py: router, dispatch, SwiGLU experts, shared expert), forward + backward in
    bf16 with fp32 master weights, at DeepSeek-V3 expert dims (d 7168, f 2048, top-8) with 32 local experts and
    8192 tokens: 65,536 routed rows. Returns the best % of peak (useful FLOPs: routed + shared + router)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from c2jax.models.config import ModelConfig
    from c2jax.models.moe import MoE

    d, f, e, k, tokens = ctx.size((7168, 2048, 32, 8, 8192), (64, 32, 8, 2, 64))
    best = None
    for impl in ("sorted", "ragged"):
        def one(impl=impl):
            if impl == "ragged" and ctx.dry_run:
                raise Skip("dry run: the `sorted` run's code with moe_impl='ragged' (lax.ragged_dot, a dense "
                           "masked matmul on the CPU), left out to keep the dry run short")
            cfg = ModelConfig(hidden_size=d, moe_intermediate_size=f, n_routed_experts=e, num_experts_per_tok=k,
                              n_shared_experts=1, n_group=1, topk_group=1, dtype="bfloat16", moe_impl=impl,
                              moe_capacity_factors=ctx.size(ModelConfig.moe_capacity_factors, (2.0,)))
            graphdef, params, rest = nnx.split(MoE(cfg, nnx.Rngs(params=0)), nnx.Param, ...)
            x = jax.random.normal(jax.random.key(2), (1, tokens, d), jnp.bfloat16)

            def loss(params, x):
                y, _ = nnx.merge(graphdef, params, rest)(x)
                return jnp.mean(y.astype(jnp.float32) ** 2)

            step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
            t = timed(step, params, x, repeats=ctx.size(5, 2))
            fwd_flops = 2 * tokens * (3 * d * f * (k + cfg.n_shared_experts) + d * e)
            pct = 100 * 3 * fwd_flops / t / peak
            return {"ms": 1e3 * t, "tflops": 3 * fwd_flops / t / 1e12, "pct_peak_bf16": pct,
                    "shape": {"tokens": tokens, "d": d, "f": f, "experts": e, "top_k": k, "routed_rows": tokens * k}}

        r = ctx.sub(f"moe_layer/{impl}", one, need_s=ctx.size(15, 1))
        if isinstance(r, dict):
            best = r["pct_peak_bf16"] if best is None else max(best, r["pct_peak_bf16"])
            ctx.headline(f"MoE layer {impl} {r['tflops']:.3g} TFLOP/s ({r['pct_peak_bf16']:.0f}% peak)")
    return best


def section_quantizers(ctx: Context) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from c2jax.kernels.fp8_deepseek import quantize_fp8_tiles
    from c2jax.kernels.mxfp8 import quantize_mx
    from c2jax.kernels.nvfp4 import quantize_nvfp4
    from c2jax.kernels.permute import permute_quantize_mx

    rows, d = ctx.size((65536, 7168), (64, 256))
    x = jax.random.normal(jax.random.key(0), (rows, d), jnp.bfloat16)
    src = jnp.asarray(np.random.default_rng(2).permutation(rows), jnp.int32)
    ctx.set("shape", {"rows": rows, "d": d, "dtype": "bfloat16"})
    bw = ctx.sub("copy_GBps_same_size", lambda: copy_bandwidth(x.size * 2) / 1e9, need_s=2)
    interpret = not ctx.gpu

    def pallas_permute(a):
        return permute_quantize_mx(a, src, impl="pallas_triton")  # interpreted on the CPU (dispatch.py)

    fns = {
        "mxfp8_e4m3_1x32": lambda a: quantize_mx(a),
        "nvfp4_per_token_1x16": lambda a: quantize_nvfp4(a, scaling="per_token"),
        "fp8_deepseek_1x128": lambda a: quantize_fp8_tiles(a),
        "permute_mxfp8_xla": lambda a: permute_quantize_mx(a, src, impl="xla"),
        "permute_mxfp8_pallas_triton": pallas_permute,
    }

    def eq():
        a = np.asarray(jax.jit(fns["permute_mxfp8_xla"])(x).values.astype(jnp.float32))
        q = jax.jit(pallas_permute)(x)
        b = np.asarray(q.values.astype(jnp.float32))
        ref_s = np.asarray(jax.jit(fns["permute_mxfp8_xla"])(x).scales.astype(jnp.float32))
        same = bool(np.array_equal(a, b, equal_nan=True)) and bool(
            np.array_equal(ref_s, np.asarray(q.scales.astype(jnp.float32)), equal_nan=True))
        ctx.check("permute+MXFP8 pallas_triton == xla (bitwise)", same,
                  "values and scales identical" + (" (interpret mode)" if interpret else ""))
        return {"identical": same, "interpret": interpret}

    ctx.sub("equality/permute_mxfp8", eq, need_s=ctx.size(5, 1))
    for name, fn in fns.items():
        def speed(fn=fn, name=name):
            f = jax.jit(fn)
            out = f(x)
            written = sum(leaf.nbytes for leaf in jax.tree.leaves(out))
            t = timed(f, x, repeats=ctx.size(5, 1))
            r = {"ms": 1e3 * t, "GBps_read": x.nbytes / t / 1e9, "GBps_read_write": (x.nbytes + written) / t / 1e9}
            if bw:
                r["pct_of_copy_bandwidth"] = 100 * r["GBps_read_write"] / bw
            if name.endswith("pallas_triton") and not ctx.gpu:
                r["note"] = "interpret mode (CPU): exercises the call, not a speed"
            return r

        r = ctx.sub(f"throughput/{name}", speed, need_s=ctx.size(4, 1))
        if isinstance(r, dict) and name == "mxfp8_e4m3_1x32":
            ctx.headline(f"MXFP8 {r['GBps_read_write']:.3g} GB/s r+w")


def section_train_medium(ctx: Context) -> None:
    import jax.numpy as jnp
    import numpy as np
    import optax

    from c2jax.models.config import preset
    from c2jax.models.flops import training_flops_per_token
    from c2jax.models.transformer import init
    from c2jax.train.step import init_train_state, make_train_step

    peak, note = peak_flops(ctx)
    name = ctx.size("medium", "tiny")
    runs = ctx.size(((4096, 4), (32768, 1)), ((64, 2),))  # dry run: one length (the loop is the same)
    layers = ctx.size({}, DRY_MODEL)
    ctx.set("setup", {"preset": name, "dtype": "bfloat16 compute, float32 params", "peak": note,
                      "step": "c2jax.train.step.make_train_step: fwd + bwd + AdamW + router-bias update, no MTP"})
    for seq, batch in runs:
        def one(seq=seq, batch=batch, remat="none"):
            base = preset(name)
            cfg = base.replace(dtype="bfloat16", num_nextn_predict_layers=0, remat_policy=remat, **layers,
                               max_position_embeddings=max(seq, base.max_position_embeddings))
            tx = optax.adamw(1e-4)
            graphdef, state = init_train_state(init(cfg, seed=0), tx)
            step = make_train_step(graphdef, tx, router_bias_rate=1e-3, donate=True)
            ids = np.random.default_rng(seq).integers(0, cfg.vocab_size, (batch, seq + 1)).astype(np.int32)
            data = {"input_ids": jnp.asarray(ids[:, :-1]), "targets": jnp.asarray(ids[:, 1:]),
                    "segment_ids": jnp.ones((batch, seq), jnp.int32),
                    "positions": jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq)),
                    "loss_mask": jnp.ones((batch, seq), jnp.float32)}
            t0 = time.perf_counter()
            compiled = step.lower(state, data).compile()
            compile_s = time.perf_counter() - t0
            mem = compiled.memory_analysis()
            temp = getattr(mem, "temp_size_in_bytes", None) if mem is not None else None
            state, metrics, _, times = _timed_steps(compiled, state, data, ctx.size(3, 1))
            step_s = statistics.median(times)
            tokens = batch * seq
            fpt = training_flops_per_token(cfg, seq, include_mtp=False)
            loss = float(metrics["loss"])
            ctx.check(f"train {name} S={seq} loss finite", math.isfinite(loss), f"loss {loss:.4g}")
            return {"batch": batch, "remat": remat, "compile_s": compile_s, "step_s": step_s,
                    "tokens_per_s": tokens / step_s, "mfu_pct": 100 * fpt * tokens / step_s / peak,
                    "train_flops_per_token": fpt, "xla_temp_GiB": None if temp is None else temp / 2**30,
                    "loss": loss}

        def with_retry(one=one, seq=seq):
            try:
                return one()
            except Exception as e:  # noqa: BLE001 - out of memory at remat none: retry with remat full once
                if "RESOURCE_EXHAUSTED" not in str(e) and "out of memory" not in str(e).lower():
                    raise
                ctx.set(f"S{seq}_remat_none", f"out of memory: {str(e)[:200]}")
                return one(remat="full")

        r = ctx.sub(f"S{seq}", with_retry, need_s=ctx.size(25, 2))
        if isinstance(r, dict):
            ctx.headline(f"S={seq}: {r['tokens_per_s']:,.0f} tok/s, MFU {r['mfu_pct']:.1f}%")
            ctx.target(f"{name} training MFU at S={seq}", r["mfu_pct"], 35.0, "%")
        else:
            ctx.target(f"{name} training MFU at S={seq}", None, 35.0, "%")


def _engine_rates(cfg, graphdef, state, prompts, new, config):
    """(decode tokens/s excluding the first token's time, tokens/s, ttft s, outputs, engine) of a greedy
    generation; compiled first."""
    from c2jax.models.inference import InferenceEngine, Request

    engine = InferenceEngine(cfg, graphdef, state, config=config)
    reqs = [Request(p, new, temperature=0.0) for p in prompts]
    first = [Request(p, 1, temperature=0.0) for p in prompts]
    engine.generate(reqs)  # compile every shape used below
    engine.generate(first)
    t0 = time.perf_counter()
    engine.generate(first)
    ttft = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = engine.generate(reqs)
    total = time.perf_counter() - t0
    assert all(len(r.token_ids) == new for r in out)
    b = len(prompts)
    decode_s = max(total - ttft, 1e-9)
    return b * (new - 1) / decode_s, b * new / total, ttft, [r.token_ids for r in out], engine


def _speculative_engines(cfg, prompts, new, chunk, k=2):
    """(plain, speculative) `_engine_rates` of one model with an MTP module, greedy."""
    import dataclasses

    from flax import nnx

    from c2jax.models.inference import EngineConfig
    from c2jax.models.transformer import init

    if "speculative_k" not in {f.name for f in dataclasses.fields(EngineConfig)}:
        raise Skip("MTP speculative decoding is not implemented (EngineConfig has no speculative_k)")
    cfg = cfg.replace(num_nextn_predict_layers=max(cfg.num_nextn_predict_layers, 1))
    graphdef, state = nnx.split(init(cfg, seed=0))
    base = dict(slots=len(prompts), max_len=len(prompts[0]) + new + 2 * chunk + k + 1, chunk_steps=chunk)
    plain = _engine_rates(cfg, graphdef, state, prompts, new, EngineConfig(**base))
    spec = _engine_rates(cfg, graphdef, state, prompts, new, EngineConfig(
        **base, speculative_k=k, speculative_rounds=4, speculative_max_batch=len(prompts),
        speculative_adaptive=False))  # forced on: this measures speculation itself
    return plain, spec


def _mtp_speculation_equal(ctx: Context, cfg, prompts, new, chunk):
    """Greedy speculative decoding emits exactly plain greedy decoding (models/inference/speculative.py):
    checked in fp32 at the highest matmul precision, where the one-pass verify and the step-by-step decode
    agree to rounding (in bf16 a near-tie may flip and the sequences part, which says nothing)."""
    import jax

    with jax.default_matmul_precision("highest"):
        plain, spec = _speculative_engines(cfg.replace(dtype="float32"), prompts, new, chunk)
    same = plain[3] == spec[3]
    agree = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(plain[3], spec[3])]
    ctx.check("sampler MTP speculative greedy == plain greedy (fp32)", same,
              f"{len(prompts)} x {new} tokens; tokens equal before the first difference: {agree}")
    return {"outputs_equal": same, "equal_prefix_tokens": agree, "acceptance_rate": spec[4].acceptance_rate}


def section_sampler(ctx: Context) -> None:
    from flax import nnx

    from c2jax.models.config import preset
    from c2jax.models.inference import EngineConfig, cache_bytes_per_token
    from c2jax.models.transformer import init

    name = ctx.size("medium", "tiny")
    # with its MTP module (medium has one): unused by plain decoding, the draft model of speculative decoding
    # dry run: fp32, where speculative greedy must equal plain greedy exactly (checked by the speed run below)
    dtype = ctx.size("bfloat16", "float32")
    cfg = preset(name).replace(num_nextn_predict_layers=1, dtype=dtype, **ctx.size({}, DRY_MODEL))
    prompt_len, new, chunk = ctx.size((128, 64, 16), (8, 8, 4))
    spec_k = 2
    max_len = prompt_len + new + 2 * chunk + spec_k + 1  # room for a speculative round past the budget
    batches = ctx.size((1, 8, 32), (1,))
    model = init(cfg, seed=0)
    graphdef, state = nnx.split(model)
    latent_bytes, _ = cache_bytes_per_token(cfg)
    ctx.set("setup", {"preset": name, "dtype": f"{dtype} compute, float32 params", "prompt": prompt_len,
                      "new_tokens": new, "chunk_steps": chunk, "greedy": True,
                      "bytes_model": "per decode step: every non-expert weight + the routed experts a batch of b "
                                     "touches in expectation (1 - (1 - k/E)^b of them) + b embedding rows + the "
                                     "latent cache read (b x mean length x cache bytes/token)"})
    bw = ctx.sub("copy_GBps", lambda: copy_bandwidth(ctx.size(1 << 30, 8 << 20)) / 1e9, need_s=2)
    weight_bytes, expert_bytes, embed_row_bytes = 0, 0, 0
    for path, leaf in nnx.to_flat_state(nnx.filter_state(state, nnx.Param)):
        value = leaf.get_value()
        axes = leaf.get_metadata().get("logical_axes", ())
        if "experts" in axes and "expert_mlp" in axes:
            expert_bytes += value.nbytes
        elif path[0] == "embed_tokens":
            embed_row_bytes = value.nbytes // value.shape[0]
        elif path[0] == "mtp":  # not read by plain decoding
            continue
        else:
            weight_bytes += value.nbytes
    frac = lambda b: 1 - (1 - cfg.num_experts_per_tok / cfg.n_routed_experts) ** b  # noqa: E731
    rng = __import__("numpy").random.default_rng(0)
    prompts_by_batch = {b: rng.integers(1, cfg.vocab_size, size=(b, prompt_len)).tolist() for b in (*batches, 1)}
    prompts1 = prompts_by_batch[1]
    outputs = {}
    for b in batches:
        def one(b=b):
            prompts = prompts_by_batch[b]
            config = EngineConfig(slots=b, max_len=max_len, chunk_steps=chunk)
            decode_rate, rate, ttft, outputs[b], _ = _engine_rates(cfg, graphdef, state, prompts, new, config)
            per_step = b / decode_rate
            mean_len = prompt_len + new / 2
            step_bytes = (weight_bytes + frac(b) * expert_bytes + b * embed_row_bytes
                          + b * mean_len * latent_bytes)
            r = {"tokens_per_s": rate, "decode_tokens_per_s": decode_rate, "ttft_s": ttft,
                 "decode_step_ms": 1e3 * per_step, "bytes_per_step_GB": step_bytes / 1e9,
                 "effective_GBps": step_bytes / per_step / 1e9}
            if bw:
                r["bandwidth_utilisation_pct"] = 100 * r["effective_GBps"] / bw
            return r

        r = ctx.sub(f"batch{b}", one, need_s=ctx.size(10, 1))
        if isinstance(r, dict):
            ctx.headline(f"b={b}: {r['decode_tokens_per_s']:,.0f} tok/s"
                         + (f" ({r['bandwidth_utilisation_pct']:.0f}% bw)" if "bandwidth_utilisation_pct" in r else ""))
    # MTP speculative decoding: equality on the tiny preset (cheap to compile), speed on this section's model
    tiny = preset("tiny").replace(**DRY_MODEL) if ctx.dry_run else preset("tiny")
    few = rng.integers(1, tiny.vocab_size, size=(ctx.size(2, 1), 16)).tolist()
    def equality():
        if cfg.dtype == "float32":
            raise Skip("this section's model is fp32 here: the speed run below checks the same equality on it")
        return _mtp_speculation_equal(ctx, tiny, few, ctx.size(32, 8), 4)

    ctx.sub("mtp_speculative/equality", equality, need_s=ctx.size(10, 1))
    def speed():
        plain = ctx.record["results"].get("batch1")
        if not isinstance(plain, dict):
            raise Skip("needs the batch-1 plain decoding figure of this section, which did not run")
        config = EngineConfig(slots=1, max_len=max_len, chunk_steps=chunk, speculative_k=spec_k,
                              speculative_rounds=4, speculative_max_batch=1, speculative_adaptive=False)
        spec = _engine_rates(cfg, graphdef, state, prompts1, new, config)
        if cfg.dtype == "float32":  # exact arithmetic up to rounding: greedy speculation is plain greedy
            ctx.check("sampler MTP speculative greedy == plain greedy (fp32)", spec[3] == outputs[1],
                      f"1 x {new} tokens, k = {spec_k}")
        return {"batch": 1, "k": spec_k, "plain_decode_tokens_per_s": plain["decode_tokens_per_s"],
                "speculative_decode_tokens_per_s": spec[0], "speedup": spec[0] / plain["decode_tokens_per_s"],
                "acceptance_rate": spec[4].acceptance_rate,
                "note": "random weights: the acceptance (and so the speed-up) of a trained model will differ"}

    r = ctx.sub("mtp_speculative/speed_batch1", speed, need_s=ctx.size(15, 1))
    if isinstance(r, dict):
        ctx.headline(f"MTP speculation b=1: {r['speedup']:.2f}x, acceptance {r['acceptance_rate']}")


def section_rl_step(ctx: Context) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from c2jax.models.config import preset
    from c2jax.models.transformer import forward, init
    from c2jax.rl.batch import RLBatch, replay_from_model
    from c2jax.rl.config import RLConfig
    from c2jax.rl.learner import init_rl_state, make_optimizer, make_rl_step

    name = ctx.size("medium", "tiny")
    rows, seq = ctx.size((4, 2048), (2, 16))
    cfg = preset(name).replace(num_nextn_predict_layers=0, dtype="bfloat16", **ctx.size({}, DRY_MODEL))
    rl_cfg = RLConfig(learning_rate=1e-6)
    ctx.set("setup", {"preset": name, "rows": rows, "seq": seq, "dtype": "bfloat16 compute, float32 params",
                      "rl_config": "RLConfig defaults (REINFORCE, constant normaliser, Adam, clip 1.0)"})
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (rows, seq + 1)).astype(np.int32)

    def one():
        model = init(cfg, seed=0)
        graphdef, state = nnx.split(model)
        t0 = time.perf_counter()
        sample = jax.jit(lambda s, ids: forward(graphdef, s, ids, return_mtp=False))
        out = sample(state, jnp.asarray(tokens[:, :-1]))
        logp = jax.nn.log_softmax(out.logits, -1)
        behavior = np.asarray(jnp.take_along_axis(logp, jnp.asarray(tokens[:, 1:])[..., None], -1)[..., 0])
        replay = replay_from_model(out.expert_ids).astype(np.int32)
        sampler_s = time.perf_counter() - t0
        batch = RLBatch(
            input_ids=tokens[:, :-1], targets=tokens[:, 1:], loss_mask=np.ones((rows, seq), bool),
            positions=np.broadcast_to(np.arange(seq, dtype=np.int32), (rows, seq)).copy(),
            segment_ids=np.ones((rows, seq), np.int32),
            sequence_ids=np.broadcast_to(np.arange(rows, dtype=np.int32)[:, None], (rows, seq)).copy(),
            advantages=np.broadcast_to(np.linspace(-1, 1, rows, dtype=np.float32)[:, None], (rows, seq)).copy(),
            behavior_logprobs=behavior.astype(np.float32), policy_versions=np.zeros((rows, seq), np.int32),
            replay_ids=replay)
        tx = make_optimizer(rl_cfg)
        graphdef, rl_state = init_rl_state(init(cfg, seed=0), tx, rl_cfg)
        step = make_rl_step(graphdef, tx, rl_cfg)
        batch = jax.tree.map(jnp.asarray, batch)
        rl_state, metrics, first_s, times = _timed_steps(step, rl_state, batch, ctx.size(2, 1))
        m = {k: float(v) for k, v in metrics.items() if np.ndim(v) == 0}
        override = m.get("replay/override_fraction")
        finite = math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])
        ctx.check("RL step loss and gradient norm finite", finite,
                  f"loss {m['loss']:.4g}, grad norm {m['grad_norm']:.4g}")
        ctx.check("RL step router replay: the learner used the sampler's experts", override == 0.0,
                  f"replay/override_fraction {override}")
        step_s = min(times)
        ctx.headline(f"{rows * seq / step_s:,.0f} tok/s, override {override}")
        keep = ("loss", "grad_norm", "replay/override_fraction", "mismatch/abs_mean", "entropy", "tokens_trained")
        return {"sampler_forward_s": sampler_s, "first_step_s": first_s, "step_s": step_s,
                "tokens_per_s": rows * seq / step_s, "metrics": {k: m[k] for k in keep if k in m}}

    ctx.sub("step", one, need_s=ctx.size(20, 2))


def section_selftest_error(ctx: Context) -> None:
    ctx.set("before_the_error", 1.0)
    raise RuntimeError("deliberate failure (--selftest): the sections after this one must still run")


def section_selftest_timeout(ctx: Context) -> None:
    ctx.set("before_the_hang", 1.0)
    time.sleep(3600)  # killed by the driver at the deadline


SECTIONS: dict[str, Callable[[Context], None]] = {
    "env": section_env, "model": section_model, "attention": section_attention,
    "grouped_gemm": section_grouped_gemm, "quantizers": section_quantizers, "train_medium": section_train_medium,
    "sampler": section_sampler, "rl_step": section_rl_step, "selftest_error": section_selftest_error,
    "selftest_timeout": section_selftest_timeout,
}


def run_worker(name: str, path: Path, dry_run: bool, deadline_s: float | None, allow_cpu: bool = False) -> int:
    """Run one section, recording into `path`. Exit code 0 unless the section raised. Without --dry-run a
    section other than `env` and the self-tests refuses to start its full-size work without a GPU."""
    if dry_run:
        os.environ["JAX_PLATFORMS"] = "cpu"
    ctx = Context(name, path, dry_run, deadline_s)
    try:
        if not (dry_run or allow_cpu or name == "env" or name.startswith("selftest") or ctx.gpu):
            import jax

            ctx.record["status"] = "skipped"
            ctx.record["reason"] = (f"needs GPU: the JAX backend here is {jax.default_backend()!r}; the full-size "
                                    "section would take hours on it (use --dry-run, or --allow-cpu)")
            ctx.record.pop("errors", None)
            ctx.flush()
            return 0
        SECTIONS[name](ctx)
    except Exception as e:  # noqa: BLE001 - recorded; the driver goes on with the next section
        ctx.record["status"] = "error"
        ctx.record["error"] = _tail(traceback.format_exc())
        ctx.record["reason"] = f"{type(e).__name__}: {str(e)[:300]}"
        ctx.flush()
        traceback.print_exc()
        return 1
    failed = [c["name"] for c in ctx.record["checks"] if not c["passed"]]
    errors = ctx.record.pop("errors")
    if failed:
        ctx.record["status"] = "fail"
        ctx.record["reason"] = f"failed checks: {', '.join(failed)}"
    elif errors:
        ctx.record["status"] = "partial"
        ctx.record["reason"] = f"sub-measurements raised: {', '.join(errors)}"
    else:
        ctx.record["status"] = "ok"
    if errors and failed:
        ctx.record["reason"] += f"; sub-measurements raised: {', '.join(errors)}"
    ctx.flush()
    return 0
