"""Per-test pytest results: from a JUnit XML report (the trusted source) or from `-rA` summary lines.

Statuses follow SWE-bench's log parsers: PASSED, FAILED, ERROR, SKIPPED, XFAIL (XPASS is reported
by pytest's JUnit writer as a pass when non-strict and as a failure when strict).
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

PASSED, FAILED, ERROR, SKIPPED, XFAIL, XPASS = "PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS"
FAILING = {FAILED, ERROR}


class ReportError(ValueError):
    """The JUnit report is missing or malformed."""


def _node_id(case: ET.Element) -> str:
    """Rebuilds pytest's node id from an xunit1 <testcase>: file, classes below the module, name."""
    name = case.get("name", "")
    file = case.get("file")
    classname = case.get("classname", "")
    if not file:
        return f"{classname}::{name}" if classname else name
    module = file[:-3].replace("/", ".") if file.endswith(".py") else file.replace("/", ".")
    rest = classname[len(module) + 1:] if classname.startswith(module + ".") else ""
    return "::".join([file, *filter(None, rest.split(".")), name])


def parse_junit(xml_text: str | bytes) -> dict[str, str]:
    """Test node id -> status from pytest's `--junitxml` (`-o junit_family=xunit1`, which records files)."""
    try:
        root = ET.fromstring(xml_text)
    except ET.ParseError as e:
        raise ReportError(f"unreadable JUnit XML: {e}") from None
    if root.tag not in ("testsuites", "testsuite"):
        raise ReportError(f"JUnit XML root is <{root.tag}>, expected <testsuites> or <testsuite>")
    statuses: dict[str, str] = {}
    for case in root.iter("testcase"):
        node = _node_id(case)
        tags = {child.tag: child for child in case}
        if "error" in tags:
            status = ERROR
        elif "failure" in tags:
            status = FAILED
        elif "skipped" in tags:
            status = XFAIL if tags["skipped"].get("type") == "pytest.xfail" else SKIPPED
        else:
            status = PASSED
        # a test that passed but errored in teardown appears twice; the worse outcome wins
        if statuses.get(node) not in FAILING:
            statuses[node] = status
    return statuses


_RA_LINE = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\s+(\S+?)(?:\s+-\s.*)?$")


def parse_pytest_rA(log: str) -> dict[str, str]:
    """Node id -> status from the "short test summary info" lines `pytest -rA` prints.

    Any program can print such lines, so this is only used where no JUnit report exists (Terminal-Bench
    1 scripts that run pytest their own way) and is always cross-checked with the exit code.
    """
    statuses: dict[str, str] = {}
    for line in log.splitlines():
        m = _RA_LINE.match(line.strip())
        if m and ("::" in m.group(2) or m.group(2).endswith(".py")):
            status = m.group(1)
            statuses[m.group(2)] = FAILED if status == XPASS else status
    return statuses
