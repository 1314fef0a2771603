"""Runtime hooks that the vLLM patch series calls: the logic lives here, where tests reach it."""
