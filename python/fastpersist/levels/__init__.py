"""Checkpoint levels (docs/architecture.md, "Checkpoint levels"): where each rank's share of a step lives beyond its own
node (partner replicas), and restoring from the fastest level that still holds a verified copy."""
