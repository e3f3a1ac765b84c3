"""A ladder of small learnable tasks for tiny models (RL demos on CPU), generated from a seed.

Rungs, easiest first, all in the normal task format and graded by the normal pytest grader:
  echo       single turn: the prompt quotes the word to write to answer.txt (tool-call format + copying)
  answer     single turn: the prompt holds everything; write a short string to answer.txt
  lookup     multi-turn tool use: the answer is the value of one of `lookup_keys` keys in a settings file the
             agent must read first (values are words from a fixed vocabulary of 16)
  micro_bug  a micro repository (3-5 small functions) with a one-token bug; hidden tests name it
"""

from __future__ import annotations

import functools
import random
import tempfile
from pathlib import Path

from c2jax.rl.tasks.patches import make_patch, patch_size
from c2jax.rl.tasks.task import Task, write_task

RUNGS = ("echo", "answer", "lookup", "micro_bug")

# tests/test_answer.py of a generated task: answer.txt must hold `expected` (str.format)
ANSWER_TEST = '''from pathlib import Path


def test_answer():
    assert Path("answer.txt").read_text().strip() == {expected!r}
'''

_WORDS = ["apple", "birch", "cedar", "delta", "ember", "fable", "grove", "harbor", "iris", "juniper", "kelp",
          "lumen", "maple", "nectar", "orbit", "pebble"]


# Values of `echo` and `lookup` answers: 16 words, none of them a key or an echo word. A small closed vocabulary
# keeps each answer a word (one token of a BPE trained on the transcripts), so a tiny model can learn to copy it
# from the context; the numbers of the first ladder (10-999) were 900 rare tokens, or 2-3 bytes to copy in order.
ANSWER_WORDS = ["amber", "azure", "bronze", "cobalt", "coral", "crimson", "indigo", "jade", "khaki", "lilac",
                "navy", "ochre", "plum", "rust", "sage", "teal"]
# five letters each, distinct first letters
_ECHO_WORDS = ["apple", "birch", "cedar", "delta", "ember", "fable", "grove", "hazel", "ivory", "jolly", "koala",
               "lemon", "maple", "noble", "olive", "pearl"]


_SENDERS = sorted(set(_ECHO_WORDS) | set(_WORDS))  # 24 words, none of them a value


def closed_vocabulary() -> tuple[list[str], list[str]]:
    """(words, values): every word that carries an `echo` or `lookup` task's information (senders, keys,
    values), and the values an answer can be. The ladder's action tokenizer (rl/system/envs.py) is built on
    them."""
    return sorted(set(_SENDERS) | set(ANSWER_WORDS)), list(ANSWER_WORDS)


def _echo_task(rng: random.Random, idx: int) -> tuple[Task, dict[str, str], dict[str, str], dict[str, bytes]]:
    # one quoted value word to copy and a sender word not to: 16 x 24 = 384 tasks. A held-out task is a pair no
    # train task has, so it is solved only by copying the quoted word from the prompt. (Two quoted words to copy
    # in order, 1,560 pairs: 0 of 32 held-out solved after the demo's 1,200 mixed SFT steps; alone from scratch,
    # P(exact) 0.10 after 800 steps: measured)
    sender, word = rng.choice(_SENDERS), rng.choice(ANSWER_WORDS)
    prompts = {"terse": f'{sender}: write "{word}" -> answer.txt',
               "issue": f'{sender} asks: write the word "{word}" to answer.txt.',
               "full": f'A request from {sender}: create a file answer.txt in the repository root containing exactly '
                       f'the word "{word}" (without the quotes), followed by a newline.'}
    repo = {"README.md": "Scratch workspace.\n"}
    return _task(f"ladder-echo-{idx:03d}", "echo", "easy", prompts, distractor=sender), repo, \
        {**repo, "answer.txt": word + "\n"}, {"tests/test_answer.py": ANSWER_TEST.format(expected=word)}


