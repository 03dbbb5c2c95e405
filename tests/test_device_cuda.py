"""The CUDA checks of tests/device_check.py as tests: skipped cleanly where there is no GPU."""

import pytest
import torch

import device_check

no_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (run tests/device_check.py on a GPU)")


@no_gpu
@pytest.mark.parametrize("check", device_check.CHECKS, ids=lambda c: c.__name__)
def test_cuda(check):
    check()


def test_the_device_check_script_refuses_to_pretend_without_a_gpu(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_check.main() == 2 and "no CUDA device" in capsys.readouterr().out
