"""Where the trainer runs (``trainer.device``): the names the config takes, what 'auto' and 'cuda' resolve to
(per rank under torchrun), the process group's backend, and the refusals at ``coordinator init`` and ``run``
before anything is written: a CUDA device this machine lacks, a world size that does not divide the batch.

This machine has no GPU: the refusals run the real CUDA check; what CUDA machines resolve to is tested with
only the CUDA availability check mocked (``cuda_devices``), in the tests named ``..._mocked_cuda``.
"""

from __future__ import annotations

import signal

import pytest
import torch
from support import make_coordinator_dir

from veriroll.cli.main import main
from veriroll.coordinator.config import CoordinatorConfig
from veriroll.coordinator.trainer import device as trainer_device_module
from veriroll.coordinator.trainer.device import (
    check_trainer_device,
    check_trainer_placement,
    check_world_size,
    process_group_backend,
    trainer_device,
)
from veriroll.protos.config import ConfigError, load_config

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")


def config(**settings) -> CoordinatorConfig:
    return load_config(CoordinatorConfig, overrides=settings)


@pytest.mark.parametrize("name", ["auto", "cpu", "cuda", "cuda:0", "cuda:12"])
def test_trainer_device_takes_auto_cpu_cuda_and_cuda_n(name):
    assert config(**{"trainer.device": name}).trainer.device == name


# Not "gpu": that id is a keyword, and conftest skips "gpu" tests on a machine without one.
@pytest.mark.parametrize("name", ["xpu", "CUDA", "cuda:", "cuda:-1", "cuda:x", "mps", "cpu:0", " cpu", ""])
def test_trainer_device_refuses_any_other_name_naming_the_field_and_the_forms(name):
    with pytest.raises(ConfigError) as caught:
        config(**{"trainer.device": name})
    message = str(caught.value)
    assert "trainer.device" in message and "'auto', 'cpu', 'cuda' or 'cuda:N'" in message, message


def test_trainer_device_defaults_to_auto():
    assert CoordinatorConfig().trainer.device == "auto"


@needs_no_cuda
def test_auto_is_cpu_on_a_machine_without_cuda():
    assert trainer_device("auto", {}) == torch.device("cpu")
    assert check_trainer_device("auto", {"LOCAL_RANK": "1", "WORLD_SIZE": "2"}) == torch.device("cpu")
    assert process_group_backend(trainer_device("auto", {})) == "gloo"


@needs_no_cuda
@pytest.mark.parametrize("name", ["cuda", "cuda:0", "cuda:3"])
def test_cuda_is_refused_on_a_machine_without_one_naming_the_field_and_what_was_found(name):
    with pytest.raises(ConfigError) as caught:
        check_trainer_device(name, {})
    message = str(caught.value)
    assert f"trainer.device = {name!r}" in message and "no CUDA device" in message, message
    assert "CUDA build" in message and "'auto' or 'cpu'" in message


def test_auto_and_cuda_take_cuda_local_rank_under_torchrun_mocked_cuda(monkeypatch):
    monkeypatch.setattr(trainer_device_module, "cuda_devices", lambda: 4)
    assert trainer_device("auto", {}) == torch.device("cuda", 0)
    assert trainer_device("cuda", {}) == torch.device("cuda", 0)
    torchrun = {"LOCAL_RANK": "2", "WORLD_SIZE": "4"}
    assert check_trainer_device("auto", torchrun) == torch.device("cuda", 2)
    assert check_trainer_device("cuda", torchrun) == torch.device("cuda", 2)
    assert check_trainer_device("cpu", torchrun) == torch.device("cpu")
    assert check_trainer_device("cuda:3", {}) == torch.device("cuda", 3)
    assert process_group_backend(torch.device("cuda", 2)) == "nccl"
    assert process_group_backend("cpu") == "gloo"


def test_a_cuda_index_past_the_device_count_is_refused_with_the_count_mocked_cuda(monkeypatch):
    monkeypatch.setattr(trainer_device_module, "cuda_devices", lambda: 2)
    with pytest.raises(ConfigError, match=r"trainer.device = 'cuda:2' means cuda:2, but this machine has 2 CUDA "
                                          r"devices \(cuda:0..cuda:1\)"):
        check_trainer_device("cuda:2", {})
    with pytest.raises(ConfigError, match=r"'cuda' means cuda:3 \(LOCAL_RANK 3\), but this machine has 2"):
        check_trainer_device("cuda", {"LOCAL_RANK": "3", "WORLD_SIZE": "4"})


