"""The package layout: one installed import name (`c2jax`), the folders' layering
`kernels <- models <- c2jax <- rl <- experiments` read statically from the checkout (no symlinks, no
imports executed), the build backend's mapping of the folders, and coexistence with Hugging Face's `kernels`."""

import ast
import importlib
import shutil
import subprocess
import sys
import tomllib
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

from c2jax.layout import SUBPACKAGE_FOLDERS

ROOT = Path(__file__).resolve().parent.parent
# Folder -> the layer it is, lowest first; a module may import only its own layer or a lower one.
LAYERS = {"kernels": 0, "models": 1, "c2jax": 2, "rl": 3, "experiments": 4}
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _imported_modules(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
            names += [f"{node.module}.{a.name}" for a in node.names]  # `from c2jax.rl import system`
    return names


def _module_files() -> dict[str, Path]:
    """Every first-party module name -> its file, as the build backend maps them (pyproject's package-dir),
    found by walking real files only (`Path.rglob` does not follow symlinked folders)."""
    files = {}
    for folder in LAYERS:
        prefix = "experiments" if folder == "experiments" else ("c2jax" if folder == "c2jax" else f"c2jax.{folder}")
        for path in (ROOT / folder).rglob("*.py"):
            if path.is_symlink() or any(p.is_symlink() for p in path.relative_to(ROOT).parents if p != Path(".")):
                continue
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            files[".".join([prefix, *parts])] = path
    for name, folder in SUBPACKAGE_FOLDERS.items():
        files[name] = ROOT / folder  # a namespace folder: `from c2jax.kernels import mxfp8` points into it
    return files


def _layer_of_file(path: Path) -> str:
    return path.relative_to(ROOT).parts[0]


def _import_graph() -> dict[str, set[str]]:
    """Static graph between "rooms" (a folder and its first-level subfolder, e.g. `rl/system`)."""
    files = _module_files()
    graph: dict[str, set[str]] = {}
    for path in files.values():
        if path.is_dir():
            continue
        room = _room(path)
        graph.setdefault(room, set())
        for name in _imported_modules(path):
            target = _resolve(name, files)
            if target is not None and _room(target) != room:
                graph[room].add(_room(target))
    return graph


def _room(path: Path) -> str:
    parts = path.relative_to(ROOT).parts
    return "/".join(parts[:2]) if len(parts) > 2 else parts[0]


def _resolve(name: str, files: dict[str, Path]) -> Path | None:
    while name:
        if name in files:
            return files[name]
        name = name.rpartition(".")[0]
    return None


def test_the_checkout_has_no_symlinks():
    """Static tools read the tree as cloned: a symlinked package would hide its imports from them."""
    tracked = subprocess.run(["git", "ls-files", "-s"], cwd=ROOT, capture_output=True, text=True, check=True)
    links = [line.split("\t", 1)[1] for line in tracked.stdout.splitlines() if line.startswith("120000")]
    assert not links, f"symlinks in the repository: {links}"


@pytest.mark.parametrize("folder", list(LAYERS))
def test_no_folder_imports_upward_or_by_a_bare_name(folder):
    files = _module_files()
    problems = []
    for path in (p for p in files.values() if _layer_of_file(p) == folder and not p.is_dir()):
        for module in _imported_modules(path):
            top = module.split(".")[0]
            if top in {"models", "rl", "kernels"}:
                problems.append(f"{path.relative_to(ROOT)} imports `{module}`: use c2jax.{module}")
                continue
            target = _resolve(module, files)
            if target is None:
                continue
            layer = _layer_of_file(target)
            if LAYERS[layer] > LAYERS[folder]:
                problems.append(f"{path.relative_to(ROOT)} ({folder}) imports `{module}` ({layer}): upward")
    assert not problems, "\n".join(problems)


def test_the_static_import_graph_shows_every_room_and_only_downward_arrows():
    """The graph a reviewer's tool draws from the checkout: all rooms of docs/ARCHITECTURE.md appear, the
    three model/RL/kernel folders have arrows into them, and none points to a higher layer."""
    graph = _import_graph()
    rooms = set(graph)
    for expected in ("kernels", "models", "models/hf", "models/inference", "c2jax", "c2jax/train", "c2jax/data",
                     "rl", "rl/system", "rl/harness", "rl/sandbox", "rl/eval", "rl/tasks"):
        assert expected in rooms, (expected, sorted(rooms))
    arrows = [(a, b) for a, targets in graph.items() for b in targets]
    assert len(arrows) > 30, arrows
    upward = [(a, b) for a, b in arrows if LAYERS[b.split("/")[0]] > LAYERS[a.split("/")[0]]]
    assert not upward, upward
    assert any(b.startswith("models") for a, b in arrows if a.startswith("rl"))
    assert any(b == "kernels" for a, b in arrows if a.startswith("models"))


def test_pyproject_maps_each_folder_to_its_import_name_and_lists_every_package():
    """The wheel's contents come from this list: a new subfolder missing from it would be left out."""
    config = PYPROJECT["tool"]["setuptools"]
    assert config["package-dir"] == SUBPACKAGE_FOLDERS
    expected = {name if path.is_dir() or path.name == "__init__.py" else name.rpartition(".")[0]
                for name, path in _module_files().items() if name.startswith("c2jax")}
    assert set(config["packages"]) == expected, (sorted(expected - set(config["packages"])),
                                                 sorted(set(config["packages"]) - expected))


def test_the_folders_are_namespace_packages_under_c2jax():
    """No __init__.py at the folders' top: from the repository root a bare `import kernels` must find
    Hugging Face's regular package, never ours."""
    for name, folder in SUBPACKAGE_FOLDERS.items():
        assert not (ROOT / folder / "__init__.py").exists(), folder
        module = importlib.import_module(name)
        assert [Path(p).resolve() for p in module.__path__] == [(ROOT / folder).resolve()]


def test_a_built_wheel_holds_only_c2jax_and_imports_outside_the_checkout(tmp_path):
    """The wheel a user installs: every file under `c2jax/`, the folders inside it, importable from
    elsewhere, ahead of the checkout's editable install. Built from a copy: setuptools writes build/ into
    the source tree."""
    source = tmp_path / "source"
    source.mkdir()
    shutil.copy(ROOT / "pyproject.toml", source)
    for folder in ("c2jax", *SUBPACKAGE_FOLDERS.values()):
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                            "-w", str(tmp_path / "dist"), str(source)], capture_output=True, text=True,
                           timeout=600, cwd=tmp_path)
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("c2jax-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        archive.extractall(tmp_path / "site")
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"c2jax"}, tops
    for folder in SUBPACKAGE_FOLDERS.values():
        assert any(n.startswith(f"c2jax/{folder}/") for n in names), folder
    code = (f"import sys; sys.path.insert(0, {str(tmp_path / 'site')!r})\n"
            "import c2jax.models.config, c2jax.rl.system.config, c2jax.kernels.mxfp8\n"
            "print(c2jax.models.config.__file__, c2jax.rl.system.config.__file__)\n")
    proc = subprocess.run([sys.executable, "-I", "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for file in proc.stdout.split():
        assert file.startswith(str(tmp_path / "site" / "c2jax")), proc.stdout


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


def test_every_first_party_import_names_a_file_of_the_checkout():
    """A `c2jax.*` import the static graph cannot place (a typo, a module left behind by a move) is caught
    here rather than by the first user who reaches it."""
    files = _module_files()
    missing = []
    for path in (p for p in files.values() if not p.is_dir()):
        for module in _imported_modules(path):
            # `from c2jax.x import name` lists `c2jax.x.name` too, which may be a name: then c2jax.x must be a file
            if module.split(".")[0] in {"c2jax", "experiments"} and module not in files \
                    and module.rpartition(".")[0] not in files:
                missing.append(f"{path.relative_to(ROOT)}: {module}")
    assert not missing, "\n".join(missing)
