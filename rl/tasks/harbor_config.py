"""Harbor's task.toml runtime fields, read into what c2jax's sandboxes honour, or a refusal naming the field.

Harbor (laude-institute/harbor, `models/task/config.py`) reads `[environment]`, `[agent]`, `[verifier]`
and `[solution]` into pydantic models that ignore unknown keys; this module does the same for the
fields that change how a task runs. Fields are applied only when the task.toml sets them, so c2jax's
own tasks (which set none of them) keep the sandbox defaults. Honoured:

  [environment] workdir         the workspace is mounted there and every phase starts there
                env             set for every command (agent, oracle, verifier); ${VAR} / ${VAR:-d}
                                resolved from the host, as Harbor does; over a plain Dockerfile's ENV
                cpus            cgroup CPU quota (where the cpu controller is writable)
                memory_mb, memory ("2G", "512M", "1024K": Harbor's deprecated spelling)
                                the sandbox's memory cap
                storage_mb, storage   caps each file and the private /tmp (the workspace's total
                                size is not capped)
                network_mode / allow_internet / allowed_hosts   offline by default: "no-network" is
                                exact; "public" runs offline unless the run allows the network
                                (eval `allow_network`, RL `env.allow_network`), then on the host's
                                network; "allowlist" always runs offline (a host allowlist is not
                                enforced here). `network_note` says which tasks ran with less than
                                they permit; validation and the eval report list them.
  [agent]       timeout_sec     the episode's wall clock (and the longest single command)
                env             (not a Harbor field; accepted) set for the agent's commands
  [verifier]    timeout_sec     test.sh's wall clock (Task.timeout_s)
                env             set for test.sh
  [solution]    env             set for the oracle's solve.sh

A prebuilt `docker_image` runs when the image store ($C2JAX_IMAGE_STORE, see c2jax.rl.sandbox.oci) holds it
(saved with `docker save` or `skopeo copy`): the task's sandboxes are bwrap containers of the image (Docker /
Podman containers with `sandbox: docker / podman / auto` where an engine runs, rl/sandbox/engine.py), its WORKDIR
(unless task.toml sets one) and ENV apply, the Dockerfile is not built.

Refused (the task loads as unsupported, with the field in the reason): a `docker_image` missing from the store,
GPUs, a non-Linux `os`, `healthcheck`, `mcp_servers`, `skills_dir`, `[agent]`/`[verifier]` `user`,
a separate verifier environment, verifier `collect` commands, and multi-step `steps`.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

from c2jax.rl.sandbox.base import Limits

NETWORK_MODES = ("public", "no-network", "allowlist")
_TEMPLATE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class HarborConfigError(ValueError):
    """A task.toml field holds a value of the wrong type or shape."""


class Refused(Exception):
    """A well-formed field c2jax cannot honour; the message names it."""


@dataclass(frozen=True)
class TaskEnvironment:
    """The runtime fields of one task.toml (None / empty: not set, so the sandbox default applies)."""

    workdir: str | None = None
    network: str = "public"  # Harbor's resolved baseline; only "public" can get the host network here
    allowed_hosts: tuple[str, ...] = ()
    cpus: float | None = None
    memory_mb: int | None = None
    storage_mb: int | None = None
    env: dict[str, str] = field(default_factory=dict)
    agent_timeout_s: float | None = None
    agent_env: dict[str, str] = field(default_factory=dict)
    verifier_env: dict[str, str] = field(default_factory=dict)
    solution_env: dict[str, str] = field(default_factory=dict)
    image: str | None = None  # a saved container image (c2jax.rl.sandbox.oci) found for `docker_image`
    dockerfile: str | None = None  # a Dockerfile built over a store image (c2jax.rl.tasks.image_build)

    @property
    def in_image(self) -> bool:
        """Whether the task's sandboxes are containers of an image (a saved one, or its Dockerfile built)."""
        return self.image is not None or self.dockerfile is not None

    def limits(self) -> Limits | None:
        """The sandbox limits the task asks for, or None when it sets none of cpus/memory/storage."""
        if self.cpus is None and self.memory_mb is None and self.storage_mb is None:
            return None
        base = Limits()
        storage = None if self.storage_mb is None else self.storage_mb * 1024**2
        return Limits(memory_bytes=base.memory_bytes if self.memory_mb is None else self.memory_mb * 1024**2,
                      cpus=self.cpus,
                      file_size_bytes=base.file_size_bytes if storage is None else storage,
                      tmp_bytes=base.tmp_bytes if storage is None else min(base.tmp_bytes, storage))

    def shares_network(self, allow_network: bool) -> bool:
        """Whether the task's sandboxes get the host's network: the run allows it and the task permits
        the public internet. An allowlist is never widened to the whole network."""
        return bool(allow_network) and self.network == "public"

    def network_note(self, allow_network: bool) -> str | None:
        """Why the task runs with less network than its task.toml permits, or None when it does not."""
        if self.network == "no-network" or self.shares_network(allow_network):
            return None
        if self.network == "allowlist":
            hosts = ", ".join(self.allowed_hosts) or "no hosts listed"
            return (f"network_mode allowlist ({hosts}): ran offline, c2jax does not enforce host allowlists "
                    "(allow_network shares only with tasks allowing the public internet)")
        return "the public internet is allowed by the task: ran offline (allow_network is off)"

    def sandbox_options(self, phase: str, *, allow_network: bool = False) -> dict[str, Any]:
        """Keyword options for a sandbox factory in `phase` ("agent", "solution" or "verifier");
        `network=True` only when `shares_network(allow_network)`."""
        extra = {"agent": self.agent_env, "verifier": self.verifier_env, "solution": self.solution_env}
        if phase not in extra:
            raise ValueError(f"phase must be one of {sorted(extra)}, got {phase!r}")
        options: dict[str, Any] = {}
        if self.shares_network(allow_network):
            options["network"] = True
        if self.workdir is not None:
            options["workdir"] = self.workdir
        env = {**self.env, **extra[phase]}
        if env:
            options["env"] = env
        limits = self.limits()
        if limits is not None:
            options["limits"] = limits
        if self.image is not None:
            options["image_source"] = self.image
        if self.dockerfile is not None:
            options["image_build"] = self.dockerfile
        return options


