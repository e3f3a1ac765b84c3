"""Feature deletion (Composer 2.5's synthetic tasks): remove public top-level functions or classes, the
private helpers only they use, and their re-exports (`from .m import name`, `__all__` entries), so the
package still imports; the tests that exercised them become the hidden FAIL_TO_PASS tests, and the task
is to re-implement the feature.

A feature is one or more public targets, possibly in several modules. Its closure adds every private
top-level def or constant (`_name`) that the removed code refers to and nothing left in the package
refers to, repeated until nothing more qualifies, so the agent re-implements what the feature needed
rather than finding its helpers still lying next to the gap.
"""

from __future__ import annotations

import ast
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

_DEF_TYPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _uses(source: str, name: str) -> bool:
    """Whether a module refers to `name` other than by defining, importing or listing it."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == name:
            return True
        if isinstance(node, ast.Attribute) and node.attr == name:
            return True
    return False


def _refs(node: ast.AST) -> set[str]:
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
    return out


def _private_assign_name(node: ast.stmt) -> str | None:
    """`_NAME = ...` / `_NAME: T = ...` at top level (a private constant), else None."""
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
        name = node.targets[0].id
    elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
        name = node.target.id
    else:
        return None
    return name if _is_private(name) else None


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name != "_"


@dataclass(frozen=True)
class _Unit:
    """One top-level statement of a package module: a def (named) or anything else (name None)."""

    module: str
    name: str | None
    first: int  # first line, decorators included (1-based)
    last: int
    refs: frozenset[str]


def _units(module: str, source: str) -> list[_Unit]:
    out = []
    for node in ast.parse(source).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue  # importing a name is not using it; re-exports are dropped with the name
        name = node.name if isinstance(node, _DEF_TYPES) else _private_assign_name(node)
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        out.append(_Unit(module, name, first, node.end_lineno, frozenset(_refs(node))))
    return out


@dataclass
class Package:
    """The package's modules parsed once: top-level units and their references."""

    repo: Path
    modules: list[str]
    sources: dict[str, str] = field(init=False)
    units: list[_Unit] = field(init=False)

    def __post_init__(self):
        self.sources = {m: (self.repo / m).read_text() for m in self.modules}
        self.units = [u for m, s in self.sources.items() for u in _units(m, s)]

    def public_defs(self) -> list[_Unit]:
        return [u for u in self.units if u.name and not u.name.startswith("_")]  # named units: defs, private constants

    def referrers(self, name: str, removed: set[_Unit]) -> list[_Unit]:
        return [u for u in self.units if u not in removed and name in u.refs and u.name != name]


@dataclass(frozen=True)
class Feature:
    """What one task removes: public `targets` and private `helpers`, as (module, name)."""

    targets: tuple[tuple[str, str], ...]
    helpers: tuple[tuple[str, str], ...]
    edits: tuple[tuple[str, str], ...]  # (module path, new source), sorted by path
    lines: int  # source lines removed, summed over modules
    files: int  # modules edited (re-exports included)

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(sorted({m for m, _ in self.targets}))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for _, n in self.targets)


def deletable(repo: Path, modules: list[str]) -> list[tuple[str, str]]:
    """(module path, name) of public top-level defs that no other package code uses."""
    pkg = Package(repo, modules)
    return [(u.module, u.name) for u in pkg.public_defs() if not pkg.referrers(u.name, {u})]


def closure(pkg: Package, targets: list[tuple[str, str]]) -> Feature:
    """The feature of `targets` (each deletable on its own): the targets, plus the private helpers that
    only removed code refers to, found to a fixed point; and the edited sources."""
    by_key = {(u.module, u.name): u for u in pkg.units if u.name}
    removed = {by_key[t] for t in targets}
    helpers: list[_Unit] = []
    changed = True
    while changed:
        changed = False
        wanted = set().union(*(u.refs for u in removed))
        for u in pkg.units:
            if (u.name and _is_private(u.name) and u.name in wanted and u not in removed
                    and not pkg.referrers(u.name, removed | {u})):
                removed.add(u)
                helpers.append(u)
                changed = True
    names = {u.name for u in removed}
    edits = []
    lines = 0
    for mod, src in pkg.sources.items():
        spans = [(u.first, u.last) for u in removed if u.module == mod]
        new = _splice(src, [(a, b, "") for a, b in spans])
        for name in sorted(names):
            new = _drop_reexports(new, name)
        new = _tidy(new) if new != src else new
        if new != src:
            ast.parse(new)
            edits.append((mod, new))
            lines += len(src.splitlines()) - len(new.splitlines())
    return Feature(tuple(targets), tuple(sorted((u.module, u.name) for u in helpers)), tuple(edits), lines,
                   len(edits))


def test_mentions(repo: Path, names: set[str]) -> dict[str, set[str]]:
    """name -> the test files (repository paths) that import it by name or read it off an imported
    module (`from pkg.m import name`, `m.name`): what a test file exercises, not words it happens to use."""
    from c2jax.rl.tasks.patches import is_test_path

    out: dict[str, set[str]] = {n: set() for n in names}
    for path in sorted(repo.rglob("*.py")):
        rel = path.relative_to(repo).as_posix()
        if not is_test_path(rel):
            continue
        try:
            tree = ast.parse(path.read_text(errors="replace"))
        except SyntaxError:
            continue
        imported, modules = set(), set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                for a in node.names:
                    imported.add(a.name)
                    modules.add(a.asname or a.name)
            elif isinstance(node, ast.Import):
                modules.update((a.asname or a.name).split(".")[0] for a in node.names)
        read = {n.attr for n in ast.walk(tree)
                if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in modules}
        for n in names & (imported | read):
            out[n].add(rel)
    return out


