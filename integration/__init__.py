"""vtoken.integration: what vtoken needs around the core to run on real K/V and in vLLM.

Three packages, imports flowing one way: ``device`` (the torch device layer) <- ``vllm`` (the vLLM plugin)
<- ``bench`` (the evaluation harness, which also drives the simulator in ``vtoken.core.sim``).
"""
