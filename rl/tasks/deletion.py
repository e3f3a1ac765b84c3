"""Feature deletion (Composer 2.5's synthetic tasks): remove a public top-level function or class and
its re-exports (`from .m import name`, `__all__` entries) so the package still imports; the tests
that exercised it become the hidden FAIL_TO_PASS tests, and the task is to re-implement it."""

from __future__ import annotations

import ast
from pathlib import Path


def _uses(source: str, name: str) -> bool:
    """Whether a module refers to `name` other than by defining, importing or listing it."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == name:
            return True
        if isinstance(node, ast.Attribute) and node.attr == name:
            return True
    return False


def deletable(repo: Path, modules: list[str]) -> list[tuple[str, str]]:
    """(module path, name) of public top-level defs that no other package code uses."""
    sources = {m: (repo / m).read_text() for m in modules}
    out = []
    for mod, src in sources.items():
        for node in ast.parse(src).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                body_wo = _remove_def(src, node.name)
                if not any(_uses(body_wo if m == mod else s, node.name) for m, s in sources.items()):
                    out.append((mod, node.name))
    return out


def _splice(source: str, spans: list[tuple[int, int, str]]) -> str:
    """Replaces whole-line spans (1-based first line, last line inclusive, new text), from the end."""
    lines = source.splitlines(keepends=True)
    for first, last, text in sorted(spans, reverse=True):
        lines[first - 1: last] = [text] if text else []
    return "".join(lines)


def _remove_def(source: str, name: str) -> str:
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            return _splice(source, [(first, node.end_lineno, "")])
    return source


def _drop_reexports(source: str, name: str) -> str:
    spans = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.ImportFrom) and any(a.name == name for a in node.names):
            kept = [a for a in node.names if a.name != name]
            text = "" if not kept else ast.unparse(ast.ImportFrom(node.module, kept, node.level)) + "\n"
            spans.append((node.lineno, node.end_lineno, text))
        elif (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
              and isinstance(node.value, (ast.List, ast.Tuple))):
            elts = [e for e in node.value.elts if not (isinstance(e, ast.Constant) and e.value == name)]
            if len(elts) != len(node.value.elts):
                value = type(node.value)(elts=elts, ctx=ast.Load())
                assign = ast.Assign(targets=node.targets, value=value, lineno=node.lineno)
                spans.append((node.lineno, node.end_lineno, ast.unparse(assign) + "\n"))
    return _splice(source, spans)


def delete_feature(repo: Path, modules: list[str], module: str, name: str) -> dict[str, str]:
    """Edited module texts (path -> new source) with `name` removed from `module` and its re-exports
    removed everywhere in the package."""
    edits = {}
    for mod in modules:
        src = (repo / mod).read_text()
        new = _drop_reexports(_remove_def(src, name) if mod == module else src, name)
        if new != src:
            ast.parse(new)
            edits[mod] = new
    return edits


def prompts(module: str, name: str, f2p: list[str], package: str, original: str) -> dict[str, str]:
    doc = ""
    for node in ast.parse(original).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
            doc = ast.get_docstring(node) or ""
            sig = f"{name}({ast.unparse(node.args)})" if isinstance(node, ast.FunctionDef) else f"class {name}"
    shown = ", ".join(f"`{t}`" for t in f2p[:3]) + (f" and {len(f2p) - 3} more" if len(f2p) > 3 else "")
    return {
        "terse": f"add {name} to {package}",
        "issue": f"{package} is missing `{name}` (it belongs in {module}). Please implement it; "
                 f"tests such as {shown} use it.",
        "full": f"Implement `{sig}` in {module} and export it the way the package exports its other "
                f"public names. Specification (docstring):\n\n{doc or '(none)'}\n\nThe tests {shown} must pass.",
    }
