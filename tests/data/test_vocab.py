"""The built-in SentencePiece vocabulary: training, special ids, round trips, the cache."""
import hashlib
import json
import os
import pathlib
import threading
import time
import unicodedata

import pytest
import sentencepiece

from decal_jax import settings
from decal_jax.data import corpus, vocabularies

import paths

SMALL = 1000  # pieces: quick to train, still covers the corpus


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
  """A fresh DECAL_CACHE_DIR holding one trained SMALL vocabulary for this module."""
  with pytest.MonkeyPatch.context() as mp:
    path = tmp_path_factory.mktemp("decal_cache")
    mp.setenv("DECAL_CACHE_DIR", str(path))
    vocab = vocabularies.builtin_vocabulary(SMALL)
    assert not list(path.glob("*.model")), "creating the vocabulary must not train it"
    assert vocab.vocab_size > 0  # first use: trains
    yield path, vocab


def _tiny_corpus(monkeypatch, marker):
  """Replaces the corpus by 150 training documents (+ a marker) so training is instant."""
  docs = corpus.documents()
  small = {"train": docs["train"][:150] + [marker], "validation": docs["validation"][:5]}
  monkeypatch.setattr(corpus, "documents", lambda: small)


def test_trains_once_into_the_cache_dir_keyed_by_size_and_corpus(cache):
  path, vocab = cache
  files = list(path.glob("*.model"))
  train_text = "\n".join(corpus.documents()["train"]).encode("utf-8")
  expected = f"builtin_spm_{SMALL}_bytes_{hashlib.sha256(train_text).hexdigest()[:12]}.model"
  assert [f.name for f in files] == [expected]
  assert vocab.sentencepiece_model_file == str(files[0])
  assert not list(path.glob("*.tmp*"))  # the atomic write left no temp file


def test_special_ids_follow_t5(cache):
  _, vocab = cache
  sp = sentencepiece.SentencePieceProcessor(model_file=vocab.sentencepiece_model_file)
  assert (sp.pad_id(), sp.eos_id(), sp.unk_id(), sp.bos_id()) == (0, 1, 2, -1)
  assert [sp.id_to_piece(i) for i in range(3)] == ["<pad>", "</s>", "<unk>"]
  assert 500 < sp.get_piece_size() <= SMALL
  assert vocab.vocab_size == sp.get_piece_size() + 100  # 100 sentinels on top
  assert (vocab.pad_id, vocab.eos_id, vocab.unk_id) == (0, 1, 2)


def test_round_trips_held_out_text(cache):
  """decode(encode(s)) == s up to SentencePiece's NFKC normalisation (e.g. '…' -> '...')."""
  _, vocab = cache
  held_out = corpus.documents()["validation"]
  for text in held_out:
    ids = vocab.encode(text)
    assert 2 not in ids, "no unknown pieces (byte fallback)"
    assert vocab.decode(ids) == unicodedata.normalize("NFKC", text)
  # Real subword pieces: fewer pieces than characters.
  assert sum(len(vocab.encode(t)) for t in held_out) < 0.4 * sum(map(len, held_out))


def test_second_use_reuses_the_cached_file(cache, monkeypatch):
  path, _ = cache
  model = next(path.glob("*.model"))
  mtime = model.stat().st_mtime_ns

  def must_not_train(*args, **kwargs):
    raise AssertionError("retrained although the cache holds the model")

  monkeypatch.setattr(vocabularies, "train_sentencepiece", must_not_train)
  again = vocabularies.builtin_vocabulary(SMALL)
  assert again.vocab_size > 100 and again.sentencepiece_model_file == str(model)
  assert model.stat().st_mtime_ns == mtime


def test_each_recipe_has_its_own_file_and_chars_keeps_the_name_before_byte_fallback(
    tmp_path, monkeypatch):
  """A changed recipe is a new file; the first recipe ('chars', no byte fallback) keeps the
  name its files had, so a cache built before byte fallback still serves old checkpoints."""
  monkeypatch.setenv("DECAL_CACHE_DIR", str(tmp_path))
  _tiny_corpus(monkeypatch, "marker document for the recipe test")
  train_text = "\n".join(corpus.documents()["train"]).encode("utf-8")
  fingerprint = hashlib.sha256(train_text).hexdigest()[:12]
  chars = pathlib.Path(vocabularies.builtin_vocabulary_path(600, recipe="chars"))
  assert chars.name == f"builtin_spm_600_{fingerprint}.model"
  monkeypatch.setenv("DECAL_BUILTIN_VOCAB", "chars")
  assert vocabularies.builtin_vocabulary(600).sentencepiece_model_file == str(chars)
  monkeypatch.delenv("DECAL_BUILTIN_VOCAB")
  default = pathlib.Path(vocabularies.builtin_vocabulary_path(600))
  assert default.name == f"builtin_spm_600_bytes_{fingerprint}.model" != chars.name
  pieces = {name: sentencepiece.SentencePieceProcessor(model_file=str(path))
            for name, path in (("chars", chars), ("bytes", default))}
  assert pieces["bytes"].piece_to_id("<0xC2>") != 2 and pieces["chars"].piece_to_id("<0xC2>") == 2
  assert "byte_fallback" not in chars.read_bytes().decode("latin1")  # as trained before it


def test_an_unknown_recipe_names_the_choices(monkeypatch):
  monkeypatch.setenv("DECAL_BUILTIN_VOCAB", "bites")
  with pytest.raises(settings.SettingError,
                     match=r"DECAL_BUILTIN_VOCAB='bites' is not allowed.*one of bytes, chars"):
    vocabularies.builtin_vocabulary()
  with pytest.raises(ValueError, match=r"recipe 'bites'; choose one of \['bytes', 'chars'\]"):
    vocabularies.builtin_vocabulary(recipe="bites")


