"""seqio tasks of decal_jax (importing `decal_jax.tasks` registers them).

| task | source | vocabulary |
|---|---|---|
| decal_builtin_span_corruption | the built-in corpus (Python's docs; no download) | built-in SentencePiece |
| decal_c4_span_corruption | TFDS `c4/en:3.1.0` | T5 SentencePiece |
| decal_cnn_dailymail, decal_arxiv, decal_pubmed, decal_mediasum | TFDS or local JSONL | the model's |
| decal_squad, decal_triviaqa, decal_hotpotqa | TFDS or local JSONL (HotpotQA: local only) | the model's |
| decal_builtin_qa | the built-in corpus: paragraph -> its section title | the model's |
| decal_{builtin,c4}_autoencode, _continuation, their `_marked` forms (targets open with 'reconstruct:' / 'continue:'), _autoencode_continuation (the marked ones 1:1) | built-in corpus / TFDS c4 | built-in / the model's |
| decal_text_autoencode (BLEU), or `register_text_autoencode_task(...)` | your JSONL text | the model's |
| decal_known_{uniform,repeat}_k{k}_n{n}: n symbols from k one-token words, uniform or with the first half repeated (information known exactly; `known_content_tasks.py`) | generated | built-in |
| decal_builtin_lm, decal_c4_lm, decal_text_lm, or `register_text_lm_task(...)` (perplexity) | built-in corpus / TFDS c4 / your text files | built-in / the model's |
| decal_{builtin,c4,text}_sentence_lm, or `register_text_sentence_lm_task(...)` (GPTHF: end-of-sentence tokens) | built-in corpus / TFDS c4 / your text files | built-in / the model's |
| decal_msmarco_retrieval (pairs), decal_msmarco_retrieval_negatives (triples), decal_beir_builtin, decal_beir_<name> or `register_beir_task(...)` (dual encoder: inputs / targets / negative_targets) | MS MARCO files or TFDS beir/msmarco / the built-in corpus / your BEIR folders | the model's |

Downstream tasks: see `downstream_tasks.py` for the local-file layout and field names.
"""
from decal_jax.tasks import autoencoding_tasks  # noqa: F401  (registers the tasks)
from decal_jax.tasks import downstream_tasks  # noqa: F401  (registers the tasks)
from decal_jax.tasks import known_content_tasks  # noqa: F401  (registers the tasks)
from decal_jax.tasks import lm_tasks  # noqa: F401  (registers the tasks)
from decal_jax.tasks import retrieval_tasks  # noqa: F401  (registers the tasks)
from decal_jax.tasks import sentence_lm_tasks  # noqa: F401  (registers the tasks)
from decal_jax.tasks import span_corruption_tasks  # noqa: F401  (registers the tasks)
from decal_jax.tasks import squid_tasks  # noqa: F401  (registers the tasks)
