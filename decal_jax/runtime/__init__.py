"""The runtime of a run: the training loop and its step and state, checkpoints, run control
(locks, resilience, the vocabulary record), optimizers, the evaluation and inference loops
(retrieval's included), the entry points' command line, console and gin handling."""
