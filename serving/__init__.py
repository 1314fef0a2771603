"""Serving: profiles, the Dockerfile, the vLLM patch series and the runtime hooks patches call."""
