"""The one ending of every benchmark: its table, the machine it ran on, its JSON (with `machine`), where it went.

    from c2jax.bench_report import write_results
    from c2jax.machine import describe

    machine = describe()                      # at the start: the load before the measurement
    rows = [...]                              # one dict per measured configuration
    write_results("runs/bench/foo.json", rows, columns=["batch", ("tokens_per_s", "tokens/s", ",.0f")],
                  meta={"preset": "small"}, machine=machine, title="foo: small preset")

prints the table, then `machine: <c2jax.machine.summary_line>` (the load at the start and at the end), then
`wrote runs/bench/foo.json`, and writes `{**meta, "rows": rows, "machine": machine}` atomically (a temporary file
renamed over the old one). A bare name ("foo") means runs/bench/foo.json. A column is a row's key, a dotted key
for a nested dict ("c2jax.tokens_per_s"), or a `Col` (or tuple of its fields) with a header, a format and
optionally a function computing the cell from the row; a row without one of the columns is a ValueError naming
the column and the row. `render_table` / `print_table` give a second table in the same style, `write_json` the
JSON alone (for a report written again after every step, as the GPU check's).

The table is `rich`'s in its Markdown box (a table docs/ can take as it is), rendered to plain text (no colour,
never wrapped), so that a log and a terminal show the same.
"""

from __future__ import annotations

import io
import json
import math
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from c2jax.machine import describe, finish, summary_line

BENCH_DIR = Path("runs/bench")


@dataclass(frozen=True)
class Col:
    """A table column: `key` of each row (dotted for nested dicts), its `header` (default: the key), `fmt` (a
    format spec such as ",.0f", ".3f", ".1%", a template such as "{:.2f}x", or a function of the value; default:
    `format_value`; a None value is "-" whatever the format), `value`, a function of the whole row that computes
    the cell instead of looking `key` up (a derived figure), and `scale`, a factor for a number before it is
    formatted (1e3: seconds shown as ms; 2**-30: bytes as GiB)."""

    key: str
    header: str | None = None
    fmt: str | Callable[[Any], str] = ""
    value: Callable[[Mapping[str, Any]], Any] | None = None
    scale: float = 1.0


ColumnSpec = str | Col | tuple


def _col(spec: ColumnSpec) -> Col:
    if isinstance(spec, Col):
        return spec
    if isinstance(spec, str):
        return Col(spec)
    if isinstance(spec, tuple) and 1 <= len(spec) <= 4 and isinstance(spec[0], str):
        return Col(*spec)
    raise TypeError(f"a column is a key, a Col or a tuple (key, header, fmt, value); got {spec!r}")


def format_value(v: Any) -> str:
    """A cell: None as "-", floats to 4 significant digits (from 10,000 on: whole, with thousands separators)."""
    if v is None:
        return "-"
    if isinstance(v, float) and not isinstance(v, bool):
        if math.isfinite(v) and abs(v) >= 1e4:
            return f"{v:,.0f}"
        return f"{v:.4g}"
    return str(v)


_MISSING = object()


def _lookup(row: Mapping[str, Any], key: str) -> Any:
    """row[key], or through nested dicts for a dotted key; None where a level on the way is None."""
    if key in row:
        return row[key]
    value: Any = row
    for part in key.split("."):
        if value is None:
            return None
        if not isinstance(value, Mapping) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _cells(rows: Sequence[Mapping[str, Any]], cols: list[Col]) -> list[list[str]]:
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise ValueError(f"row {i} is a {type(row).__name__}, not a dict: {row!r:.200}")
        cells = []
        for c in cols:
            v = c.value(row) if c.value is not None else _lookup(row, c.key)
            if v is _MISSING:
                raise ValueError(f"row {i} has no column {c.key!r} (its keys: {', '.join(map(str, row))})")
            if c.scale != 1.0 and isinstance(v, int | float) and not isinstance(v, bool):
                v = v * c.scale
            if v is None:
                cells.append("-")
            elif callable(c.fmt):
                cells.append(c.fmt(v))
            elif c.fmt:
                cells.append(c.fmt.format(v) if "{" in c.fmt else format(v, c.fmt))
            else:
                cells.append(format_value(v))
        out.append(cells)
    return out


