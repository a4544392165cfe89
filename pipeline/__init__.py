"""Libra control plane: streams, messages, config, feeder, run orchestration and the CLI."""
