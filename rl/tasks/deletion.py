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
    """One statement of a package module that a feature can remove or that can use a removed name: a
    top-level def, a private constant, a method of a top-level class (`owner` = the class), or any other
    top-level statement (name None). A class's own unit holds its header and non-method body; its
    methods are units of their own, so removing one method leaves the class's other uses standing."""

    module: str
    name: str | None
    first: int  # first line, decorators included (1-based)
    last: int
    refs: frozenset[str]
    owner: str | None = None  # the enclosing top-level class of a method
    body_first: int | None = None  # a function's first statement after its docstring (None: not a function)
    body_indent: str = ""

    @property
    def qualname(self) -> str:
        return f"{self.owner}.{self.name}" if self.owner else str(self.name)


def _first_line(node: ast.AST) -> int:
    return min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])


def _body(node: ast.AST, lines: list[str]) -> dict:
    """A multi-line function's body after its docstring (what a stub replaces): first line, indentation."""
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return {}
    body = node.body[1:] if ast.get_docstring(node) is not None else node.body
    if not body or _first_line(body[0]) <= node.body[0].end_lineno and body is not node.body:
        return {}  # nothing after the docstring, or a statement on the docstring's line
    first_line = _first_line(body[0])
    if first_line <= node.lineno:
        return {}  # a one-line def: `def f(): return 1`
    text = lines[first_line - 1]
    return {"body_first": first_line, "body_indent": text[: len(text) - len(text.lstrip())]}


def _units(module: str, source: str) -> list[_Unit]:
    out = []
    lines = source.splitlines()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue  # importing a name is not using it; re-exports are dropped with the name
        if isinstance(node, ast.ClassDef):
            methods = [b for b in node.body if isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef))]
            header = [*node.decorator_list, *node.bases, *node.keywords,
                      *(b for b in node.body if b not in methods)]
            out.append(_Unit(module, node.name, _first_line(node), node.end_lineno,
                             frozenset().union(*(_refs(h) for h in header))))
            out += [_Unit(module, m.name, _first_line(m), m.end_lineno, frozenset(_refs(m)), node.name,
                          **_body(m, lines)) for m in methods]
            continue
        name = node.name if isinstance(node, _DEF_TYPES) else _private_assign_name(node)
        out.append(_Unit(module, name, _first_line(node), node.end_lineno, frozenset(_refs(node)),
                         **_body(node, lines)))
    return out


@dataclass
class Package:
    """The package's modules parsed once: units and the names each refers to."""

    repo: Path
    modules: list[str]
    sources: dict[str, str] = field(init=False)
    units: list[_Unit] = field(init=False)

    def __post_init__(self):
        self.sources = {m: (self.repo / m).read_text() for m in self.modules}
        self.units = [u for m, s in self.sources.items() for u in _units(m, s)]
        self.by_key = {(u.module, u.qualname): u for u in self.units if u.name}

    def members(self, unit: _Unit) -> list[_Unit]:
        """A class and its methods; any other unit alone."""
        if unit.owner is None and any(u.owner == unit.name and u.module == unit.module for u in self.units):
            return [u for u in self.units if u.module == unit.module and (u is unit or u.owner == unit.name)]
        return [unit]

    def referrers(self, name: str, removed: set[_Unit]) -> list[_Unit]:
        return [u for u in self.units if u not in removed and name in u.refs and u.name != name]

    def public_targets(self, methods: bool = True) -> list[_Unit]:
        """Public top-level defs, and (with `methods`) public methods defined once in a public class
        that keeps other statements, that nothing else in the package refers to by name."""
        out = []
        for u in self.units:
            if not u.name or u.name.startswith("_"):
                continue
            if u.owner is not None:
                siblings = [v for v in self.units if v.module == u.module and v.owner == u.owner]
                if (not methods or u.owner.startswith("_") or len(siblings) < 2
                        or sum(v.name == u.name for v in siblings) > 1):
                    continue
            if not self.referrers(u.name, set(self.members(u))):
                out.append(u)
        return out


    def stub_targets(self, min_body_lines: int = 6) -> list[_Unit]:
        """Public functions and public methods of public top-level classes, defined once in their scope,
        whose body after the docstring spans at least `min_body_lines` lines: what a stub task empties
        (callers elsewhere in the package do not matter: the name stays)."""
        out = []
        for u in self.units:
            if not u.name or u.name.startswith("_") or u.body_first is None or (u.owner or "").startswith("_"):
                continue
            if u.last - u.body_first + 1 < min_body_lines:
                continue
            if sum(v.name == u.name and v.owner == u.owner and v.module == u.module for v in self.units) > 1:
                continue  # overloads, property setters: one name, several defs
            out.append(u)
        return out


