"""vtoken.integration: the torch device layer and the vLLM plugin. Filled by the device and vLLM issues."""