def test_a_different_corpus_builds_a_different_file(tmp_path, monkeypatch):
  monkeypatch.setenv("DECAL_CACHE_DIR", str(tmp_path))
  _tiny_corpus(monkeypatch, "first marker document for the cache key test")
  first = vocabularies.builtin_vocabulary_path(600)
  _tiny_corpus(monkeypatch, "second marker document for the cache key test")
  second = vocabularies.builtin_vocabulary_path(600)
  assert first != second
  assert {p.name for p in tmp_path.glob("*.model")} == {pathlib.Path(first).name,
                                                        pathlib.Path(second).name}


def test_concurrent_first_uses_train_once(tmp_path, monkeypatch):
  """Two workers that both find no cached model: the lock lets exactly one train."""
  monkeypatch.setenv("DECAL_CACHE_DIR", str(tmp_path))
  _tiny_corpus(monkeypatch, "marker document for the lock test")
  calls, real_train = [], vocabularies.train_sentencepiece

  def slow_train(*args, **kwargs):
    calls.append(1)
    time.sleep(0.3)  # long enough for the other worker to reach the lock
    return real_train(*args, **kwargs)

  monkeypatch.setattr(vocabularies, "train_sentencepiece", slow_train)
  paths = []
  workers = [threading.Thread(
      target=lambda: paths.append(vocabularies.builtin_vocabulary_path(600))) for _ in range(2)]
  for w in workers:
    w.start()
  for w in workers:
    w.join()
  assert len(calls) == 1 and len(set(paths)) == 1 and pathlib.Path(paths[0]).exists()


def test_unwritable_cache_dir_names_the_fix(tmp_path, monkeypatch):
  blocker = tmp_path / "a_file"
  blocker.write_text("not a directory")
  monkeypatch.setenv("DECAL_CACHE_DIR", str(blocker / "cache"))
  _tiny_corpus(monkeypatch, "marker document for the error test")
  with pytest.raises(OSError, match="DECAL_CACHE_DIR"):
    vocabularies.builtin_vocabulary_path(600)


def _load_make_vocab():
  import importlib
  return importlib.import_module("decal_jax.commands.make_vocab")


def test_make_vocab_trains_from_a_jsonl_file(tmp_path, capsys):
  docs = corpus.documents()["train"][:200]
  source = tmp_path / "docs.jsonl"
  source.write_text("\n".join(json.dumps({"body": d}) for d in docs))
  out = tmp_path / "v.model"
  _load_make_vocab().main(["--input", str(source), "--field", "body", "--vocab_size", "600",
                           "--output", str(out)])
  printed = capsys.readouterr().out
  assert "Training on 200 lines" in printed and str(out) in printed and "example" in printed
  import seqio
  vocab = seqio.SentencePieceVocabulary(str(out))
  assert (vocab.tokenizer.pad_id(), vocab.tokenizer.eos_id(), vocab.tokenizer.unk_id()) == (0, 1, 2)
  assert vocab.decode(vocab.encode(docs[0])) == unicodedata.normalize("NFKC", docs[0])


def test_make_vocab_builds_the_builtin_vocabulary_into_the_cache(cache, capsys):
  path, _ = cache
  _load_make_vocab().main(["--vocab_size", str(SMALL)])
  printed = capsys.readouterr().out
  assert str(next(path.glob("*.model"))) in printed


def _same_ids_as_seqio(plain, seqio_vocab, texts):
  assert (plain.vocab_size, plain.extra_ids) == (seqio_vocab.vocab_size, seqio_vocab.extra_ids)
  for text in texts:
    ids = plain.encode(text)
    assert ids == list(seqio_vocab.encode(text)), text[:60]
    for tail in ([plain.vocab_size - 1, 5], [1, 7, 9], [plain.vocab_size + 3]):
      assert plain.decode(ids + tail) == seqio_vocab.decode(ids + tail)  # sentinel, eos, past


SENTINEL_TEXTS = ["Fill <extra_id_0> and <extra_id_99> here.", "<extra_id_7>", "plain words"]


def test_the_plain_builtin_vocabulary_gives_seqios_ids_without_seqio(cache):
  """builtin_plain_vocabulary (SentencePiece alone, for GPU images without seqio) against
  seqio's SentencePieceVocabulary over the same file: every corpus document and literal
  sentinel strings tokenize to the same ids, and the sizes agree."""
  _, vocab = cache
  plain = vocabularies.builtin_plain_vocabulary(SMALL)
  assert plain.path == vocab.sentencepiece_model_file
  docs = corpus.documents()
  _same_ids_as_seqio(plain, vocab, docs["train"][::7] + docs["validation"] + SENTINEL_TEXTS)
  assert plain.encode("<extra_id_0>")[-1] == plain.vocab_size - 1  # seqio's order: 0 on top


def test_the_plain_vocabulary_gives_seqios_ids_on_the_t5_vocabulary():
  data = pathlib.Path(os.environ.get("DECAL_DATA_DIR", paths.REPO.parent / "shared" / "data"))
  spiece = data / "vocab" / "t5_spiece.model"
  if not spiece.exists():
    pytest.skip(f"the T5 vocabulary is not at {spiece} (../shared/data)")
  import seqio
  plain = vocabularies.t5_plain_vocabulary(str(spiece))
  assert plain.vocab_size == 32_100
  with pytest.raises(ValueError, match="DECAL_T5_VOCAB"):
    vocabularies.t5_plain_vocabulary("gs://t5-data/vocabs/sentencepiece.model")
  _same_ids_as_seqio(plain, seqio.SentencePieceVocabulary(str(spiece), extra_ids=100),
                     corpus.documents()["validation"][:40] + SENTINEL_TEXTS + ["é 中 $ £ ж"])
