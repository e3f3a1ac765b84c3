"""Tasks and graders: the Harbor-layout task format, SWE-bench compatibility, generators, the ladder."""

from c2jax.rl.tasks.grading import GradeResult, grade
from c2jax.rl.tasks.task import Task, TaskFormatError, load_task, load_tasks, write_task

__all__ = ["GradeResult", "Task", "TaskFormatError", "grade", "load_task", "load_tasks", "write_task"]
