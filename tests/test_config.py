"""The config system: typed dataclasses from YAML and dotted overrides; every error names its field."""

import dataclasses
import re
import subprocess
import sys
from pathlib import Path
from typing import Literal

import pytest
import yaml

from c2jax.cli import main
from c2jax.config import (
    ConfigError,
    MeshConfig,
    RunConfig,
    apply_overrides,
    from_dict,
    load,
    load_yaml,
    resolve_presets,
    save,
    to_dict,
)
from c2jax.data.config import DataConfig
from c2jax.models.config import PRESETS, ModelConfig, RopeScaling, preset
from c2jax.rl.eval.config import EvalConfig
from c2jax.rl.system.config import RLSystemConfig
from c2jax.rl.tasks.build import SuiteConfig
from c2jax.train.config import PretrainConfig

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "experiments" / "configs"


@dataclasses.dataclass(frozen=True)
class Inner:
    x: int = 0


@dataclasses.dataclass(frozen=True)
class Kinds:
    """One field of every annotation kind the config system supports."""

    i: int = 0
    f: float = 0.0
    b: bool = False
    s: str = ""
    maybe: int | None = None
    floats: tuple[float, ...] = ()
    pair: tuple[int, str] = (0, "")
    table: dict[str, int] = dataclasses.field(default_factory=dict)
    mode: Literal["a", "b"] = "a"
    inner: Inner = Inner()
    maybe_inner: Inner | None = None


def test_every_annotation_kind_is_built_from_plain_yaml_values():
    got = from_dict(Kinds, yaml.safe_load("""
        i: 3
        f: 2            # an int is a fine float
        b: true
        s: hi
        maybe: null
        floats: [1, 2.5]
        pair: [1, x]
        table: {a: 1}
        mode: b
        inner: {x: 4}
        maybe_inner: {x: 5}
    """))
    assert got == Kinds(3, 2.0, True, "hi", None, (1.0, 2.5), (1, "x"), {"a": 1}, "b", Inner(4), Inner(5))
    assert isinstance(got.f, float)


