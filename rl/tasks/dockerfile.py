"""Which environment definitions c2jax runs without a container engine, and why it refuses the rest.

c2jax runs a Harbor or Terminal-Bench environment by mounting its build context (environment/, or a
TB1 task directory) as the working directory. That is what the Dockerfile describes only when it has
one stage, builds nothing, and copies the context itself into the working directory: FROM, WORKDIR,
ENV, ARG, LABEL, USER, SHELL, CMD, ENTRYPOINT, EXPOSE, and COPY of context paths to the same paths
under the working directory (`COPY . .`, `COPY app.py /app/`). For anything else the
refusal names the file, the line and the most basic obstacle (a multi-stage build before a RUN step,
a RUN step before a COPY of other paths), so a suite's unsupported tasks can be sorted by what
would make them run. Compose files (services beside the main container, devices) are refused too.
Of the image's metadata, WORKDIR (`workdir`) is the task's working directory and ENV (`env`) is set for
every command of the task, as Docker keeps both for the container's processes.
"""

from __future__ import annotations

import posixpath
import shlex
from dataclasses import dataclass
from pathlib import Path

COMPOSE_FILES = ("docker-compose.yaml", "docker-compose.yml", "compose.yaml", "compose.yml")
# Instructions that only set metadata of the image (no build step): WORKDIR and ENV are applied to the
# task's sandboxes (`workdir`, `env`), ARG feeds ENV's substitution, the rest change nothing c2jax runs.
METADATA = {"FROM", "WORKDIR", "ENV", "ARG", "LABEL", "USER", "SHELL", "CMD", "ENTRYPOINT", "EXPOSE", "MAINTAINER"}
_BACKEND = "needs the container backend, which c2jax does not have yet"


@dataclass(frozen=True)
class Instruction:
    line: int  # 1-based line where the instruction starts
    word: str  # upper-cased, e.g. "RUN"
    args: str  # the rest, continuation lines joined


def instructions(text: str) -> list[Instruction]:
    """The Dockerfile's instructions: comments and blank lines dropped, `\\` continuations joined."""
    out: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # a comment inside a continued instruction is dropped, as Docker does
        if not pending:
            start = number
        if line.endswith("\\"):
            pending.append(line[:-1].strip())
            continue
        pending.append(line)
        word, _, args = " ".join(p for p in pending if p).partition(" ")
        out.append(Instruction(start, word.upper(), args.strip()))
        pending = []
    if pending:
        word, _, args = " ".join(p for p in pending if p).partition(" ")
        out.append(Instruction(start, word.upper(), args.strip()))
    return out


def _short(args: str, limit: int = 60) -> str:
    return args if len(args) <= limit else args[: limit - 3] + "..."


def split_flags(args: str) -> tuple[list[str], list[str]]:
    """(--flags, operands) of a COPY / ADD / RUN, shell-style or JSON-array form."""
    if args.startswith("["):
        import json

        try:
            return [], [str(a) for a in json.loads(args)]
        except ValueError:
            pass
    try:
        words = shlex.split(args)
    except ValueError:
        words = args.split()
    flags = [w for w in words if w.startswith("--")]
    return flags, [w for w in words if not w.startswith("--")]


def _copy_keeps_layout(context: Path, workdir: str, operands: list[str]) -> bool:
    """Whether `COPY operands` puts every source where mounting the build context at `workdir` puts it
    (`COPY . .`, `COPY app.py .`, `COPY src/ src/`...), so the mount is what the image holds there."""
    if len(operands) < 2:
        return False
    sources, dest = operands[:-1], operands[-1]
    target = posixpath.normpath(posixpath.join(workdir, dest))
    into_dir = dest.endswith("/") or len(sources) > 1 or dest in (".", "./")
    for src in sources:
        rel = posixpath.normpath(src)
        if rel.startswith("..") or rel.startswith("/"):
            return False
        is_dir = rel == "." or (context / rel).is_dir()
        if is_dir:  # a directory's contents land in the destination
            if target != posixpath.normpath(posixpath.join(workdir, rel)):
                return False
        elif (posixpath.join(target, posixpath.basename(rel)) if into_dir else target) != \
                posixpath.normpath(posixpath.join(workdir, rel)):
            return False
    return True


