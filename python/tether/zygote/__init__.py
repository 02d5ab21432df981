"""The zygote: a warm Python process that has the heavy imports done once and forks a
child per request (``client``: the parent's handle on it; ``server``: the zygote process
itself)."""
