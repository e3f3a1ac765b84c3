"""The package layout: one installed import name (`c2jax`), the folders' layering
`kernels <- models <- c2jax <- rl <- experiments`, and coexistence with Hugging Face's `kernels`."""

import ast
import importlib
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Folder -> the layer it is, lowest first; a module may import only its own layer or a lower one.
LAYERS = {"kernels": 0, "models": 1, "c2jax": 2, "rl": 3, "experiments": 4}
LAYER_OF_NAME = {"c2jax.kernels": "kernels", "c2jax.models": "models", "c2jax.rl": "rl",
                 "c2jax": "c2jax", "experiments": "experiments"}


def _imported_modules(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def _layer_of(module: str) -> str | None:
    for prefix in sorted(LAYER_OF_NAME, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + "."):
            return LAYER_OF_NAME[prefix]
    return None


def _sources(folder: str) -> list[Path]:
    """The folder's own modules: c2jax/'s symlinks to the other folders are theirs, not c2jax's."""
    links = {"models", "rl", "kernels"} if folder == "c2jax" else set()
    return [p for p in (ROOT / folder).rglob("*.py") if p.relative_to(ROOT / folder).parts[0] not in links]


@pytest.mark.parametrize("folder", list(LAYERS))
def test_no_folder_imports_upward_or_by_a_bare_name(folder):
    problems = []
    for path in _sources(folder):
        for module in _imported_modules(path):
            top = module.split(".")[0]
            if top in {"models", "rl", "kernels"}:
                problems.append(f"{path.relative_to(ROOT)} imports `{module}`: use c2jax.{module}")
                continue
            layer = _layer_of(module)
            if layer is not None and LAYERS[layer] > LAYERS[folder]:
                problems.append(f"{path.relative_to(ROOT)} ({folder}) imports `{module}` ({layer}): upward")
    assert not problems, "\n".join(problems)


def test_the_folders_are_namespace_packages_under_c2jax():
    """No __init__.py at the folders' top: from the repository root a bare `import kernels` must find
    Hugging Face's regular package, never ours."""
    for folder in ("models", "rl", "kernels"):
        assert not (ROOT / folder / "__init__.py").exists(), folder
        link = ROOT / "c2jax" / folder
        assert link.is_symlink() and link.resolve() == (ROOT / folder).resolve(), link
        module = importlib.import_module(f"c2jax.{folder}")
        assert [Path(p).resolve() for p in module.__path__] == [(ROOT / folder).resolve()]


def test_transformers_and_its_kernels_dependency_import_beside_c2jax_from_the_repo_root():
    """Run from the repository root (its folders first on sys.path), as `python -m pytest` and the demo
    do: transformers imports Hugging Face's `kernels` where it is installed, and c2jax's modules load too."""
    code = ("import importlib.util, transformers, c2jax.kernels.mxfp8, c2jax.models.hf, c2jax.rl.system.config\n"
            "from transformers import DeepseekV3ForCausalLM\n"
            "spec = importlib.util.find_spec('kernels')\n"
            "origin = spec.origin if spec else None\n"
            "print('hub' if origin and 'site-packages' in origin else 'ours' if spec else 'none')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    try:
        metadata.distribution("kernels")
    except metadata.PackageNotFoundError:
        assert proc.stdout.strip() in {"ours", "none"}
    else:
        assert proc.stdout.strip() == "hub"  # HF's kernels installed: a bare `kernels` is theirs
