"""A Debian root filesystem from the Debian archive, saved as an OCI image in the image store: a base image made
without any container registry (`c2jax images debian`).

`mmdebstrap` (Debian's tool; `apt install mmdebstrap`) installs the suite's packages of a variant (`minbase`:
essential packages and apt, ~170 MB unpacked for bookworm) into a tar archive; `write_layout` packs a root
filesystem tar as a one-layer OCI image layout with a config (Env, WorkingDir, Cmd), which the rest of c2jax
treats like any saved image (`c2jax.rl.sandbox.oci`): Dockerfiles build FROM it, Harbor tasks name it.

apt inside a bubblewrap container runs as uid 0 of a user namespace in which its `_apt` user does not exist, so
the image sets `APT::Sandbox::User "root"` (mmdebstrap writes its `--aptopt` options into the image's
/etc/apt/apt.conf.d) and apt installs packages there as Docker builds do.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from c2jax.rl.sandbox.oci import DEFAULT_ENV, ImageError, find_in_store, store_name

DEFAULT_MIRROR = "http://deb.debian.org/debian"
MT = "application/vnd.oci.image."
SANDBOX_APT_OPTION = 'APT::Sandbox::User "root"'


def _copy_hashing(src: Path, dst: Path) -> tuple[str, int]:
    h, size = hashlib.sha256(), 0
    with src.open("rb") as fin, dst.open("wb") as fout:
        while chunk := fin.read(1 << 20):
            h.update(chunk)
            fout.write(chunk)
            size += len(chunk)
    return "sha256:" + h.hexdigest(), size


def _write_blob(root: Path, data: bytes) -> tuple[str, int]:
    digest = hashlib.sha256(data).hexdigest()
    (root / "blobs" / "sha256" / digest).write_bytes(data)
    return "sha256:" + digest, len(data)


def write_layout(rootfs_tar: str | os.PathLike, out_dir: str | os.PathLike, *, reference: str = "",
                 env: dict[str, str] | None = None, workdir: str = "/", cmd: tuple[str, ...] = ("bash",),
                 labels: dict[str, str] | None = None) -> Path:
    """An OCI image layout at `out_dir` (which must not exist) whose one uncompressed layer is `rootfs_tar`."""
    rootfs_tar, out_dir = Path(rootfs_tar), Path(out_dir)
    if out_dir.exists():
        raise ImageError(f"{out_dir} already exists")
    if not rootfs_tar.is_file():
        raise ImageError(f"{rootfs_tar}: no such root filesystem archive")
    blobs = out_dir / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    staging = blobs / ".layer"
    layer_digest, layer_size = _copy_hashing(rootfs_tar, staging)
    os.rename(staging, blobs / layer_digest.split(":")[1])
    config = {"architecture": "amd64", "os": "linux",
              "config": {"Env": [f"{k}={v}" for k, v in {**DEFAULT_ENV, **(env or {})}.items()],
                         "WorkingDir": workdir, "Cmd": list(cmd), "Labels": labels or {}},
              # an uncompressed layer's diff_id is its digest
              "rootfs": {"type": "layers", "diff_ids": [layer_digest]}}
    cfg_digest, cfg_size = _write_blob(out_dir, json.dumps(config, sort_keys=True).encode())
    manifest = {"schemaVersion": 2, "mediaType": MT + "manifest.v1+json",
                "config": {"mediaType": MT + "config.v1+json", "digest": cfg_digest, "size": cfg_size},
                "layers": [{"mediaType": MT + "layer.v1.tar", "digest": layer_digest, "size": layer_size}]}
    man_digest, man_size = _write_blob(out_dir, json.dumps(manifest, sort_keys=True).encode())
    desc = {"mediaType": MT + "manifest.v1+json", "digest": man_digest, "size": man_size,
            "platform": {"os": "linux", "architecture": "amd64"}}
    if reference:
        desc["annotations"] = {"org.opencontainers.image.ref.name": reference}
    (out_dir / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [desc]}))
    (out_dir / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    return out_dir


def mmdebstrap_unusable_reason() -> str | None:
    """None when mmdebstrap is installed, else what to install."""
    if shutil.which("mmdebstrap") is None:
        return "mmdebstrap is not installed (Debian / Ubuntu: `apt install mmdebstrap`)"
    return None


def build_debian_base(store: str | os.PathLike, *, suite: str = "bookworm", variant: str = "minbase",
                      mirror: str = DEFAULT_MIRROR, include: tuple[str, ...] = (), reference: str = "",
                      force: bool = False, timeout_s: float = 1800.0) -> tuple[str, Path, float]:
    """(reference, layout path, seconds) of a Debian `suite` root filesystem saved in `store` as
    `c2jax/debian:<suite>` (or `reference`); an image already there is kept unless `force`."""
    reference = reference or f"c2jax/debian:{suite}"
    store = Path(store)
    existing = find_in_store(reference, store)
    if existing is not None and not force:
        return reference, existing, 0.0
    reason = mmdebstrap_unusable_reason()
    if reason:
        raise ImageError(f"cannot build {reference}: {reason}")
    store.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix=".debian-", dir=store))
    try:
        tar = work / "rootfs.tar"
        argv = ["mmdebstrap", f"--variant={variant}", "--format=tar", f"--aptopt={SANDBOX_APT_OPTION}",
                *([f"--include={','.join(include)}"] if include else []), suite, str(tar), mirror]
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise ImageError(f"cannot build {reference}: mmdebstrap timed out after {timeout_s:.0f} s") from None
        if proc.returncode != 0:
            raise ImageError(f"cannot build {reference}: `{' '.join(argv)}` exited with status {proc.returncode}:\n"
                             f"{(proc.stdout + proc.stderr)[-2000:]}")
        layout = write_layout(tar, work / "layout", reference=reference,
                              labels={"c2jax.debian.suite": suite, "c2jax.debian.variant": variant,
                                      "c2jax.debian.mirror": mirror})
        out = store / store_name(reference)
        if out.exists():
            shutil.rmtree(out)
        os.rename(layout, out)
        return reference, out, time.perf_counter() - start
    finally:
        shutil.rmtree(work, ignore_errors=True)
