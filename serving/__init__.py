"""Serving: profiles, the Dockerfile, the vLLM patch series and the runtime hooks patches call."""

# The patches' switches are declared in their entries of the series; whatever reads one through
# flashnext.envs (a hook in the patched vLLM, a profile, the selftest) has imported this package.
from flashnext.serving.patches import series as _series  # noqa: F401
