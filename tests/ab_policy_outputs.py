"""The four original policies' outputs on real vLLM, for comparing two trees (issue #23: unchanged, bit for bit).

    PYTHONPATH=DIR_WITH_vtoken_LINK python tests/ab_policy_outputs.py TREE OUT.json

H2O, Scissorhands, StreamingLLM and Random at budget 0.5, on the gather path (compact) and the dense path (densify),
under strict verify, through TREE's test harness (3 prompts, 40 tokens each); writes every pass (token ids, logprobs,
finish reason, cached tokens) as JSON. Run it in two trees and compare the files (docs/results.md, "Policy zoo").
"""
import json
import sys

if __name__ == "__main__":
    sys.path.insert(0, sys.argv[1] + "/tests")
    import vllm_harness as H
    out = {}
    for policy in ("h2o", "scissorhands", "streaming_llm", "random"):
        for path, reclaim in (("gather", "compact"), ("dense", "densify")):
            cfg = {"policy": policy, "budget": 0.5, "read_path": path, "reclaim": reclaim, "seed": 3,
                   "strict_verify": "strict"}
            out[f"{policy}/{path}"] = H.run(cfg, max_tokens=40)["passes"]
    json.dump(out, open(sys.argv[2], "w"))
