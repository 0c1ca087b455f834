"""GPTHF's paper sizes against their GPT baselines and its run files."""
import pathlib

import gin
import pytest

from gin_config_helpers import REPO, _build_model, _decoder_only_param_count, _parse


# --------------------------------------------------------------------------- GPTHF

# 24 blocks x (4 * 1024^2 attention + 3 * 1024 * 4096 SwiGLU + 2 * 1024 norms) + 32,128 x 1024
# tied embedding + 1024 final norm; 12 blocks at width 768 likewise (hand-worked).
GPTHF_SIZES = {("models/gpthf_16_8.gin", "models/gpt_baseline_24.gin"): (16, 24, 435_602_432),
               ("models/gpthf_8_4.gin", "models/gpt_baseline_12.gin"): (8, 12, 137_939_712)}


@pytest.mark.parametrize("files", sorted(GPTHF_SIZES))
def test_gpthf_paper_sizes_match_their_gpt_baselines(files, monkeypatch):
  """GPTHF-16-8 / -8-4 have exactly the parameters of Baseline-24 / -12 (one stack, split
  into word- and sentence-level blocks); ends of sentences are the T5 top sentinel."""
  import os
  data = pathlib.Path(os.environ.get("DECAL_DATA_DIR", REPO.parent / "shared" / "data"))
  t5_vocab = data / "vocab" / "t5_spiece.model"
  if not t5_vocab.exists():
    pytest.skip(f"{t5_vocab} not found: set DECAL_DATA_DIR to the shared data folder")
  monkeypatch.setenv("DECAL_T5_VOCAB", str(t5_vocab))  # the end id comes from its size
  encoder, layers, count = GPTHF_SIZES[files]
  _parse(files[0])
  model = _build_model()
  cfg = model.module.config
  assert type(model.module).__name__ == "Gpthf"
  assert (cfg.encoder_layers, cfg.decoder.num_layers, cfg.sentence_end_id) == (encoder, layers,
                                                                                32099)
  assert _decoder_only_param_count(model) == count
  gin.clear_config()
  _parse(files[1])
  baseline = _build_model()
  assert type(baseline.module).__name__ == "Decoder"
  assert _decoder_only_param_count(baseline) == count
  gin.clear_config()


def test_gpthf_tiny_and_its_run_file():
  _parse("models/gpthf_tiny.gin", "runs/gpthf_lm_builtin.gin",
         bindings=["MODEL_DIR = '/tmp/unused'"])
  model = _build_model()
  cfg = model.module.config
  assert (cfg.encoder_layers, cfg.decoder.num_layers, cfg.decoder.emb_dim) == (4, 6, 128)
  assert cfg.sentence_end_id == model.output_vocabulary.vocab_size - 1
  assert gin.query_parameter("%MIXTURE_OR_TASK_NAME") == "decal_builtin_sentence_lm"
  assert gin.query_parameter("%MAX_SENTENCE_LENGTH") == cfg.max_sentence_length == 64
  gin.clear_config()


# 6 blocks x (q, o 128 x 128 + k, v 128 x 64 + SwiGLU 3 x 128 x 384 + 2 norms of 128) +
# embedding and logits 2 x 4,224 x 128 + final norm 128 (hand-worked; untied).
TINY_6_BLOCKS = (6 * (2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 384 + 2 * 128)
                 + 2 * 4224 * 128 + 128)


def test_gpthf_real_text_run_file_reads_each_token_once(monkeypatch):
  """runs/gpthf_lm_real.gin (docs/results/gpthf_lm_real.md): the real-text task with its own
  vocabulary; GPTHF and the 6-block GPT have the same parameters (2,262,656); the run reads
  fewer tokens than the training split holds, counted here by tokenizing it."""
  import os
  from decal_jax.data import real_text, real_text_files, sentences
  data = pathlib.Path(os.environ.get("DECAL_DATA_DIR", REPO.parent / "shared" / "data"))
  if not (data / real_text_files.FILES["c4"]).exists():
    pytest.skip(f"{data / 'text'} not found: set DECAL_DATA_DIR to the shared data folder")
  monkeypatch.setenv("DECAL_DATA_DIR", str(data))
  _parse("models/gpthf_tiny.gin", "runs/gpthf_lm_real.gin",
         bindings=["MODEL_DIR = '/tmp/unused'"])
  model = _build_model()
  cfg, vocab = model.module.config, model.output_vocabulary
  assert isinstance(vocab, real_text.RealTextVocabulary)
  assert gin.query_parameter("%MIXTURE_OR_TASK_NAME") == "decal_real_text_sentence_lm"
  assert cfg.sentence_end_id == vocab.vocab_size - 1 < cfg.decoder.vocab_size == 4224
  assert (cfg.encoder_layers, cfg.decoder.num_layers) == (4, 6)
  assert _decoder_only_param_count(model) == TINY_6_BLOCKS
  read = (gin.query_parameter("%TRAIN_STEPS") * gin.query_parameter("%BATCH_SIZE") *
          gin.query_parameter("%TASK_FEATURE_LENGTHS")["targets"])
  end = vocab.vocab_size - 1
  held = sum(len(sentences.encode_sentences(d, vocab, end, cfg.max_sentence_length))
             for d in real_text_files.documents()["train"])
  assert read < held
  gin.clear_config()
  _parse("models/decoder_tiny.gin", "runs/gpthf_lm_real.gin",
         bindings=["MODEL_DIR = '/tmp/unused'", "decoder.DecoderConfig.num_layers = 6"])
  gpt = _build_model()
  assert type(gpt.module).__name__ == "Decoder" and gpt.output_vocabulary == vocab
  assert _decoder_only_param_count(gpt) == TINY_6_BLOCKS
  gin.clear_config()

