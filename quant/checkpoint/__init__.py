"""Checkpoints on disk: reading a snapshot, and the rules every writer follows (confined paths,
atomic outputs, locks, strict JSON)."""
