"""seqio tasks of decal_jax (importing `decal_jax.tasks` registers them).

| task | source | vocabulary |
|---|---|---|
| decal_builtin_span_corruption | the built-in corpus (Python's docs; no download) | built-in SentencePiece |
| decal_c4_span_corruption | TFDS `c4/en:3.1.0` | T5 SentencePiece |
"""
from decal_jax.tasks import span_corruption_tasks  # noqa: F401  (registers the tasks)
