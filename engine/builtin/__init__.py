"""The built-in target/draft checkpoints, their synthetic task and canary text sets.

`engine.builtin.task` is pure Python (no torch): probes and the demo import it to
generate in_domain and shifted traffic. The checkpoints live in `target/` and `draft/`.
"""
