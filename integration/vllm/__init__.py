"""vtoken inside vLLM 0.32: settings, the start-up compatibility check, and (next) the plugin itself."""
