"""Container images without a container engine: an OCI image unpacked once into a root filesystem.

Accepted sources (what `docker save`, `podman save`, `skopeo copy ... oci:DIR` and buildkit's OCI exporter write):
- an OCI image-layout directory (`oci-layout`, `index.json`, `blobs/<alg>/<hex>`);
- a tar archive of one (`docker save` since Docker 25 writes both layouts in one archive);
- a classic `docker save` archive (`manifest.json` listing the config and the layer tars).

`load_image(source, cache_dir)` picks the linux/amd64 manifest (or the only one), checks every blob against its
digest, applies the layers in order into `cache_dir/<manifest digest>/rootfs` and returns the image with its
config (Env, WorkingDir, User, Cmd, Entrypoint). The unpacked tree is shared by every episode on that image (it is
never written: sandboxes put a private copy-on-write layer over it), and made once per digest: a second load is a
lookup, concurrent loads race to one atomic rename.

Layer semantics follow the OCI image spec's "Applying changesets": a file `.wh.NAME` deletes NAME from the lower
layers, `.wh..wh..opq` in a directory hides everything the lower layers put there; hard links point into the tree
built so far. Member paths are confined to the root filesystem: absolute names are made relative, and a member
whose path would leave the tree (`..`, or through a symlink unpacked earlier) is refused with its layer and name;
device nodes are skipped (an unprivileged sandbox gets its /dev from bubblewrap). Compressed layers: gzip, and
uncompressed tar; zstd layers are refused with the reason (Python's standard library cannot read them).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import stat
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import IO

WHITEOUT_PREFIX = ".wh."
OPAQUE_MARKER = ".wh..wh..opq"
INDEX_TYPES = ("application/vnd.oci.image.index.v1+json", "application/vnd.docker.distribution.manifest.list.v2+json")
PLATFORM = ("linux", "amd64")
# an unpacked tree holds this file once it is whole (written last, before the atomic rename)
COMPLETE_MARKER = ".c2jax-complete"
# under the image's Env, as Docker does for an image that sets no PATH
DEFAULT_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root"}


class ImageError(ValueError):
    """The image cannot be used; the message names the source and the part that is wrong."""


@dataclass(frozen=True)
class ImageConfig:
    """What the image's config says about the processes started in it (the OCI config's `config` object)."""

    env: dict[str, str] = field(default_factory=dict)
    workdir: str = "/"
    user: str = ""
    cmd: tuple[str, ...] = ()
    entrypoint: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, config: dict) -> ImageConfig:
        c = config.get("config") or {}
        env = {}
        for item in c.get("Env") or ():
            key, _, value = item.partition("=")
            env[key] = value
        return cls(env=env, workdir=c.get("WorkingDir") or "/", user=c.get("User") or "",
                   cmd=tuple(c.get("Cmd") or ()), entrypoint=tuple(c.get("Entrypoint") or ()))


@dataclass(frozen=True)
class Image:
    digest: str  # of the manifest: "sha256:<hex>"
    rootfs: Path
    config: ImageConfig
    layers: tuple[str, ...]  # layer digests, bottom first


# ------------------------------------------------------------------------------------------- reading sources
class _Blobs:
    """Blob access by digest, from a layout directory or from a tar archive, with digest verification."""

    def __init__(self, source: Path):
        self.source = source
        self._tar = None
        if source.is_dir():
            self._root = source
        elif source.is_file():
            try:
                self._tar = tarfile.open(source)
            except tarfile.TarError as e:
                raise ImageError(f"{source}: not an OCI layout directory or an image tar archive ({e})") from e
            self._names = {PurePosixPath(m.name).as_posix().removeprefix("./"): m
                           for m in self._tar.getmembers() if m.isfile()}
        else:
            raise ImageError(f"{source}: no such image (expected an OCI layout directory or a `docker save` tar)")

    def close(self):
        if self._tar is not None:
            self._tar.close()

    def has(self, name: str) -> bool:
        return (self._root / name).is_file() if self._tar is None else name in self._names

    def open(self, name: str) -> IO[bytes]:
        if self._tar is None:
            path = self._root / name
            if not path.is_file():
                raise ImageError(f"{self.source}: missing {name}")
            return path.open("rb")
        member = self._names.get(name)
        if member is None:
            raise ImageError(f"{self.source}: the archive has no {name}")
        return self._tar.extractfile(member)

    def read_json(self, name: str) -> dict:
        with self.open(name) as f:
            try:
                return json.load(f)
            except ValueError as e:
                raise ImageError(f"{self.source}: {name} is not valid JSON ({e})") from e

    def blob_name(self, digest: str) -> str:
        alg, _, hexdigest = digest.partition(":")
        if alg != "sha256" or len(hexdigest) != 64 or not all(c in "0123456789abcdef" for c in hexdigest):
            raise ImageError(f"{self.source}: unsupported or malformed digest {digest!r} (sha256 expected)")
        return f"blobs/sha256/{hexdigest}"

    def verified(self, name: str, digest: str) -> bytes:
        """The whole blob, checked against its digest (configs, manifests: small)."""
        with self.open(name) as f:
            data = f.read()
        if "sha256:" + hashlib.sha256(data).hexdigest() != digest:
            raise ImageError(f"{self.source}: {name} does not match its digest {digest} (corrupt or truncated)")
        return data


def _pick_manifest(blobs: _Blobs, index: dict, where: str) -> dict:
    manifests = index.get("manifests") or []
    if not manifests:
        raise ImageError(f"{blobs.source}: {where} lists no manifests")
    if len(manifests) > 1:
        wanted = [m for m in manifests
                  if (m.get("platform") or {}).get("os") == PLATFORM[0]
                  and (m.get("platform") or {}).get("architecture") == PLATFORM[1]]
        if not wanted:
            platforms = sorted({"{}/{}".format((m.get("platform") or {}).get("os"),
                                               (m.get("platform") or {}).get("architecture")) for m in manifests})
            raise ImageError(f"{blobs.source}: {where} has no {'/'.join(PLATFORM)} manifest "
                             f"(has {', '.join(platforms)})")
        manifests = wanted[:1]
    desc = manifests[0]
    data = blobs.verified(blobs.blob_name(desc["digest"]), desc["digest"])
    doc = json.loads(data)
    if doc.get("mediaType", desc.get("mediaType")) in INDEX_TYPES or "manifests" in doc:
        return _pick_manifest(blobs, doc, f"index {desc['digest']}")
    return {"digest": desc["digest"], "manifest": doc}


def _read_source(blobs: _Blobs) -> tuple[str, dict, list[tuple[str, str, str]]]:
    """(manifest digest, image config JSON, [(layer name in the source, digest, media type)])."""
    if blobs.has("index.json"):
        picked = _pick_manifest(blobs, blobs.read_json("index.json"), "index.json")
        manifest = picked["manifest"]
        cfg_desc = manifest.get("config") or {}
        if "digest" not in cfg_desc:
            raise ImageError(f"{blobs.source}: manifest {picked['digest']} has no config")
        config = json.loads(blobs.verified(blobs.blob_name(cfg_desc["digest"]), cfg_desc["digest"]))
        layers = [(blobs.blob_name(d["digest"]), d["digest"], d.get("mediaType", ""))
                  for d in manifest.get("layers", [])]
        return picked["digest"], config, layers
    if blobs.has("manifest.json"):
        entries = blobs.read_json("manifest.json")
        if not isinstance(entries, list) or not entries:
            raise ImageError(f"{blobs.source}: manifest.json lists no images")
        if len(entries) > 1:
            raise ImageError(f"{blobs.source}: the archive holds {len(entries)} images; save one image per archive")
        entry = entries[0]
        with blobs.open(entry["Config"]) as f:
            config_bytes = f.read()
        config = json.loads(config_bytes)
        # the classic format names blobs by path; the layers' digests are in the config (`rootfs.diff_ids`,
        # of the uncompressed tars), in order
        diff_ids = (config.get("rootfs") or {}).get("diff_ids") or []
        if len(diff_ids) != len(entry.get("Layers", [])):
            raise ImageError(f"{blobs.source}: {len(entry.get('Layers', []))} layers but {len(diff_ids)} diff_ids in "
                             "the config")
        digest = "sha256:" + hashlib.sha256(config_bytes + json.dumps(entry, sort_keys=True).encode()).hexdigest()
        return digest, config, [(name, diff, "diff_id") for name, diff in zip(entry["Layers"], diff_ids)]
    raise ImageError(f"{blobs.source}: neither index.json (OCI layout) nor manifest.json (docker save) found")


# ------------------------------------------------------------------------------------------- applying layers
class _HashingReader(io.RawIOBase):
    def __init__(self, f: IO[bytes]):
        self.f, self.h = f, hashlib.sha256()

    def readable(self):
        return True

    def readinto(self, b):
        data = self.f.read(len(b))
        self.h.update(data)
        b[:len(data)] = data
        return len(data)


class _Raw(io.RawIOBase):
    def __init__(self, f: IO[bytes]):
        self.f = f

    def readable(self):
        return True

    def readinto(self, b):
        data = self.f.read(len(b))
        b[:len(data)] = data
        return len(data)


def _inside(root: Path, rel: str, layer: str) -> Path:
    """root/rel with every existing parent resolved inside root (a symlink to elsewhere is refused)."""
    parts = [p for p in PurePosixPath(rel).parts if p not in ("/", ".")]
    if any(p == ".." for p in parts):
        raise ImageError(f"layer {layer}: member {rel!r} leaves the root filesystem ('..')")
    path = root
    for i, part in enumerate(parts):
        path = path / part
        if i < len(parts) - 1 and path.is_symlink():
            target = Path(os.path.normpath(path.parent / os.readlink(path))) if not os.readlink(path).startswith("/") \
                else Path(os.path.normpath(root / os.readlink(path).lstrip("/")))
            if target != root and root not in target.parents:
                raise ImageError(f"layer {layer}: member {rel!r} goes through symlink {path.relative_to(root)} "
                                 "out of the root filesystem")
            path = target
    return path


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def _apply_layer(root: Path, stream: IO[bytes], layer: str) -> None:
    try:
        tar = tarfile.open(fileobj=stream, mode="r|")
    except tarfile.TarError as e:
        raise ImageError(f"layer {layer}: not a tar stream ({e})") from e
    opaque_done: set[Path] = set()
    with tar:
        for m in tar:
            name = m.name
            parent, base = posixpath_split(name)
            if base == OPAQUE_MARKER:
                d = _inside(root, parent, layer)
                if d.is_dir() and d not in opaque_done:
                    for child in d.iterdir():
                        _remove(child)
                opaque_done.add(d)
                continue
            if base.startswith(WHITEOUT_PREFIX):
                target = _inside(root, posixpath_join(parent, base[len(WHITEOUT_PREFIX):]), layer)
                if target.exists() or target.is_symlink():
                    _remove(target)
                continue
            dest = _inside(root, name, layer)
            if m.ischr() or m.isblk() or m.isfifo():
                continue  # /dev comes from the sandbox
            if dest.exists() or dest.is_symlink():
                if not (m.isdir() and dest.is_dir() and not dest.is_symlink()):
                    _remove(dest)
            dest.parent.mkdir(parents=True, exist_ok=True)
            if m.isdir():
                dest.mkdir(exist_ok=True)
                os.chmod(dest, (m.mode & 0o7777) | stat.S_IRWXU)
            elif m.issym():
                os.symlink(m.linkname, dest)
            elif m.islnk():
                src = _inside(root, m.linkname, layer)
                if not src.exists():
                    raise ImageError(f"layer {layer}: hard link {name!r} to missing {m.linkname!r}")
                os.link(src, dest)
            elif m.isfile():
                src = tar.extractfile(m)
                with open(dest, "wb") as out:
                    shutil.copyfileobj(src, out, 1 << 20)
                os.chmod(dest, m.mode & 0o7777)
            else:
                raise ImageError(f"layer {layer}: member {name!r} has an unsupported type {m.type!r}")


def posixpath_split(name: str) -> tuple[str, str]:
    p = PurePosixPath(name.rstrip("/") or ".")
    return str(p.parent), p.name


def posixpath_join(parent: str, base: str) -> str:
    return str(PurePosixPath(parent) / base)


def _layer_stream(raw: IO[bytes], media_type: str, layer: str) -> IO[bytes]:
    head = raw.peek(4)[:4] if hasattr(raw, "peek") else b""
    if "zstd" in media_type or head.startswith(b"\x28\xb5\x2f\xfd"):
        raise ImageError(f"layer {layer}: zstd-compressed layers are not supported (re-save the image with gzip "
                         "or uncompressed layers, e.g. `skopeo copy --dest-compress-format gzip`)")
    if "gzip" in media_type or head.startswith(b"\x1f\x8b"):
        return gzip.GzipFile(fileobj=raw)
    return raw


def load_image(source: str | os.PathLike, cache_dir: str | os.PathLike) -> Image:
    """The image at `source` unpacked under `cache_dir` (once per manifest digest)."""
    source, cache_dir = Path(source), Path(cache_dir)
    blobs = _Blobs(source)
    try:
        digest, config, layers = _read_source(blobs)
        image_cfg = ImageConfig.from_json(config)
        out = cache_dir / digest.replace(":", "-")
        if (out / COMPLETE_MARKER).is_file():
            return Image(digest, out / "rootfs", image_cfg, tuple(d for _, d, _ in layers))
        cache_dir.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".unpack-", dir=cache_dir))
        try:
            rootfs = staging / "rootfs"
            rootfs.mkdir()
            for name, layer_digest, media_type in layers:
                with blobs.open(name) as f:
                    # OCI descriptors hash the blob as stored (compressed); a classic `docker save` lists the
                    # diff_ids, hashes of the uncompressed tars
                    if media_type == "diff_id":
                        reader = _HashingReader(_layer_stream(io.BufferedReader(_Raw(f), 1 << 20), "", name))
                        stream = io.BufferedReader(reader, 1 << 20)
                    else:
                        reader = _HashingReader(f)
                        stream = _layer_stream(io.BufferedReader(reader, 1 << 20), media_type, layer_digest)
                    _apply_layer(rootfs, stream, layer_digest)
                    while stream.read(1 << 20):  # the tar's end padding: hash all of it
                        pass
                    actual = "sha256:" + reader.h.hexdigest()
                    if actual != layer_digest:
                        raise ImageError(f"{source}: layer {name} does not match its digest {layer_digest} "
                                         "(corrupt or truncated)")
            (staging / "config.json").write_text(json.dumps(config))
            (staging / COMPLETE_MARKER).write_text(digest + "\n")
            try:
                os.rename(staging, out)
            except OSError:
                # lost the race to a half-written tree: cannot happen by rename
                if not (out / COMPLETE_MARKER).is_file():
                    raise
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
        return Image(digest, out / "rootfs", image_cfg, tuple(d for _, d, _ in layers))
    finally:
        blobs.close()


# ------------------------------------------------------------------------------------------- image store
# A directory of saved images, found by reference: `docker save REF -o STORE/NAME.tar`, or an OCI layout /
# archive written by `skopeo copy docker://REF oci:STORE/NAME` / `oci-archive:STORE/NAME.tar`, where NAME is the
# reference with '/', ':' and '@' replaced by '_' (example/tb2-task:20251031 -> example_tb2-task_20251031).
IMAGE_STORE_ENV = "C2JAX_IMAGE_STORE"
IMAGE_CACHE_ENV = "C2JAX_IMAGE_CACHE"


def store_name(reference: str) -> str:
    return reference.replace("/", "_").replace(":", "_").replace("@", "_")


def find_in_store(reference: str, store: str | os.PathLike | None = None) -> Path | None:
    """The saved image for `reference` in `store` (default: $C2JAX_IMAGE_STORE), or None."""
    store = store if store is not None else os.environ.get(IMAGE_STORE_ENV)
    if not store:
        return None
    name = store_name(reference)
    for candidate in (Path(store) / name, Path(store) / f"{name}.tar"):
        if candidate.is_dir() and (candidate / "index.json").is_file() or candidate.is_file():
            return candidate
    return None


def read_image_config(source: str | os.PathLike) -> tuple[str, ImageConfig]:
    """(manifest digest, config) of a saved image, without unpacking its layers."""
    blobs = _Blobs(Path(source))
    try:
        digest, config, _ = _read_source(blobs)
        return digest, ImageConfig.from_json(config)
    finally:
        blobs.close()


def image_cache_dir() -> Path:
    """Where images are unpacked: $C2JAX_IMAGE_CACHE, else ~/.cache/c2jax/images."""
    return Path(os.environ.get(IMAGE_CACHE_ENV) or Path.home() / ".cache" / "c2jax" / "images")
