"""Fixtures of the conformance tier: one launch serves many tests (see launch.Plan)."""
import pytest

from .launch import Plan
from .methods import EACH_WAY, METHODS, kept_unless_slow, params

#: Methods the GPT script also runs with its biases and norms' weights exchanged in groups.
GROUPED = ("topk", "qsgd", "efsignsgd", "onebit", "sparseloco", "dgc", "auto")
GPT_FEATURES = ("plain", "bf16", "fp16", "accumulate", "unused", "frozen", "static", "bucket_view", "join",
                "compile")  # compile last: its first run compiles (about 15-60 s on 2 cores), the others reuse it


@pytest.fixture(scope="session")
def chars():
    """The scripts train on the harness's character dataset; without its files they cannot run."""
    from gradzip.harness.data import DataNotFoundError, load_dataset

    try:
        load_dataset("chars", seq_len=32)
    except DataNotFoundError as exc:
        pytest.skip(f"the chars dataset is missing: {exc}")


def gpt_runs(features, methods):
    return [{"name": f"{feature}/{method}", "method": method, "params": params(method), "feature": feature,
             "deadline": 300 if feature == "compile" else 60}
            for feature in features for method in methods]


def checkpoint_runs(methods, folder):
    """Plain training runs that save a checkpoint to ``folder``/<method>/rank<r>.pt after epoch 0."""
    runs = []
    for method in methods:
        (folder / method).mkdir(parents=True, exist_ok=True)
        runs.append({"name": f"checkpoint/{method}", "method": method, "params": params(method),
                     "feature": "checkpoint", "save": str(folder / method)})
    return runs


@pytest.fixture(scope="session")
def gpt_plan(chars, tmp_path_factory):
    """Every method plain and in every feature (the default run: in the others, one method of each way
    of exchanging), and the checkpointing runs that test_resume.py resumes, in one launch (the
    checkpoints first: a launch dying in a later run then does not cost the resume tests)."""
    folder = tmp_path_factory.mktemp("gpt")
    runs = (checkpoint_runs(METHODS, folder / "ckpt") + gpt_runs(GPT_FEATURES[:1], METHODS)
            + gpt_runs(GPT_FEATURES[1:], kept_unless_slow(EACH_WAY)))
    runs += [{"name": f"grouped/{method}", "method": method, "params": {**params(method), "group_vectors_below": 2**16},
              "feature": "plain", "deadline": 60} for method in GROUPED]
    return Plan("gpt_ddp.py", runs, folder, timeout=480).execute()


@pytest.fixture(scope="session")
def resume_plan(gpt_plan, tmp_path_factory):
    """A new process pair that loads each checkpoint written by ``gpt_plan`` and trains the last epoch."""
    runs = [{"name": f"resumed/{run['method']}", "method": run["method"], "params": run["params"],
             "feature": "checkpoint", "resume": run["save"]}
            for run in gpt_plan.runs if run["feature"] == "checkpoint"]
    return Plan("gpt_ddp.py", runs, tmp_path_factory.mktemp("resume")).execute()


@pytest.fixture(scope="session")
def optimizer_plan(chars, tmp_path_factory):
    """gradzip.DistributedOptimizer runs of every method: set_to_none=True with a checkpoint after
    epoch 0, set_to_none=False, and the resumption of the checkpoint with fresh objects, in one launch."""
    folder = tmp_path_factory.mktemp("optimizer")
    runs = []
    for kind in ("checkpoint", "keep_grads", "resumed"):
        for method in METHODS:
            run = {"name": f"{kind}/{method}", "method": method, "params": params(method)}
            ckpt = folder / "ckpt" / method
            ckpt.mkdir(parents=True, exist_ok=True)
            run.update({"checkpoint": {"save": str(ckpt)}, "keep_grads": {"set_to_none": False},
                        "resumed": {"resume": str(ckpt)}}[kind])
            runs.append(run)
    return Plan("horovod_style.py", runs, folder).execute()
