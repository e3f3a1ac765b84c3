"""Building a task suite from a config (sdist generators + the ladder) and validating one.

Validation is the generators' contract made checkable: on the base repository the hidden tests must
not pass (the grade is not `resolved`, and every FAIL_TO_PASS test fails), and with the reference
solution the grade must be `resolved`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from c2jax.rl.tasks import deletion, mutation
from c2jax.rl.tasks.gencommon import emit_task, package_modules, run_tests, split_outcome
from c2jax.rl.tasks.grading import GradeResult, SandboxFactory, grade
from c2jax.rl.tasks.harbor import open_task_sandbox, solve_command, upload_solution
from c2jax.rl.tasks.ladder import RUNGS, build_ladder
from c2jax.rl.tasks.release import build_release_task
from c2jax.rl.tasks.sdist import SdistError, SdistSpec, prepare
from c2jax.rl.tasks.task import Task, load_tasks


@dataclass(frozen=True)
class LibraryConfig:
    name: str
    version: str
    sha256: str
    package: str = ""  # import package name (default: name with "-" -> "_")
    tests: tuple[str, ...] = ()  # pytest targets (default: discovery from the repository root)
    split: str = "train"  # every task of a library shares its split, so train and eval repos stay disjoint
    mutation_tasks: int = 2  # single-file bug-injection tasks to keep
    multi_file_tasks: int = 0  # bug-injection tasks combining mutations across files
    mutations_per_multi: int = 2
    deletion_tasks: int = 1
    # multi-file feature deletions (c2bench v1): public targets + the private helpers only they use +
    # their re-exports, at least feature_min_lines removed over at least feature_min_files files
    feature_tasks: int = 0
    feature_min_lines: int = 40
    feature_min_files: int = 2
    feature_max_targets: int = 3
    # the same features with bodies emptied to `raise NotImplementedError` (signatures and docstrings
    # kept): callers elsewhere in the package do not matter, so most libraries have many
    stub_tasks: int = 0
    stub_min_body_lines: int = 6
    max_candidates: int = 20  # candidates tried per generator before giving up


@dataclass(frozen=True)
class ReleaseConfig:
    """A pair of consecutive releases of one library (see rl/tasks/release.py)."""

    name: str
    old_version: str
    old_sha256: str
    new_version: str
    new_sha256: str
    package: str = ""
    tests: tuple[str, ...] = ()
    split: str = "train"


@dataclass(frozen=True)
class LadderConfig:
    per_rung: int = 0
    rungs: tuple[str, ...] = RUNGS


@dataclass(frozen=True)
class SuiteConfig:
    seed: int = 0
    cache_dir: str = "~/.cache/c2jax/tasks"
    sandbox: str = "bwrap"  # "bwrap", or "local" (no isolation; trusted code only)
    test_timeout_s: float = 300.0
    libraries: tuple[LibraryConfig, ...] = ()
    releases: tuple[ReleaseConfig, ...] = ()
    ladder: LadderConfig = field(default_factory=LadderConfig)


# docker / podman / auto apply to container-image tasks (rl/sandbox/engine.py); other tasks use bwrap
SANDBOX_KINDS = ("bwrap", "local", "docker", "podman", "auto")


@dataclass(frozen=True)
class BackendFactory:
    """`factory(repo_dir, **options)` for one backend; options (workdir, env, limits, network) come from
    a task's task.toml through `open_task_sandbox`. `allow_network` is the run's policy: when False (the
    default) no task gets the network, whatever its task.toml permits."""

    kind: str
    allow_network: bool = False

    def __post_init__(self):
        if self.kind not in SANDBOX_KINDS:
            raise ValueError(f"sandbox must be one of {', '.join(SANDBOX_KINDS)}, got {self.kind!r}")
        if not isinstance(self.allow_network, bool):
            raise ValueError(f"allow_network must be true or false, got {self.allow_network!r}")

    def __call__(self, repo, **options):
        if options.get("network") and not self.allow_network:
            raise ValueError("a sandbox with the host network was asked of a factory whose run does not "
                             "allow the network (allow_network: false)")
        image_source = options.pop("image_source", None)
        image_build = options.pop("image_build", None)
        if self.kind == "local":
            if image_source is not None or image_build is not None:
                raise ValueError(f"the task runs in the container image {image_source}, which needs the bwrap "
                                 "sandbox (sandbox: bwrap), not the unisolated local one")
            from c2jax.rl.sandbox import LocalSandbox

            return LocalSandbox(repo, allow_unisolated=True, **options)
        from c2jax.rl.sandbox.bwrap import BwrapSandbox
        from c2jax.rl.sandbox.envpool import environment_pool, open_over_snapshot

        # images and base snapshots are prepared once per process (None: $C2JAX_ENV_POOL=0, every call prepares)
        pool = environment_pool()
        if (image_source is not None or image_build is not None) and self.kind != "bwrap":
            # docker / podman: that engine (an error when it does not run); auto: one that runs, else bwrap below
            from c2jax.rl.sandbox.engine import engine_for_kind, open_image_sandbox

            engine = engine_for_kind(self.kind)
            if engine is not None:
                return open_image_sandbox(engine, repo, image_source=image_source, image_build=image_build,
                                          build_network=self.allow_network, pool=pool, **options)
        if image_source is not None or image_build is not None:
            from c2jax.rl.sandbox.base import WORKSPACE
            from c2jax.rl.sandbox.oci import IMAGE_STORE_ENV, image_cache_dir, load_image

            if image_build is not None:  # built once per content, then cached (c2jax.rl.tasks.image_build)
                from c2jax.rl.tasks.image_build import build_image

                store = os.environ.get(IMAGE_STORE_ENV)
                image = (pool.built_image(image_build, store=store, cache_dir=image_cache_dir(),
                                          network=self.allow_network) if pool is not None else
                         build_image(image_build, store=store, cache_dir=image_cache_dir(), network=self.allow_network))
            else:
                image = (pool.image(image_source, image_cache_dir()) if pool is not None else
                         load_image(image_source, image_cache_dir()))
            # the workspace is what the image holds at the working directory (empty when it holds nothing)
            workdir = options.get("workdir", WORKSPACE)
            seed = image.rootfs / workdir.lstrip("/")
            if not seed.is_dir() or seed.is_symlink():
                seed = image.rootfs.parent / "empty-workdir"
                seed.mkdir(exist_ok=True)
            return open_over_snapshot(BwrapSandbox, pool, seed, immutable=True, image=image, **options)
        return open_over_snapshot(BwrapSandbox, pool, repo, immutable=False, **options)


def sandbox_factory(kind: str, *, allow_network: bool = False) -> SandboxFactory:
    """`factory(repo_dir, **options)`; options (workdir, env, limits, network) come from a task's
    task.toml. With `allow_network`, tasks permitting the public internet share the host's network."""
    return BackendFactory(kind, allow_network)


