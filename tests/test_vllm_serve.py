"""``vtoken serve``: vLLM's OpenAI-compatible server with vtoken on, started as the docs say, spoken to over HTTP.

Each server runs in its own process group on 127.0.0.1 and a free port, and is stopped by its process group
whatever the tests' outcome. Two configurations: compact on the gather path and (the slow sample,
``VTOKEN_SLOW_TESTS=1``) densify on the dense path, both with strict verify. Against each: concurrent text
completions and chats, streaming and not, whose greedy text must equal the in-process engine's for the same
prompts and settings; ``/metrics`` and the periodic stats log line; and bad requests (too long, malformed,
cancelled mid-stream), after which the server still serves, vtoken saw no mismatch and vLLM's block pool is
whole again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("httpx")

from vtoken.integration.bench.server import ENGINE, MODEL, ServerProcess  # noqa: E402

VTOKEN = str(Path(sys.executable).with_name("vtoken"))
CONFIGS = {
    "densify": {"policy": "streaming_llm", "budget": 0.5, "reclaim": "densify", "strict_verify": "strict"},
    "compact": {"policy": "streaming_llm", "budget": 0.5, "reclaim": "compact", "read_path": "gather",
                "strict_verify": "strict"},
}
MAX_MODEL_LEN = ENGINE["max_model_len"]

# Python the model has seen the like of (it was trained on the standard library), long enough that eviction
# leaves blocks sparse (prompts of 20-170 bytes, 32-token blocks, half the tokens kept).
# NOTE: no two prompts share their first block. On the dense path a prefix-cache hit protects the shared tokens
# from eviction (stock kernels read the shared block whole), so a request that hits another's blocks may
# evict other tokens than it would alone, by design, and its greedy text may differ from the reference's.
PROMPTS = [
    "def __init__(self, ",
    "import os\nimport sys\n\n\ndef main(argv=None):\n    \"\"\"Parse the command line and run.\"\"\"\n    ",
    "class Queue:\n    def __init__(self, maxsize=0):\n        self.maxsize = maxsize\n        self._init(maxsize)\n"
    "\n    def qsize(self):\n        ",
    "    for key, value in sorted(items.items()):\n        if value is None:\n            continue\n        ",
    "def read_lines(path, encoding='utf-8'):\n    with open(path, encoding=encoding) as f:\n        ",
    "    except (OSError, ValueError) as exc:\n        raise RuntimeError(f'cannot parse {name!r}') from exc\n",
    "if __name__ == '__main__':\n    import doctest\n    doctest.testmod()\n    ",
    "    @property\n    def name(self):\n        \"\"\"The name of the object, as given.\"\"\"\n        return ",
]
CHATS = [
    [{"role": "user", "content": "a function that returns the sum of a list"}],
    [{"role": "system", "content": "you write Python"}, {"role": "user", "content": "open a file and read it"}],
    [{"role": "user", "content": "sort a dictionary by its values"}],
    [{"role": "system", "content": "answer in one line"}, {"role": "user", "content": "reverse a string"}],
]
MAX_TOKENS = 48


# compact (the gather path, its backend) in `make test`; densify (stock kernels) in the slow sample: the server
# code is the same, the dense path is checked in process (tests/test_vllm_e2e.py)
@pytest.fixture(scope="module", params=["compact", pytest.param("densify", marks=pytest.mark.slow)])
def config(request):
    return request.param


@pytest.fixture(scope="module")
def server(config, tmp_path_factory):
    log = tmp_path_factory.mktemp(f"serve-{config}") / "server.log"
    # every request bounded (60 s); vLLM's stats line every second instead of every 10
    with ServerProcess(CONFIGS[config], log, env={"VLLM_LOG_STATS_INTERVAL": "1"}, request_timeout_s=60) as s:
        yield s


@pytest.fixture(scope="module")
def reference(config):
    """Greedy text of the in-process engine (``vllm.LLM`` in the test's own process: the same model, settings and
    engine options as the server's, without its processes)."""
    saved = {k: os.environ.get(k) for k in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE", "HF_HUB_OFFLINE")}
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
    from vllm import SamplingParams

    from vtoken.integration.bench.vllm_engine import start_llm
    try:
        llm = start_llm(model=MODEL, additional_config={"vtoken": CONFIGS[config]}, **ENGINE)
        try:
            params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
            texts = [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]
            chats = [o.outputs[0].text for o in llm.chat(CHATS, params, use_tqdm=False)]
        finally:
            llm.llm_engine.engine_core.shutdown()  # its KV connector goes now, not at a later collection
            del llm
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return {"completion": texts, "chat": chats}


def completion(s: ServerProcess, prompt: str, stream: bool, max_tokens: int = MAX_TOKENS) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return _request(s, "/v1/completions", body, stream)


def chat(s: ServerProcess, messages: list, stream: bool) -> dict:
    body = {"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
    return _request(s, "/v1/chat/completions", body, stream)


def _request(s: ServerProcess, path: str, body: dict, stream: bool) -> dict:
    """The response as one dict {text, finish_reason, usage, object}, checked for well-formedness."""
    is_chat = path.endswith("chat/completions")
    if not stream:
        r = s.client.post(path, json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["object"] == ("chat.completion" if is_chat else "text_completion") and len(out["choices"]) == 1
        c = out["choices"][0]
        text = c["message"]["content"] if is_chat else c["text"]
        assert not is_chat or c["message"]["role"] == "assistant"
        return {"text": text, "finish_reason": c["finish_reason"], "usage": out["usage"], "id": out["id"]}
    body = dict(body, stream=True, stream_options={"include_usage": True})
    pieces, finish, usage, ids = [], None, None, set()
    with s.client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    for line in lines[:-1]:
        assert line.startswith("data: "), line
        chunk = json.loads(line[len("data: "):])
        assert chunk["object"] == ("chat.completion.chunk" if is_chat else "text_completion")
        ids.add(chunk["id"])
        if chunk.get("usage"):
            assert usage is None and not chunk["choices"]  # the usage chunk comes once, last
            usage = chunk["usage"]
            continue
        (c,) = chunk["choices"]
        pieces.append((c["delta"].get("content") or "") if is_chat else c["text"])
        if c.get("finish_reason"):
            assert finish is None
            finish = c["finish_reason"]
    assert len(ids) == 1 and usage is not None and finish is not None
    return {"text": "".join(pieces), "finish_reason": finish, "usage": usage, "id": ids.pop()}


def test_concurrent_completions_and_chats_equal_the_in_process_engine(server, reference):
    # half of each kind streamed, every prompt once (NOTE at PROMPTS)
    jobs = [(completion, p, i % 2 == 1) for i, p in enumerate(PROMPTS)] + \
           [(chat, m, i % 2 == 1) for i, m in enumerate(CHATS)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        outs = list(pool.map(lambda job: job[0](server, job[1], job[2]), jobs))
    assert len({o["id"] for o in outs}) == len(jobs)  # one request each
    for (fn, arg, st), out in zip(jobs, outs):
        kind = fn.__name__
        want = reference[kind][(PROMPTS if kind == "completion" else CHATS).index(arg)]
        where = f"{kind} {'streamed' if st else 'whole'} {arg!r:.40}"
        assert out["text"] == want, where
        u = out["usage"]
        assert u["completion_tokens"] <= MAX_TOKENS and u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
        assert out["finish_reason"] == ("length" if u["completion_tokens"] == MAX_TOKENS else "stop"), where
        if kind == "completion":
            assert u["prompt_tokens"] == 1 + len(arg.encode()), where  # bos + the bytes
    # greedy fp32 in the server is deterministic across runs and across streaming
    first = completion(server, PROMPTS[0], False, max_tokens=24)
    assert (first["usage"]["prompt_tokens"], first["usage"]["completion_tokens"]) == (20, 24)
    assert first["text"].startswith("self")  # a trained model's guess
    assert completion(server, PROMPTS[0], True, max_tokens=24)["text"] == first["text"]
    assert server.alive()


def test_metrics_move_and_the_stats_log_line_carries_vtoken(server, config):
    completion(server, PROMPTS[2], False)  # whatever ran before, this request evicts and relocates
    m = server.metrics()
    assert m["vllm:vtoken_tokens_evicted_total"] > 0
    assert m["vllm:vtoken_plans_committed_total"] > 0 and m["vllm:vtoken_tokens_moved_total"] > 0
    assert m["vllm:vtoken_copies_verified_total"] > 0 and m["vllm:vtoken_write_slots_audited_total"] > 0
    assert m["vllm:vtoken_mismatches_total"] == 0 and m["vllm:vtoken_quarantined_total"] == 0
    if config == "compact":
        assert m["vllm:vtoken_blocks_released_total"] > 0
    deadline = time.monotonic() + 10  # the line is logged every VLLM_LOG_STATS_INTERVAL (1 s) while busy
    while not (lines := [x for x in server.tail(200_000).splitlines() if "KV Transfer metrics:" in x]):
        assert time.monotonic() < deadline, server.tail()
        time.sleep(0.5)
    assert "tokens_evicted=" in lines[-1] or "'tokens_evicted'" in lines[-1], lines[-1]


def test_bad_requests_leave_the_server_up_consistent_and_the_pool_whole(server):
    too_long = server.client.post("/v1/completions", json={"model": MODEL, "prompt": "x" * MAX_MODEL_LEN,
                                                          "max_tokens": 8})
    assert too_long.status_code == 400 and "maximum context length" in too_long.text, too_long.text
    malformed = server.client.post("/v1/completions", content=b'{"model": "x", "prompt": ',
                                   headers={"content-type": "application/json"})
    assert malformed.status_code == 400, malformed.text
    wrong_type = server.client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": "many"})
    assert wrong_type.status_code == 400, wrong_type.text
    # cancelled mid-stream: read a few chunks of a long generation, then hang up
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 600, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with server.client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        got = 0
        for line in r.iter_lines():
            got += line.startswith("data: ")
            if got == 40:  # past the prompt, and some tokens evicted
                break
    # the server notices the hang-up, aborts the request, and frees its blocks
    deadline = time.monotonic() + 30
    while (m := server.metrics())["vllm:num_requests_running"] or m["vllm:num_requests_waiting"]:
        assert time.monotonic() < deadline, "the cancelled request is still running"
        time.sleep(0.5)
    after = completion(server, PROMPTS[0], False, max_tokens=24)  # still serving, same greedy text
    assert after["usage"]["completion_tokens"] == 24 and after["text"].startswith("self")
    m = server.metrics()
    assert m["vllm:kv_cache_usage_perc"] == 0.0, m  # every block back in the pool
    assert m["vllm:vtoken_retained_blocks"] == 0 and m["vllm:vtoken_ideal_blocks"] == 0, m
    assert m["vllm:vtoken_mismatches_total"] == 0 and m["vllm:vtoken_quarantined_total"] == 0
    assert server.alive() and server.client.get("/health").status_code == 200


def test_the_load_generator_measures_this_server(server):
    """``vtoken bench vllm --questions q9``'s closed-loop clients, for one short window against this server."""
    from vtoken.integration.bench import q9_serving_load as q9
    prompts = [list(p.encode()) for p in PROMPTS[:3]]  # token ids; the generator puts bos in front
    m = q9.measure_window(server.base, prompts, clients=3, seconds=1.0, max_tokens=16)
    assert m["errors"] == [] and m["requests"] >= 3 and m["tokens"] == 16 * m["requests"]
    assert m["throughput_tok_s"] == pytest.approx(m["tokens"] / m["wall_s"])
    assert 0 < m["ttft_p50_ms"] <= m["ttft_p95_ms"] and 0 <= m["itl_p50_ms"] <= m["itl_p95_ms"]
    assert 0 < m["tpot_p50_ms"] <= m["tpot_p95_ms"] < 1000 * m["wall_s"]


def test_async_scheduling_on_the_cpu_build_is_reported_not_silently_dropped():
    out = subprocess.run([VTOKEN, "serve", "--async-scheduling", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "usage: vllm serve [model_tag] [options]" in out.stdout  # vLLM's own parser
    assert "vtoken serve: --async-scheduling is ignored on vLLM's CPU build" in out.stderr
