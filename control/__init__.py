"""The Redis control plane: key layout, records, the async store and a private local server."""