# ------------------------------------------------------------------------------------------- ENV
def expand_words(text: str, variables: dict[str, str], *, split: bool) -> list[str]:
    """Docker's word processing of an ENV / ARG argument: quotes removed ('...' literal, "..." with
    substitution), backslash escapes, and $VAR / ${VAR} / ${VAR:-default} / ${VAR:+alternative}
    replaced from `variables` (unset: empty, as Docker does). `split`: unquoted whitespace separates
    words (the key=value form); else the whole text is one word (the legacy `ENV KEY value` form)."""
    words: list[str] = []
    cur: list[str] = []
    started = False
    i, n = 0, len(text)

    def variable(at: int) -> tuple[str, int]:
        """(substituted text, index after it) for the `$` at `at`."""
        if at + 1 < n and text[at + 1] == "{":
            end = text.find("}", at + 2)
            if end == -1:
                return "$", at + 1
            body = text[at + 2:end]
            name, op, word = body, "", ""
            for candidate in (":-", ":+"):
                if candidate in body:
                    name, _, word = body.partition(candidate)
                    op = candidate
                    break
            value = variables.get(name)
            if op == ":-":
                out = value if value else "".join(expand_words(word, variables, split=False))
            elif op == ":+":
                out = "".join(expand_words(word, variables, split=False)) if value else ""
            else:
                out = value or ""
            return out, end + 1
        j = at + 1
        while j < n and (text[j].isalnum() or text[j] == "_"):
            j += 1
        if j == at + 1:
            return "$", at + 1
        return variables.get(text[at + 1:j], ""), j

    while i < n:
        c = text[i]
        if c == "\\" and i + 1 < n:
            cur.append(text[i + 1])
            started, i = True, i + 2
        elif c == "'":
            end = text.find("'", i + 1)
            end = n if end == -1 else end
            cur.append(text[i + 1:end])
            started, i = True, end + 1
        elif c == '"':
            i += 1
            while i < n and text[i] != '"':
                if text[i] == "\\" and i + 1 < n and text[i + 1] in '"$\\':
                    cur.append(text[i + 1])
                    i += 2
                elif text[i] == "$":
                    value, i = variable(i)
                    cur.append(value)
                else:
                    cur.append(text[i])
                    i += 1
            started, i = True, i + 1
        elif c == "$":
            value, i = variable(i)
            cur.append(value)
            started = True
        elif split and c.isspace():
            if started:
                words.append("".join(cur))
            cur, started = [], False
            i += 1
        else:
            cur.append(c)
            started, i = True, i + 1
    if started:
        words.append("".join(cur))
    return words


def variable_assignments(ins: Instruction, variables: dict[str, str]) -> list[tuple[str, str]]:
    """The (name, value) pairs of an ENV (or ARG with defaults) instruction, substituted."""
    where = f"line {ins.line}"
    first = ins.args.split(None, 1)[0] if ins.args.strip() else ""
    if ins.word == "ENV" and "=" not in first:  # legacy form: ENV NAME the rest of the line
        name, _, rest = ins.args.strip().partition(" ")
        if not name or not rest.strip():
            raise ValueError(f"{where}: ENV {ins.args!r} sets no value")
        value = "".join(expand_words(rest.strip(), variables, split=False))
        if "\x00" in value or not name.replace("_", "a").isalnum():
            raise ValueError(f"{where}: ENV {ins.args!r} is not NAME value (a NUL byte, or a bad name)")
        return [(name, value)]
    pairs = []
    for word in expand_words(ins.args, variables, split=True) if ins.word == "ENV" else ins.args.split():
        name, eq, value = word.partition("=")
        if ins.word == "ARG":
            value = "".join(expand_words(value, variables, split=False)) if eq else None
        elif not eq:
            raise ValueError(f"{where}: ENV {ins.args!r} mixes NAME=value pairs with a bare {word!r}")
        if not name or not (name[0].isalpha() or name[0] == "_") or not name.replace("_", "a").isalnum():
            raise ValueError(f"{where}: {ins.word} {ins.args!r}: {name!r} is not a variable name")
        if value is not None and "\x00" in value:
            raise ValueError(f"{where}: {ins.word} {name} holds a NUL byte, which no environment can carry")
        pairs.append((name, value))
    return pairs


