"""One runner, with its one worker process, for every test of tests/docs."""

from __future__ import annotations

import pytest

from tests.docs.runner import DocRunner


@pytest.fixture(scope="session")
def doc_runner(tmp_path_factory):
    runner = DocRunner(tmp_path_factory.mktemp("docs"))
    yield runner
    runner.close()
