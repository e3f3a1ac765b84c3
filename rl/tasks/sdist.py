"""Pinned sdists of real libraries that ship their tests: fetched with pip at build time, verified by
sha256, cached, unpacked into a clean repository directory."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SdistSpec:
    name: str
    version: str
    sha256: str
    package: str = ""  # the import package whose modules generators edit (default: name with _ for -)
    tests: tuple[str, ...] = ()  # test paths given to pytest (default: pytest's discovery)

    @property
    def package_dir(self) -> str:
        return self.package or self.name.replace("-", "_")


class SdistError(RuntimeError):
    pass


def fetch(spec: SdistSpec, cache_dir: str | Path) -> Path:
    """The sdist archive, from `cache_dir` or `pip download --no-binary :all: --no-deps`; its sha256
    must match the pin."""
    cache = Path(cache_dir) / "sdists"
    cache.mkdir(parents=True, exist_ok=True)
    found = [p for p in cache.glob("*") if _matches(p, spec)]
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-q",
               "-d", str(cache), f"{spec.name}=={spec.version}"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        found = [p for p in cache.glob("*") if _matches(p, spec)]
        if proc.returncode != 0 or not found:
            raise SdistError(f"pip could not download {spec.name}=={spec.version}: {proc.stderr.strip()[-500:]}")
    archive = found[0]
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    if digest != spec.sha256:
        raise SdistError(f"{archive.name}: sha256 {digest} does not match the pinned {spec.sha256}")
    return archive


def _matches(path: Path, spec: SdistSpec) -> bool:
    # exactly NAME-VERSION.<archive>: a prefix test would take markdown-3.11.1 for 3.11, pytz-2026.3.post1 for 2026.3
    name = path.name.lower().replace("_", "-")
    stem = f"{spec.name.lower().replace('_', '-')}-{spec.version.lower()}"
    return name in {stem + ext for ext in (".tar.gz", ".zip", ".tar.bz2", ".tgz")}


def unpack(archive: Path, dest: str | Path) -> Path:
    """Unpacks the sdist's single top directory to `dest` (replaced), without egg-info or caches."""
    dest = Path(dest)
    if dest.exists():
        shutil.rmtree(dest)
    tmp = dest.with_name(dest.name + ".unpack")
    shutil.rmtree(tmp, ignore_errors=True)
    if archive.suffix == ".zip":
        with zipfile.ZipFile(archive) as z:
            z.extractall(tmp)
    else:
        with tarfile.open(archive) as t:
            t.extractall(tmp, filter="data")
    tops = list(tmp.iterdir())
    if len(tops) != 1 or not tops[0].is_dir():
        raise SdistError(f"{archive.name}: expected one top-level directory")
    shutil.move(str(tops[0]), dest)
    shutil.rmtree(tmp)
    for junk in [*dest.glob("*.egg-info"), *dest.rglob("__pycache__")]:
        shutil.rmtree(junk, ignore_errors=True)
    return dest


def prepare(spec: SdistSpec, cache_dir: str | Path) -> Path:
    """A pristine unpacked copy of the sdist under the cache (reused when present)."""
    dest = Path(cache_dir) / "repos" / f"{spec.name}-{spec.version}"
    if not dest.is_dir():
        unpack(fetch(spec, cache_dir), dest)
    return dest
