"""One real stack for the whole faults tier (``bench.fault_stack``), started once per session:
every scenario starts by checking that it serves correctly, so they can run one after another."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bench.fault_stack import FaultStack, fault_stack
from bench.faults import stack_options

CAP = 3  # the load tenant's concurrency cap; the scenarios' clients run at the cap


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultStack]:
    logs = tmp_path_factory.mktemp("fault-stack-logs")  # the roles' logs, kept by pytest
    with fault_stack(max_concurrency=CAP, log_dir=logs, **stack_options()) as fs:
        yield fs
