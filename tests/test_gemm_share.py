"""experiments/bench/gemm_share.py: which XLA ops count as matrix multiplication.

Spec: an op (or fusion) counts as a GEMM iff its HLO op_name metadata comes from a dot_general, keyed by
(module name, op name) from XLA's optimized-HLO dumps; an op that is a dot in one dumped compilation of a module
and not in another is refused (the profiler's events could not be attributed)."""

from __future__ import annotations

import pytest

from experiments.bench.gemm_share import _dot_ops

DOT = ('  %ynn_fusion.1 = f32[16,16,512]{2,1,0} fusion(%a, %b), kind=kCustom, calls=%c, '
       'metadata={op_name="jit(decode_chunk)/while/body/ecd,edg->ecg/dot_general" stack_frame_id=3}\n')
REDUCE = ('  ROOT %ynn_fusion.2 = f32[32]{0} fusion(%a), kind=kCustom, calls=%d, '
          'metadata={op_name="jit(decode_chunk)/while/body/reduce_max" stack_frame_id=4}\n')


def _dump(tmp_path, name, text):
    (tmp_path / f"module_0001.{name}.cpu_after_optimizations.txt").write_text(text)


def test_dots_and_other_ops_are_told_apart(tmp_path):
    _dump(tmp_path, "jit_decode_chunk", DOT + REDUCE + "  %p = f32[2]{0} parameter(0)\n")
    (tmp_path / "module_0001.jit_decode_chunk.cpu_after_optimizations-memory-usage-report.txt").write_text(DOT)
    kinds = _dot_ops(str(tmp_path))
    assert kinds == {("jit_decode_chunk", "ynn_fusion.1"): True, ("jit_decode_chunk", "ynn_fusion.2"): False}


def test_an_op_that_changes_kind_between_compilations_is_refused(tmp_path):
    _dump(tmp_path, "jit_decode_chunk", DOT)
    other = DOT.replace("ecd,edg->ecg/dot_general", "reduce_sum")
    (tmp_path / "module_0002.jit_decode_chunk.cpu_after_optimizations.txt").write_text(other)
    with pytest.raises(RuntimeError, match="ynn_fusion.1"):
        _dot_ops(str(tmp_path))
