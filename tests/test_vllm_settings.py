"""``additional_config={"vtoken": {...}}``: every bad value fails at start-up naming the key and what it accepts."""

import pytest

from vtoken.integration.vllm.settings import SettingsError, VTokenSettings


def parse(**block):
    return VTokenSettings.from_additional_config({"vtoken": block})


def test_not_enabled_without_the_block():
    assert VTokenSettings.from_additional_config(None) is None
    assert VTokenSettings.from_additional_config({"other": 1}) is None


def test_the_documented_block_parses():
    s = parse(policy="streaming_llm", budget=0.5, reclaim="densify", strict_verify="strict")
    assert (s.policy, s.budget, s.reclaim, s.read_path, s.strict_verify, s.on_mismatch) == \
        ("streaming_llm", 0.5, "densify", "dense", "strict", "raise")
    assert parse(policy="random", budget=512).budget == 512
    assert parse().policy == "none"


@pytest.mark.parametrize("block, message", [
    ({"policy": "lru"}, "vtoken.policy must be one of ['none', 'streaming_llm', 'random', 'h2o', 'scissorhands', 'tova', 'knorm', "
     "'snapkv'], got 'lru'"),
    ({"budget": 1.5}, "vtoken.budget must be a ratio in (0, 1]"),
    ({"budget": 0}, "or a token count >= 1 (e.g. 512), got 0"),
    ({"budget": True}, "vtoken.budget"),
    ({"budget": "half"}, "vtoken.budget"),
    ({"reclaim": "pack"}, "vtoken.reclaim must be one of ['densify', 'compact', 'off'], got 'pack'"),
    ({"strict_verify": "on"}, "vtoken.strict_verify must be one of ['off', 'sampled', 'strict'], got 'on'"),
    ({"on_mismatch": "ignore"}, "vtoken.on_mismatch must be one of ['raise', 'quarantine']"),
    ({"sample_every": 0}, "vtoken.sample_every must be an integer >= 1, got 0"),
    ({"evict_every": 0}, "vtoken.evict_every must be an integer >= 1, got 0"),
    ({"evict_every": 2.0}, "vtoken.evict_every must be an integer >= 1, got 2.0"),
    ({"theta_f": 1.0}, "vtoken.theta_f must be a number in [0, 1), got 1.0"),
    ({"seed": "x"}, "vtoken.seed must be an integer"),
    ({"stict_verify": "strict"}, "unknown vtoken setting(s) ['stict_verify']; known: ['policy', 'budget'"),
    ({"policy": "random", "reclaim": "off"}, "vtoken.reclaim='off' with read_path='dense'"),
    ({"read_path": "sparse"}, "vtoken.read_path must be one of ['dense', 'gather'], got 'sparse'"),
    ({"headroom": -1}, "vtoken.headroom must be an integer >= 0 (blocks), got -1"),
    ({"headroom": 2}, "vtoken.headroom reserves blocks for compaction destinations; it needs reclaim='compact'"),
    ({"score_layers": -1}, "vtoken.score_layers must be an integer >= 0 (the last N layers; 0: all), got -1"),
    ({"score_layers": 1.5}, "vtoken.score_layers must be an integer >= 0"),
])
def test_a_bad_setting_names_the_key_and_the_allowed_values(block, message):
    with pytest.raises(SettingsError) as e:
        parse(**block)
    assert message in str(e.value)


def test_the_gather_path_takes_every_reclaim_mode():
    for reclaim in ("compact", "off", "densify"):
        assert parse(read_path="gather", policy="random", budget=0.5, reclaim=reclaim).reclaim == reclaim


def test_the_block_itself_must_be_a_mapping():
    with pytest.raises(SettingsError, match=r"additional_config\['vtoken'\] must be a mapping"):
        VTokenSettings.from_additional_config({"vtoken": "strict"})
