import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "table: the test prints a table (its output is shown at the end of the run)")


def pytest_terminal_summary(terminalreporter) -> None:
    """Echo what the ``table`` tests printed (pytest shows a passing test's output nowhere else): the
    oracle and hostile tables are read in CI's log."""
    for report in terminalreporter.stats.get("passed", []):
        if report.when == "call" and "table" in report.keywords and report.capstdout:
            terminalreporter.write_sep("-", f"table: {report.nodeid}")
            terminalreporter.write(report.capstdout)