def _spec(lib: LibraryConfig) -> SdistSpec:
    return SdistSpec(lib.name, lib.version, lib.sha256, lib.package, lib.tests)


def _base_task(lib: LibraryConfig, task_id: str, generator: str, category: str) -> Task:
    return Task(id=task_id, instruction="", repo_dir=None, tests_dir=None, category=category, repo=lib.name,
                test_files=lib.tests, metadata={"generator": generator, "split": lib.split,
                                                "library_version": lib.version})


def build_library(lib: LibraryConfig, out_dir: Path, factory: SandboxFactory, *, cache_dir: Path, seed: int,
                  timeout_s: float = 300.0, progress: Callable[[str], None] = lambda _: None) -> list[Path]:
    """Bug-injection and feature-deletion tasks from one pinned sdist."""
    spec = _spec(lib)
    repo = prepare(spec, cache_dir)
    baseline = run_tests(repo, factory, tests=lib.tests, timeout_s=timeout_s)
    if baseline is None:
        raise RuntimeError(f"{lib.name}: the clean sdist's tests did not run")
    modules = package_modules(repo, spec.package_dir)
    rng = random.Random(f"{seed}/{lib.name}")
    written: list[Path] = []

    def keep(task, edits, f2p, p2p, prompts, difficulty):
        task = dataclasses.replace(task, prompts=prompts, instruction=prompts["issue"], difficulty=difficulty)
        written.append(emit_task(task, repo, edits, f2p, p2p, out_dir))
        progress(task.id)

    for multi, wanted in ((False, lib.mutation_tasks), (True, lib.multi_file_tasks)):
        kept = 0
        for _ in range(lib.max_candidates):
            if kept == wanted:
                break
            n = lib.mutations_per_multi if multi else 1
            muts = mutation.sample(repo, modules, rng, n_mutations=n, across_files=multi)
            if len(muts) < n or (multi and len({m.path for m in muts}) < 2):
                continue
            edits = {}
            try:
                for path in sorted({m.path for m in muts}):
                    edits[path] = mutation.apply((repo / path).read_text(), [m for m in muts if m.path == path])
            except SyntaxError:
                continue
            broken = run_tests(repo, factory, edits=edits, tests=lib.tests, timeout_s=timeout_s)
            if broken is None:
                continue
            f2p, p2p = split_outcome(baseline, broken)
            if not f2p:  # SWE-smith's rule: at least one test must go pass -> fail
                continue
            kind = "multi_file_bug" if multi else "bug"
            task = _base_task(lib, f"{lib.name}-{kind}-{kept:03d}", "mutation", kind)
            task = dataclasses.replace(task, metadata={**task.metadata, "mutations": [m.kind for m in muts]})
            keep(task, edits, f2p, p2p, mutation.prompts(muts, f2p, spec.package_dir), mutation.difficulty(muts, f2p))
            kept += 1

    options = deletion.deletable(repo, modules)
    rng.shuffle(options)
    kept = 0
    for module, name in options[: lib.max_candidates]:
        if kept == lib.deletion_tasks:
            break
        edits = deletion.delete_feature(repo, modules, module, name)
        broken = run_tests(repo, factory, edits=edits, tests=lib.tests, timeout_s=timeout_s)
        if broken is None:
            continue
        f2p, p2p = split_outcome(baseline, broken)
        # a deletion that breaks import of the package fails every test: not a feature task
        if not f2p or not p2p:
            continue
        task = _base_task(lib, f"{lib.name}-feature-{kept:03d}", "deletion", "feature")
        prompts = deletion.prompts(module, name, f2p, spec.package_dir, (repo / module).read_text())
        size = sum(len((repo / m).read_text().splitlines()) - len(t.splitlines()) for m, t in edits.items())
        keep(task, edits, f2p, p2p, prompts, "hard" if size > 30 else "medium")
        kept += 1

    for stub, wanted in ((False, lib.feature_tasks), (True, lib.stub_tasks)):
        if wanted:
            _feature_tasks(lib, repo, modules, rng, factory, baseline, stub, wanted, keep, timeout_s)
    return written


