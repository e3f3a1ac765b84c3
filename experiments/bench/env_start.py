"""Sandbox start cost per environment kind, cold (the first episode of a worker process) and warm (its later ones).

An episode's start is what an environment worker pays before the agent's first tool call and after its last:
the task's factory call (`c2jax.rl.tasks.build.sandbox_factory(kind)(repo, **options)`, as `open_task_sandbox`
makes it for `EnvironmentHost.open_sandbox` and for every grade), the first `exec("true")` (one bwrap launch,
or one `<engine> exec`) and `close()`. Kinds, each built here from small real local images, no registry:

- bwrap-repo: a task repository (a 200-file, 2.4 MB Python package) under bwrap.
- oci-image: an OCI image-layout task (`image_source`): a layer of this host's sh/bash/coreutils and their
  libraries, and a gzip layer holding the same package at /app, the task's workdir.
- dockerfile: a Dockerfile task (`image_build`): `FROM` the tools image in the image store, `COPY` of the
  package to /app, one `RUN`, built by c2jax's Dockerfile interpreter.
- debian-rootfs: a one-layer image as `c2jax images debian` writes it (`rl/sandbox/debian.write_layout`) with the
  package added at /app: the real Debian minbase when the store (`--debian-store`, else $C2JAX_IMAGE_STORE) holds
  `c2jax/debian:bookworm`, else this host's tools in the same one-layer format (the row says which).
- docker / podman: the oci-image task on the engine (`sandbox: auto`) when a daemon answers; else a row saying
  why not.

Each (kind, pool) pair runs in `--workers` fresh worker processes of `--episodes` episodes each, over an image
cache already filled (the unpack / build is a one-off per machine, shown as `first ever`: the first episode in
the first process, on an empty cache). `pool=off` is $C2JAX_ENV_POOL=0, i.e. every episode prepares its
environment as before the environment pool (c2jax.rl.sandbox.envpool).

    python -m experiments.bench.env_start [--workers 3 --episodes 8] [--quick] [--out runs/bench/env_start.json]
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

MT = "application/vnd.oci.image."
TOOLS = ("sh", "bash", "env", "cat", "true", "mkdir", "chmod", "tee", "cp", "ls")
DEBIAN_REF = "c2jax/debian:bookworm"


# --------------------------------------------------------------------------------------------- fixtures
def make_package(root: Path, files: int = 200) -> Path:
    """A sdist-sized synthetic Python package (files x ~2 KB), as experiments.bench.env_throughput's."""
    for i in range(files):
        p = root / "pkg" / f"sub{i % 10}" / f"mod{i}.py"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("".join(f"def f{j}(x):\n    return x + {j}\n\n" for j in range(60)))
    return root


def tools_entries(names=TOOLS) -> list[tuple[str, bytes | None]]:
    """(path, bytes or None for a directory): host binaries at bin/ and every library they load."""
    entries, seen = [], set()
    for name in names:
        exe = shutil.which(name)
        if exe is None:
            continue
        out = subprocess.run(["ldd", exe], capture_output=True, text=True).stdout
        files = [(f"bin/{name}", Path(os.path.realpath(exe)))]
        files += [(p.lstrip("/"), Path(os.path.realpath(p))) for line in out.splitlines()
                  for p in line.split() if p.startswith("/")]
        for rel, real in files:
            parts = Path(rel).parts
            for i in range(1, len(parts)):
                d = "/".join(parts[:i])
                if d not in seen:
                    seen.add(d)
                    entries.append((d, None))
            if rel not in seen:
                seen.add(rel)
                entries.append((rel, real.read_bytes()))
    return entries


def tree_entries(root: Path, prefix: str) -> list[tuple[str, bytes | None]]:
    out = [(prefix, None)]
    for p in sorted(root.rglob("*")):
        out.append((f"{prefix}/{p.relative_to(root)}", None if p.is_dir() else p.read_bytes()))
    return out


