"""The lab: benchmarks, results-table drivers, the ablation harness and the GPU suite, with
the helpers that serve only them. Run from a checkout's root as `python -m tools.<name>`
(each file opens with its command); they import `decal_jax` and this folder's helpers, never
another tool's internals. The wheel does not carry them."""