# ------------------------------------------------------------------------------------------ values
def _table(spec: dict, name: str) -> dict:
    value = spec.get(name, {})
    if not isinstance(value, dict):
        raise HarborConfigError(f"[{name}] must be a table, got {type(value).__name__}")
    return value


def _positive(table: dict, key: str, where: str, kind=float) -> Any:
    value = table.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise HarborConfigError(f"{where}.{key} must be a positive number, got {value!r}")
    if kind is int and value != int(value):
        raise HarborConfigError(f"{where}.{key} must be a whole number, got {value!r}")
    return kind(value)


def size_to_mb(value: Any, where: str) -> int:
    """Harbor's deprecated size strings ("2G", "512M", "1024K"; a bare number is MB here)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return int(value)
    if not isinstance(value, str):
        raise HarborConfigError(f"{where} must be a size such as '2G' or '512M', got {value!r}")
    text = value.strip().upper()
    scale = {"G": 1024.0, "M": 1.0, "K": 1 / 1024}
    try:
        number = float(text[:-1]) if text[-1:] in scale else float(text)
    except ValueError:
        raise HarborConfigError(f"{where} must be a size such as '2G' or '512M', got {value!r}") from None
    mb = int(number * scale.get(text[-1:], 1.0))
    if mb <= 0:
        raise HarborConfigError(f"{where} must be at least 1 MB, got {value!r}")
    return mb


def resolve_env(table: dict, where: str, host_env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` of a table as strings, ${VAR} and ${VAR:-default} filled from the host (Harbor's
    `resolve_env_vars`); a variable missing on the host with no default refuses the task."""
    raw = table.get("env", {})
    if not isinstance(raw, dict):
        raise HarborConfigError(f"{where}.env must be a table of strings, got {type(raw).__name__}")
    host = os.environ if host_env is None else host_env
    out = {}
    for key, value in raw.items():
        if not isinstance(value, (str, int, float, bool)):
            raise HarborConfigError(f"{where}.env.{key} must be a string, got {type(value).__name__}")

        def fill(m, key=key):
            if m.group(1) in host:
                return host[m.group(1)]
            if m.group(2) is not None:
                return m.group(2)
            raise Refused(f"{where}.env.{key} needs ${{{m.group(1)}}}, which is not set on this host")

        out[str(key)] = _TEMPLATE.sub(fill, str(value).lower() if isinstance(value, bool) else str(value))
    return out


def network_baseline(env_table: dict) -> str:
    """Harbor's baseline policy: network_mode when set (allowed_hosts alone implies "allowlist"), else
    "no-network" when allow_internet is false, else "public" (Harbor's default)."""
    mode = env_table.get("network_mode")
    if mode is not None and mode not in NETWORK_MODES:
        raise HarborConfigError(f"[environment].network_mode must be one of {NETWORK_MODES}, got {mode!r}")
    allow = env_table.get("allow_internet", True)
    if not isinstance(allow, bool):
        raise HarborConfigError(f"[environment].allow_internet must be true or false, got {allow!r}")
    if mode is None and env_table.get("allowed_hosts"):
        return "allowlist"
    return mode or ("public" if allow else "no-network")


# ------------------------------------------------------------------------------------------ refusals
def _find_image(environment: dict, image_store: str | None) -> str | None:
    """The saved image for `[environment].docker_image`, or None when the task names none; refused (with
    where it was looked for) when the image is not in the store."""
    from c2jax.rl.sandbox.oci import IMAGE_STORE_ENV, find_in_store, store_name

    ref = environment.get("docker_image")
    if not ref:
        return None
    if not isinstance(ref, str):
        raise HarborConfigError(f"[environment].docker_image must be a string, got {ref!r}")
    store = image_store if image_store is not None else os.environ.get(IMAGE_STORE_ENV)
    found = find_in_store(ref, store)
    if found is None:
        where = f"not in the image store {store}" if store else f"no image store (set ${IMAGE_STORE_ENV})"
        raise Refused(f"[environment].docker_image = {ref!r}: {where}; pull it there (`c2jax images pull {ref}`) "
                      f"or save it there as {store_name(ref)}.tar (`docker save {ref} -o ...`) or as an OCI layout "
                      f"(`skopeo copy docker://{ref} oci:STORE/{store_name(ref)}`)")
    return str(found)