def tar_bytes(entries) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in entries:
            info = tarfile.TarInfo(name)
            if data is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            else:
                info.size, info.mode = len(data), 0o755 if name.startswith(("bin/", "lib", "usr/")) else 0o644
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _blob(root: Path, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    (root / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
    (root / "blobs" / "sha256" / digest).write_bytes(data)
    return "sha256:" + digest


def write_oci_layout(root: Path, layers: list[bytes], *, workdir: str = "/") -> Path:
    """An OCI image layout of `layers` (uncompressed tars, bottom first; all but the first stored gzip)."""
    root.mkdir(parents=True)
    (root / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    config = {"architecture": "amd64", "os": "linux",
              "config": {"Env": ["PATH=/usr/local/bin:/usr/bin:/bin"], "WorkingDir": workdir, "Cmd": ["sh"]},
              "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(t).hexdigest() for t in layers]}}
    descs = []
    for i, t in enumerate(layers):
        data = t if i == 0 else gzip.compress(t, compresslevel=1)
        descs.append({"mediaType": MT + "layer.v1.tar" + ("" if i == 0 else "+gzip"), "digest": _blob(root, data),
                      "size": len(data)})
    cfg = json.dumps(config).encode()
    manifest = json.dumps({"schemaVersion": 2, "mediaType": MT + "manifest.v1+json",
                           "config": {"mediaType": MT + "config.v1+json", "digest": _blob(root, cfg),
                                      "size": len(cfg)}, "layers": descs}).encode()
    desc = {"mediaType": MT + "manifest.v1+json", "digest": _blob(root, manifest), "size": len(manifest),
            "platform": {"os": "linux", "architecture": "amd64"}}
    (root / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [desc]}))
    return root


def _debian_rootfs_tar(debian_store: str | None, out: Path, package: Path) -> str:
    """A one-layer root filesystem tar with the package at app/: the Debian minbase of the store when there,
    else this host's tools. Returns what it is made of."""
    from c2jax.rl.sandbox.oci import find_in_store

    source = find_in_store(DEBIAN_REF, debian_store) if debian_store else None
    if source is not None and source.is_dir():
        index = json.loads((source / "index.json").read_text())
        manifest = json.loads((source / "blobs/sha256" / index["manifests"][0]["digest"].split(":")[1]).read_bytes())
        (layer,) = manifest["layers"]
        shutil.copyfile(source / "blobs/sha256" / layer["digest"].split(":")[1], out)
        made_of = f"{DEBIAN_REF} (mmdebstrap minbase, {source.name})"
    else:
        out.write_bytes(tar_bytes(tools_entries()))
        made_of = "host tools (no Debian base in the store)"
    with tarfile.open(out, "a") as tar:
        for name, data in tree_entries(package, "app"):
            info = tarfile.TarInfo(name)
            if data is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            else:
                info.size, info.mode = len(data), 0o644
                tar.addfile(info, io.BytesIO(data))
    return made_of


def build_fixtures(work: Path, debian_store: str | None) -> dict:
    """{kind: {"sandbox", "repo", "options", "env", "about"}} for every kind; images in work/store."""
    from c2jax.rl.sandbox.debian import write_layout

    package = make_package(work / "package")
    store = work / "store"
    store.mkdir()
    tools = tar_bytes(tools_entries())
    write_oci_layout(store / "example_app_1", [tools, tar_bytes(tree_entries(package, "app"))], workdir="/app")
    write_oci_layout(store / "example_base_1", [tools])
    ctx = work / "task-dockerfile" / "environment"
    shutil.copytree(package, ctx)
    (ctx / "Dockerfile").write_text("FROM example/base:1\nWORKDIR /app\nCOPY pkg/ ./pkg/\n"
                                    "RUN mkdir -p /etc && echo built > /etc/built\n")
    made_of = _debian_rootfs_tar(debian_store, work / "debian-rootfs.tar", package)
    write_layout(work / "debian-rootfs.tar", store / "example_debian-app_1", reference="example/debian-app:1",
                 workdir="/app")
    (work / "debian-rootfs.tar").unlink()
    empty = work / "no-repo"  # an image task's repository is what its image holds
    empty.mkdir()
    env = {"C2JAX_IMAGE_STORE": str(store), "C2JAX_IMAGE_CACHE": str(work / "cache")}
    image = {"image_source": str(store / "example_app_1"), "workdir": "/app"}
    return {
        "bwrap-repo": {"sandbox": "bwrap", "repo": str(package), "options": {}, "env": env,
                       "about": "200-file package, 2.4 MB"},
        "oci-image": {"sandbox": "bwrap", "repo": str(empty), "options": image, "env": env,
                      "about": "2 layers: host tools + package at /app (gzip)"},
        "dockerfile": {"sandbox": "bwrap", "repo": str(empty), "env": env, "about": "FROM tools, COPY package, RUN",
                       "options": {"image_build": str(ctx / "Dockerfile"), "workdir": "/app"}},
        "debian-rootfs": {"sandbox": "bwrap", "repo": str(empty), "env": env, "about": made_of,
                          "options": {"image_source": str(store / "example_debian-app_1"), "workdir": "/app"}},
        "engine": {"sandbox": "auto", "repo": str(empty), "options": image, "env": env,
                   "about": "the oci-image task on the engine"},
    }


# ------------------------------------------------------------------------------------------ measurement
def run_episodes(spec: dict, episodes: int) -> list[dict]:
    """In this process: `episodes` x (factory call, exec("true"), close), each timed."""
    from c2jax.rl.tasks.build import sandbox_factory

    factory = sandbox_factory(spec["sandbox"])
    out = []
    for _ in range(episodes):
        t0 = time.perf_counter()
        sandbox = factory(spec["repo"], **spec["options"])
        t1 = time.perf_counter()
        res = sandbox.exec("true")
        t2 = time.perf_counter()
        sandbox.close()
        t3 = time.perf_counter()
        if res.exit_code != 0:
            raise RuntimeError(f"exec true failed in {sandbox!r}: {res.stderr[-500:]}")
        out.append({"open_s": t1 - t0, "exec_s": t2 - t1, "close_s": t3 - t2, "total_s": t3 - t0})
    return out


def _worker(spec: dict, episodes: int, pool: bool) -> list[dict]:
    """A fresh worker process running `episodes` episodes of `spec`."""
    env = {**os.environ, **spec["env"]}
    if pool:
        env.pop("C2JAX_ENV_POOL", None)
    else:
        env["C2JAX_ENV_POOL"] = "0"
    proc = subprocess.run([sys.executable, "-m", "experiments.bench.env_start", "--child", json.dumps(spec),
                           "--episodes", str(episodes)], env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"worker for {spec['about']} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _engine_reason() -> str | None:
    from c2jax.rl.sandbox.engine import detect_engine

    engine, why = detect_engine()
    return None if engine is not None else why


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=3, help="fresh worker processes per kind and pool setting")
    ap.add_argument("--episodes", type=int, default=8, help="episodes per worker (the first is the cold one)")
    ap.add_argument("--quick", action="store_true", help="2 workers x 4 episodes")
    ap.add_argument("--kinds", default="bwrap-repo,oci-image,dockerfile,debian-rootfs,engine")
    ap.add_argument("--debian-store", default=os.environ.get("C2JAX_IMAGE_STORE"),
                    help=f"an image store holding {DEBIAN_REF} (`c2jax images debian`)")
    ap.add_argument("--out", default="runs/bench/env_start.json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(run_episodes(json.loads(args.child), args.episodes)))
        return 0
    if args.quick:
        args.workers, args.episodes = 2, 4

    from c2jax.bench_report import write_results
    from c2jax.machine import describe

    machine = describe()
    kinds = [k for k in args.kinds.split(",") if k]
    rows, notes = [], []
    with tempfile.TemporaryDirectory(prefix="env-start-") as tmp:
        t = time.perf_counter()
        fixtures = build_fixtures(Path(tmp), args.debian_store)
        notes.append(f"fixtures built in {time.perf_counter() - t:.1f} s")
        for kind in kinds:
            spec = fixtures[kind]
            if kind == "engine":
                why = _engine_reason()
                if why is not None:
                    notes.append(f"docker / podman: not measured, no engine runs here ({why})")
                    continue
            first_ever = _worker(spec, 1, pool=True)[0]["total_s"]  # empty image cache: unpack / build
            runs: dict[bool, list] = {False: [], True: []}
            for _ in range(args.workers):  # interleaved, so a change of the machine's load hits both alike
                for pool in (False, True):
                    runs[pool].append(_worker(spec, args.episodes, pool))
            for pool, eps in runs.items():
                cold = [e[0]["total_s"] for e in eps]
                warm = [x for e in eps for x in e[1:]]
                rows.append({
                    "kind": kind, "pool": "on" if pool else "off", "first_ever_s": first_ever,
                    "cold_p50_ms": 1e3 * statistics.median(cold), "cold_p90_ms": 1e3 * pct(cold, 0.9),
                    "warm_p50_ms": 1e3 * statistics.median(t["total_s"] for t in warm),
                    "warm_p90_ms": 1e3 * pct([t["total_s"] for t in warm], 0.9),
                    "warm_open_p50_ms": 1e3 * statistics.median(t["open_s"] for t in warm),
                    "warm_exec_p50_ms": 1e3 * statistics.median(t["exec_s"] for t in warm),
                    "warm_close_p50_ms": 1e3 * statistics.median(t["close_s"] for t in warm),
                    "cold_n": len(cold), "warm_n": len(warm), "image": spec["about"]})
    print(f"sandbox start = factory call + exec('true') + close; {args.workers} fresh worker processes x "
          f"{args.episodes} episodes per row (cold: each worker's first episode; warm: the others); the image "
          "cache is filled first (first ever: the first episode on an empty cache)")
    write_results(args.out, rows, machine=machine, notes=notes, columns=[
        "kind", "pool", ("first_ever_s", "first ever s", ".2f"), ("cold_p50_ms", "cold p50 ms", ".1f"),
        ("cold_p90_ms", "cold p90 ms", ".1f"), ("warm_p50_ms", "warm p50 ms", ".1f"),
        ("warm_p90_ms", "warm p90 ms", ".1f"), ("warm_open_p50_ms", "open", ".1f"),
        ("warm_exec_p50_ms", "exec", ".1f"), ("warm_close_p50_ms", "close", ".1f"), ("cold_n", "n cold"),
        ("warm_n", "n warm")],
        meta={"workers": args.workers, "episodes": args.episodes, "notes": notes,
              "images": {r["kind"]: r["image"] for r in rows}})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
