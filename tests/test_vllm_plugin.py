"""The vLLM general plugin: ``additional_config={"vtoken": ...}`` alone installs vtoken, and every bad or
unverified setting fails while vLLM builds its config, before any model is loaded."""

import os

import pytest

pytest.importorskip("vllm")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from vllm.config import KVTransferConfig  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402

from vllm_harness import TINY  # noqa: E402
from vtoken.integration.vllm.compat import UnsupportedConfigError  # noqa: E402
from vtoken.integration.vllm.settings import SettingsError  # noqa: E402


def config(vtoken=None, **kw):
    args = dict(model=TINY, load_format="dummy", skip_tokenizer_init=True, dtype="float32", block_size=32,
                enforce_eager=True, max_model_len=2048)
    args.update(kw)
    if vtoken is not None:
        args["additional_config"] = {"vtoken": vtoken}
    return EngineArgs(**args).create_engine_config()


def test_the_entry_point_is_installed():
    from importlib.metadata import entry_points
    assert [e.value for e in entry_points(group="vllm.general_plugins") if e.name == "vtoken"] == \
        ["vtoken.integration.vllm.plugin:register"]


def test_the_vtoken_block_installs_the_connector_and_nothing_else_does():
    assert config().kv_transfer_config is None
    c = config({"strict_verify": "strict"})
    assert c.kv_transfer_config.kv_connector == "VTokenConnector"
    assert c.kv_transfer_config.kv_connector_module_path == "vtoken.integration.vllm.connector"


@pytest.mark.parametrize("block, exc, message", [
    ({"strict_verify": "yes"}, SettingsError, "vtoken.strict_verify must be one of ['off', 'sampled', 'strict']"),
    ({"drill_every": -1}, SettingsError, "vtoken.drill_every must be an integer >= 0"),
    ({"policy": "h2o", "score_layers": -1}, SettingsError, "vtoken.score_layers must be an integer >= 0"),
    ({"policy": "random", "budget": 0}, SettingsError, "vtoken.budget must be a ratio in (0, 1]"),
    ({"policy": "random", "reclaim": "compact"}, SettingsError, "use reclaim='densify', or read_path='gather'"),
])
def test_bad_or_unbuilt_settings_fail_at_config_time(block, exc, message):
    with pytest.raises(exc) as e:
        config(block)
    assert message in str(e.value)


def test_eviction_and_quarantine_settings_are_accepted():
    c = config({"policy": "streaming_llm", "budget": 0.5, "reclaim": "densify", "strict_verify": "strict",
                "on_mismatch": "quarantine"})
    assert c.kv_transfer_config.kv_connector == "VTokenConnector"
    assert c.additional_config["vtoken"]["policy"] == "streaming_llm"


def test_another_kv_connector_is_refused():
    other = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both")
    with pytest.raises(UnsupportedConfigError, match="remove --kv-transfer-config"):
        config({}, kv_transfer_config=other)


def test_the_documented_vllm_serve_command_line_enables_vtoken():
    """docs/staging.md's ``vtoken serve ... --additional-config '{"vtoken": ...}'`` (``vllm serve``'s arguments),
    parsed by vLLM's own CLI parser; tests/test_vllm_serve.py starts the server itself."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    block = '{"vtoken": {"policy": "streaming_llm", "budget": 0.5, "reclaim": "densify", "strict_verify": "strict"}}'
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--model", TINY, "--load-format", "dummy", "--skip-tokenizer-init", "--dtype", "float32",
                              "--block-size", "32", "--enforce-eager", "--additional-config", block])
    c = EngineArgs.from_cli_args(args).create_engine_config()
    assert c.kv_transfer_config.kv_connector == "VTokenConnector"
    assert c.additional_config["vtoken"]["strict_verify"] == "strict"
    bad = parser.parse_args(["--model", TINY, "--load-format", "dummy", "--block-size", "32",
                             "--additional-config", '{"vtoken": {"budget": 2.5}}'])
    with pytest.raises(SettingsError, match="vtoken.budget must be a ratio in"):
        EngineArgs.from_cli_args(bad).create_engine_config()


def test_a_second_engine_in_the_process_is_refused_while_the_first_is_alive():
    """vLLM keeps a process's first KV connector agent, so an in-process engine started while an earlier one is
    alive would run with the earlier one's vtoken settings on its worker side (a bench once ran H2O on a
    Random engine's connector and stopped on V4). The worker refuses to bind, naming the fix; with the
    first engine shut down, the second starts and generates."""
    import gc

    import vllm_harness as H
    from vllm import SamplingParams

    first = H.make_llm({"policy": "random", "budget": 0.5}, multiprocess=False)
    try:
        with pytest.raises(Exception) as caught:
            H.make_llm({"policy": "h2o", "budget": 0.5}, multiprocess=False)
        chain, e = [], caught.value
        while e is not None:
            chain.append(str(e))
            e = e.__cause__ or e.__context__
        assert any("belongs to an earlier engine in this process" in m and "shut that engine down first" in m
                   for m in chain), chain
        from vtoken.integration.bench.vllm_engine import drop_frames
        drop_frames(caught.value)
        del caught
        gc.collect()
    finally:
        first.llm_engine.engine_core.shutdown()
        del first
        gc.collect()
    second = H.make_llm({"policy": "h2o", "budget": 0.5}, multiprocess=False)
    try:
        [out] = second.generate([H.prompts(1)[0]], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0))
        assert len(out.outputs[0].token_ids) == 4
    finally:
        second.llm_engine.engine_core.shutdown()
