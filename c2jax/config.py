"""The one config system: typed frozen dataclasses, YAML files and dotted `a.b=value` overrides.

Every config class of the project (`RunConfig` here, `PretrainConfig`, `RLSystemConfig`, `EvalConfig`,
`SuiteConfig`, `DataConfig`, ...) is read by one loader, `load(cls, source, overrides)`: a YAML file, a
mapping or nothing, then dotted overrides, then `model: {preset: NAME}` sections, then the typed
`from_dict`; `save(cfg, directory)` writes the resolved `directory/config.yaml` a run keeps next to its
logs. Every field is type-checked on the way in and every error is a `ConfigError` naming its dotted
path (an unknown key with the closest valid one, a wrong value with the expected type), so a typo in a
40-field model config points at the line to fix.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import os
import re
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

from c2jax.models.config import PRESETS, ConfigError, ModelConfig, preset

T = TypeVar("T")


AxisRules = dict[str, str | tuple[str, ...] | None]


@dataclass(frozen=True)
class MeshConfig:
    """Sizes of the device-mesh axes; their product is the number of devices a run uses.

    One axis may be -1: it takes whatever the other axes leave of the available devices. The rules map
    logical axis names (models/layers.py for parameters, models/logical.py for activations) to mesh
    axes; entries here override c2jax.sharding_rules' defaults key by key."""

    data: int = 1
    fsdp: int = 1
    expert: int = 1
    context: int = 1
    tensor: int = 1
    param_rules: AxisRules = field(default_factory=dict)
    activation_rules: AxisRules = field(default_factory=dict)

    def __post_init__(self):
        for name, size in zip(self.axis_names, self.shape):
            if not isinstance(size, int) or isinstance(size, bool) or (size <= 0 and size != -1):
                raise ConfigError(f"{name} must be a positive integer or -1 (inferred), got {size!r}")
        if list(self.shape).count(-1) > 1:
            raise ConfigError(f"at most one mesh axis can be -1, got {dict(zip(self.axis_names, self.shape))}")

    @property
    def axis_names(self) -> tuple[str, ...]:
        return ("data", "fsdp", "expert", "context", "tensor")

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, name) for name in self.axis_names)

    @property
    def num_devices(self) -> int:
        if -1 in self.shape:
            raise ConfigError(f"mesh {self.sizes} has an inferred (-1) axis: resolve(num_devices) it first")
        return math.prod(self.shape)

    @property
    def sizes(self) -> dict[str, int]:
        return dict(zip(self.axis_names, self.shape))

    def resolve(self, num_devices: int) -> MeshConfig:
        """This mesh with its -1 axis (if any) sized so the mesh uses exactly `num_devices`."""
        known = math.prod(s for s in self.shape if s != -1)
        if -1 not in self.shape:
            if known != num_devices:
                raise ConfigError(f"mesh {self.sizes} needs {known} devices, {num_devices} available")
            return self
        if num_devices % known:
            raise ConfigError(f"mesh {self.sizes}: {num_devices} devices do not divide by the fixed axes' {known}")
        inferred = next(n for n, s in zip(self.axis_names, self.shape) if s == -1)
        return dataclasses.replace(self, **{inferred: num_devices // known})


@dataclass(frozen=True)
class DistributedConfig:
    """Multi-host JAX (one process per host): arguments of jax.distributed.initialize.

    With enabled and no address, JAX detects the cluster (SLURM, Open MPI, Kubernetes/GKE, Cloud TPU) or
    reads JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID (see c2jax/distributed.py)."""

    enabled: bool = False
    coordinator_address: str = ""  # host:port of process 0
    num_processes: int = 0  # 0 = detect
    process_id: int = -1  # -1 = detect
    local_device_ids: tuple[int, ...] = ()  # () = all local devices
    # a process that stops sending heartbeats for this long is declared dead and every other process aborts
    # with "The following tasks are unhealthy (stopped sending heartbeats)"; JAX's default is 100 s
    heartbeat_timeout_s: int = 100
    initialization_timeout_s: int = 300  # how long process i waits for the others to join

    def __post_init__(self):
        if self.heartbeat_timeout_s <= 0 or self.initialization_timeout_s <= 0:
            raise ConfigError("distributed: heartbeat_timeout_s and initialization_timeout_s must be > 0")


@dataclass(frozen=True)
class RunConfig:
    name: str = "run"
    seed: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    output_dir: str = "runs"


# Typed construction ------------------------------------------------------------------------------

def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin is not None:
        return f"{origin.__name__}[{', '.join('...' if a is Ellipsis else _type_name(a) for a in args)}]"
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _mismatch(tp: Any, value: Any, path: str) -> ConfigError:
    return ConfigError(f"{path}: expected {_type_name(tp)}, got {value!r}")


def _convert(tp: Any, value: Any, path: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:  # report the inner error: it is more precise than "expected X | None"
            return _convert(options[0], value, path)
        for option in options:
            try:
                return _convert(option, value, path)
            except ConfigError:
                pass
        raise _mismatch(tp, value, path)
    if origin is Literal:
        # `type(...) is` so that True does not pass for Literal[1]
        if any(value == a and type(value) is type(a) for a in args):
            return value
        raise _mismatch(tp, value, path)
    if tp is tuple or origin is tuple:
        if isinstance(value, str) or not isinstance(value, Sequence):
            raise _mismatch(tp, value, path)
        if not args or (len(args) == 2 and args[1] is Ellipsis):
            item = args[0] if args else Any
            return tuple(_convert(item, v, f"{path}[{i}]") for i, v in enumerate(value))
        if len(args) != len(value):
            raise ConfigError(f"{path}: expected {_type_name(tp)} ({len(args)} items), got {value!r}")
        return tuple(_convert(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if tp is dict or origin is dict:
        if not isinstance(value, Mapping):
            raise _mismatch(tp, value, path)
        key_tp, value_tp = args or (Any, Any)
        return {
            _convert(key_tp, k, path): _convert(value_tp, v, _join(path, str(k))) for k, v in value.items()
        }
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if isinstance(value, Mapping):
            return from_dict(tp, value, path)
        raise _mismatch(tp, value, path)
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise _mismatch(tp, value, path)
    if tp is int and isinstance(value, bool):
        raise _mismatch(tp, value, path)
    if tp is type(None):
        if value is None:
            return None
        raise _mismatch(tp, value, path)
    if tp in (int, bool, str):
        if isinstance(value, tp):
            return value
        raise _mismatch(tp, value, path)
    raise TypeError(f"{path}: unsupported annotation {tp!r} in a config dataclass")


def from_dict(cls: type[T], data: Mapping[str, Any], path: str = "") -> T:
    """Build the frozen dataclass `cls` from a (nested) dict, checking every key and type.

    `path` is the dotted location of `data` in the enclosing config; errors are prefixed with it.
    """
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path or cls.__name__}: expected a mapping for {cls.__name__}, got {data!r}")
    hints = typing.get_type_hints(cls)  # resolves the string annotations of `from __future__`
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        key = str(key)
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f"did you mean {close[0]}?" if close else f"valid keys: {', '.join(fields)}"
            raise ConfigError(f"{_join(path, key)}: unknown key; {hint}")
        kwargs[key] = _convert(hints[key], value, _join(path, key))
    for name, f in fields.items():
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if required and name not in kwargs:
            raise ConfigError(f"{_join(path, name)}: missing required key")
    try:
        return cls(**kwargs)
    except ConfigError as e:
        if not path:
            raise
        raise ConfigError(f"{path}: {e}") from None


def to_dict(obj: Any) -> Any:
    """Inverse of `from_dict`: plain dicts, lists and scalars only, safe for `yaml.safe_dump`."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (tuple, list)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, Mapping):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


# YAML ----------------------------------------------------------------------------------------------

class _Loader(yaml.SafeLoader):
    """PyYAML follows YAML 1.1, where `1e-6` (no dot) is a string; read such numbers as floats."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def parse_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)


def load_yaml(path: str | os.PathLike) -> dict[str, Any]:
    try:
        data = parse_yaml(Path(path).read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def dump_yaml(obj: Any, path: str | os.PathLike) -> Path:
    path = Path(path)
    path.write_text(yaml.safe_dump(to_dict(obj), sort_keys=False))
    return path


# Overrides, presets, loading ------------------------------------------------------------------------

Override = str | tuple[str, Any]


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[Override]) -> dict[str, Any]:
    """Return a copy of `data` with each override set: `a.b.c=value`, whose `value` is YAML (`null`,
    `[1.5, 2]`, ...), or a pair `("a.b.c", value)` from code, whose value is taken as it is."""
    if isinstance(overrides, (str, bytes)):
        raise ConfigError(f"overrides: expected a sequence of dotted.key=value, got the string {overrides!r}")
    data = copy.deepcopy(dict(data))
    for override in overrides:
        if isinstance(override, tuple):
            key, value = override
            parts = key.strip().split(".")
            if not all(parts):
                raise ConfigError(f"override {override!r}: expected a dotted.key")
        else:
            key, sep, text = override.partition("=")
            parts = key.strip().split(".")
            if not sep or not all(parts):
                raise ConfigError(f"override {override!r}: expected dotted.key=value")
            try:
                value = parse_yaml(text)
            except yaml.YAMLError as e:
                raise ConfigError(f"override {override!r}: value is not valid YAML: {e}") from None
        node = data
        for i, part in enumerate(parts[:-1]):
            if isinstance(node, list):  # `env.sources.0.weight=2`: an item of a list of sections
                node = node[_list_index(node, part, override, parts[:i])]
                if not isinstance(node, dict):
                    raise ConfigError(f"override {override!r}: {'.'.join(parts[:i + 1])} is not a section")
                continue
            child = node.get(part)
            if child is None:  # e.g. `model.rope_scaling.factor=2` where rope_scaling is null
                child = node[part] = {}
            elif isinstance(child, (list, tuple)) and parts[i + 1].lstrip("-").isdigit():
                child = node[part] = [copy.deepcopy(dict(c)) if isinstance(c, Mapping) else c for c in child]
            elif not isinstance(child, dict):
                raise ConfigError(f"override {override!r}: {'.'.join(parts[:i + 1])} is not a section")
            node = child
        if isinstance(node, list):
            node[_list_index(node, parts[-1], override, parts[:-1])] = value
        else:
            node[parts[-1]] = value
    return data


def _list_index(items: list, part: str, override: Any, where: list[str]) -> int:
    try:
        index = int(part)
    except ValueError:
        raise ConfigError(f"override {override!r}: {'.'.join(where)} is a list; expected an item index, got "
                          f"{part!r}") from None
    if not -len(items) <= index < len(items):
        raise ConfigError(f"override {override!r}: {'.'.join(where)} has {len(items)} items, no item {index}")
    return index


def _merge(base: dict[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """Deep merge: `update`'s sections refine `base`'s rather than replace them."""
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(dict(out[key]), value)
        else:
            out[key] = value
    return out


def resolve_presets(data: Mapping[str, Any]) -> dict[str, Any]:
    """`data` with a `model: {preset: NAME, ...}` section replaced by that preset's fields, the section's
    other keys applied on top (a nested section such as `rope_scaling` refines the preset's)."""
    data = dict(data)
    model = data.get("model")
    if not isinstance(model, Mapping) or "preset" not in model:
        return data
    rest = {k: v for k, v in model.items() if k != "preset"}
    name = model["preset"]
    if not isinstance(name, str):
        raise ConfigError(f"model.preset: expected a preset name, got {name!r}; known: {sorted(PRESETS)}")
    try:
        base = to_dict(preset(name))
    except ConfigError as e:
        raise ConfigError(f"model.preset: {e}") from None
    return {**data, "model": _merge(base, rest)}


def _takes_preset(cls: type) -> bool:
    """Whether `cls` has a top-level `model: ModelConfig` section, so a preset name can stand for it."""
    return typing.get_type_hints(cls).get("model") is ModelConfig


def _source_data(cls: type, source: Any) -> dict[str, Any]:
    if source is None:
        return {}
    if isinstance(source, Mapping):
        return dict(source)
    if not isinstance(source, (str, os.PathLike)):
        raise ConfigError(f"{cls.__name__}: a config source is a YAML path, a mapping or None, got {source!r}")
    if _takes_preset(cls) and isinstance(source, str) and source in PRESETS:
        return {"model": {"preset": source}}
    if Path(source).is_file():
        return load_yaml(source)
    if not _takes_preset(cls):
        raise ConfigError(f"{source}: no such {cls.__name__} YAML file")
    close = difflib.get_close_matches(str(source), PRESETS, n=1)
    hint = f"; did you mean {close[0]}?" if close else ""
    raise ConfigError(f"{source}: neither a model preset ({', '.join(PRESETS)}) nor a YAML file{hint}")


def load(cls: type[T], source: str | os.PathLike | Mapping[str, Any] | None = None,
         overrides: Sequence[Override] = (), *, presets: bool = True, path: str = "") -> T:
    """The config `cls` from `source`, then `overrides` (see `apply_overrides`), type-checked by `from_dict`.

    `source` is a YAML file, a mapping (e.g. a section of another config) or None (the defaults); for a
    config with a `model` section (`RunConfig`, `PretrainConfig`, `RLSystemConfig`) also a model preset
    name (see `c2jax.models.config.PRESETS`). With `presets`, `model: {preset: NAME, ...}` starts from that
    preset and applies the other keys on top; overrides apply first, so `model.preset=tiny` on the command
    line switches the preset. `path` prefixes every error, for a config that is a section of another.
    """
    data = apply_overrides(_source_data(cls, source), overrides)
    if presets:
        data = resolve_presets(data)
    return from_dict(cls, data, path)


def save(cfg: Any, directory: str | os.PathLike) -> Path:
    """Write the fully resolved config `cfg` as `directory/config.yaml` (made if missing), next to the run's
    logs; `load(type(cfg), that_path)` reads it back equal."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    return dump_yaml(cfg, directory / "config.yaml")


# Command-line sources ------------------------------------------------------------------------------

def add_source_arguments(p, help: str, overrides_help: str) -> None:
    """`SOURCE [KEY=VALUE ...]` or `--config YAML [KEY=VALUE ...]`, as `c2jax pretrain` and `c2jax rl` take."""
    p.add_argument("source", nargs="?", help=f"{help} (or --config)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=overrides_help)
    p.add_argument("--config", dest="config_file", metavar="YAML", help="a YAML file, instead of SOURCE")


def resolve_source(args) -> str:
    """The source the command line named; with --config, a positional KEY=VALUE is an override. Sets
    args.source and args.overrides accordingly."""
    if args.config_file is not None:
        if args.source is not None:
            if "=" not in args.source:
                raise ConfigError(f"two sources: {args.source!r} and --config {args.config_file!r}; give one")
            args.overrides = [args.source, *args.overrides]
        args.source = args.config_file
    if args.source is None:
        raise ConfigError(f"no source: name a model preset ({', '.join(PRESETS)}) or a YAML file (--config)")
    return args.source


# `c2jax config` -------------------------------------------------------------------------------------

def add_parser(subparsers):
    p = subparsers.add_parser("config", help="print a resolved run config as YAML")
    add_source_arguments(p, f"a model preset ({', '.join(PRESETS)}) or a YAML file", "dotted overrides, e.g. seed=1")
    return p


def run(args) -> int:
    cfg = load(RunConfig, resolve_source(args), args.overrides)
    print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
    return 0


__all__ = [
    "ConfigError", "DistributedConfig", "MeshConfig", "Override", "RunConfig", "apply_overrides", "dump_yaml",
    "from_dict", "load", "load_yaml", "parse_yaml", "resolve_presets", "save", "to_dict",
]
