"""experiments/bench/gemm_share.py: which XLA ops count as matrix multiplication, and overlapping op time.

Spec: an op counts as a GEMM iff it is a dot or convolution, or a fusion whose computation holds one or a reduce
named after a dot_general (XLA's rewrite of a matrix-vector product); a copy or transpose of a dot's output,
and control flow (while, conditional), do not. Keys are (module name, op name) from XLA's optimized-HLO
dumps; an op that is a GEMM in one dumped compilation of a module and not in another is refused. Op time is
the union of the ops' intervals (two ops on two threads at once count once)."""

from __future__ import annotations

import pytest

from experiments.bench.gemm_share import _dot_ops, _union_s

HLO = """HloModule jit_decode_chunk, entry_computation_layout={()->f32[]}

%fused_computation (param_0: f32[16,16,512], param_1: f32[16,512,512]) -> f32[16,16,512] {
  %param_0 = f32[16,16,512]{2,1,0} parameter(0)
  %param_1 = f32[16,512,512]{2,1,0} parameter(1)
  ROOT %dot.1 = f32[16,16,512]{2,1,0} dot(%param_0, %param_1), lhs_batch_dims={0}, rhs_batch_dims={0}
}

%fused_computation.1 (param_0.1: f32[8192,512], param_1.1: f32[512]) -> f32[8192] {
  %param_0.1 = f32[8192,512]{1,0} parameter(0)
  %multiply.3 = f32[8192,512]{1,0} multiply(%param_0.1, %param_0.1), metadata={op_name="jit(f)/nd,vd->nv/dot_general"}
  %constant.1 = f32[] constant(0)
  ROOT %reduce.2 = f32[8192]{0} reduce(%multiply.3, %constant.1), dimensions={1}, to_apply=%add, metadata={op_name="jit(f)/nd,vd->nv/dot_general"}
}

%fused_computation.2 (param_0.2: f32[8,64]) -> f32[64,8] {
  %param_0.2 = f32[8,64]{1,0} parameter(0)
  ROOT %transpose.1 = f32[64,8]{1,0} transpose(%param_0.2), dimensions={1,0}, metadata={op_name="jit(f)/bkr,rhv->bkhv/dot_general"}
}

ENTRY %main (a: f32[16,16,512], b: f32[16,512,512]) -> f32[] {
  %ynn_fusion.1 = f32[16,16,512]{2,1,0} fusion(%a, %b), kind=kCustom, calls=%fused_computation, metadata={op_name="jit(f)/ecd,edg->ecg/dot_general"}
  %reduce_fusion = f32[8192]{0} fusion(%w, %x), kind=kLoop, calls=%fused_computation.1, metadata={op_name="jit(f)/reduce"}
  %transpose_copy_fusion = f32[64,8]{1,0} fusion(%y), kind=kLoop, calls=%fused_computation.2, metadata={op_name="jit(f)/bkr,rhv->bkhv/dot_general"}
  %cond.2 = (f32[32,512]{1,0}, s32[]) conditional(%i, %a, %b), branch_computations={%fused_computation, %fused_computation.2}
  %dot.7 = f32[8,8]{1,0} dot(%c, %d), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %exp.1 = f32[] exponential(%e), metadata={op_name="jit(f)/exp"}
}
"""  # noqa: E501 (HLO as XLA dumps it: one instruction per line)


def _dump(tmp_path, module_id, text):
    (tmp_path / f"module_{module_id:04d}.jit_decode_chunk.cpu_after_optimizations.txt").write_text(text)


def test_gemms_and_other_ops_are_told_apart(tmp_path):
    _dump(tmp_path, 1, HLO)
    (tmp_path / "module_0001.jit_decode_chunk.cpu_after_optimizations-memory-usage-report.txt").write_text("x")
    kinds = {op: gemm for (module, op), gemm in _dot_ops(str(tmp_path)).items() if module == "jit_decode_chunk"}
    assert kinds["ynn_fusion.1"] and kinds["reduce_fusion"] and kinds["dot.7"]
    assert not kinds["transpose_copy_fusion"] and not kinds["cond.2"] and not kinds["exp.1"]


def test_an_op_that_changes_kind_between_compilations_is_refused(tmp_path):
    _dump(tmp_path, 1, HLO)
    _dump(tmp_path, 2, HLO.replace("calls=%fused_computation,", "calls=%fused_computation.2,"))
    with pytest.raises(RuntimeError, match="ynn_fusion.1"):
        _dot_ops(str(tmp_path))


def test_overlapping_op_time_counts_once():
    assert _union_s([(0, 10), (5, 15), (20, 30), (21, 22)]) == pytest.approx(25e-6)
    assert _union_s([]) == 0.0
