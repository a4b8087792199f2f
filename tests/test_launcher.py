"""The launcher's workers start from a fork server that imported torch once, and run in their caller's
environment of the moment they start, as spawned interpreters would."""
import os

from gradzip.launcher import run_workers
from tests import workers


def test_workers_fork_from_one_server_with_torch_loaded_and_see_the_callers_environment(monkeypatch):
    monkeypatch.setenv("GRADZIP_TEST_GONE", "set before the server started")
    first = run_workers(workers.where_started, 2, ("GRADZIP_TEST_GONE", "GRADZIP_TEST_NEW"), every_rank=True)
    monkeypatch.delenv("GRADZIP_TEST_GONE")
    monkeypatch.setenv("GRADZIP_TEST_NEW", "set after")
    second = run_workers(workers.where_started, 2, ("GRADZIP_TEST_GONE", "GRADZIP_TEST_NEW"), every_rank=True)
    assert [env for env, _, _ in first] == [{"GRADZIP_TEST_GONE": "set before the server started",
                                             "GRADZIP_TEST_NEW": None}] * 2
    assert [env for env, _, _ in second] == [{"GRADZIP_TEST_GONE": None, "GRADZIP_TEST_NEW": "set after"}] * 2
    servers = {parent for _, parent, _ in first + second}
    assert len(servers) == 1 and os.getpid() not in servers, "every worker is a child of one fork server"
    assert all(has_torch for _, _, has_torch in first + second), "the server has torch loaded"
