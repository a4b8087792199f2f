"""One checkpoint for every rank: ``state_dict(all_ranks=True)``, ``torch.distributed.checkpoint`` through
``state.stateful()``, resuming on another number of ranks (:func:`gradzip.state.reshard`), and
``register(resume=...)`` refusing a checkpoint without gradzip's state.  Real gloo processes.
"""
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.nn.parallel import DistributedDataParallel as DDP

import gradzip
from gradzip.state import GradzipState, reshard

from .distributed import run_workers
from .workers import one_rank_group


def _trained_state(worker, method="topk", steps=3, params=None):
    state = GradzipState(method, **(params or {"ratio": 0.25}))
    torch.manual_seed(100 + worker)  # each rank its own gradients, so residuals differ between ranks
    for _ in range(steps):
        state.exchange([("w", torch.randn(32, 16)), ("b", torch.randn(16))])
    return state


def _dcp_save(rank, world, path):
    state = _trained_state(rank)
    dcp.save({"gradzip": state.stateful()}, checkpoint_id=path)
    own = state.state_dict()
    state.close()
    return own["tensors"]


def _dcp_load(rank, world, path):
    state = GradzipState("topk", ratio=0.25)
    dcp.load({"gradzip": state.stateful()}, checkpoint_id=path)
    loaded = state.loaded
    tensors = {k: dict(v) for k, v in state.tensors.items()}
    state.close()
    return loaded, tensors


def test_dcp_checkpoint_resumes_each_rank_and_on_another_world_size(tmp_path):
    saved = run_workers(_dcp_save, 2, str(tmp_path / "ckpt"))
    assert not torch.equal(saved[0]["w"]["residual"], saved[1]["w"]["residual"])
    same = run_workers(_dcp_load, 2, str(tmp_path / "ckpt"))
    for rank, (loaded, tensors) in enumerate(same):
        assert loaded
        for key in saved[rank]:
            assert torch.equal(tensors[key]["residual"], saved[rank][key]["residual"])
    three = run_workers(_dcp_load, 3, str(tmp_path / "ckpt"))
    for key in saved[0]:
        mean = (saved[0][key]["residual"] + saved[1][key]["residual"]) / 2
        for loaded, tensors in three:
            torch.testing.assert_close(tensors[key]["residual"], mean, rtol=1e-6, atol=1e-7)


def _gathered(rank, world, method):
    state = _trained_state(rank, method, steps=4, params={"rank": 2, "dense_steps": 1} if method == "powersgd" else None)
    gathered = state.state_dict(all_ranks=True)
    own = state.state_dict()
    state.close()
    return gathered, own


@pytest.mark.parametrize("method", ["topk", "powersgd"])
def test_all_ranks_form_holds_every_rank_and_reshards_by_the_mean(method):
    results = run_workers(_gathered, 2, method)
    gathered = results[0][0]
    assert [part["rank"] for part in gathered["all_ranks"]] == [0, 1]
    for rank, (_, own) in enumerate(results):
        part = gathered["all_ranks"][rank]
        assert part["steps"] == own["steps"]
        for key, slot in own["tensors"].items():
            for name, value in slot.items():
                assert torch.equal(part["tensors"][key][name], value)
    parts = gathered["all_ranks"]
    for new_rank in range(3):
        mine = reshard(parts, new_rank, 3)
        for key, slot in parts[0]["tensors"].items():
            for name, value in slot.items():
                other = parts[1]["tensors"][key][name]
                if torch.equal(value, other):  # shared on every rank (PowerSGD's Q): kept as it is
                    assert torch.equal(mine["tensors"][key][name], value)
                else:
                    torch.testing.assert_close(mine["tensors"][key][name], (value + other) / 2)
    if method == "powersgd":
        names = {name for slot in parts[0]["tensors"].values() for name in slot}
        assert names, "PowerSGD kept no state: the test would prove nothing"


def test_reshard_refuses_state_it_cannot_average():
    part = {"tensors": {"w": {"count": torch.tensor([1])}}, "totals": {}, "rank": 0}
    other = {"tensors": {"w": {"count": torch.tensor([2])}}, "totals": {}, "rank": 1}
    with pytest.raises(ValueError, match="differs between ranks and is not a float tensor"):
        reshard([part, other], 0, 3)


