"""Autoencoding + text continuation tasks and their 1:1 mixtures (CCProxy's training recipe
and DeCAL's "autoencode" ablation), on the built-in corpus and on C4.

| name | source |
|---|---|
| decal_builtin_autoencode, decal_builtin_continuation | built-in corpus (no download) |
| decal_builtin_autoencode_continuation | the two above, 1:1 |
| decal_c4_autoencode, decal_c4_continuation | TFDS c4/en:3.1.0, T5 vocabulary |
| decal_c4_autoencode_continuation | the two above, 1:1 |

Autoencoding targets are the whole input, so these tasks want TASK_FEATURE_LENGTHS with
'targets' >= 'inputs' (the trainer refuses shorter targets).
"""
import functools

import seqio

from decal_jax.data import autoencoding, corpus, vocabularies
from decal_jax.tasks.span_corruption_tasks import C4_TFDS_NAME, PreparedTfdsSource

OBJECTIVES = {"autoencode": autoencoding.autoencode, "continuation": autoencoding.continuation}


def _register(name: str, source: seqio.DataSource, vocabulary: seqio.Vocabulary,
              objective) -> seqio.Task:
  if name in seqio.TaskRegistry.names():
    seqio.TaskRegistry.remove(name)
  features = {k: seqio.Feature(vocabulary, add_eos=True, required=True)
              for k in ("inputs", "targets")}
  return seqio.TaskRegistry.add(
      name, source=source, output_features=features, metric_fns=[],
      preprocessors=[functools.partial(seqio.preprocessors.rekey, key_map={"targets": "text"}),
                     seqio.preprocessors.tokenize, objective,
                     seqio.preprocessors.append_eos_after_trim])


def register_mixture(prefix: str, source_fn, vocabulary: seqio.Vocabulary) -> seqio.Mixture:
  """`<prefix>_autoencode`, `<prefix>_continuation` and their 1:1 mixture
  `<prefix>_autoencode_continuation`."""
  names = [f"{prefix}_{objective}" for objective in OBJECTIVES]
  for name, objective in zip(names, OBJECTIVES.values()):
    _register(name, source_fn(), vocabulary, objective)
  mixture = f"{prefix}_autoencode_continuation"
  if mixture in seqio.MixtureRegistry.names():
    seqio.MixtureRegistry.remove(mixture)
  return seqio.MixtureRegistry.add(mixture, [(n, 1.0) for n in names])


register_mixture("decal_builtin", corpus.data_source, vocabularies.builtin_vocabulary())
register_mixture("decal_c4", lambda: PreparedTfdsSource(C4_TFDS_NAME),
                 vocabularies.t5_vocabulary(check=False))