def _feature_tasks(lib: LibraryConfig, repo: Path, modules: list[str], rng: random.Random, factory: SandboxFactory,
                   baseline: dict[str, str], stub: bool, wanted: int, keep: Callable, timeout_s: float) -> None:
    """Multi-file feature tasks (deleted, or with `stub` emptied to `raise NotImplementedError`)."""
    features = deletion.multi_file_features(repo, modules, rng, min_lines=lib.feature_min_lines,
                                            min_files=lib.feature_min_files, max_targets=lib.feature_max_targets,
                                            stub=stub, min_body_lines=lib.stub_min_body_lines)
    features.sort(key=lambda f: f.files < 2)  # multi-file candidates first, in their seeded order
    mentions = deletion.test_mentions(repo, {n for f in features for n in f.names})
    kind = "reimplement" if stub else "multi_file_feature"
    kept, used = 0, set()
    tried = 0
    for feature in features:
        if kept == wanted or tried == lib.max_candidates:
            break
        if any(not mentions[n] for n in feature.names):
            continue  # no test file uses a target: nothing would check it
        if used & set(feature.targets):
            continue  # each target in one task at most: tasks of a library stay distinct
        tried += 1
        edits = dict(feature.edits)
        broken = run_tests(repo, factory, edits=edits, tests=lib.tests, timeout_s=timeout_s)
        if broken is None:
            continue
        f2p, p2p = split_outcome(baseline, broken)
        if not f2p or not p2p:
            continue
        # every target must be exercised by a hidden test file (imported by name, or read as an
        # attribute): a target no hidden test uses would be a part of the task nothing checks
        hidden = {t.split("::")[0] for t in f2p}
        if any(not (mentions[n] & hidden) for n in feature.names):
            continue
        task = _base_task(lib, f"{lib.name}-{kind.replace('_', '-')}-{kept:03d}", "deletion", kind)
        task = dataclasses.replace(task, metadata={
            **task.metadata, "targets": [f"{m}:{n}" for m, n in feature.targets],
            "helpers": [f"{m}:{n}" for m, n in feature.helpers]})
        originals = {m: (repo / m).read_text() for m in feature.modules}
        keep(task, edits, f2p, p2p, deletion.feature_prompts(feature, f2p, lib.package or lib.name.replace("-", "_"),
                                                             originals), "hard")
        used |= set(feature.targets)
        kept += 1


