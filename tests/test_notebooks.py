"""Every notebook under notebooks/ runs top to bottom (what a user opening it would do)."""

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


def _execute(path: Path) -> list[dict]:
    """The error outputs of one top-to-bottom run (an exception escaping a cell is one too)."""
    nb = nbformat.read(path, as_version=4)
    try:
        NotebookClient(nb, timeout=600, kernel_name="python3",
                       resources={"metadata": {"path": str(path.parent)}}).execute()
    except Exception as e:  # noqa: BLE001 -- reported by the notebook's own test
        return [{"ename": type(e).__name__, "evalue": str(e)[-2000:]}]
    return [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]


@pytest.fixture(scope="module")
def executed():
    # Two kernels at a time: a kernel spends much of its time in single-threaded Python (imports, tracing,
    # compiling), so two overlap well on two cores.
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(NOTEBOOKS, pool.map(_execute, NOTEBOOKS)))


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes(path, executed):
    assert not executed[path], executed[path]


def test_there_is_at_least_one_notebook():
    assert NOTEBOOKS