@dataclass(frozen=True)
class Feature:
    """What one task removes: public `targets` and private `helpers`, as (module, qualified name:
    `name` or `Class.method`)."""

    targets: tuple[tuple[str, str], ...]
    helpers: tuple[tuple[str, str], ...]
    edits: tuple[tuple[str, str], ...]  # (module path, new source), sorted by path
    lines: int  # source lines removed, summed over modules
    files: int  # modules edited (re-exports included)
    stub: bool = False  # the targets keep their signature and docstring; their bodies raise NotImplementedError

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(sorted({m for m, _ in self.targets}))

    @property
    def names(self) -> tuple[str, ...]:
        """The targets' bare names (a method's without its class): what tests refer to."""
        return tuple(n.rsplit(".", 1)[-1] for _, n in self.targets)


def deletable(repo: Path, modules: list[str], *, methods: bool = False) -> list[tuple[str, str]]:
    """(module path, qualified name) of public top-level defs (and, with `methods`, public methods) that
    no other package code uses."""
    return [(u.module, u.qualname) for u in Package(repo, modules).public_targets(methods)]


def closure(pkg: Package, targets: list[tuple[str, str]], *, stub: bool = False) -> Feature | None:
    """The feature of `targets`: the targets removed (each deletable on its own) or, with `stub`, their
    bodies replaced by `raise NotImplementedError` (signature, decorators and docstring kept); plus the
    private helpers that only removed code refers to, found to a fixed point; and the edited sources.
    None when the edit would leave a class with an empty body."""
    removed: set[_Unit] = set()
    for t in targets:
        removed.update([pkg.by_key[t]] if stub else pkg.members(pkg.by_key[t]))
    stubbed = set(removed) if stub else set()
    helpers: list[_Unit] = []
    changed = True
    while changed:
        changed = False
        wanted = set().union(*(u.refs for u in removed))
        for u in pkg.units:
            if (u.name and _is_private(u.name) and u.name in wanted and u not in removed
                    and not pkg.referrers(u.name, removed | set(pkg.members(u)))):
                removed.update(pkg.members(u))
                helpers.append(u)
                changed = True
    gone_classes = {(u.module, u.name) for u in removed if u.owner is None and u not in stubbed}
    names = {u.name for u in removed if u.owner is None and u not in stubbed}  # re-exports: top-level names
    edits = []
    lines = 0
    for mod, src in pkg.sources.items():
        spans = [(u.body_first, u.last, f"{u.body_indent}raise NotImplementedError\n") if u in stubbed
                 else (u.first, u.last, "")
                 for u in removed if u.module == mod and (mod, u.owner) not in gone_classes]
        new = _splice(src, spans, tidy=True)
        for name in sorted(names):
            new = _drop_reexports(new, name)
        if new != src:
            try:
                ast.parse(new)
            except SyntaxError:
                return None  # a class left with no body
            edits.append((mod, new))
            lines += len(src.splitlines()) - len(new.splitlines())
    return Feature(tuple(targets), tuple(sorted((u.module, u.qualname) for u in helpers)), tuple(edits), lines,
                   len(edits), stub)


def test_mentions(repo: Path, names: set[str]) -> dict[str, set[str]]:
    """name -> the test files (repository paths) that import it by name or read it as an attribute
    (`from pkg.m import name`, `m.name`, `obj.name()` for a method): what a test file exercises, not
    words it happens to use (a local variable called `one` does not count)."""
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
        used = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                used.update(a.name for a in node.names)
            elif isinstance(node, ast.Attribute):
                used.add(node.attr)
        for n in names & used:
            out[n].add(rel)
    return out