def columns_of(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The first row's keys: the default columns."""
    return list(rows[0]) if rows else []


def render_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[ColumnSpec] | None = None,
                 title: str | None = None) -> str:
    """The table as plain text (no trailing newline), `title` on the line above. Columns of numbers (and "-")
    are right-aligned."""
    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    rows = list(rows)
    cols = [_col(c) for c in (columns if columns is not None else columns_of(rows))]
    if not cols:
        raise ValueError("a table needs at least one column")
    cells = _cells(rows, cols)
    table = Table(box=box.MARKDOWN)
    for j, c in enumerate(cols):
        numeric = bool(cells) and all(_numeric(r[j]) for r in cells)
        table.add_column(Text(c.header if c.header is not None else c.key), justify="right" if numeric else "left")
    for r in cells:
        table.add_row(*(Text(s.replace("|", "\\|")) for s in r))  # Text: "[...]" is text, not rich markup
    buf = io.StringIO()
    Console(file=buf, width=100_000, color_system=None, force_terminal=False, soft_wrap=False).print(table)
    lines = [line.rstrip() for line in buf.getvalue().splitlines() if line.strip()]  # not the box's blank edges
    return "\n".join([title, *lines] if title else lines)  # the title on its own line: rich would wrap it


def _numeric(s: str) -> bool:
    t = s.strip().replace(",", "").rstrip("%x")
    if t in ("-", "nan", "inf", "-inf"):
        return True
    try:
        float(t)
    except ValueError:
        return False
    return True


def print_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[ColumnSpec] | None = None,
                title: str | None = None) -> None:
    print(render_table(rows, columns, title), flush=True)


def bench_path(name_or_path: str | os.PathLike) -> Path:
    """A bare name (no folder, no suffix) is runs/bench/NAME.json; anything else is the path itself."""
    p = Path(name_or_path)
    if isinstance(name_or_path, str) and p.parent == Path(".") and not p.suffix:
        return BENCH_DIR / f"{p.name}.json"
    return p


def _jsonable(o: Any) -> Any:
    if hasattr(o, "tolist"):  # NumPy / JAX scalars and arrays
        return o.tolist()
    if isinstance(o, os.PathLike):
        return os.fspath(o)
    return str(o)


def write_text(path: str | os.PathLike, text: str) -> Path:
    """Write atomically: a reader never sees half a file, a killed writer leaves the old one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_json(path: str | os.PathLike, data: Mapping[str, Any], *, machine: Mapping[str, Any] | None = None,
               indent: int = 2) -> Path:
    """`data` as JSON at `path` (atomically), with `machine` under "machine" where given (data must then not
    have the key itself). NumPy values become lists/numbers, anything else unknown its str()."""
    if machine is not None:
        if "machine" in data:
            raise ValueError("data already has a 'machine' key; pass the machine in one place only")
        data = {**data, "machine": machine}
    return write_text(path, json.dumps(data, indent=indent, default=_jsonable) + "\n")


def write_results(out: str | os.PathLike, rows: Sequence[Mapping[str, Any]] = (), *,
                  columns: Sequence[ColumnSpec] | None = None, title: str | None = None,
                  meta: Mapping[str, Any] | None = None, machine: dict[str, Any] | None = None,
                  rows_key: str | None = "rows", notes: Iterable[str] = (), indent: int = 2) -> Path:
    """Print the table of `rows` (if any), then each of `notes`, the machine line and the path written.

    JSON: `{**meta, rows_key: rows, "machine": machine}` (`rows_key=None`: the rows are the table only, the
    figures being in `meta`). `machine` is `c2jax.machine.describe()` taken at the start of the measurement;
    its end load is recorded here (`finish`). None: described now. Returns the path written. Every check runs
    before anything is printed or written: a bad row or column is a ValueError naming it.
    """
    meta = dict(meta or {})
    rows = list(rows)
    if "machine" in meta:
        raise ValueError("meta has a 'machine' key; pass the machine as machine=")
    if rows_key is not None:
        if rows_key in meta:
            raise ValueError(f"meta has the rows' key {rows_key!r}; pass rows_key=None or another name")
        meta[rows_key] = rows
    table = render_table(rows, columns, title) if rows else None
    machine = finish(machine if machine is not None else describe())
    if table is not None:
        print(table)
    for note in notes:
        print(note)
    path = write_json(bench_path(out), meta, machine=machine, indent=indent)
    print(f"machine: {summary_line(machine)}")
    print(f"wrote {path}", flush=True)
    return path