@pytest.mark.parametrize(
    "data, message",
    [
        ({"i": "3"}, "i: expected int, got '3'"),
        ({"i": True}, "i: expected int, got True"),  # bool is an int subclass in Python, not here
        ({"f": False}, "f: expected float, got False"),
        ({"b": 1}, "b: expected bool, got 1"),
        ({"b": "yes"}, "b: expected bool, got 'yes'"),
        ({"s": 5}, "s: expected str, got 5"),
        ({"floats": "1.5"}, "floats: expected tuple[float, ...], got '1.5'"),
        ({"floats": [1.5, "x"]}, "floats[1]: expected float, got 'x'"),
        ({"pair": [1]}, "pair: expected tuple[int, str] (2 items)"),
        ({"table": {"a": "1"}}, "table.a: expected int, got '1'"),
        ({"mode": "c"}, "mode: expected 'a' | 'b', got 'c'"),
        ({"inner": 3}, "inner: expected Inner, got 3"),
        ({"inner": {"x": 1.5}}, "inner.x: expected int, got 1.5"),
        ({"maybe_inner": {"y": 1}}, "maybe_inner.y: unknown key"),
    ],
)
def test_wrong_types_are_rejected_naming_the_field(data, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        from_dict(Kinds, data)


def test_unknown_key_is_rejected_with_its_dotted_name_and_a_suggestion():
    with pytest.raises(ConfigError, match=r"^model\.hiden_size: unknown key; did you mean hidden_size\?$"):
        from_dict(RunConfig, {"model": {"hiden_size": 8}})
    with pytest.raises(ConfigError, match=r"^mesh\.zzz: unknown key; valid keys: data, fsdp, expert"):
        from_dict(RunConfig, {"mesh": {"zzz": 1}})


@pytest.mark.parametrize(
    "model, message",
    [
        ({"num_experts_per_tok": 9}, "model: num_experts_per_tok (9) exceeds n_routed_experts (8)"),
        ({"n_group": 3}, "model: n_group (3) must divide n_routed_experts (8)"),
        ({"qk_rope_head_dim": 7}, "model: qk_rope_head_dim must be even"),
        ({"n_group": 2, "topk_group": 4}, "model: topk_group (4) exceeds n_group (2)"),
        ({"rope_scaling": {"factor": 0.5}}, "model.rope_scaling: rope_scaling.factor must be >= 1"),
    ],
)
def test_inconsistent_values_are_rejected_with_where_they_sit(model, message):
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        from_dict(RunConfig, {"model": model})


def test_mesh_sizes_must_be_positive_and_describe_the_mesh():
    with pytest.raises(ConfigError, match=r"^mesh: fsdp must be a positive integer or -1 \(inferred\), got 0"):
        from_dict(RunConfig, {"mesh": {"fsdp": 0}})
    mesh = MeshConfig(data=2, fsdp=2, expert=2)
    assert mesh.axis_names == ("data", "fsdp", "expert", "context", "tensor")
    assert mesh.shape == (2, 2, 2, 1, 1)
    assert mesh.num_devices == 8


def test_dotted_overrides_parse_values_as_yaml():
    data = apply_overrides(
        {"model": {"q_lora_rank": 16}},
        ["model.q_lora_rank=null", "model.moe_capacity_factors=[1.5,2]", "seed=3", "name=x",
         "model.rms_norm_eps=1e-5", "model.rope_scaling.factor=4"],
    )
    assert data == {
        "model": {"q_lora_rank": None, "moe_capacity_factors": [1.5, 2], "rms_norm_eps": 1e-5,
                  "rope_scaling": {"factor": 4}},
        "seed": 3, "name": "x",
    }


@pytest.mark.parametrize("override", ["seed", "=3", "model..x=1", "model.x=[1,"])
def test_malformed_override_is_a_clear_error(override):
    with pytest.raises(ConfigError, match=re.escape(f"override '{override}'")):
        apply_overrides({}, [override])


def test_override_cannot_descend_into_a_scalar():
    with pytest.raises(ConfigError, match="seed is not a section"):
        apply_overrides({"seed": 1}, ["seed.x=1"])


def test_a_preset_name_is_a_config_source():
    cfg = load(RunConfig, "small", ["model.q_lora_rank=64", "seed=7"])
    assert cfg.model == preset("small").replace(q_lora_rank=64)
    assert cfg.seed == 7 and cfg.mesh == MeshConfig()


def test_yaml_preset_section_starts_from_the_preset_then_applies_keys_then_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("name: r\nmodel:\n  preset: kimi-k2.5\n  num_hidden_layers: 4\n  rope_scaling:\n"
                    "    factor: 8\nmesh: {expert: 4}\n")
    cfg = load(RunConfig, str(path), ["model.first_k_dense_replace=2", "mesh.data=2"])
    kimi = preset("kimi-k2.5")
    assert cfg.model == kimi.replace(
        num_hidden_layers=4, first_k_dense_replace=2,
        rope_scaling=dataclasses.replace(kimi.rope_scaling, factor=8.0),  # a section refines, not replaces
    )
    assert cfg.name == "r" and cfg.mesh == MeshConfig(data=2, expert=4)
    assert load(RunConfig, str(path), ["model.preset=tiny"]).model.hidden_size == preset("tiny").hidden_size
    assert load(RunConfig, str(path), ["model.rope_scaling=null"]).model.rope_scaling is None


def test_unknown_preset_and_missing_file_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="model.preset: unknown model preset 'nope'"):
        load(RunConfig, "small", ["model.preset=nope"])
    with pytest.raises(ConfigError, match="neither a model preset"):
        load(RunConfig, str(tmp_path / "missing.yaml"))


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_round_trip_through_plain_dicts_and_yaml(name):
    cfg = RunConfig(name=name, model=preset(name), mesh=MeshConfig(fsdp=2))
    assert from_dict(RunConfig, to_dict(cfg)) == cfg
    assert from_dict(RunConfig, yaml.safe_load(yaml.safe_dump(to_dict(cfg)))) == cfg