def multi_file_features(repo: Path, modules: list[str], rng: random.Random, *, min_lines: int = 40,
                        min_files: int = 2, max_targets: int = 3, methods: bool = True, stub: bool = False,
                        min_body_lines: int = 6) -> list[Feature]:
    """Candidate features of at least `min_lines` removed lines over at least `min_files` files, in a
    seeded random order: single targets whose closure already is that large (a class with its helpers
    and its re-export), then groups of up to `max_targets` targets (top-level defs, and public methods
    with `methods`) from different modules that one test file exercises together: a coherent feature
    that spans modules. With `stub`, the targets are function and method bodies (`stub_targets`)."""
    pkg = Package(repo, modules)
    units = pkg.stub_targets(min_body_lines) if stub else pkg.public_targets(methods)
    singles = {(u.module, u.qualname): closure(pkg, [(u.module, u.qualname)], stub=stub) for u in units}
    singles = {k: f for k, f in singles.items() if f is not None}
    keys = list(singles)
    rng.shuffle(keys)

    def big(f: Feature | None) -> bool:
        return f is not None and f.lines >= min_lines and f.files >= min_files

    out = [singles[k] for k in keys if big(singles[k])]
    seen = {f.targets for f in out}
    bare = {k: k[1].rsplit(".", 1)[-1] for k in keys}
    mentions = test_mentions(repo, set(bare.values()))
    for seed in keys:
        if not mentions[bare[seed]]:
            continue
        group = [seed]
        partners = [k for k in keys if k[0] != seed[0] and mentions[bare[k]] & mentions[bare[seed]]]
        rng.shuffle(partners)
        feature = singles[seed]
        for p in partners:
            if len(group) == max_targets or big(feature):
                break
            if p[0] in {m for m, _ in group}:
                continue
            trial = closure(pkg, sorted(group + [p]), stub=stub)
            if trial is not None:
                group, feature = group + [p], trial
        key = tuple(sorted(group))
        if len(group) > 1 and big(feature) and key not in seen:
            seen.add(key)
            out.append(feature)
    return out


def _splice(source: str, spans: list[tuple[int, int, str]], *, tidy: bool = False) -> str:
    """Replaces whole-line spans (1-based first line, last line inclusive, new text), from the end.
    With `tidy`, a removed span takes surplus blank lines with it (at most two in a row at top level,
    one in an indented block, none at the start or end of the file), so the gap does not show where
    the code was and nothing else in the file changes."""
    lines = source.splitlines(keepends=True)
    for first, last, text in sorted(spans, reverse=True):
        indented = lines[first - 1][:1] in (" ", "\t")
        lines[first - 1: last] = [text] if text else []
        if not tidy or text:
            continue
        i = first - 1
        before = 0
        while i - before - 1 >= 0 and not lines[i - before - 1].strip():
            before += 1
        after = 0
        while i + after < len(lines) and not lines[i + after].strip():
            after += 1
        at_edge = i - before == 0 or i + after == len(lines)
        excess = before + after - (0 if at_edge else 1 if indented else 2)
        cut_after = min(max(excess, 0), after)
        del lines[i: i + cut_after]
        cut_before = max(excess - cut_after, 0)
        del lines[i - cut_before: i]
    return "".join(lines)


def _remove_def(source: str, name: str) -> str:
    for node in ast.parse(source).body:
        if isinstance(node, _DEF_TYPES) and node.name == name:
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            return _splice(source, [(first, node.end_lineno, "")])
    return source


def _drop_items(source: str, items: list[ast.AST]) -> str | None:
    """Removes list / import items (nodes with positions) from the source, touching only their text:
    an item alone on its line takes the line; otherwise the item and its comma. None when an item
    spans lines (the caller rewrites the statement)."""
    lines = source.splitlines(keepends=True)
    for item in sorted(items, key=lambda n: (n.lineno, n.col_offset), reverse=True):
        if item.lineno != item.end_lineno:
            return None
        line = lines[item.lineno - 1]
        head, rest = line[: item.col_offset], line[item.end_col_offset:]
        if not head.strip() and re.fullmatch(r"\s*,?\s*(#.*)?\n?", rest):
            lines[item.lineno - 1] = ""
        elif m := re.match(r"\s*,[ \t]*", rest):
            lines[item.lineno - 1] = head + rest[m.end():]
        else:
            m = re.search(r",\s*$", head)
            lines[item.lineno - 1] = (head[: m.start()] if m else head) + rest
    return "".join(lines)


