"""The shipped ``byte-llama`` checkpoint: trained (held-out loss far below uniform), vLLM runs it exactly
as transformers does (greedy tokens agree), and its tokenizer (ids = bytes, bos first) serves text.

The checkpoint and its training script live in ``integration/vllm/models``; the script's data and loss
functions are reused here (imported by path).
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

MODELS = Path(__file__).resolve().parents[1] / "integration" / "vllm" / "models"
CKPT = MODELS / "byte-llama"
# Measured at training time on 64 held-out windows: see byte-llama/training.json. The 16-window sample
# below measured 1.165 nats/byte (Python 3.11.7 stdlib; uniform is ln 256 = 5.545); the bound leaves room
# for another Python's stdlib.
MAX_HELDOUT_NATS = 1.8
PROMPT = list(b"def __init__(self, ")
N_TOKENS = 32


def _train_module():
    spec = importlib.util.spec_from_file_location("train_byte_llama", MODELS / "train_byte_llama.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _hf_greedy(n: int) -> list[int]:
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained(str(CKPT), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=n, min_new_tokens=n,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


def test_checkpoint_is_trained():
    t = _train_module()
    assert (CKPT / "config.json").is_file() and (CKPT / "model.safetensors").is_file()
    model = t.load_model(CKPT)
    assert model.config.vocab_size == 256 and model.config.architectures == ["LlamaForCausalLM"]
    windows = t.heldout_windows(n=16, length=t.CONTEXT, seed=t.EVAL_SEED)
    loss = t.mean_loss(model, windows)
    assert loss < MAX_HELDOUT_NATS, (loss, math.log(256))


@pytest.fixture
def preloaded():
    """The engine core's process forks from a server that imported vLLM once (``vllm_harness.preload_processes``)."""
    pytest.importorskip("vllm")
    import vllm_harness
    vllm_harness.preload_processes()


def test_vllm_greedy_matches_transformers(monkeypatch, preloaded):
    # the engine core in its own process: vLLM's KV connector is process-global, and this engine is plain vLLM
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    pytest.importorskip("vllm")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    expected = _hf_greedy(N_TOKENS)
    llm = LLM(model=str(CKPT), skip_tokenizer_init=True, dtype="float32", block_size=32, enforce_eager=True,
              max_model_len=1024, enable_prefix_caching=False, seed=0)
    params = SamplingParams(temperature=0, max_tokens=N_TOKENS, ignore_eos=True, logprobs=0, detokenize=False)
    got = list(llm.generate([TokensPrompt(prompt_token_ids=PROMPT)], params)[0].outputs[0].token_ids)
    assert got == expected, (bytes(PROMPT + got), bytes(PROMPT + expected))


# ---- the tokenizer (issue #17): text prompts and text completions -----------------------------------------
TEXTS = ["def __init__(self, ", "x = {'é': \"€\"}\n\treturn x", "  leading spaces, trailing  ", "<s></s> [bos]", ""]


def _tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(CKPT), local_files_only=True)


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_ids_are_the_utf8_bytes_after_bos_and_decode_back(text):
    tok = _tokenizer()
    ids = tok(text)["input_ids"]
    assert ids == [2] + list(text.encode("utf-8"))
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.decode(ids) == "\x02" + text  # bos is byte 2 (STX), as in training
    assert (tok.bos_token_id, tok.eos_token_id, len(tok)) == (2, 3, 256)


def test_tokenizer_decodes_every_byte_sequence_the_model_can_emit():
    tok = _tokenizer()
    assert tok.decode(list(range(32, 127))) == bytes(range(32, 127)).decode()
    assert tok.decode([0xC3, 0xA9, 0xE2, 0x82, 0xAC]) == "é€"  # multi-byte characters split over tokens
    assert tok.decode([0x68, 0x69, 0xC3]) == "hi\ufffd"  # a cut-off character: the replacement character
    assert tok.decode([2, 104, 105, 3], skip_special_tokens=True) == "hi"


def test_chat_template_renders_a_conversation_as_comments_after_bos():
    tok = _tokenizer()
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "sum a list"}]
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == tok.bos_token + "# system: be brief\n# user: sum a list\n# assistant:"  # bos: the byte-level "Ă"
    assert tok.apply_chat_template(chat[1:], tokenize=False) == tok.bos_token + "# user: sum a list\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == 2 and ids[1:] == list(text[1:].encode())  # bos once, from the template


def test_the_committed_tokenizer_files_are_what_make_byte_tokenizer_writes(tmp_path):
    spec = importlib.util.spec_from_file_location("make_byte_tokenizer", MODELS / "make_byte_tokenizer.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    written = mod.write(tmp_path)
    assert sorted(p.name for p in written) == ["chat_template.jinja", "tokenizer.json", "tokenizer_config.json"]
    for p in written:
        assert p.read_text() == (CKPT / p.name).read_text(), f"{p.name} differs: rerun make_byte_tokenizer.py"


def test_vllm_serves_text_prompts_with_the_shipped_tokenizer(monkeypatch, preloaded):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pytest.importorskip("vllm")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=str(CKPT), dtype="float32", block_size=32, enforce_eager=True, max_model_len=1024,
              enable_prefix_caching=False, seed=0)
    params = SamplingParams(temperature=0, max_tokens=N_TOKENS, ignore_eos=True)
    text = llm.generate([bytes(PROMPT).decode()], params)[0]
    ids = llm.generate([TokensPrompt(prompt_token_ids=[2] + PROMPT)], params)[0]
    assert text.prompt_token_ids == [2] + PROMPT
    assert list(text.outputs[0].token_ids) == list(ids.outputs[0].token_ids)
    assert text.outputs[0].text == bytes(text.outputs[0].token_ids).decode("utf-8", "replace")
    assert text.outputs[0].text.startswith("self)")  # what 12 minutes of training on the stdlib gives