def build_release(rel: ReleaseConfig, out_dir: Path, factory: SandboxFactory, *, cache_dir: Path,
                  timeout_s: float = 300.0) -> list[Path]:
    old = prepare(SdistSpec(rel.name, rel.old_version, rel.old_sha256, rel.package), cache_dir)
    new = prepare(SdistSpec(rel.name, rel.new_version, rel.new_sha256, rel.package), cache_dir)
    lib = LibraryConfig(rel.name, rel.old_version, rel.old_sha256, rel.package, rel.tests, rel.split)
    task = _base_task(lib, f"{rel.name}-release-{rel.new_version}", "release", "release")
    task = dataclasses.replace(task, metadata={**task.metadata, "new_version": rel.new_version})
    path = build_release_task(task, old, new, rel.package or rel.name.replace("-", "_"), factory, out_dir,
                              tests=rel.tests, timeout_s=timeout_s)
    return [path] if path else []


def build_suite(cfg: SuiteConfig, out_dir: str | Path, *, factory: SandboxFactory | None = None,
                errors: list[str] | None = None) -> list[Path]:
    """Builds every library's tasks and the ladder into `out_dir`, and writes `manifest.json`. A source
    that cannot be fetched or run is skipped with its error appended to `errors` (raised if None), so
    one bad pin does not lose the rest of the suite."""
    from c2jax.progress import progress

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    factory = factory or sandbox_factory(cfg.sandbox)
    cache = Path(cfg.cache_dir).expanduser()
    written: list[Path] = []
    with progress(len(cfg.libraries) + len(cfg.releases) + 1, desc="tasks build", unit="source") as bar:
        def attempt(label, fn):
            bar.set_postfix_str(label)
            try:
                written.extend(fn())
            except (SdistError, RuntimeError, FileNotFoundError) as e:
                if errors is None:
                    raise
                errors.append(f"{label}: {e}")
            bar.update()

        for lib in cfg.libraries:
            attempt(lib.name, lambda lib=lib: build_library(
                lib, out_dir, factory, cache_dir=cache, seed=cfg.seed, timeout_s=cfg.test_timeout_s,
                progress=lambda tid: bar.set_postfix_str(tid)))
        for rel in cfg.releases:
            attempt(f"{rel.name} {rel.old_version}->{rel.new_version}", lambda rel=rel: build_release(
                rel, out_dir, factory, cache_dir=cache, timeout_s=cfg.test_timeout_s))
        if cfg.ladder.per_rung:
            written += build_ladder(out_dir, seed=cfg.seed, per_rung=cfg.ladder.per_rung, rungs=cfg.ladder.rungs)
        bar.update()
    write_manifest(out_dir)
    return written