def env(dockerfile: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment the image's ENV instructions leave, which Docker keeps for every process started
    in the container. `$VAR` in a value is substituted as Docker does at build time: from earlier ENV and
    ARG (with its default) of the stage, else from `base`, which stands for the base image's environment
    (pass the sandbox's own, so `ENV PATH=/opt/bin:$PATH` keeps the sandbox's PATH), else empty. ARG
    values themselves do not persist. A malformed ENV raises ValueError naming the file and line."""
    base = dict(base or {})
    out: dict[str, str] = {}
    args: dict[str, str] = {}
    global_args: dict[str, str] = {}
    seen_from = False
    for ins in instructions(dockerfile.read_text(errors="replace")):
        try:
            if ins.word == "FROM":
                seen_from, out, args = True, {}, {}
            elif ins.word == "ARG":
                for name, value in variable_assignments(ins, {**base, **global_args, **args, **out}):
                    if not seen_from:
                        global_args[name] = value or ""
                    elif name not in out:  # an ENV of the same name wins over the ARG
                        args[name] = value if value is not None else global_args.get(name, "")
            elif ins.word == "ENV":
                out.update(variable_assignments(ins, {**base, **args, **out}))
        except ValueError as e:
            raise ValueError(f"{dockerfile.name} {e}") from None
    return out


def workdir(dockerfile: Path) -> str | None:
    """The image's working directory: every WORKDIR applied in turn (a relative one joins the last)."""
    current = None
    for ins in instructions(dockerfile.read_text(errors="replace")):
        if ins.word == "WORKDIR" and ins.args:
            current = posixpath.normpath(posixpath.join(current or "/", ins.args.strip('"')))
    return current


def unsupported_reason(dockerfile: Path) -> str | None:
    """None when mounting the build context as the working directory is what `dockerfile` builds;
    else the most basic reason it is not, naming the file and line."""
    name = dockerfile.name
    found: list[tuple[int, str]] = []  # (rank: lower is more basic, message)
    steps = instructions(dockerfile.read_text(errors="replace"))
    froms = [ins for ins in steps if ins.word == "FROM"]
    if len(froms) > 1:
        found.append((0, f"{name}: multi-stage build (FROM at lines {', '.join(str(f.line) for f in froms)}) "
                         "is not supported"))
    current = "/"
    for ins in steps:
        where = f"{name} line {ins.line}"
        flags, operands = split_flags(ins.args) if ins.word in ("RUN", "COPY", "ADD") else ([], [])
        if ins.word == "WORKDIR" and ins.args:
            current = posixpath.normpath(posixpath.join(current, ins.args.strip('"')))
        elif ins.word == "RUN" and any(f.startswith("--mount") for f in flags):
            found.append((1, f"{where}: RUN --mount is not supported"))
        elif ins.word == "ADD" and any(o.startswith(("http://", "https://", "git@")) for o in operands[:-1]):
            found.append((1, f"{where}: ADD of a URL is not supported"))
        elif ins.word == "RUN":
            found.append((2, f"{where}: RUN {_short(ins.args)}: a build step {_BACKEND}"))
        elif ins.word == "ADD":
            found.append((2, f"{where}: ADD {_short(ins.args)}: ADD (archives are unpacked) {_BACKEND}"))
        elif ins.word == "COPY":
            if any(f.startswith("--from") for f in flags):
                found.append((1, f"{where}: COPY --from (another stage or image) is not supported"))
                continue
            if not _copy_keeps_layout(dockerfile.parent, current, operands):
                found.append((3, f"{where}: COPY {_short(ins.args)}: c2jax mounts the build context itself as "
                                 f"the working directory ({current}); copying other paths {_BACKEND}"))
        elif ins.word not in METADATA:
            found.append((2, f"{where}: {ins.word} is not supported"))
    return min(found, key=lambda f: f[0])[1] if found else None  # the first of the most basic


def compose_reason(env_dir: Path) -> str | None:
    """Why a compose file in `env_dir` cannot run (Harbor merges it into the main service's
    definition: extra services, devices, GPUs), or None when there is none."""
    for name in COMPOSE_FILES:
        path = env_dir / name
        if path.is_file():
            text = path.read_text(errors="replace")
            if "/dev/kvm" in text:
                return f"{env_dir.name}/{name}: the task needs KVM (/dev/kvm), which c2jax sandboxes do not expose"
            if "nvidia" in text or "gpus" in text:
                return f"{env_dir.name}/{name}: the task needs a GPU, which c2jax sandboxes do not expose"
            return (f"{env_dir.name}/{name}: compose environments (services beside the main container) "
                    "are not supported")
    return None
