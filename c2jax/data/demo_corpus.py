"""The demo corpus: code, docs and SFT pairs built on the fly from the Python installed on this machine.

  stdlib_code  every .py file of the standard library and of site-packages (language "python")
  stdlib_docs  per Python module, its docstrings (module, then each class and function, with its
               qualified name), plus the .rst/.md/.txt files shipped in those trees
  stdlib_sft   per function with a docstring: prompt = signature + docstring, completion = body

A source's `path`, when set, replaces the default roots (stdlib + site-packages) with that directory.
The corpus is deterministic on a given machine; it changes when packages are installed or removed.
"""

from __future__ import annotations

import ast
import os
import site
import sysconfig
from pathlib import Path

from c2jax.data.config import SourceConfig
from c2jax.data.source_tree import SourceTreeSource

# Packaging metadata and compiled caches are not prose; nested site-packages would list files twice.
_EXCLUDES = ("site-packages/", "dist-packages/", "*.dist-info/", "*.egg-info/", "__pycache__/")
_SFT_MIN_BODY_LINES, _SFT_MAX_BODY_LINES = 2, 80


def default_roots() -> tuple[Path, ...]:
    roots = [Path(sysconfig.get_paths()["stdlib"])]
    roots += [Path(p) for p in site.getsitepackages() + [sysconfig.get_paths()["purelib"]]]
    unique = []
    for root in roots:
        root = root.resolve()
        if root.is_dir() and root not in unique:
            unique.append(root)
    return tuple(unique)


def _roots(cfg: SourceConfig) -> tuple[Path, ...]:
    return (Path(os.path.expanduser(cfg.path)),) if cfg.path else default_roots()


def stdlib_code(cfg: SourceConfig) -> SourceTreeSource:
    return SourceTreeSource(cfg, _roots(cfg), languages=("python",), excludes=_EXCLUDES)


def _parse(text: str) -> ast.Module | None:
    try:
        return ast.parse(text)
    except (SyntaxError, ValueError, RecursionError):  # Python 2 files and test fixtures exist in the wild
        return None


def _documented(tree: ast.Module):
    """(qualified name, node) of every class and function with a docstring, in source order."""
    stack = [("", tree)]
    while stack:
        prefix, node = stack.pop()
        children = [n for n in ast.iter_child_nodes(node)
                    if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
        for child in reversed(children):
            stack.append((f"{prefix}{child.name}.", child))
        if node is not tree and ast.get_docstring(node):
            yield prefix[:-1], node


def module_docs(text: str, path: str) -> str:
    """Module docstring then `name: docstring` paragraphs of a Python file; "" when it has none."""
    tree = _parse(text)
    if tree is None:
        return ""
    parts = []
    if doc := ast.get_docstring(tree):
        parts.append(doc)
    for name, node in _documented(tree):
        if not name.split(".")[-1].startswith("_"):
            parts.append(f"{name}:\n{ast.get_docstring(node)}")
    if not parts:
        return ""
    module = path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
    return f"{module}\n\n" + "\n\n".join(parts) + "\n"


class _DocsSource(SourceTreeSource):
    def __getitem__(self, index: int) -> list[dict]:
        text = self.read_text(index)
        if text is None:
            return []
        _, rel, lang = self.files[index]
        if lang == "python":
            text = module_docs(text, rel)
        return [{"text": text, "language": lang, "path": rel}] if text.strip() else []


def stdlib_docs(cfg: SourceConfig) -> SourceTreeSource:
    return _DocsSource(cfg, _roots(cfg), languages=("python", "rst", "markdown", "text"), excludes=_EXCLUDES)


def _dedent(lines: list[str], width: int) -> str:
    return "".join(line[width:] if not line[:width].strip() else line.lstrip() for line in lines)


def function_pairs(text: str) -> list[dict]:
    """{"prompt": signature + docstring, "completion": body} for each documented function."""
    tree = _parse(text)
    if tree is None:
        return []
    lines = text.splitlines(keepends=True)
    pairs = []
    for _, node in _documented(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or len(node.body) < 2:
            continue
        start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
        body_start, end = node.body[0].end_lineno, node.end_lineno
        if not _SFT_MIN_BODY_LINES <= end - body_start <= _SFT_MAX_BODY_LINES:
            continue
        width = node.col_offset
        pairs.append({"prompt": _dedent(lines[start:body_start], width),
                      "completion": _dedent(lines[body_start:end], width)})
    return pairs


class _SftSource(SourceTreeSource):
    def __getitem__(self, index: int) -> list[dict]:
        text = self.read_text(index)
        return function_pairs(text) if text is not None else []


def stdlib_sft(cfg: SourceConfig) -> SourceTreeSource:
    return _SftSource(cfg, _roots(cfg), languages=("python",), excludes=_EXCLUDES)


__all__ = ["default_roots", "function_pairs", "module_docs", "stdlib_code", "stdlib_docs", "stdlib_sft"]
