"""Two Harbor tasks whose environments are container images, for RL runs over mixed suites on a machine with no
registry: both use the Debian base image `c2jax images debian` saves in the image store (mmdebstrap from the Debian
archive). `debian-version` runs in that image as it is (an `oci-image` environment: its /etc/debian_version is
what the task asks about); `built-greeting` has a Dockerfile that builds over it (a `dockerfile` environment: the
file the task asks about exists only in the built image). Each ships its oracle (solution/solve.sh) and a
verifier (tests/test.sh writing /logs/verifier/reward.txt)."""

from __future__ import annotations

from pathlib import Path

DEBIAN_REFERENCE = "c2jax/debian:bookworm"

_TASKS = {
    "debian-version": {
        "task.toml": f'schema_version = "1.1"\n[metadata]\ncategory = "image"\ndifficulty = "easy"\n'
                     f'[environment]\ndocker_image = "{DEBIAN_REFERENCE}"\nworkdir = "/app"\nallow_internet = false\n'
                     "[verifier]\ntimeout_sec = 60.0\n",
        "instruction.md": "Write the major version number of this Debian system (the part of /etc/debian_version "
                          "before the first dot) to answer.txt in the working directory.\n",
        "solution/solve.sh": "cut -d. -f1 /etc/debian_version > answer.txt\n",
        "tests/test.sh": '#!/bin/bash\nwant="$(cut -d. -f1 /etc/debian_version)"\n'
                         'if [ -n "$want" ] && [ "$(cat /app/answer.txt 2>/dev/null)" = "$want" ]; then echo 1; '
                         "else echo 0; fi > /logs/verifier/reward.txt\n",
    },
    "built-greeting": {
        "task.toml": 'schema_version = "1.1"\n[metadata]\ncategory = "image"\ndifficulty = "easy"\n'
                     "[environment]\nallow_internet = false\n[verifier]\ntimeout_sec = 60.0\n",
        "environment/Dockerfile": f"FROM {DEBIAN_REFERENCE}\nRUN mkdir -p /app && echo 'built over debian' > "
                                  "/etc/c2jax-greeting\nWORKDIR /app\n",
        "instruction.md": "Copy the contents of /etc/c2jax-greeting into answer.txt in the working directory.\n",
        "solution/solve.sh": "cp /etc/c2jax-greeting answer.txt\n",
        "tests/test.sh": '#!/bin/bash\nif [ -s /etc/c2jax-greeting ] && cmp -s /etc/c2jax-greeting /app/answer.txt; '
                         "then echo 1; else echo 0; fi > /logs/verifier/reward.txt\n",
    },
}


def write_image_tasks(out_dir: str | Path) -> Path:
    """Writes the two tasks under `out_dir` (kept as they are if already there) and returns it."""
    out_dir = Path(out_dir)
    for name, files in _TASKS.items():
        for rel, text in files.items():
            path = out_dir / name / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            if not path.is_file() or path.read_text() != text:
                path.write_text(text)
            if rel.endswith(".sh"):
                path.chmod(0o755)
    return out_dir
