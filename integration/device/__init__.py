"""vtoken.integration.device: the torch device layer, engine-neutral.

``kv_layout`` (KV planes and in-block layouts, probed), ``kv_cache`` (a paged KV cache over those planes),
``copy_engine`` (relocation copies on a device stream, with completion events), ``verify`` (K/V digests,
strict and sampled verification) and ``tensor_tags`` (tags written into real tensors, for the fuzzer).
NOTE: imports flow one way: ``vtoken.core`` <- this package <- ``vtoken.integration.vllm`` <- the bench.
"""
