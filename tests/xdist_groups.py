"""How the test processes share work beyond a module: the modules whose tests use the session's
local Prefect server (tests/flows/conftest.py: its deployments, process worker and finished tiny
run) go to one test process under `--dist loadfile` (tests/conftest.py's scheduler), which
builds those once. ``tests/test_server_group_on_cpu.py`` keeps this list true."""

from __future__ import annotations

SERVER_MODULES = frozenset(
    {
        "tests/flows/test_automation_server.py",
        "tests/flows/test_deploy_server.py",
        "tests/flows/test_samples_on_cpu.py",
        "tests/flows/test_ui_browser.py",
    }
)