def _refusals(spec: dict, environment: dict, agent: dict, verifier: dict) -> None:
    """Raises Refused for the first field c2jax cannot honour."""
    if environment.get("gpus", 0) or environment.get("gpu_types"):
        raise Refused("[environment].gpus / gpu_types: c2jax sandboxes have no GPU")
    if str(environment.get("os", "linux")).lower() != "linux":
        raise Refused(f"[environment].os = {environment['os']!r}: c2jax sandboxes run Linux only")
    for key, why in (("healthcheck", "nothing keeps running between commands, so there is no service to check"),
                     ("mcp_servers", "c2jax's harness has no MCP client"),
                     ("skills_dir", "c2jax's harness does not install agent skills")):
        if environment.get(key):
            raise Refused(f"[environment].{key}: {why}")
    for name, table in (("agent", agent), ("verifier", verifier)):
        if table.get("user") is not None:
            raise Refused(f"[{name}].user = {table['user']!r}: every command runs as the sandbox's one "
                          "unprivileged user")
    if verifier.get("environment_mode") == "separate" or verifier.get("environment"):
        raise Refused("[verifier].environment_mode / environment: a separate verifier environment is not supported")
    if verifier.get("collect"):
        raise Refused("[verifier].collect: verifier collect commands are not supported")
    if spec.get("steps"):
        raise Refused("steps: multi-step tasks are not supported")


def parse_environment(spec: dict, *, dockerfile_workdir: str | None = None,
                      dockerfile_env: dict[str, str] | None = None,
                      host_env: dict[str, str] | None = None,
                      image_store: str | None = None) -> tuple[TaskEnvironment, str | None]:
    """(the task's runtime fields, None) or (defaults, why the task is refused). Malformed values raise
    HarborConfigError naming the field. `dockerfile_workdir` is the last WORKDIR of a plain Dockerfile,
    the working directory when task.toml sets none (as Docker's image WORKDIR is for Harbor);
    `dockerfile_env` is what its ENV instructions set, under `[environment].env` (Harbor passes that
    to the container, over the image's ENV)."""
    from c2jax.rl.sandbox.bwrap import check_mount_point

    environment, agent = _table(spec, "environment"), _table(spec, "agent")
    verifier, solution = _table(spec, "verifier"), _table(spec, "solution")
    network = network_baseline(environment)
    hosts = environment.get("allowed_hosts") or []
    if not isinstance(hosts, list) or not all(isinstance(h, str) for h in hosts):
        raise HarborConfigError(f"[environment].allowed_hosts must be a list of host names, got {hosts!r}")
    workdir = environment.get("workdir", dockerfile_workdir)
    memory = _positive(environment, "memory_mb", "[environment]", int)
    if memory is None and environment.get("memory") is not None:
        memory = size_to_mb(environment["memory"], "[environment].memory")
    storage = _positive(environment, "storage_mb", "[environment]", int)
    if storage is None and environment.get("storage") is not None:
        storage = size_to_mb(environment["storage"], "[environment].storage")
    cpus = _positive(environment, "cpus", "[environment]")
    agent_timeout = _positive(agent, "timeout_sec", "[agent]")
    _positive(verifier, "timeout_sec", "[verifier]")  # read into Task.timeout_s by the loader
    try:
        image = _find_image(environment, image_store)
        if image is not None:
            # a prebuilt image: its WORKDIR and ENV, not the Dockerfile's (Harbor runs the image as saved)
            from c2jax.rl.sandbox.oci import ImageError, read_image_config

            try:
                image_cfg = read_image_config(image)[1]
            except ImageError as e:
                raise Refused(f"[environment].docker_image = {environment['docker_image']!r}: {e}") from None
            workdir = environment.get("workdir", image_cfg.workdir if image_cfg.workdir != "/" else None)
            dockerfile_env = {}
        _refusals(spec, environment, agent, verifier)
        if workdir is not None:
            try:
                workdir = check_mount_point(workdir, "[environment].workdir")
            except ValueError as e:
                raise Refused(str(e)) from None
        parsed = TaskEnvironment(
            workdir=workdir, network=network, allowed_hosts=tuple(hosts), cpus=cpus, memory_mb=memory,
            storage_mb=storage, env={**(dockerfile_env or {}), **resolve_env(environment, "[environment]", host_env)},
            agent_timeout_s=agent_timeout,
            agent_env=resolve_env(agent, "[agent]", host_env),
            verifier_env=resolve_env(verifier, "[verifier]", host_env),
            solution_env=resolve_env(solution, "[solution]", host_env), image=image)
    except Refused as e:
        return TaskEnvironment(network=network, allowed_hosts=tuple(hosts)), str(e)
    return parsed, None
