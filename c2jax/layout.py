"""The source layout: the top-level folders `models/`, `rl/` and `kernels/` are the packages `c2jax.models`,
`c2jax.rl` and `c2jax.kernels`.

A wheel holds them under `c2jax/` (pyproject.toml's `[tool.setuptools.package-dir]`). In a checkout, and in
an editable install of one, they sit beside `c2jax/`. They have no `__init__.py` on purpose: as PEP 420
namespace folders, a bare `import kernels` run from the repository root still finds Hugging Face's kernel
hub (a regular package wins over a namespace portion), never ours. setuptools' editable finder maps only
folders with an `__init__.py`, so this finder maps the three names to the folders, and only where `c2jax/`
itself lacks them (a checkout or an editable install; a wheel's own folders come first).
tests/test_layout.py checks this table against pyproject.toml's mapping.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from pathlib import Path

# Import name -> its folder, relative to the repository root (the directory holding c2jax/).
SUBPACKAGE_FOLDERS = {"c2jax.kernels": "kernels", "c2jax.models": "models", "c2jax.rl": "rl"}


class SourceLayoutFinder(importlib.abc.MetaPathFinder):
    """Finds `c2jax.models` etc. as namespace packages rooted at the top-level folders of `root`."""

    def __init__(self, root: Path):
        self.root = root

    def find_spec(self, fullname, path=None, target=None):
        folder = SUBPACKAGE_FOLDERS.get(fullname)
        if folder is None or not (self.root / folder).is_dir():
            return None
        spec = importlib.machinery.ModuleSpec(fullname, None, is_package=True)
        spec.submodule_search_locations = [str(self.root / folder)]
        return spec


def install() -> None:
    package = Path(__file__).resolve().parent
    if all((package / name.rpartition(".")[2]).is_dir() for name in SUBPACKAGE_FOLDERS):
        return  # an installed wheel: the folders are c2jax's own
    if not any(isinstance(f, SourceLayoutFinder) for f in sys.meta_path):
        sys.meta_path.append(SourceLayoutFinder(package.parent))