def _answer_task(rng: random.Random, idx: int) -> tuple[Task, dict[str, str], dict[str, str], dict[str, bytes]]:
    a, b = rng.randint(2, 49), rng.randint(2, 49)
    op, sym = rng.choice([("add", "+"), ("subtract", "-"), ("multiply", "*")])
    expected = str({"+": a + b, "-": a - b, "*": a * b}[sym])
    prompts = {"terse": f"{a} {sym} {b} -> answer.txt",
               "issue": f"Compute {a} {sym} {b} and write the result to answer.txt.",
               "full": f"Create a file answer.txt in the repository root containing only the integer "
                       f"result of {a} {sym} {b} ({op} the numbers), followed by a newline."}
    repo = {"README.md": "Scratch workspace.\n"}
    return _task(f"ladder-answer-{idx:03d}", "answer", "easy", prompts), repo, \
        {**repo, "answer.txt": expected + "\n"}, \
        {"tests/test_answer.py": ANSWER_TEST.format(expected=expected)}


def _lookup_task(rng, idx, n_keys: int = 2):
    keys = rng.sample(_WORDS, n_keys)
    # distinct: copying the wrong key's value fails
    values = dict(zip(keys, rng.sample(ANSWER_WORDS, len(keys))))
    target = rng.choice(keys)
    config = "".join(f"{k} = {v}\n" for k, v in values.items())
    prompts = {"terse": f"value of {target} -> answer.txt",
               "issue": f"Look up `{target}` in settings.ini and write its value to answer.txt.",
               "full": f"settings.ini holds `key = value` lines. Read it, find the key `{target}`, and write "
                       f"its value alone (plus a newline) to answer.txt in the repository root."}
    repo = {"settings.ini": config}
    return _task(f"ladder-lookup-{idx:03d}", "lookup", "easy", prompts, reads=("settings.ini",),
                 distractor=target), repo, \
        {**repo, "answer.txt": f"{values[target]}\n"}, \
        {"tests/test_answer.py": ANSWER_TEST.format(expected=str(values[target]))}


# (function source, test body, [(correct token, buggy token)]); each bug changes exactly one token
_FUNCS = [
    ("def add(a, b):\n    return a + b\n", "assert add(2, 3) == 5", [("a + b", "a - b")]),
    ("def double(x):\n    return x * 2\n", "assert double(7) == 14", [("x * 2", "x * 3"), ("x * 2", "x + 2")]),
    ("def is_even(n):\n    return n % 2 == 0\n", "assert is_even(4) and not is_even(7)",
     [("== 0", "== 1"), ("== 0", "!= 0")]),
    ("def clamp(x, lo, hi):\n    return max(lo, min(x, hi))\n",
     "assert clamp(5, 0, 3) == 3 and clamp(-1, 0, 3) == 0", [("min(x, hi)", "max(x, hi)")]),
    ("def last(items):\n    return items[-1]\n", "assert last([1, 2, 3]) == 3", [("[-1]", "[0]")]),
    ("def count_positive(xs):\n    return sum(1 for x in xs if x > 0)\n",
     "assert count_positive([-1, 0, 2, 5]) == 2", [("x > 0", "x >= 0"), ("x > 0", "x < 0")]),
    ("def greet(name):\n    return 'hello ' + name\n", "assert greet('bo') == 'hello bo'",
     [("'hello '", "'hello'")]),
    ("def square(x):\n    return x ** 2\n", "assert square(3) == 9", [("x ** 2", "x ** 3")]),
]


def _micro_bug_task(rng, idx):
    funcs = rng.sample(range(len(_FUNCS)), rng.randint(3, 5))
    buggy = rng.choice(funcs)
    good_token, bad_token = rng.choice(_FUNCS[buggy][2])
    sources = [_FUNCS[i][0] for i in funcs]
    fixed = "\n\n".join(sources)
    broken = "\n\n".join(s.replace(good_token, bad_token, 1) if i == buggy else s for i, s in zip(funcs, sources))
    names = [_FUNCS[i][0].split("(")[0][4:] for i in funcs]
    tests = "from mathlib.core import " + ", ".join(names) + "\n" + "".join(
        f"\n\ndef test_{name}():\n    {_FUNCS[i][1]}\n" for name, i in zip(names, funcs))
    bug_name = _FUNCS[buggy][0].split("(")[0][4:]
    prompts = {"terse": f"{bug_name} is broken",
               "issue": f"`{bug_name}` in mathlib/core.py returns wrong results. Please fix it.",
               "full": f"`mathlib.core.{bug_name}` has a one-token bug. The test `{_FUNCS[buggy][1]}` should "
                       f"pass. Fix the function without changing the others."}
    repo = {"mathlib/__init__.py": "", "mathlib/core.py": broken}
    task = _task(f"ladder-micro_bug-{idx:03d}", "micro_bug", "medium", prompts, reads=("mathlib/core.py",))
    overlay = {"tests/test_core.py": tests}
    f2p = [f"tests/test_core.py::test_{bug_name}"]
    p2p = [f"tests/test_core.py::test_{n}" for n in names if n != bug_name]
    return (task, f2p, p2p), repo, \
        {**repo, "mathlib/core.py": fixed}, overlay


