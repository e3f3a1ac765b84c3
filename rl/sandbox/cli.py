"""`c2jax images pull REF [--store DIR] [--platform linux/amd64] [--force]`, `c2jax images list [--store DIR]` and
`c2jax images debian [--suite bookworm] [--variant minbase] [--store DIR]`.

The image store is `--store` or `$C2JAX_IMAGE_STORE` (docs/sandbox.md, "Container images without an engine"):
`pull` fetches an image from its registry into it as an OCI layout (`c2jax.rl.sandbox.registry`), `list` shows
what it holds, with each image's manifest digest, `debian` makes a Debian base image from the Debian archive with
mmdebstrap (`c2jax.rl.sandbox.debian`), saved as `c2jax/debian:<suite>`: a base for Dockerfiles where no registry
is reachable.
"""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("images", help="the image store: pull images from a registry, list them "
                                                  "(rl/sandbox)", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="images_command", required=True, metavar="ACTION")
    pull = sub.add_parser("pull", help="pull an image from an OCI / Docker registry into the store",
                          description="Pull REF (Docker's reference rules: `ubuntu` is "
                                      "registry-1.docker.io/library/ubuntu:latest) into the image store as an OCI "
                                      "layout named after REF. Credentials, when the registry wants them: "
                                      "C2JAX_REGISTRY_AUTH_<REGISTRY>=user:password (e.g. "
                                      "C2JAX_REGISTRY_AUTH_GHCR_IO) or C2JAX_REGISTRY_AUTH for every registry.")
    pull.add_argument("reference", metavar="REF", help="image reference: [REGISTRY/]REPOSITORY[:TAG][@sha256:...]")
    pull.add_argument("--store", default=None, help="image store directory (default $C2JAX_IMAGE_STORE)")
    pull.add_argument("--platform", default="linux/amd64", help="OS/ARCH[/VARIANT] picked from a multi-platform "
                                                                "image (default linux/amd64)")
    pull.add_argument("--force", action="store_true", help="pull again even when the store has the image")
    pull.add_argument("--insecure", action="store_const", const=True, default=None,
                      help="plain HTTP (default: only for localhost / 127.0.0.1 registries)")
    pull.add_argument("--timeout", type=float, default=60.0, help="seconds per connection and read (default 60)")
    pull.add_argument("--jobs", type=int, default=4, help="layers downloaded at once (default 4)")
    pull.add_argument("-q", "--quiet", action="store_true", help="no line per downloaded blob")
    deb = sub.add_parser("debian", help="make a Debian base image with mmdebstrap, saved as c2jax/debian:SUITE")
    deb.add_argument("--store", default=None, help="image store directory (default $C2JAX_IMAGE_STORE)")
    deb.add_argument("--suite", default="bookworm", help="Debian suite (default bookworm)")
    deb.add_argument("--variant", default="minbase", help="mmdebstrap variant (default minbase: essential + apt)")
    deb.add_argument("--mirror", default=None, help="Debian mirror (default http://deb.debian.org/debian)")
    deb.add_argument("--include", default="", help="comma-separated extra packages")
    deb.add_argument("--reference", default="", help="name in the store (default c2jax/debian:SUITE)")
    deb.add_argument("--force", action="store_true", help="build again even when the store has the image")
    ls = sub.add_parser("list", help="the images in the store, with their manifest digests")
    ls.add_argument("--store", default=None, help="image store directory (default $C2JAX_IMAGE_STORE)")
    return parser


def run(args) -> int:
    import sys
    import time

    from c2jax.rl.sandbox.oci import find_in_store, read_image_config
    from c2jax.rl.sandbox.registry import parse_reference, pull, store_dir, stored_images

    def fail(message: str, status: int) -> int:
        print(f"error: c2jax images {args.images_command}: {message}", file=sys.stderr)
        return status

    try:
        store = store_dir(args.store)
    except ValueError as e:
        return fail(str(e), 2)

    if args.images_command == "debian":
        from c2jax.rl.sandbox.debian import DEFAULT_MIRROR, build_debian_base

        try:
            ref, path, seconds = build_debian_base(
                store, suite=args.suite, variant=args.variant, mirror=args.mirror or DEFAULT_MIRROR,
                include=tuple(p for p in args.include.split(",") if p), reference=args.reference, force=args.force)
        except ValueError as e:
            return fail(str(e), 1)
        how = "already in the store" if seconds == 0.0 else f"built in {seconds:.1f} s"
        print(f"{ref}: {read_image_config(path)[0]} -> {path} ({how})")
        return 0

    if args.images_command == "list":
        try:
            images = stored_images(store)
        except ValueError as e:
            return fail(str(e), 2)
        if not images:
            print(f"{store}: no images")
            return 0
        width = max(len(i.reference) for i in images)
        for i in images:
            print(f"{i.reference:<{width}}  {i.digest or 'unreadable: ' + i.error}  {i.path.name}")
        return 1 if any(i.error for i in images) else 0

    try:
        parse_reference(args.reference)
    except ValueError as e:
        return fail(str(e), 2)
    existing = find_in_store(args.reference, store)
    if existing is not None and not args.force:
        print(f"{args.reference}: already in the store at {existing} (--force pulls it again)")
        return 0
    log = None if args.quiet else (lambda line: print(f"  {line}", file=sys.stderr, flush=True))
    start = time.perf_counter()
    try:
        path = pull(args.reference, store, platform=args.platform, insecure=args.insecure, timeout_s=args.timeout,
                    force=args.force, jobs=args.jobs, log=log)
    except ValueError as e:  # RegistryError / ImageError are ValueErrors, as is a malformed reference
        return fail(str(e), 1)
    digest = read_image_config(path)[0]
    print(f"{args.reference}: {digest} -> {path} ({time.perf_counter() - start:.1f} s)")
    return 0
