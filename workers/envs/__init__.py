"""Environments the rollout worker plays and the reward worker scores (``calc``: the calculator task)."""