def test_one_pinned_gpu_for_several_ranks_is_refused_mocked_cuda(monkeypatch):
    monkeypatch.setattr(trainer_device_module, "cuda_devices", lambda: 2)
    with pytest.raises(ConfigError, match="puts all 2 ranks"):
        check_trainer_device("cuda:1", {"LOCAL_RANK": "0", "WORLD_SIZE": "2"})
    assert check_trainer_device("cuda:1", {"WORLD_SIZE": "1"}) == torch.device("cuda", 1)


def test_a_world_size_that_does_not_divide_the_batch_is_refused():
    cfg = config(**{"trainer.groups_per_step": 6, "trainer.min_groups": 6, "leases.group_size": 4})  # 24 samples
    assert check_world_size(cfg, {}) == 1
    assert check_world_size(cfg, {"WORLD_SIZE": "8"}) == 8
    with pytest.raises(ConfigError) as caught:
        check_world_size(cfg, {"WORLD_SIZE": "5"})
    message = str(caught.value)
    assert "WORLD_SIZE 5" in message and "groups_per_step 6 x leases.group_size 4 = 24" in message, message
    with pytest.raises(ConfigError, match="is not a whole number"):
        check_world_size(cfg, {"WORLD_SIZE": "two"})


def test_more_ranks_than_the_smallest_batch_are_refused():
    cfg = config(**{"trainer.groups_per_step": 8, "trainer.min_groups": 1, "leases.group_size": 2})  # 16, at least 2
    with pytest.raises(ConfigError, match="min_groups 1 x leases.group_size 2 = 2 samples"):
        check_world_size(cfg, {"WORLD_SIZE": "4"})


def test_processes_without_a_trainer_are_not_checked():
    for settings in ({"trainer.enabled": False}, {"role": "edge"}, {"role": "verifier"}):
        cfg = config(**{"trainer.device": "cuda:9", **settings})
        assert check_trainer_placement(cfg, {"WORLD_SIZE": "7"}) is None


def _init(tmp_path, *extra):
    return main(["coordinator", "init", "--dir", str(tmp_path / "coord"), "--json", *extra])


@needs_no_cuda
def test_init_refuses_a_cuda_trainer_without_cuda_and_writes_nothing(tmp_path, capsys):
    assert _init(tmp_path, "--set", "trainer.device=cuda") == 2
    err = capsys.readouterr().err
    assert "trainer.device = 'cuda'" in err and "no CUDA device" in err, err
    assert not (tmp_path / "coord").exists()


def test_init_refuses_a_world_size_that_does_not_divide_the_batch_and_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "7")
    assert _init(tmp_path, "--set", "trainer.device=cpu") == 2
    assert "WORLD_SIZE 7 does not divide the trainer's batch" in capsys.readouterr().err
    assert not (tmp_path / "coord").exists()


def _run(base, *extra) -> int:
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return main(["coordinator", "run", "--dir", str(base), *extra])
    finally:  # `run` installs its stop handlers: give pytest its own back
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


@needs_no_cuda
def test_run_refuses_a_cuda_trainer_without_cuda_before_writing_anything(tmp_path, capsys):
    base = make_coordinator_dir(tmp_path, {"trainer.enabled": True, "trainer.device": "cuda:0"})
    before = sorted(p.name for p in base.iterdir())
    assert _run(base) == 2
    err = capsys.readouterr().err
    assert "trainer.device = 'cuda:0'" in err and "no CUDA device" in err, err
    assert sorted(p.name for p in base.iterdir()) == before  # no lock file, no ports.json, no shardcast store


def test_run_refuses_a_world_size_that_does_not_divide_the_batch(tmp_path, capsys, monkeypatch):
    base = make_coordinator_dir(tmp_path, {"trainer.enabled": True, "trainer.device": "cpu",
                                           "trainer.groups_per_step": 4, "leases.group_size": 4})
    monkeypatch.setenv("WORLD_SIZE", "3")
    before = sorted(p.name for p in base.iterdir())
    assert _run(base) == 2
    assert "WORLD_SIZE 3 does not divide the trainer's batch: trainer.groups_per_step 4 x leases.group_size 4 = 16" \
        in capsys.readouterr().err
    assert sorted(p.name for p in base.iterdir()) == before