def _drop_reexports(source: str, name: str) -> str:
    """`name` out of `from .m import ...` statements and `__all__` lists, editing only those items."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.ImportFrom) and any(a.name == name for a in node.names):
            kept = [a for a in node.names if a.name != name]
            if not kept:
                return _drop_reexports(_splice(source, [(node.lineno, node.end_lineno, "")]), name)
            text = _drop_items(source, [a for a in node.names if a.name == name])
            if text is None:
                text = _splice(source, [(node.lineno, node.end_lineno,
                                         ast.unparse(ast.ImportFrom(node.module, kept, node.level)) + "\n")])
            return _drop_reexports(text, name)
        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
                and isinstance(node.value, (ast.List, ast.Tuple))):
            gone = [e for e in node.value.elts if isinstance(e, ast.Constant) and e.value == name]
            if not gone:
                continue
            text = _drop_items(source, gone) if len(gone) < len(node.value.elts) else None
            if text is None:
                value = type(node.value)(elts=[e for e in node.value.elts if e not in gone], ctx=ast.Load())
                assign = ast.Assign(targets=node.targets, value=value, lineno=node.lineno)
                text = _splice(source, [(node.lineno, node.end_lineno, ast.unparse(assign) + "\n")])
            return _drop_reexports(text, name)
    return source


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


def _find(source: str, qualname: str) -> ast.AST | None:
    """The top-level def `name`, or the method `Class.method` of a top-level class."""
    body = ast.parse(source).body
    *owner, name = qualname.split(".")
    if owner:
        cls = next((n for n in body if isinstance(n, ast.ClassDef) and n.name == owner[0]), None)
        body = cls.body if cls else []
    return next((n for n in body if isinstance(n, _DEF_TYPES) and n.name == name), None)


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
    qualnames = [n for _, n in feature.targets]
    one = len(qualnames) == 1
    where = _and([f"`{n}` ({m})" for m, n in feature.targets])
    test_files = sorted({t.split("::")[0] for t in f2p})
    shown_files = _and([f"`{t}`" for t in test_files[:3]]) + (" and others" if len(test_files) > 3 else "")
    specs = []
    for m, n in feature.targets:
        node = _find(originals[m], n)
        doc = (ast.get_docstring(node) or "(no docstring)") if node else ""
        sig = _signature(node) if node else n
        specs.append(f"- `{n.rsplit('.', 1)[0] + '.' if '.' in n else ''}{sig}` in {m}:\n{_indent(doc)}")
    helpers = f"It also used private helpers that were removed: {_and([n for _, n in feature.helpers])}.\n" \
        if feature.helpers else ""
    if feature.stub:
        return {
            "terse": f"{package}: implement {_and([f'`{n}`' for n in qualnames])}",
            "issue": f"In {package}, {where} only raise{'s' if one else ''} NotImplementedError. Implement "
                     f"{'it' if one else 'them'} as the docstrings and callers expect; {shown_files} "
                     f"exercise{'s' if len(test_files) == 1 else ''} {'it' if one else 'them'}.",
            "full": f"Implement the bodies of these {package} functions (signatures and docstrings are in "
                    f"place):\n" + "\n".join(specs) + f"\n{helpers}The tests {_shown(f2p)} must pass.",
        }
    return {
        "terse": f"{package}: bring back {_and([f'`{n}`' for n in qualnames])}",
        "issue": f"{package} lost {where}. Re-implement {'it' if one else 'them'} with the same public API "
                 f"(exports included); {shown_files} exercise{'s' if len(test_files) == 1 else ''} "
                 f"{'it' if one else 'them'}.",
        "full": f"Implement in {package}, with the same names, signatures and exports as the package's other "
                f"public API:\n" + "\n".join(specs) + f"\n{helpers}The tests {_shown(f2p)} must pass.",
    }


def _indent(text: str) -> str:
    return "\n".join("    " + line if line else "" for line in text.splitlines())