def _register_resume(rank, world, resume):
    model = DDP(torch.nn.Linear(4, 2))
    try:
        gradzip.register(model, "topk", ratio=0.5, resume=resume)
    except (FileNotFoundError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "registered"


def test_register_resume_refuses_what_holds_no_gradzip_state(tmp_path):
    missing = run_workers(_register_resume, 1, str(tmp_path / "gradzip_rank{rank}.pt"))[0]
    assert missing.startswith("FileNotFoundError") and "gradzip_rank0.pt" in missing
    torch.save({"model": {}, "optimizer": {}}, tmp_path / "model.pt")
    plain = run_workers(_register_resume, 1, str(tmp_path / "model.pt"))[0]
    assert plain.startswith("ValueError") and "holds no gradzip state_dict" in plain


def test_optimizer_state_dict_without_gradzip_state_warns_that_feedback_starts_fresh():
    model = torch.nn.Linear(3, 2)
    opt = gradzip.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                       "topk", ratio=0.5)
    with pytest.warns(UserWarning, match="holds no gradzip state"):
        opt.load_state_dict(opt.optimizer.state_dict())
    plain = gradzip.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), "fp16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no feedback, nothing lost: no warning
        plain.load_state_dict(plain.optimizer.state_dict())


@pytest.mark.parametrize("backend", [None, "gloo", "cpu:gloo"])
def test_a_group_says_which_backend_takes_each_device(backend, tmp_path):
    """A group made with no backend named (``get_backend`` says "undefined"; on a GPU machine NCCL, with
    or without gloo for CPU tensors, by torch's version) or for some device types only: gradzip's
    transport asks which backend takes a tensor's device, where checkpoints gather and where a loaded
    state goes."""
    from gradzip.collectives import ProcessGroupTransport
    with one_rank_group(backend, tmp_path):
        transport = ProcessGroupTransport()
        cuda = torch.cuda.is_available() and dist.is_nccl_available()
        if backend is None and cuda:
            assert transport.backends["cuda"] == "nccl"
            assert transport.device == torch.device("cuda", torch.cuda.current_device())
        else:
            assert transport.backends == {None: {"cpu": "gloo"}, "gloo": {"cpu": "gloo", "cuda": "gloo"},
                                          "cpu:gloo": {"cpu": "gloo"}}[backend]
            assert transport.device == torch.device("cpu")
        assert transport.allgather_bytes(b"abc") == [b"abc"]  # a checkpoint's gather, on that device
        flat = torch.arange(5.0, device=transport.device)
        assert torch.equal(transport.allgather_into(flat, flat.new_empty(1, 5)), flat.view(1, 5))
        assert transport.exchanged_on == flat.device == transport.device  # from then on: the exchanges' device


def test_a_torch_without_backend_configs_names_one_backend(monkeypatch):
    from gradzip import collectives
    monkeypatch.delattr(dist, "get_backend_config")
    for name, want in (("nccl", {"cuda": "nccl"}), ("gloo", {"cpu": "gloo", "cuda": "gloo"})):
        monkeypatch.setattr(dist, "get_backend", lambda group=None, name=name: name)
        assert collectives.backends_of() == want


def test_a_state_loaded_before_any_exchange_is_not_put_on_the_current_gpu(monkeypatch, tmp_path):
    """Under a GPU backend, before its first exchange and with no device bound to the group, a rank
    does not know its GPU: the current one is GPU 0 on every rank that never set one.  A state loaded
    then stays where it was read until its gradients place it (checkpoint gathers still take the
    current GPU, having no other).  On this CPU the backend and the GPU are pretended."""
    from gradzip.collectives import ProcessGroupTransport
    saved = _trained_state(0).state_dict()
    with one_rank_group("gloo", tmp_path):
        transport = ProcessGroupTransport()  # what a group of several ranks gives
        resumed = GradzipState("topk", ratio=0.25, transport=transport)
        monkeypatch.setattr(transport, "backends", {"cpu": "gloo", "cuda": "nccl"})
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        assert isinstance(transport, ProcessGroupTransport) and transport.known_device is None
        assert transport.device == torch.device("cuda", 0)
        resumed.load_state_dict(saved)  # a CPU build cannot put a tensor on cuda:0: this raised
        assert resumed._unplaced == {"w", "b"} and resumed.tensors["w"]["residual"].device.type == "cpu"
        resumed.close()


def test_a_state_placed_by_no_group_follows_its_gradients_once():
    """Loaded at world size 1 (no group to say where the gradients live), each key's state is moved to its
    gradients' device at its first exchange and never looked at again (the move itself needs a GPU:
    tests/stacks/test_gpu.py); a state loaded under a group's device is placed at once."""
    state = _trained_state(0)
    saved = state.state_dict()
    state.close()
    resumed = GradzipState("topk", ratio=0.25)
    resumed.load_state_dict(saved)
    assert resumed._unplaced == {"w", "b"}
    resumed.exchange([("w", torch.randn(32, 16)), ("b", torch.randn(16))])
    assert resumed._unplaced == set()
    resumed.close()
