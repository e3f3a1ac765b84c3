"""A directory of code as a source of documents: one document per file, tagged with its language.

Files are kept when their language (from the extension, or the whole name for Makefile/Dockerfile) is
wanted, they are not larger than `max_file_bytes`, they decode as UTF-8, and no exclude pattern matches:
the config's `excludes` (gitignore syntax, relative to the root) and, with `respect_gitignore`, every
`.gitignore` in the tree (each relative to its own directory, as git reads them). `.git/` is always
skipped. Matching is done by `pathspec`'s GitIgnoreSpec, which implements git's rules.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

import pathspec

from c2jax.data.config import SourceConfig
from c2jax.models.config import ConfigError

LANGUAGES: dict[str, tuple[str, ...]] = {
    "python": (".py", ".pyi"), "c": (".c", ".h"), "cpp": (".cc", ".cpp", ".cxx", ".hpp", ".hh", ".hxx"),
    "cuda": (".cu", ".cuh"), "rust": (".rs",), "go": (".go",), "java": (".java",), "kotlin": (".kt", ".kts"),
    "scala": (".scala",), "csharp": (".cs",), "swift": (".swift",), "javascript": (".js", ".mjs", ".cjs", ".jsx"),
    "typescript": (".ts", ".tsx"), "ruby": (".rb",), "php": (".php",), "lua": (".lua",), "shell": (".sh", ".bash"),
    "haskell": (".hs",), "ocaml": (".ml", ".mli"), "julia": (".jl",), "r": (".r", ".R"), "sql": (".sql",),
    "html": (".html", ".htm"), "css": (".css", ".scss"), "markdown": (".md", ".markdown"), "rst": (".rst",),
    "text": (".txt",), "yaml": (".yaml", ".yml"), "toml": (".toml",), "json": (".json",),
    "makefile": ("Makefile", "makefile", "GNUmakefile"), "dockerfile": ("Dockerfile",),
    "cmake": ("CMakeLists.txt", ".cmake"),
}
_BY_NAME = {name: lang for lang, names in LANGUAGES.items() for name in names if not name.startswith(".")}
_BY_SUFFIX = {suffix: lang for lang, names in LANGUAGES.items() for suffix in names if suffix.startswith(".")}


def language_of(path: str | Path) -> str | None:
    """The language tag of a file, or None when it is not a known text/code format."""
    name = os.path.basename(path)
    return _BY_NAME.get(name) or _BY_SUFFIX.get(os.path.splitext(name)[1])


def _read_gitignore(directory: Path) -> pathspec.GitIgnoreSpec | None:
    path = directory / ".gitignore"
    if not path.is_file():
        return None
    try:
        return pathspec.GitIgnoreSpec.from_lines(path.read_text(errors="replace").splitlines())
    except Exception as e:  # a malformed pattern: say which file
        raise ConfigError(f"{path}: cannot parse: {e}") from None


def list_files(root: Path, languages: tuple[str, ...], excludes: tuple[str, ...], respect_gitignore: bool,
               max_file_bytes: int) -> list[tuple[str, str]]:
    """Sorted (path relative to root, language) of the files a source tree keeps."""
    unknown = sorted(set(languages) - set(LANGUAGES))
    if unknown:
        raise ConfigError(f"languages: unknown {unknown}; known: {sorted(LANGUAGES)}")
    if not root.is_dir():
        raise ConfigError(f"{root}: not a directory")
    wanted = set(languages or LANGUAGES)
    listed = _walk(root.resolve(), tuple(excludes), respect_gitignore, max_file_bytes)
    return [(rel, lang) for rel, lang in listed if lang in wanted]


@functools.lru_cache(maxsize=16)  # sources over the same tree (the demo's three) walk it once
def _walk(root: Path, excludes: tuple[str, ...], respect_gitignore: bool,
          max_file_bytes: int) -> tuple[tuple[str, str], ...]:
    top = pathspec.GitIgnoreSpec.from_lines(excludes)
    # (directory relative to root, its .gitignore spec) for the directory being walked and its ancestors
    specs: dict[str, pathspec.GitIgnoreSpec] = {}
    out = []

    def ignored(rel: str, is_dir: bool) -> bool:
        probe = rel + "/" if is_dir else rel
        if top.match_file(probe):
            return True
        for base, spec in specs.items():
            if base == "" or rel.startswith(base + "/"):
                if spec.match_file(probe[len(base) + 1:] if base else probe):
                    return True
        return False

    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root).replace(os.sep, "/")
        rel_dir = "" if rel_dir == "." else rel_dir
        if respect_gitignore and (spec := _read_gitignore(Path(dirpath))) is not None:
            specs[rel_dir] = spec
        prefix = f"{rel_dir}/" if rel_dir else ""
        dirnames[:] = sorted(d for d in dirnames if d != ".git" and not ignored(prefix + d, True))
        for name in sorted(filenames):
            lang = language_of(name)
            if lang is None or ignored(prefix + name, False):
                continue
            full = os.path.join(dirpath, name)
            try:
                if os.path.islink(full) or os.path.getsize(full) > max_file_bytes:
                    continue
            except OSError:  # vanished while walking
                continue
            out.append((prefix + name, lang))
    return tuple(out)


class SourceTreeSource:
    """Files under one or more roots; item i is [{"text", "language", "path"}] or [] (not UTF-8)."""

    def __init__(self, cfg: SourceConfig, roots: tuple[Path, ...] | None = None,
                 languages: tuple[str, ...] | None = None, excludes: tuple[str, ...] = ()):
        self.cfg = cfg
        roots = roots or (Path(os.path.expanduser(cfg.path)),)
        languages = cfg.languages or languages or ()
        files = []
        for root in roots:
            listed = list_files(root, languages, tuple(cfg.excludes) + tuple(excludes), cfg.respect_gitignore,
                                cfg.max_file_bytes)
            files += [(root / rel, rel, lang) for rel, lang in listed]
        if cfg.max_documents is not None and len(files) > cfg.max_documents:
            # a subset spread over the whole tree (not its alphabetical head), stable across runs
            digest = lambda f: hashlib.sha256(str(f[1]).encode()).digest()
            files = sorted(sorted(files, key=digest)[:cfg.max_documents], key=lambda f: str(f[0]))
        self.files = files

    def __len__(self) -> int:
        return len(self.files)

    def read_text(self, index: int) -> str | None:
        path = self.files[index][0]
        try:
            return path.read_bytes().decode("utf-8")
        except (UnicodeDecodeError, OSError):  # binary with a code-like name, or removed since listing
            return None

    def __getitem__(self, index: int) -> list[dict]:
        text = self.read_text(index)
        if text is None:
            return []
        _, rel, lang = self.files[index]
        return [{"text": text, "language": lang, "path": rel}]


__all__ = ["LANGUAGES", "SourceTreeSource", "language_of", "list_files"]