def multi_file_features(repo: Path, modules: list[str], rng: random.Random, *, min_lines: int = 40,
                        min_files: int = 2, max_targets: int = 3) -> list[Feature]:
    """Candidate features of at least `min_lines` removed lines over at least `min_files` files, in a
    seeded random order: single targets whose closure already is that large (a class with its helpers
    and its re-export), then groups of up to `max_targets` targets from different modules that one test
    file exercises together (a coherent feature that spans modules)."""
    pkg = Package(repo, modules)
    singles = {t: closure(pkg, [t]) for t in deletable(repo, modules)}
    keys = list(singles)
    rng.shuffle(keys)
    out = [singles[k] for k in keys if singles[k].lines >= min_lines and singles[k].files >= min_files]
    seen = {f.targets for f in out}
    mentions = test_mentions(repo, {n for _, n in keys})
    for seed in keys:
        if not mentions[seed[1]]:
            continue
        group = [seed]
        partners = [k for k in keys if k[0] != seed[0] and mentions[k[1]] & mentions[seed[1]]]
        rng.shuffle(partners)
        feature = singles[seed]
        for p in partners:
            if len(group) == max_targets or (feature.lines >= min_lines and feature.files >= min_files):
                break
            if p[0] in {m for m, _ in group}:
                continue
            group.append(p)
            feature = closure(pkg, sorted(group))
        key = tuple(sorted(group))
        if len(group) > 1 and feature.lines >= min_lines and feature.files >= min_files and key not in seen:
            seen.add(key)
            out.append(feature)
    return out


def _tidy(source: str) -> str:
    """At most two blank lines in a row, and one newline at the end: what removing defs leaves, tidied
    (PEP 8 spacing), so the gap does not show where the feature was."""
    text = re.sub(r"\n(?:[ \t]*\n){3,}", "\n\n\n", source)
    return text.rstrip("\n") + "\n" if text.strip() else ""


def _splice(source: str, spans: list[tuple[int, int, str]]) -> str:
    """Replaces whole-line spans (1-based first line, last line inclusive, new text), from the end."""
    lines = source.splitlines(keepends=True)
    for first, last, text in sorted(spans, reverse=True):
        lines[first - 1: last] = [text] if text else []
    return "".join(lines)


def _remove_def(source: str, name: str) -> str:
    for node in ast.parse(source).body:
        if isinstance(node, _DEF_TYPES) and node.name == name:
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
    removed everywhere in the package (no helpers: the single-target task of `deletion_tasks`)."""
    edits = {}
    for mod in modules:
        src = (repo / mod).read_text()
        new = _drop_reexports(_remove_def(src, name) if mod == module else src, name)
        if new != src:
            ast.parse(new)
            edits[mod] = new
    return edits


def _signature(node: ast.AST) -> str:
    if isinstance(node, ast.ClassDef):
        bases = ", ".join(ast.unparse(b) for b in node.bases)
        return f"class {node.name}" + (f"({bases})" if bases else "")
    return f"{node.name}({ast.unparse(node.args)})"


def _find(source: str, name: str) -> ast.AST | None:
    return next((n for n in ast.parse(source).body if isinstance(n, _DEF_TYPES) and n.name == name), None)


def prompts(module: str, name: str, f2p: list[str], package: str, original: str) -> dict[str, str]:
    node = _find(original, name)
    doc = (ast.get_docstring(node) or "") if node else ""
    sig = _signature(node) if node else name
    shown = _shown(f2p)
    return {
        "terse": f"add {name} to {package}",
        "issue": f"{package} is missing `{name}` (it belongs in {module}). Please implement it; "
                 f"tests such as {shown} use it.",
        "full": f"Implement `{sig}` in {module} and export it the way the package exports its other "
                f"public names. Specification (docstring):\n\n{doc or '(none)'}\n\nThe tests {shown} must pass.",
    }


def _shown(f2p: list[str], n: int = 3) -> str:
    return ", ".join(f"`{t}`" for t in f2p[:n]) + (f" and {len(f2p) - n} more" if len(f2p) > n else "")


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def feature_prompts(feature: Feature, f2p: list[str], package: str, originals: dict[str, str]) -> dict[str, str]:
    """Terse (one line, as a user would type it), issue (where each name belongs and which tests use
    them: CursorBench-length), full (signatures and docstrings, the helpers' names, every module)."""
    names = [f"`{n}`" for n in feature.names]
    where = _and([f"`{n}` ({m})" for m, n in feature.targets])
    test_files = sorted({t.split("::")[0] for t in f2p})
    specs = []
    for m, n in feature.targets:
        node = _find(originals[m], n)
        doc = (ast.get_docstring(node) or "(no docstring)") if node else ""
        specs.append(f"- `{_signature(node) if node else n}` in {m}:\n{_indent(doc)}")
    helpers = f" It also used private helpers that were removed: {_and([n for _, n in feature.helpers])}." \
        if feature.helpers else ""
    return {
        "terse": f"{package}: bring back {_and(names)}",
        "issue": f"{package} lost {where}. Re-implement {'it' if len(names) == 1 else 'them'} and export "
                 f"them as before; {_and([f'`{t}`' for t in test_files[:3]])} exercise"
                 f"{'s' if len(test_files[:3]) == 1 else ''} {'it' if len(names) == 1 else 'them'}.",
        "full": f"Implement in {package}, exporting each name the way the package exports its other public "
                f"names:\n" + "\n".join(specs) + f"\n{helpers}\nThe tests {_shown(f2p)} must pass.",
    }


def _indent(text: str) -> str:
    return "\n".join("    " + line if line else "" for line in text.splitlines())
