"""The launcher's workers start from a fork server that imported torch once, and run in their caller's
environment of the moment they start, and end running their exit handlers, as spawned interpreters would."""
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


def test_a_worker_whose_caller_changed_what_torch_reads_at_import_is_spawned(monkeypatch):
    """The server read TORCH_LOGS, OMP_*, PYTHON* ... as it started: a caller that has changed one since
    gets a worker of its own interpreter; changed back, the server's again."""
    _, server, _ = run_workers(workers.where_started, 1, ())
    before = os.environ.get("TORCH_LOGS")
    monkeypatch.setenv("TORCH_LOGS", "graph_breaks" if before != "graph_breaks" else "recompiles")
    _, spawned, _ = run_workers(workers.where_started, 1, ())
    if before is None:
        monkeypatch.delenv("TORCH_LOGS")
    else:
        monkeypatch.setenv("TORCH_LOGS", before)
    _, again, _ = run_workers(workers.where_started, 1, ())
    assert spawned == os.getpid() and again == server != os.getpid()


def test_what_torchdynamo_and_inductor_read_at_import_counts_as_read_at_start(monkeypatch):
    """The server imports TorchDynamo (and with it Inductor's configuration), which read these as they load;
    Inductor's cache directory, which torch sets itself as it compiles, does not count."""
    from gradzip import launcher
    for name in ("TORCH_COMPILE_DISABLE", "TORCHDYNAMO_VERBOSE", "TORCHINDUCTOR_MAX_AUTOTUNE", "TORCH_LOGS"):
        monkeypatch.setenv(name, "1")
        assert launcher._read_at_start()[name] == "1", name
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/nowhere")
    assert "TORCHINDUCTOR_CACHE_DIR" not in launcher._read_at_start()


def test_a_workers_exit_handlers_run(tmp_path):
    run_workers(workers.leaves_a_file_at_exit, 2, str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exit0", "exit1"]