def check_splits_disjoint(tasks: list[Task]) -> dict[str, list[str]]:
    """split -> task ids; raises if one repository has tasks in two splits (train/eval leakage)."""
    by_repo: dict[str, set[str]] = {}
    out: dict[str, list[str]] = {}
    for t in tasks:
        split = str(t.metadata.get("split", "train"))
        by_repo.setdefault(t.repo, set()).add(split)
        out.setdefault(split, []).append(t.id)
    shared = {repo: sorted(s) for repo, s in by_repo.items() if len(s) > 1}
    if shared:
        raise ValueError(f"repositories with tasks in several splits: {shared}")
    return out


def write_manifest(out_dir: Path) -> Path:
    check_splits_disjoint(load_tasks(out_dir))
    rows = [{"id": t.id, "repo": t.repo, "split": t.metadata.get("split", "train"), "category": t.category,
             "difficulty": t.difficulty, "lines_changed": t.lines_changed, "files_changed": t.files_changed,
             "fail_to_pass": len(t.fail_to_pass), "prompt_chars": {k: len(v) for k, v in t.prompts.items()}}
            for t in load_tasks(out_dir)]
    path = out_dir / "manifest.json"
    path.write_text(json.dumps({"tasks": rows}, indent=1))
    return path


@dataclass
class Validation:
    task_id: str
    ok: bool
    reason: str
    base: GradeResult | None = None
    reference: GradeResult | None = None


def reference_patch(task: Task, factory: SandboxFactory) -> str | None:
    """The reference as a patch: the diff Harbor's oracle leaves (solution/ at /solution, solve.sh run
    from the working directory), else solution.patch, else the diff left by running solve.sh."""
    if task.harbor and task.solution_script is not None:
        sandbox, _ = open_task_sandbox(factory, task, "solution")
        with sandbox:
            upload_solution(sandbox, task)
            timeout = task.environment.agent_timeout_s if task.environment else None
            sandbox.exec(solve_command(task), timeout_s=timeout or task.timeout_s)
            return sandbox.diff()
    if task.solution_patch is not None:
        return task.solution_patch
    if task.solution_script is None:
        return None
    sb, _ = open_task_sandbox(factory, task, "solution")  # the task's env (a Dockerfile's ENV) applies
    with sb:
        sb.write_text(".c2jax-solve.sh", task.solution_script)
        sb.exec("bash .c2jax-solve.sh", timeout_s=task.timeout_s)
        sb.remove(".c2jax-solve.sh")
        return sb.diff()


def validate_task(task: Task, factory: SandboxFactory, *, python: str = sys.executable) -> Validation:
    if not task.supported:
        return Validation(task.id, True, f"unsupported: {task.unsupported_reason}")
    patch = reference_patch(task, factory)
    if patch is None:
        return Validation(task.id, False, "no reference solution")
    base = grade(task, None, factory, python=python)
    if base.status in ("resolved", "invalid", "timeout"):
        return Validation(task.id, False, f"base repository grades {base.status} ({base.reason})", base)
    passing = [t for t in task.fail_to_pass if t in base.fail_to_pass["success"]]
    if passing:
        return Validation(task.id, False, f"FAIL_TO_PASS tests already pass on the base: {passing[:3]}", base)
    ref = grade(task, patch, factory, python=python)
    if not ref.resolved and task.kind != "pytest":
        return Validation(task.id, False, f"reference grades {ref.status} with reward {ref.reward:g}"
                          + (f" ({ref.reason})" if ref.reason else ""), base, ref)
    if not ref.resolved:
        return Validation(task.id, False, f"reference grades {ref.status} ({ref.reason}); "
                          f"F2P failing {ref.fail_to_pass['failure'][:3]}, P2P failing "
                          f"{ref.pass_to_pass['failure'][:3]}", base, ref)
    return Validation(task.id, True, "ok", base, ref)