def test_save_writes_a_loadable_config(tmp_path):
    cfg = load(RunConfig, "tiny", ["model.rms_norm_eps=1e-5"])
    path = save(cfg, tmp_path / "runs" / "a")
    assert path == tmp_path / "runs" / "a" / "config.yaml"
    assert load(RunConfig, str(path)) == cfg
    assert from_dict(RunConfig, load_yaml(path)) == cfg



# `load` / `save`: one loader for every config class ---------------------------------------------------

# (config class, source, overrides) of each entry point's config: c2jax config/plan, c2jax pretrain,
# c2jax rl, c2jax eval
LOADERS = [
    (RunConfig, "tiny", ["seed=3", "mesh.fsdp=2"]),
    (PretrainConfig, CONFIGS / "cpt_small.yaml", ["optimizer.lr=1e-3", "data.seq_len=64"]),
    (RLSystemConfig, None, ["model.preset=tiny", "system.steps=3", "rl.learning_rate=1e-4"]),
    (EvalConfig, CONFIGS / "eval_small.yaml", ["samples=2", "agent.kind=scripted"]),
]
LOADER_IDS = [cls.__name__ for cls, _, _ in LOADERS]


@pytest.mark.parametrize("cls, source, overrides", LOADERS, ids=LOADER_IDS)
def test_load_save_round_trip(cls, source, overrides, tmp_path):
    cfg = load(cls, source, overrides)
    assert isinstance(cfg, cls)
    path = save(cfg, tmp_path / "run")
    assert path == tmp_path / "run" / "config.yaml"
    assert load(cls, path) == cfg  # the resolved file needs no presets or overrides
    assert load(cls, str(path)) == cfg and load(cls, to_dict(cfg)) == cfg  # a str path, a mapping
    assert load(cls, path, ["seed=11"]).seed == 11  # overrides on a saved config


# (class, override, error) of each config: an unknown key gets the closest valid one, a badly typed value
# its dotted path and the expected type; through the overrides, a YAML file and a mapping alike
LOAD_ERRORS = [
    (RunConfig, "seeed=1", "seeed: unknown key; did you mean seed?"),
    (RunConfig, "seed=abc", "seed: expected int, got 'abc'"),
    (PretrainConfig, "optimizer.lrr=1", "optimizer.lrr: unknown key; did you mean lr?"),
    (PretrainConfig, "optimizer.lr=fast", "optimizer.lr: expected float, got 'fast'"),
    (PretrainConfig, "data.sede=1", "data.sede: unknown key; did you mean seed?"),  # `data` is a plain dict field
    (PretrainConfig, "data.seq_len=[1]", "data.seq_len: expected int, got [1]"),
    (RLSystemConfig, "system.stepz=3", "system.stepz: unknown key; did you mean steps?"),
    (RLSystemConfig, "system.mode=1", "system.mode: expected 'async' | 'sync', got 1"),
    (EvalConfig, "sampels=3", "sampels: unknown key; did you mean samples?"),
    (EvalConfig, "agent.step=last", "agent.step: expected int, got 'last'"),
]


@pytest.mark.parametrize("cls, override, error", LOAD_ERRORS,
                         ids=[f"{cls.__name__}-{o.split('=')[0]}" for cls, o, _ in LOAD_ERRORS])
def test_load_errors_name_the_key_and_suggest_or_expect_for_every_config(cls, override, error, tmp_path):
    data = apply_overrides({}, [override])
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(data))
    for source, overrides in [(None, [override]), (path, []), (data, [])]:
        with pytest.raises(ConfigError, match="^" + re.escape(error) + "$"):
            load(cls, source, overrides)


def test_load_names_an_unknown_source(tmp_path):
    unknown = r"^smal: neither a model preset \(.*\) nor a YAML file; did you mean small\?$"
    with pytest.raises(ConfigError, match=unknown):
        load(RunConfig, "smal")
    missing = tmp_path / "missing.yaml"
    with pytest.raises(ConfigError, match=f"^{re.escape(str(missing))}: neither a model preset"):
        load(PretrainConfig, missing)
    with pytest.raises(ConfigError, match=f"^{re.escape(str(missing))}: no such EvalConfig YAML file$"):
        load(EvalConfig, missing)
    with pytest.raises(ConfigError, match="^tiny: no such SuiteConfig YAML file$"):  # no model: no presets
        load(SuiteConfig, "tiny")
    with pytest.raises(ConfigError, match="^RunConfig: a config source is a YAML path, a mapping or None, got 3$"):
        load(RunConfig, 3)
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(ConfigError, match="list.yaml: expected a mapping at the top level, got list"):
        load(RunConfig, tmp_path / "list.yaml")


