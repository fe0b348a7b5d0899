"""``flare bench``: a serving benchmark against any OpenAI-compatible server (docs/cli.md).

datasets -> arrivals -> client (one timed stream) -> runner (the run) ->
summary (vLLM's metric definitions from metrics) -> report (table, plot);
server_metrics adds Flare's own counters when the server exposes them.
"""
