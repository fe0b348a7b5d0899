"""ignition debug-serve --direct: a diagnostic server with its own small scheduler (docs/debug-serve.md)."""
