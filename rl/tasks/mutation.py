"""Bug injection by AST mutation (SWE-smith's procedural modifiers): flip a binary operator, a
comparison or a boolean operator, change a constant, or remove an `if` branch. Edits are spliced into
the source at the node's span, so the reference diff is as small as the bug. Candidates combining
several mutations (across files) give multi-file tasks. A candidate is kept only if at least one
test goes pass -> fail."""

from __future__ import annotations

import ast
import random
from dataclasses import dataclass
from pathlib import Path

_BINOP = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.FloorDiv, ast.FloorDiv: ast.Mult, ast.Div: ast.Mult,
          ast.Mod: ast.FloorDiv, ast.BitAnd: ast.BitOr, ast.BitOr: ast.BitAnd, ast.LShift: ast.RShift,
          ast.RShift: ast.LShift}
_CMP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
        ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is}
KINDS = ("binop", "compare", "boolop", "constant", "remove_branch")
_KIND_TEXT = {"binop": "an arithmetic operator", "compare": "a comparison", "boolop": "a boolean condition",
              "constant": "a constant", "remove_branch": "a missing branch"}


@dataclass(frozen=True)
class Mutation:
    path: str  # repository path of the module
    kind: str
    start: tuple[int, int]  # (line, col) of the replaced span, 1-based lines as in ast
    end: tuple[int, int]
    replacement: str
    function: str  # qualified name of the enclosing function ("" at module level)


def _functions(tree: ast.AST):
    """(node, qualified enclosing function name) for every node under a function."""
    def walk(node, qual):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{qual}.{child.name}" if qual else child.name
                yield from walk(child, name if not isinstance(child, ast.ClassDef) else name)
            else:
                if qual:
                    yield child, qual
                yield from walk(child, qual)
    yield from walk(tree, "")


def _mutant(node: ast.AST) -> tuple[str, str] | None:
    """(kind, replacement source) for one mutation of `node`, or None if it has none."""
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOP:
        return "binop", ast.unparse(ast.BinOp(node.left, _BINOP[type(node.op)](), node.right))
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _CMP:
        return "compare", ast.unparse(ast.Compare(node.left, [_CMP[type(node.ops[0])]()], node.comparators))
    if isinstance(node, ast.BoolOp):
        return "boolop", ast.unparse(ast.BoolOp(ast.Or() if isinstance(node.op, ast.And) else ast.And(), node.values))
    if isinstance(node, ast.Constant) and type(node.value) in (int, bool):
        value = (not node.value) if isinstance(node.value, bool) else node.value + 1
        return "constant", repr(value)
    return None


def candidates(path: str, source: str) -> list[Mutation]:
    """Every single-site mutation of one module's functions."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    out = []
    for node, func in _functions(tree):
        if not hasattr(node, "end_lineno"):
            continue
        if isinstance(node, ast.If) and not node.orelse and len(node.body) >= 1:
            indent = lines[node.lineno - 1][: node.col_offset]
            if indent.strip() == "":  # replace the whole statement by `pass`, keeping the block valid
                out.append(Mutation(path, "remove_branch", (node.lineno, node.col_offset),
                                    (node.end_lineno, node.end_col_offset), "pass", func))
            continue
        made = _mutant(node)
        if made:
            out.append(Mutation(path, made[0], (node.lineno, node.col_offset),
                                (node.end_lineno, node.end_col_offset), made[1], func))
    return out


def apply(source: str, mutations: list[Mutation]) -> str:
    """`source` with non-overlapping mutations spliced in (applied from the end of the file)."""
    lines = source.splitlines(keepends=True)
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line.encode()))
    data = source.encode()

    def pos(lc):
        return offsets[lc[0] - 1] + lc[1]  # ast columns are UTF-8 byte offsets

    for m in sorted(mutations, key=lambda m: pos(m.start), reverse=True):
        data = data[: pos(m.start)] + m.replacement.encode() + data[pos(m.end):]
    out = data.decode()
    ast.parse(out)  # a mutant must stay syntactically valid
    return out


def sample(repo: Path, modules: list[str], rng: random.Random, *, n_mutations: int = 1,
           across_files: bool = False) -> list[Mutation]:
    """`n_mutations` non-overlapping mutations, from distinct modules when `across_files`."""
    pools = {m: candidates(m, (repo / m).read_text()) for m in modules}
    pools = {m: c for m, c in pools.items() if c}
    if not pools:
        return []
    chosen: list[Mutation] = []
    files = rng.sample(sorted(pools), min(n_mutations, len(pools))) if across_files else [rng.choice(sorted(pools))]
    for i in range(n_mutations):
        pool = pools[files[i % len(files)]]
        for _ in range(20):
            m = rng.choice(pool)
            if all(m.path != c.path or m.end <= c.start or c.end <= m.start for c in chosen):
                chosen.append(m)
                break
    return chosen


def prompts(mutations: list[Mutation], f2p: list[str], package: str) -> dict[str, str]:
    funcs = sorted({m.function for m in mutations if m.function})
    where = ", ".join(f"`{f}`" for f in funcs) or "the package"
    shown = ", ".join(f"`{t}`" for t in f2p[:3]) + (f" and {len(f2p) - 3} more" if len(f2p) > 3 else "")
    kinds = sorted({_KIND_TEXT[m.kind] for m in mutations})
    files = sorted({m.path for m in mutations})
    return {
        "terse": f"{funcs[0] if funcs else package} seems broken",
        "issue": f"Since a recent change, {where} in {package} misbehaves; the tests {shown} fail. "
                 f"Please find and fix the bug.",
        "full": f"{where} ({', '.join(files)}) contain{'s' if len(funcs) == 1 else ''} "
                f"{len(mutations)} injected bug(s): {', '.join(kinds)}. Restore the intended behaviour so "
                f"that {shown} pass, without breaking other tests and without editing tests.",
    }


def difficulty(mutations: list[Mutation], f2p: list[str]) -> str:
    files = len({m.path for m in mutations})
    if files > 1 or len(mutations) > 2:
        return "hard"
    return "easy" if len(f2p) >= 3 and len(mutations) == 1 else "medium"
