"""Grouped GEMM written directly in Triton and called through jax-triton: the path for what
Pallas-Triton cannot express, chiefly Triton's `tl.dot_scaled` (native MXFP8 block-scaled MMA on
Blackwell, E8M0 scales per 32 K-elements), which Pallas does not expose.

GPU-only and optional. `import jax_triton` raises ImportError on a CPU jaxlib ("jax-triton requires JAX
to be installed with GPU support"), so this module imports jax_triton and triton only inside the
functions, and importing it never fails; calling it without them raises a RuntimeError saying what is
missing. Not executed by CPU tests (no interpreter for raw Triton here); it is exercised by the GPU test
script (tests/test_kernels.py, marked `requires_gpu`) when a GPU is lent. With only triton installed,
`compile_to_ptx` compiles both kernels for sm_90a / sm_100a without a device (gpu_check --lower-only).

Layout: tokens sorted by group (as in kernels/grouped_gemm.py). Grid (G, cdiv(M, BLOCK_M), N / BLOCK_N):
program (g, i, j) computes rows [off_g + i*BLOCK_M, ...) of group g and exits when past the group's end.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _require_triton():
    try:
        import triton
        import triton.language as tl
    except ImportError as e:
        raise RuntimeError(f"c2jax.kernels.jax_triton_grouped needs the optional package triton; import failed: {e}. "
                           "Use impl='pallas_triton' or 'xla'.") from e
    return triton, tl


def _require_jax_triton():
    try:
        import jax_triton
    except ImportError as e:
        raise RuntimeError(
            "c2jax.kernels.jax_triton_grouped needs the optional packages jax-triton and triton with a CUDA jaxlib "
            f"(pip install jax-triton 'jax[cuda12]'); import failed: {e}. Use impl='pallas_triton' or 'xla'."
        ) from e
    return (jax_triton, *_require_triton())


@functools.cache
def _kernels():
    """Build the @triton.jit kernels on first use (defining them needs triton, not jax-triton)."""
    triton, tl = _require_triton()

    @triton.jit
    def grouped_kernel(offsets_ptr, lhs_ptr, rhs_ptr, out_ptr, K: tl.constexpr, N: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        g, i, j = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        start = tl.load(offsets_ptr + g) + i * BLOCK_M
        end = tl.load(offsets_ptr + g + 1)
        if start < end:
            rows = start + tl.arange(0, BLOCK_M)
            cols = j * BLOCK_N + tl.arange(0, BLOCK_N)
            ks = tl.arange(0, BLOCK_K)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                a = tl.load(lhs_ptr + rows[:, None] * K + (k0 + ks)[None, :], mask=(rows < end)[:, None], other=0.0)
                b = tl.load(rhs_ptr + g * K * N + (k0 + ks)[:, None] * N + cols[None, :])
                acc += tl.dot(a, b)
            tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                     mask=(rows < end)[:, None])

    @triton.jit
    def grouped_mx_kernel(offsets_ptr, lhs_ptr, lhs_scale_ptr, rhs_ptr, rhs_scale_ptr, out_ptr, K: tl.constexpr,
                          N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # lhs [M, K] e4m3, lhs_scale [M, K/32] e8m0 bits; rhs stored transposed [G, N, K] e4m3 with
        # rhs_scale [G, N, K/32]: tl.dot_scaled takes both scale tensors as [rows, K/32]
        g, i, j = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        start = tl.load(offsets_ptr + g) + i * BLOCK_M
        end = tl.load(offsets_ptr + g + 1)
        if start < end:
            rows = start + tl.arange(0, BLOCK_M)
            cols = j * BLOCK_N + tl.arange(0, BLOCK_N)
            ks = tl.arange(0, BLOCK_K)
            ss = tl.arange(0, BLOCK_K // 32)
            row_ok = (rows < end)[:, None]
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                a = tl.load(lhs_ptr + rows[:, None] * K + (k0 + ks)[None, :], mask=row_ok, other=0.0)
                sa = tl.load(lhs_scale_ptr + rows[:, None] * (K // 32) + (k0 // 32 + ss)[None, :], mask=row_ok,
                             other=127)
                bt = tl.load(rhs_ptr + g * N * K + cols[:, None] * K + (k0 + ks)[None, :])
                sb = tl.load(rhs_scale_ptr + g * N * (K // 32) + cols[:, None] * (K // 32) + (k0 // 32 + ss)[None, :])
                acc = tl.dot_scaled(a, sa, "e4m3", tl.trans(bt), sb, "e4m3", acc)
            tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=row_ok)

    return grouped_kernel, grouped_mx_kernel


def _offsets(group_sizes):
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(group_sizes.astype(jnp.int32))])


def _zero_tail(out, offsets):
    return jnp.where((jnp.arange(out.shape[0]) < offsets[-1])[:, None], out, jnp.zeros((), out.dtype))


def grouped_matmul_jax_triton(lhs, rhs, group_sizes, *, preferred_element_type=None, block_m=128, block_n=128,
                              block_k=64, num_warps=8, num_stages=3):
    """lhs [M, K] sorted by group, rhs [G, K, N] -> [M, N]; K % block_k == 0, N % block_n == 0."""
    jax_triton, triton, _ = _require_jax_triton()
    grouped_kernel, _ = _kernels()
    m, k = lhs.shape
    num_groups, _, n = rhs.shape
    if k % block_k or n % block_n:
        raise NotImplementedError(f"jax_triton grouped matmul needs K % {block_k} == 0 and N % {block_n} == 0")
    offsets = _offsets(group_sizes)
    out_shape = jax.ShapeDtypeStruct((m, n), jnp.dtype(preferred_element_type or lhs.dtype))
    out = jax_triton.triton_call(offsets, lhs, rhs, kernel=grouped_kernel, out_shape=out_shape,
                                 grid=(num_groups, triton.cdiv(m, block_m), n // block_n), num_warps=num_warps,
                                 num_stages=num_stages, K=k, N=n, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return _zero_tail(out, offsets)


def grouped_matmul_mx_jax_triton(lhs_values, lhs_scales, rhs_values, rhs_scales, group_sizes, *,
                                 out_dtype=jnp.bfloat16, block_m=128, block_n=128, block_k=128, num_warps=8,
                                 num_stages=3):
    """MXFP8 grouped GEMM with native block-scaled MMA (`tl.dot_scaled`, Blackwell): lhs_values [M, K]
    e4m3 with E8M0 lhs_scales [M, K/32]; rhs_values [G, K, N] e4m3 with rhs_scales [G, K/32, N]."""
    jax_triton, triton, _ = _require_jax_triton()
    _, grouped_mx_kernel = _kernels()
    m, k = lhs_values.shape
    num_groups, _, n = rhs_values.shape
    if k % block_k or n % block_n:
        raise NotImplementedError(f"MX jax_triton grouped matmul needs K % {block_k} == 0 and N % {block_n} == 0")
    bits = lambda s: jax.lax.bitcast_convert_type(s, jnp.uint8)
    offsets = _offsets(group_sizes)
    out = jax_triton.triton_call(
        offsets, lhs_values, bits(lhs_scales), jnp.swapaxes(rhs_values, 1, 2), jnp.swapaxes(bits(rhs_scales), 1, 2),
        kernel=grouped_mx_kernel, out_shape=jax.ShapeDtypeStruct((m, n), jnp.dtype(out_dtype)),
        grid=(num_groups, triton.cdiv(m, block_m), n // block_n), num_warps=num_warps, num_stages=num_stages,
        K=k, N=n, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return _zero_tail(out, offsets)


# Triton compiles for a GPU it does not have: its NVPTX backend only needs the target's compute capability, so the two
# kernels above can be compiled to PTX (and cubin, with the ptxas its wheel bundles) on a CPU-only machine. What
# this proves: the kernels type-check, lower through Triton's passes and select the tensor-core MMA of that
# architecture; what it cannot: that they run, or how fast (gpu_check on a lent device does).
# tensor-core instructions expected in the PTX: Hopper's warpgroup MMA, Blackwell's tcgen05 MMA (block-scaled for
# tl.dot_scaled; on Hopper tl.dot_scaled is emulated by upcasting to bf16, so it too runs wgmma)
PTX_MMA = {90: {"grouped": "wgmma.mma_async", "grouped_mx": "wgmma.mma_async"},
           100: {"grouped": "tcgen05.mma.cta_group::1.kind::f16", "grouped_mx": "kind::mxf8f6f4.block_scale"}}


def compile_to_ptx(compute_capability: int, *, k: int = 1024, n: int = 1024, block_m: int = 128, block_n: int = 128,
                   num_warps: int = 8, num_stages: int = 3) -> dict[str, dict]:
    """Both kernels compiled by Triton for CUDA `compute_capability` (90: sm_90a, 100: sm_100a) with the launch
    parameters grouped_matmul_jax_triton / grouped_matmul_mx_jax_triton use, without a device. Per kernel: the PTX
    text, its `.target` line, and whether the architecture's tensor-core instruction (PTX_MMA) is in it.
    Needs only the triton package (about 1 GB installed; not a project dependency)."""
    triton, _ = _require_triton()
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if compute_capability not in PTX_MMA:
        raise ValueError(f"compute capability {compute_capability}: expected one of {sorted(PTX_MMA)}")
    grouped_kernel, grouped_mx_kernel = _kernels()
    blocks = {"K": k, "N": n, "BLOCK_M": block_m, "BLOCK_N": block_n}
    kernels = {
        "grouped": (grouped_kernel, {"offsets_ptr": "*i32", "lhs_ptr": "*bf16", "rhs_ptr": "*bf16",
                                     "out_ptr": "*bf16"}, blocks | {"BLOCK_K": 64}),
        "grouped_mx": (grouped_mx_kernel, {"offsets_ptr": "*i32", "lhs_ptr": "*fp8e4nv", "lhs_scale_ptr": "*u8",
                                           "rhs_ptr": "*fp8e4nv", "rhs_scale_ptr": "*u8", "out_ptr": "*bf16"},
                       blocks | {"BLOCK_K": 128}),
    }
    target = GPUTarget("cuda", compute_capability, 32)
    out = {}
    for name, (fn, pointers, constexprs) in kernels.items():
        signature = pointers | {key: "constexpr" for key in constexprs}
        compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=target,
                                  options={"num_warps": num_warps, "num_stages": num_stages})
        ptx = compiled.asm["ptx"]
        target_line = next((line.strip() for line in ptx.splitlines() if line.startswith(".target")), "")
        mma = PTX_MMA[compute_capability][name]
        out[name] = {"ptx": ptx, "target": target_line, "mma": mma, "has_mma": mma in ptx,
                     "cubin_bytes": len(compiled.asm.get("cubin", b""))}
    return out
