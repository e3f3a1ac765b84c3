"""c2jax.bench_report: the tail every benchmark ends with (table, machine line, JSON with `machine`, path)."""

import json
from pathlib import Path

import numpy as np
import pytest

from c2jax.bench_report import BENCH_DIR, Col, bench_path, render_table, write_json, write_results
from c2jax.machine import describe

ROWS = [{"batch": 1, "c2jax": {"tokens_per_s": 12345.6}, "hf": None, "speedup": 1.234, "mesh": "fsdp=[2]"},
        {"batch": 32, "c2jax": {"tokens_per_s": 1.5}, "hf": {"tokens_per_s": 3.0}, "speedup": None, "mesh": "a|b"}]
COLUMNS = ["batch", ("c2jax.tokens_per_s", "c2jax tok/s", ",.1f"), ("hf.tokens_per_s", "HF tok/s"),
           ("speedup", "speed-up", "{:.2f}x"), "mesh", Col("batch", "2x batch", value=lambda r: 2 * r["batch"]),
           Col("speedup", "ms", ".0f", scale=1e3)]


def test_writes_rows_meta_and_machine_and_prints_table_machine_and_path(tmp_path, capsys):
    machine = describe()
    out = tmp_path / "sub" / "bench.json"
    path = write_results(out, ROWS, columns=COLUMNS, title="a bench", meta={"preset": "small", "n": np.int64(3)},
                         machine=machine, notes=["a note"])
    assert path == out
    data = json.loads(out.read_text())
    assert data["rows"] == ROWS and data["preset"] == "small" and data["n"] == 3
    assert data["machine"]["cpu_model"] == machine["cpu_model"] and "load_avg_end" in data["machine"]
    assert list(tmp_path.joinpath("sub").iterdir()) == [out]  # no temporary file left beside it

    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "a bench"
    header = next(line for line in lines if "c2jax tok/s" in line)
    assert [c.strip() for c in header.strip("|").split("|")] == ["batch", "c2jax tok/s", "HF tok/s", "speed-up",
                                                                 "mesh", "2x batch", "ms"]
    first, second = (line for line in lines if line.startswith("|") and line[1:].split("|")[0].strip().isdigit())
    cells = [c.strip() for c in first.strip("|").split("|")]
    assert cells == ["1", "12,345.6", "-", "1.23x", "fsdp=[2]", "2", "1234"]  # None -> "-", [..] not markup
    assert [c.strip() for c in second.strip("|").split("|")][:4] == ["32", "1.5", "3", "-"]
    assert "a\\|b" in second  # a "|" in a cell cannot split the Markdown row
    assert lines.index("a note") > lines.index(second)
    assert lines[-2].startswith("machine: ") and "at start" in lines[-2] and "at end" in lines[-2]
    assert lines[-1] == f"wrote {out}"


def test_rows_key_none_keeps_the_figures_in_meta_only(tmp_path, capsys):
    out = write_results(tmp_path / "x.json", [{"measure": "MFU", "value": "0.31"}], meta={"mfu": 0.31},
                        rows_key=None)
    assert json.loads(out.read_text()).keys() == {"mfu", "machine"}  # described here when not given
    assert "| MFU " in capsys.readouterr().out
    out = write_results(tmp_path / "y.json", ROWS[:1], columns=["batch"], rows_key="results")
    assert json.loads(out.read_text())["results"] == ROWS[:1]


def test_a_bare_name_is_a_file_under_runs_bench():
    assert bench_path("gemm_share") == BENCH_DIR / "gemm_share.json"
    assert bench_path("runs/x/y.json") == Path("runs/x/y.json")
    assert bench_path(Path("plain")) == Path("plain")


def test_refuses_a_missing_column_naming_it_before_writing(tmp_path, capsys):
    rows = [{"batch": 1, "tokens_per_s": 2.0}, {"batch": 2}]
    with pytest.raises(ValueError, match=r"row 1 has no column 'tokens_per_s' \(its keys: batch\)"):
        write_results(tmp_path / "x.json", rows, columns=["batch", "tokens_per_s"])
    with pytest.raises(ValueError, match="row 0 has no column 'c2jax.ttft_s'"):
        render_table(ROWS, ["c2jax.ttft_s"])
    with pytest.raises(ValueError, match="row 0 is a list, not a dict"):
        render_table([[1, 2]], ["batch"])
    with pytest.raises(ValueError, match="meta has a 'machine' key"):
        write_results(tmp_path / "x.json", rows[:1], meta={"machine": {}})
    with pytest.raises(ValueError, match="meta has the rows' key 'rows'"):
        write_results(tmp_path / "x.json", rows[:1], meta={"rows": []})
    with pytest.raises(ValueError, match="already has a 'machine' key"):
        write_json(tmp_path / "x.json", {"machine": {}}, machine={})
    with pytest.raises(TypeError, match="a column is a key"):
        render_table(rows, [3])
    assert not (tmp_path / "x.json").exists() and capsys.readouterr().out == ""