def test_a_preset_name_is_a_source_of_every_config_with_a_model():
    assert load(RLSystemConfig, "tiny").model == preset("tiny")
    assert load(PretrainConfig, "tiny", ["model.hidden_size=64"]).model == preset("tiny").replace(hidden_size=64)
    assert load(RunConfig) == RunConfig() and load(EvalConfig) == EvalConfig()


def test_load_takes_typed_pairs_and_a_section_path_and_can_skip_presets():
    cfg = load(RunConfig, None, ["name=x", ("name", "a=b: [c"), ("mesh.fsdp", 2)])  # pairs: values as they are
    assert cfg.name == "a=b: [c" and cfg.mesh.fsdp == 2
    with pytest.raises(ConfigError, match="^overrides: expected a sequence of dotted.key=value, got the string"):
        load(RunConfig, None, "seed=1")
    with pytest.raises(ConfigError, match=r"^phases\.x\.data\.sede: unknown key; did you mean seed\?$"):
        load(DataConfig, {"sede": 1}, path="phases.x.data")
    with pytest.raises(ConfigError, match=r"^model\.preset: unknown key"):
        load(RunConfig, {"model": {"preset": "tiny"}}, presets=False)
    resolved = resolve_presets({"seed": 1, "model": {"preset": "tiny", "hidden_size": 64}})
    assert resolved["seed"] == 1 and resolved["model"] == to_dict(preset("tiny").replace(hidden_size=64))

# Each YAML under experiments/configs is one kind of config, named by its file-name prefix
# (c2bench_v1: the pinned c2bench task suite).
CONFIG_KINDS = {"cpt_": PretrainConfig, "composer2_": PretrainConfig, "eval_": EvalConfig, "rl_": RLSystemConfig,
                "tasks_": SuiteConfig, "c2bench_": SuiteConfig}


def _load_any(path):
    cls = next((c for prefix, c in CONFIG_KINDS.items() if path.name.startswith(prefix)), RunConfig)
    return load(cls, path)


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_example_configs_load(path):
    cfg = _load_any(path)
    assert dataclasses.is_dataclass(cfg)
    if hasattr(cfg, "model"):
        assert isinstance(cfg.model, ModelConfig)


def test_defaults_are_valid():
    assert from_dict(RunConfig, {}) == RunConfig()
    assert from_dict(RopeScaling, {}) == RopeScaling()


def test_cli_config_prints_the_resolved_yaml(capsys):
    assert main(["config", "tiny", "seed=5", "model.q_lora_rank=null"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["seed"] == 5 and printed["model"]["q_lora_rank"] is None
    assert from_dict(RunConfig, printed) == load(RunConfig, "tiny", ["seed=5", "model.q_lora_rank=null"])


def test_cli_bad_key_exits_2_with_a_readable_error():
    proc = subprocess.run(
        [sys.executable, "-m", "c2jax.cli", "config", "small", "model.hiden_size=8"],
        cwd=ROOT, capture_output=True, text=True,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr == "error: model.hiden_size: unknown key; did you mean hidden_size?\n"


def test_a_field_without_default_is_required():
    @dataclasses.dataclass(frozen=True)
    class Needs:
        x: int

    with pytest.raises(ConfigError, match=r"^outer\.x: missing required key$"):
        from_dict(Needs, {}, path="outer")


def test_a_broken_plugin_command_does_not_break_the_others(monkeypatch, capsys):
    from c2jax import cli

    monkeypatch.setattr(cli, "command_modules", lambda: list(cli.COMMANDS) + ["rl.no_such_command"])
    assert cli.main(["config", "tiny"]) == 0
    capsys.readouterr()
    assert cli.main(["no_such_command", "--config", "x.yaml"]) == 2
    assert "rl.no_such_command failed to import" in capsys.readouterr().err