def _task(task_id: str, rung: str, difficulty: str, prompts: dict[str, str], reads: tuple[str, ...] = (),
          distractor: str | None = None) -> Task:
    """`reads`: the files an agent must read before it can answer (the scripted oracle reads them first).
    `distractor`: the word next to the answer in the context that a careless agent copies instead (the `echo`
    sender, the `lookup` key, left of its value); the demo's imperfect teacher writes it (experiments/demo)."""
    meta = {"generator": "ladder", "rung": rung}
    if reads:
        meta["reads"] = list(reads)
    if distractor is not None:
        meta["distractor"] = distractor
    return Task(id=task_id, instruction=prompts["issue"], repo_dir=None, tests_dir=None, prompts=prompts,
                category=f"ladder/{rung}", difficulty=difficulty, repo=f"ladder-{rung}", timeout_s=60.0,
                metadata=meta)


def write_generated_task(task: Task, repo: dict[str, str], solved: dict[str, str], overlay: dict[str, str],
                         out_dir: str | Path, *, f2p, p2p=(), seed: int) -> Path:
    """Writes a generated task: `repo` as its environment, the patch to `solved` as its reference solution,
    `overlay` as its hidden tests; F2P/P2P, patch size and the seed recorded."""
    import dataclasses

    patch = make_patch(repo, solved)
    lines, files = patch_size(patch)
    with tempfile.TemporaryDirectory() as tmp:
        for rel, text in repo.items():
            (Path(tmp) / rel).parent.mkdir(parents=True, exist_ok=True)
            (Path(tmp) / rel).write_text(text)
        task = dataclasses.replace(
            task, repo_dir=Path(tmp), fail_to_pass=tuple(f2p), pass_to_pass=tuple(p2p),
            test_files=tuple(sorted(overlay)), solution_patch=patch, lines_changed=lines, files_changed=files,
            metadata={**task.metadata, "seed": seed})
        return write_task(task, out_dir, overlay={k: v.encode() for k, v in overlay.items()})


def task_content(task: Task) -> tuple:
    """What makes two ladder tasks the same task: the terse prompt and the environment's files (a `lookup`
    prompt names one of 16 keys, so the prompt alone repeats across different settings files). Train sets
    drop tasks whose content equals a held-out task's, so a held-out score is never a memorised answer."""
    files = sorted((str(p.relative_to(task.repo_dir)), p.read_bytes()) for p in Path(task.repo_dir).rglob("*")
                   if p.is_file()) if task.repo_dir else []
    return task.prompt("terse"), tuple(files)


_BUILDERS = {"echo": _echo_task, "answer": _answer_task, "lookup": _lookup_task, "micro_bug": _micro_bug_task}


def build_ladder(out_dir: str | Path, *, seed: int = 0, per_rung: int = 4,
                 rungs: tuple[str, ...] = RUNGS, lookup_keys: int = 2) -> list[Path]:
    """Writes `per_rung` tasks of each rung under `out_dir`; the same seed gives the same tasks.
    `lookup_keys`: keys in each `lookup` settings file (1 = read and copy; more = find the asked key too)."""
    unknown = set(rungs) - set(RUNGS)
    if unknown:
        raise ValueError(f"unknown ladder rungs {sorted(unknown)}; expected a subset of {RUNGS}")
    if not 1 <= lookup_keys <= len(_WORDS):
        raise ValueError(f"lookup_keys must be in 1..{len(_WORDS)}, got {lookup_keys}")
    builders = {**_BUILDERS, "lookup": functools.partial(_lookup_task, n_keys=lookup_keys)}
    written = []
    for rung in rungs:
        rng = random.Random(f"{seed}/{rung}")
        for idx in range(per_rung):
            made, repo, solved, overlay = builders[rung](rng, idx)
            task, f2p, p2p = made if isinstance(made, tuple) else (made, ["tests/test_answer.py::test_answer"], [])
            written.append(write_generated_task(task, repo, solved, overlay, out_dir, f2p=f2p, p2p=p2p, seed=seed))
    return written
