"""Dockerfiles built without a container engine: a single-stage Dockerfile interpreted over a base image from
the image store (c2jax.rl.sandbox.oci), each RUN in a bubblewrap container of the image being built.

    FROM ref [AS name]      the base from the image store ($C2JAX_IMAGE_STORE); global ARGs substitute into it
    WORKDIR / ENV / ARG     as Docker: relative WORKDIR joins the last, $VAR substitution from ENV, ARG, build args
    RUN cmd | RUN ["a"...]  as uid 0 of a user namespace, in the working directory, with ENV and ARGs set, through
                            SHELL (default /bin/sh -c); no network unless the build is given it
    COPY / ADD src... dest  from the build context, with .dockerignore; a directory copies its contents; ADD of a
                            local tar archive unpacks it (as Docker does)
    USER / SHELL            USER is recorded in the config (every command still runs as uid 0); SHELL replaces
                            the shell of later RUNs
    CMD ENTRYPOINT EXPOSE LABEL MAINTAINER STOPSIGNAL VOLUME HEALTHCHECK ONBUILD   recorded or ignored

Refused with the line and the reason: multi-stage builds, COPY --from, RUN --mount, ADD of a URL, a base image
not in the store. The result is cached by content (the base's digest, every instruction, build args and the
bytes of every file COPY/ADD reads), so an unchanged Dockerfile and context build once.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import posixpath
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

from c2jax.rl.sandbox.oci import (
    COMPLETE_MARKER,
    DEFAULT_ENV,
    Image,
    ImageConfig,
    find_in_store,
    load_image,
    store_name,
)
from c2jax.rl.tasks.dockerfile import (
    Instruction,
    expand_words,
    instructions,
    split_flags,
    variable_assignments,
)

IGNORED = {"CMD", "ENTRYPOINT", "EXPOSE", "LABEL", "MAINTAINER", "STOPSIGNAL", "VOLUME", "HEALTHCHECK", "ONBUILD"}


class ImageBuildError(ValueError):
    """The Dockerfile cannot be built; the message names the file, the line and why."""


def _dockerignore(context: Path) -> list[tuple[bool, str]]:
    """(exclude?, pattern) in order; a later `!pattern` re-includes."""
    path = context / ".dockerignore"
    if not path.is_file():
        return []
    rules = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = posixpath.normpath(line[1:] if negate else line).lstrip("/")
        rules.append((not negate, pattern))
    return rules


def _ignored(rel: str, rules: list[tuple[bool, str]]) -> bool:
    out = False
    parts = rel.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    for exclude, pattern in rules:
        if any(fnmatch.fnmatchcase(p, pattern) or (pattern.startswith("**/") and fnmatch.fnmatchcase(p, pattern[3:]))
               for p in prefixes):
            out = exclude
    return out


def _context_files(context: Path, src: str, rules, where: str) -> list[tuple[Path, str]]:
    """[(host file or dir, path relative to the source root)] for one COPY source (globs allowed)."""
    rel = posixpath.normpath(src).lstrip("/")
    if rel.startswith(".."):
        raise ImageBuildError(f"{where}: COPY source {src!r} is outside the build context")
    matches = sorted(context.glob(rel)) if any(c in rel for c in "*?[") else [context / rel]
    matches = [m for m in matches if m == context or not _ignored(str(m.relative_to(context)), rules)]
    if not matches or not all(m.exists() for m in matches):
        raise ImageBuildError(f"{where}: COPY source {src!r} not found in the build context {context}")
    return [(m, m.name) for m in matches]


def _tree_digest(path: Path, context: Path, rules) -> str:
    h = hashlib.sha256()
    items = [path] if path.is_file() else sorted(p for p in path.rglob("*"))
    for p in items:
        rel = str(p.relative_to(context)) if p != context else "."
        if p != context and _ignored(rel, rules):
            continue
        h.update(rel.encode() + b"\0")
        if p.is_file() and not p.is_symlink():
            h.update(hashlib.sha256(p.read_bytes()).digest())
        elif p.is_symlink():
            h.update(os.readlink(p).encode())
    return h.hexdigest()


def _inside_root(root: Path, path: str) -> Path:
    norm = posixpath.normpath("/" + path).lstrip("/")
    return root / norm if norm else root


def _copy_into(rootfs: Path, sources: list[tuple[Path, str]], dest: str, workdir: str, context: Path, rules,
               *, into_dir: bool, unpack: bool, where: str) -> None:
    target = posixpath.normpath(posixpath.join(workdir, dest))
    for host, name in sources:
        if unpack and host.is_file() and tarfile.is_tarfile(host):
            out = _inside_root(rootfs, target)
            out.mkdir(parents=True, exist_ok=True)
            with tarfile.open(host) as tar:
                tar.extractall(out, filter="tar")
            continue
        if host.is_dir():
            out = _inside_root(rootfs, target)
            out.mkdir(parents=True, exist_ok=True)
            for p in sorted(host.rglob("*")):
                rel = p.relative_to(host)
                if _ignored(str(p.relative_to(context)), rules):
                    continue
                q = out / rel
                if p.is_dir() and not p.is_symlink():
                    q.mkdir(parents=True, exist_ok=True)
                else:
                    q.parent.mkdir(parents=True, exist_ok=True)
                    if q.exists() or q.is_symlink():
                        q.unlink()
                    shutil.copy2(p, q, follow_symlinks=False)
        else:
            out = _inside_root(rootfs, posixpath.join(target, name) if into_dir else target)
            out.parent.mkdir(parents=True, exist_ok=True)
            if out.is_dir():
                out = out / name
            shutil.copy2(host, out)


def _run(rootfs: Path, argv: list[str], env: dict[str, str], workdir: str, network: bool, timeout_s: float,
         where: str) -> None:
    from c2jax.rl.sandbox.bwrap import find_bwrap

    cmd = [find_bwrap(), "--unshare-all", *(["--share-net"] if network else []), "--uid", "0", "--gid", "0",
           "--die-with-parent", "--new-session", "--bind", str(rootfs), "/", "--proc", "/proc", "--dev", "/dev",
           "--tmpfs", "/tmp"]
    if network:
        cmd += ["--ro-bind-try", "/etc/resolv.conf", "/etc/resolv.conf"]
    cmd += ["--chdir", workdir, "--clearenv"]
    for key, value in env.items():
        cmd += ["--setenv", key, value]
    try:
        proc = subprocess.run(cmd + ["--", *argv], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise ImageBuildError(f"{where}: timed out after {timeout_s:.0f} s") from None
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-2000:]
        raise ImageBuildError(f"{where}: exited with status {proc.returncode}:\n{tail}")


def build_image(dockerfile: str | os.PathLike, *, store: str | os.PathLike | None, cache_dir: str | os.PathLike,
                context: str | os.PathLike | None = None, build_args: dict[str, str] | None = None,
                network: bool = False, timeout_s: float = 1800.0) -> Image:
    """The image `dockerfile` builds over its base from `store`, cached under `cache_dir` by content."""
    dockerfile = Path(dockerfile)
    context = Path(context) if context is not None else dockerfile.parent
    name = dockerfile.name
    steps = instructions(dockerfile.read_text(errors="replace"))
    ref, global_args, at = _parse_from(dockerfile, steps, build_args)
    source = find_in_store(ref, store)
    if source is None:
        raise ImageBuildError(f"{name} line {steps[at].line}: base image {ref!r} is not in the image store "
                              f"{store or '(none set)'}: save it there as {store_name(ref)}.tar or pull it "
                              f"there (`c2jax images pull {ref}`)")
    cache_dir = Path(cache_dir)
    base = load_image(source, cache_dir)
    rules = _dockerignore(context)
    body = steps[at + 1:]
    for s in body:  # refuse before anything runs
        _step(s, f"{name} line {s.line}")

    key = hashlib.sha256(base.digest.encode())
    key.update(json.dumps(sorted((build_args or {}).items())).encode())
    for s in body:
        key.update(f"{s.word} {s.args}\n".encode())
        if s.word in ("COPY", "ADD"):
            for src in split_flags(s.args)[1][:-1]:
                for host, _ in _context_files(context, src, rules, f"{name} line {s.line}"):
                    key.update(_tree_digest(host, context, rules).encode())
    digest = "sha256:" + key.hexdigest()
    out = cache_dir / f"built-{key.hexdigest()}"
    if (out / COMPLETE_MARKER).is_file():
        return Image(digest, out / "rootfs", ImageConfig.from_json(json.loads((out / "config.json").read_text())),
                     base.layers)

    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".build-", dir=cache_dir))
    try:
        rootfs = staging / "rootfs"
        subprocess.run(["cp", "-a", "--reflink=auto", str(base.rootfs), str(rootfs)], check=True)
        env = dict(base.config.env)
        workdir, user = base.config.workdir or "/", base.config.user
        cmd, entrypoint = list(base.config.cmd), list(base.config.entrypoint)
        shell = ["/bin/sh", "-c"]
        args: dict[str, str] = {}
        for s in body:
            where = f"{name} line {s.line}"
            if s.word == "WORKDIR":
                workdir = posixpath.normpath(posixpath.join(workdir, "".join(
                    expand_words(s.args.strip(), {**args, **env}, split=False))))
                _inside_root(rootfs, workdir).mkdir(parents=True, exist_ok=True)
            elif s.word == "ENV":
                env.update(variable_assignments(s, {**args, **env}))
            elif s.word == "ARG":
                for k, v in variable_assignments(s, {**global_args, **args, **env}):
                    args[k] = (build_args or {}).get(k, v if v is not None else global_args.get(k, ""))
            elif s.word == "USER":
                user = s.args.strip()
            elif s.word == "SHELL":
                shell = json.loads(s.args)
            elif s.word in ("CMD", "ENTRYPOINT"):
                value = json.loads(s.args) if s.args.startswith("[") else [*shell, s.args]
                cmd, entrypoint = (value, entrypoint) if s.word == "CMD" else (cmd, value)
            elif s.word == "RUN":
                _, text = _run_flags(s.args)
                argv = json.loads(text) if text.startswith("[") else [*shell, text]
                _run(rootfs, argv, {**DEFAULT_ENV, **env, **args}, workdir, network, timeout_s, f"{where}: RUN")
            elif s.word in ("COPY", "ADD"):
                flags, operands = split_flags(s.args)
                if len(operands) < 2:
                    raise ImageBuildError(f"{where}: {s.word} needs a source and a destination")
                sources = [m for src in operands[:-1] for m in _context_files(context, src, rules, where)]
                dest = operands[-1]
                into_dir = dest.endswith("/") or len(sources) > 1 or dest in (".", "./")
                _copy_into(rootfs, sources, dest, workdir, context, rules, into_dir=into_dir,
                           unpack=s.word == "ADD", where=where)
        config = {"config": {"Env": [f"{k}={v}" for k, v in env.items()], "WorkingDir": workdir, "User": user,
                             "Cmd": cmd, "Entrypoint": entrypoint}, "c2jax": {"base": base.digest,
                                                                              "dockerfile": str(dockerfile)}}
        (staging / "config.json").write_text(json.dumps(config))
        (staging / COMPLETE_MARKER).write_text(digest + "\n")
        try:
            os.rename(staging, out)
        except OSError:
            if not (out / COMPLETE_MARKER).is_file():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return Image(digest, out / "rootfs", ImageConfig.from_json(json.loads((out / "config.json").read_text())),
                 base.layers)


def _parse_from(dockerfile: Path, steps: list[Instruction], build_args: dict[str, str] | None
                ) -> tuple[str, dict[str, str], int]:
    """(the image a single-stage Dockerfile builds FROM, the global ARGs, the FROM's index in `steps`);
    ImageBuildError for several FROMs, none, or anything but ARG before it."""
    froms = [s for s in steps if s.word == "FROM"]
    if len(froms) != 1:
        raise ImageBuildError(f"{dockerfile.name}: " + ("no FROM" if not froms else
                              f"multi-stage build (FROM at lines {', '.join(str(f.line) for f in froms)}) is not "
                              "supported"))
    at = steps.index(froms[0])
    global_args: dict[str, str] = {}
    for s in steps[:at]:
        if s.word != "ARG":
            raise ImageBuildError(f"{dockerfile.name} line {s.line}: only ARG may come before FROM, got {s.word}")
        for key, value in variable_assignments(s, dict(global_args)):
            global_args[key] = (build_args or {}).get(key, value or "")
    words = [w for w in "".join(expand_words(froms[0].args, global_args, split=False)).split()
             if not w.startswith("--platform")]
    if not words:
        raise ImageBuildError(f"{dockerfile.name} line {froms[0].line}: FROM names no image")
    return words[0], global_args, at


def base_reference(dockerfile: str | os.PathLike, build_args: dict[str, str] | None = None) -> str:
    """The image a single-stage Dockerfile builds FROM (global ARGs substituted); ImageBuildError otherwise."""
    dockerfile = Path(dockerfile)
    return _parse_from(dockerfile, instructions(dockerfile.read_text(errors="replace")), build_args)[0]


def buildable_reason(dockerfile: str | os.PathLike, store: str | os.PathLike | None) -> str | None:
    """None when `build_image` can build `dockerfile` with this store (base present, nothing refused); else why."""
    dockerfile = Path(dockerfile)
    try:
        steps = instructions(dockerfile.read_text(errors="replace"))
        ref, _, at = _parse_from(dockerfile, steps, None)
        for s in steps[at + 1:]:
            _step(s, f"{dockerfile.name} line {s.line}")
    except (ImageBuildError, ValueError) as e:
        return str(e)
    if find_in_store(ref, store) is None:
        return (f"{dockerfile.name}: base image {ref!r} is not in the image store {store or '(none set)'}: save it "
                f"there as {store_name(ref)}.tar")
    return None


def _run_flags(args: str) -> tuple[list[str], str]:
    """(leading --flags of a RUN, the command): `RUN --network=none pip install --no-deps x` keeps
    `pip install --no-deps x` whole."""
    flags, rest = [], args.strip()
    while rest.startswith("--"):
        flag, _, rest = rest.partition(" ")
        flags.append(flag)
        rest = rest.lstrip()
    return flags, rest


def _step(s: Instruction, where: str) -> None:
    """Refuses what the builder does not do, naming the line."""
    flags, operands = split_flags(s.args) if s.word in ("COPY", "ADD") else ([], [])
    if s.word == "RUN":
        flags = _run_flags(s.args)[0]
    if s.word == "RUN" and any(f.startswith("--mount") for f in flags):
        raise ImageBuildError(f"{where}: RUN --mount is not supported")
    if s.word in ("COPY", "ADD") and any(f.startswith("--from") for f in flags):
        raise ImageBuildError(f"{where}: {s.word} --from (another stage or image) is not supported")
    if s.word == "ADD" and any(o.startswith(("http://", "https://", "git@")) for o in operands[:-1]):
        raise ImageBuildError(f"{where}: ADD of a URL is not supported")
    if s.word not in {"WORKDIR", "ENV", "ARG", "USER", "SHELL", "RUN", "COPY", "ADD"} | IGNORED:
        raise ImageBuildError(f"{where}: {s.word} is not a Dockerfile instruction c2jax builds")
