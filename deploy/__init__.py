"""Typed config, the app builder, YAML, autoscaling policies, control-plane store, the CLI."""
