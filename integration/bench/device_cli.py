"""``vtoken bench device``: Q4's device half (``q4_device``) on CUDA with ``--gpu``, or a CPU smoke run.

Needs torch only (no vLLM). On a GPU box without an install, ``python tests/device_check.py`` runs the
CUDA checks and this benchmark straight from the checkout.
"""

from __future__ import annotations

import argparse

from vtoken.core.errors import ConfigError

from .device_settings import device_bench_settings
from .runner import add_run_options, run_half

# q4_device (torch) is imported when the command runs, so ``vtoken`` starts without torch
DESCRIPTION = ("Q4, device half: what a relocation costs on the device, what the async copy path buys over "
               "force-sync, and how the relocation stream fares next to unrelated GPU work.")


def register_device(bench_sub: argparse._SubParsersAction) -> None:
    p = bench_sub.add_parser("device", help="Q4 on the device: relocation throughput, async vs force-sync, "
                                            "contention (--gpu for CUDA)",
                             description=DESCRIPTION)
    p.add_argument("--gpu", action="store_true", help="run on CUDA at Llama-3.1-8B's KV geometry (needs a GPU)")
    add_run_options(p, "bench-device-out")
    p.set_defaults(run=run_device)


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def run_device(a: argparse.Namespace) -> int:
    def prepare():
        from . import q4_device  # torch: missing -> ImportError -> one line naming the extra (run_half)

        if a.gpu and not cuda_available():
            raise ConfigError("--gpu: no CUDA device visible to torch (torch.cuda.is_available() is False)")
        return device_bench_settings(a.gpu, a.quick, a.repeats, a.seed), [q4_device]
    return run_half("device", a, prepare, ("gpu", "repeats", "seed"), "torch: pip install -e '.[torch,bench]'")
