"""zero_id_to: our pipelines pad with id 0, which is '!' in byte-level BPE; the remap round
trips text with bangs and the imported model keeps the checkpoint's logits.

Against transformers' PyTorch models; skipped without the `[test-hf]` extra
(hf_import_helpers.py).
"""
import copy
import json
import re

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decal_jax.interop import hf_import
from decal_jax.runtime import checkpoints
from decal_jax.data import hf_vocabularies
from decal_jax.networks.decoder import Decoder
from hf_import_helpers import (
    transformers, safetensors_torch, REPO, TINY, TEXTS, SQUID_SMALL, SQUID_LARGE, _saved_random,
    _torch_logits, _our_logits, _write_tokenizer, _tool_module)


# ------------------------------------------------------------------------------ id 0 remap
# Our pipelines pad with id 0, which is '!' in byte-level BPE: zero_id_to moves it.
BANG_TEXTS = ["Hello!", "!!! wow!", "Hello world! How are you? Fine, thanks."]


def _free_id(tokenizer, past=7):
  """An id the tokenizer never produces: past its last one (added tokens included)."""
  return tokenizer.get_vocab_size(with_added_tokens=True) + past


def _with_zero_as(ids, zero_id_to):
  return [zero_id_to if i == 0 else i for i in ids]


def test_zero_id_to_round_trips_a_standalone_bang(hf_tokenizer):
  tokenizer, path = hf_tokenizer
  free = _free_id(tokenizer)
  vocab = hf_vocabularies.HfTokenizerVocabulary(str(path), zero_id_to=free)
  assert vocab.zero_id_to == free and vocab.vocab_size == free + 1
  eos = tokenizer.token_to_id("<|endoftext|>")
  assert vocab.eos_id == eos  # other ids keep the tokenizer's values
  hello = tokenizer.encode("Hello!", add_special_tokens=False).ids
  assert hello[-1] == 0 and tokenizer.id_to_token(0) == "!"  # '!' on its own is id 0
  for text in BANG_TEXTS + TEXTS:
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    ours = list(vocab.encode(text))
    assert 0 not in ours and ours == _with_zero_as(ids, free)
    assert vocab.decode(ours) == text
    # Id 0 is padding / BOS now: skipped before, between (never produced) and after EOS.
    assert vocab.decode([0, 0] + ours + [eos, 0, 0]) == text
  assert list(vocab.encode("Hello!"))[-1] == free and vocab.decode([free]) == "!"
  # The vocabulary without the remap is another vocabulary (gin / seqio compare them).
  plain = hf_vocabularies.HfTokenizerVocabulary(str(path))
  assert vocab != plain and plain.zero_id_to is None and list(plain.encode("Hello!")) == hello
  copied = copy.deepcopy(vocab)
  assert copied == vocab and copied.zero_id_to == free


def test_zero_id_to_round_trips_in_tensorflow(hf_tokenizer):
  import seqio
  import tensorflow as tf
  tokenizer, path = hf_tokenizer
  free = _free_id(tokenizer)
  vocab = hf_vocabularies.HfTokenizerVocabulary(str(path), zero_id_to=free)
  want = [_with_zero_as(tokenizer.encode(t, add_special_tokens=False).ids, free)
          for t in BANG_TEXTS]
  assert all(0 not in ids and free in ids for ids in want)
  assert vocab.encode_tf(tf.constant("Hello!")).numpy().tolist() == want[0]
  assert vocab.encode_tf(tf.constant(BANG_TEXTS)).to_list() == want
  features = {"targets": seqio.Feature(vocab, add_eos=True)}
  ds = tf.data.Dataset.from_tensor_slices({"targets": BANG_TEXTS})
  ds = seqio.preprocessors.append_eos(seqio.preprocessors.tokenize(ds, features), features)
  assert [list(ex["targets"]) for ex in ds.as_numpy_iterator()] == \
      [ids + [vocab.eos_id] for ids in want]
  # [b, t] as the models emit it: BOS 0 first, EOS, then 0-padding.
  eos, width = vocab.eos_id, max(len(ids) for ids in want) + 3
  dense = np.zeros((len(want), width), np.int32)
  for row, ids in zip(dense, want):
    row[1:len(ids) + 2] = ids + [eos]
  texts = [t.encode() for t in BANG_TEXTS]
  assert vocab.decode_tf(tf.constant(dense)).numpy().tolist() == texts
  assert vocab.decode_tf(tf.ragged.constant(want)).numpy().tolist() == texts
  assert vocab.decode_tf(tf.constant(want[0])).numpy() == b"Hello!"


def test_zero_id_to_refuses_an_id_the_tokenizer_uses(hf_tokenizer):
  tokenizer, path = hf_tokenizer
  used = tokenizer.token_to_id("<|endoftext|>")
  for zero_id_to in (5, used):
    vocab = hf_vocabularies.HfTokenizerVocabulary(str(path), zero_id_to=zero_id_to)  # lazy ...
    with pytest.raises(ValueError, match=rf"zero_id_to={zero_id_to} is the id of the token "
                                         rf"'{re.escape(tokenizer.id_to_token(zero_id_to))}'"):
      vocab.encode("Hello!")  # ... refused on first use, before anything is encoded
  for bad in (0, -3, True, "151935", 2.5):
    with pytest.raises(ValueError, match="zero_id_to"):
      hf_vocabularies.HfTokenizerVocabulary(str(path), zero_id_to=bad)


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def qwen2_over_tokenizer(request, hf_tokenizer, tmp_path_factory):
  """A tiny Qwen2 whose table covers the tiny tokenizer plus 12 padding rows, as Qwen2's
  tables are padded past its tokenizer; tied (as 0.5B) or with an LM head (as 7B)."""
  rows = hf_tokenizer[0].get_vocab_size(with_added_tokens=True) + 12
  config = transformers.Qwen2Config(tie_word_embeddings=request.param, rope_theta=1e6,
                                    **dict(TINY, vocab_size=rows))
  directory = tmp_path_factory.mktemp("qwen2_tied" if request.param else "qwen2_untied")
  model = _saved_random(transformers.Qwen2ForCausalLM, config, 20 + request.param, directory)
  return model, directory, rows


def test_remapped_import_gives_the_checkpoints_logits_on_text_with_bangs(
    hf_tokenizer, qwen2_over_tokenizer):
  tokenizer, path = hf_tokenizer
  model, directory, rows = qwen2_over_tokenizer
  free = rows - 1  # the table's last row, as 151935 in Qwen2-0.5B's
  vocab = hf_vocabularies.HfTokenizerVocabulary(str(path), zero_id_to=free)
  config, params = hf_import.load_hf_params(directory)
  remapped = hf_import.remap_zero_row(params, free)
  for text in BANG_TEXTS:
    theirs = np.array([tokenizer.encode(text, add_special_tokens=False).ids])  # [1, t]
    ours = np.array([list(vocab.encode(text))])  # [1, t]: '!' as `free`
    assert 0 in theirs and 0 not in ours and free in ours
    want = _torch_logits(model, theirs)  # [1, t, rows]
    got = _our_logits(config, remapped, ours)  # [1, t, rows]
    np.testing.assert_allclose(got[..., free], want[..., 0], atol=1e-4, rtol=1e-4)  # '!'
    np.testing.assert_allclose(got[..., 1:free], want[..., 1:free], atol=1e-4, rtol=1e-4)
    np.testing.assert_array_equal(got[..., 0], 0.0)  # padding: a zero row / column
    # Without the remap, '!' would be read as the padding row: the logits differ.
    assert not np.allclose(_our_logits(config, remapped, theirs), want, atol=1e-2)
  stack, original = remapped["stack"], params["stack"]
  np.testing.assert_array_equal(stack["token_embedder"]["embedding"][0], 0.0)
  np.testing.assert_array_equal(original["token_embedder"]["embedding"][0],  # input kept
                                model.model.embed_tokens.weight[0].detach().numpy())


def test_remap_zero_row_refuses_an_id_outside_the_table(qwen2_over_tokenizer):
  _, directory, rows = qwen2_over_tokenizer
  _, params = hf_import.load_hf_params(directory)
  for beyond in (rows, rows + 5):
    with pytest.raises(ValueError, match=rf"zero_id_to={beyond} is beyond "
                                         rf"token_embedder/embedding \({rows} rows"):
      hf_import.remap_zero_row(params, beyond)
  with pytest.raises(ValueError, match="must be a positive id"):
    hf_import.remap_zero_row(params, 0)


# ------------------------------------------------------------------------------ the tool, remapped
@pytest.fixture(scope="module")
def squid_checkpoints_over_tokenizer(tmp_path_factory):
  """Qwen2 pairs as 0.5B / 7B: tied small, untied large, both tables padded past the tiny
  tokenizer (small by 8 rows, large by 24), one tokenizer.json beside each."""
  root = tmp_path_factory.mktemp("squid_remap")
  _write_tokenizer(root / "small")
  tokens = json.loads((root / "small" / "tokenizer.json").read_text())
  size = 1 + max(list(tokens["model"]["vocab"].values()) +
                 [t["id"] for t in tokens["added_tokens"]])
  for i, (name, tied, sizes, pad) in enumerate((("small", True, SQUID_SMALL, 8),
                                                ("large", False, SQUID_LARGE, 24))):
    config = transformers.Qwen2Config(tie_word_embeddings=tied, rope_theta=1e6,
                                      **dict(sizes, vocab_size=size + pad))
    _saved_random(transformers.Qwen2ForCausalLM, config, 30 + i, root / name)
    _write_tokenizer(root / name)
  return root / "small", root / "large", size


def _remap_gin(tmp_path, tokenizer_json, zero_id_to):
  """models/squid_tiny.gin with the checkpoints' tokenizer.json as VOCABULARY, remapping."""
  path = tmp_path / f"squid_remap_{zero_id_to}.gin"
  path.write_text("\n".join([
      "from __gin__ import dynamic_registration", "from decal_jax.data import hf_vocabularies",
      "include 'models/squid_tiny.gin'", "VOCABULARY = @hf_vocabularies.HfTokenizerVocabulary()",
      f"hf_vocabularies.HfTokenizerVocabulary.path = '{tokenizer_json}'",
      f"hf_vocabularies.HfTokenizerVocabulary.zero_id_to = {zero_id_to}", "MEMORY_TOKENS = 4", ""]))
  return str(path)


def _torch_weight(directory, name):
  return safetensors_torch.load_file(str(directory / "model.safetensors"))[name].numpy()


def test_import_tool_remaps_both_squid_decoders_from_the_gin_vocabulary(
    squid_checkpoints_over_tokenizer, tmp_path, capsys):
  small, large, size = squid_checkpoints_over_tokenizer
  free, out = size + 7, tmp_path / "squid"  # the small table's last row
  gin_file = _remap_gin(tmp_path, small / "tokenizer.json", free)
  assert _tool_module().main(["--model", "squid", "--hf_dir", str(small), "--large_hf_dir",
                              str(large), "--out", str(out), f"--gin_file={gin_file}"]) == 0
  printed = capsys.readouterr().out
  assert f"hf_vocabularies.HfTokenizerVocabulary.zero_id_to = {free}" in printed
  assert f"token 0 moved to id {free}" in printed
  assert json.loads((out / "hf_import.json").read_text())["zero_id_to"] == free
  # The trainer's model from the model gin + hf_import.gin reads '!' as `free` ...
  gin.clear_config()
  gin.add_config_file_search_path(str(REPO / "gin"))
  gin.parse_config_files_and_bindings([gin_file, str(out / "hf_import.gin")], [],
                                      finalize_config=False)
  model = gin.query_parameter("%MODEL").scoped_configurable_fn()
  gin.clear_config()
  assert model.output_vocabulary.encode("Hello!")[-1] == free
  # ... and both decoders hold token 0's weights there (the checkpoints' own tensors).
  shapes = {"encoder_input_tokens": (1, 8), "decoder_input_tokens": (1, 4),
            "query_tokens": (1, 2)}
  abstract = jax.eval_shape(lambda: model.get_initial_variables(jax.random.PRNGKey(0),
                                                                shapes)["params"])
  fresh = jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, x.dtype), abstract)
  params, report = checkpoints.restore_matching_params(str(out), fresh)
  assert report["initialised"] == [] and report["unused"] == []
  for name, directory in (("small_decoder", small), ("large_decoder", large)):
    table = _torch_weight(directory, "model.embed_tokens.weight")  # [rows, embed]
    ours = np.asarray(params[name]["token_embedder"]["embedding"])
    np.testing.assert_array_equal(ours[free], table[0])
    np.testing.assert_array_equal(ours[0], 0.0)
    keep = np.r_[1:free, free + 1:len(table)]
    np.testing.assert_array_equal(ours[keep], table[keep])
  head = _torch_weight(large, "lm_head.weight")  # [rows, embed]
  kernel = np.asarray(params["large_decoder"]["logits_dense"]["kernel"])  # [embed, rows]
  np.testing.assert_array_equal(kernel[:, free], head[0])
  np.testing.assert_array_equal(kernel[:, 0], 0.0)
  np.testing.assert_array_equal(kernel[:, 1:free], head[1:free].T)


def test_import_tool_refuses_a_remap_that_does_not_fit(squid_checkpoints_over_tokenizer,
                                                       tmp_path):
  small, large, size = squid_checkpoints_over_tokenizer
  tool, out = _tool_module(), str(tmp_path / "never")
  squid = ["--model", "squid", "--hf_dir", str(small), "--large_hf_dir", str(large),
           "--out", out]
  tokenizer_json = small / "tokenizer.json"
  # Past the small table (size + 8 rows), though inside the large one.
  with pytest.raises(SystemExit, match=rf"zero_id_to={size + 8} is beyond the embedding "
                                       rf"table of {re.escape(str(small))}"):
    tool.main(squid + [f"--gin_file={_remap_gin(tmp_path, tokenizer_json, size + 8)}"])
  # A token of the tokenizer.
  with pytest.raises(SystemExit, match="zero_id_to=5 is the id of the token"):
    tool.main(squid + [f"--gin_file={_remap_gin(tmp_path, tokenizer_json, 5)}"])
  # A flag that disagrees with the gin vocabulary (here: one that does not remap).
  with pytest.raises(SystemExit, match=r"--zero_id_to 9 differs from the gin VOCABULARY's "
                                       r"zero_id_to \(None"):
    tool.main(squid + ["--gin_file=models/squid_tiny.gin", "--zero_id_to", "9"])
  # --model decoder remaps only when asked, and refuses ids past its table.
  with pytest.raises(SystemExit, match=rf"zero_id_to={size + 24} is beyond"):
    tool.main(["--model", "decoder", "--hf_dir", str(large), "--out", out,
               "--zero_id_to", str(size + 24)])
  assert not (tmp_path / "never").exists()


def test_import_tool_remaps_a_plain_decoder_when_asked(squid_checkpoints_over_tokenizer,
                                                       tmp_path):
  _, large, size = squid_checkpoints_over_tokenizer
  free, out = size + 23, tmp_path / "decoder"
  assert _tool_module().main(["--model", "decoder", "--hf_dir", str(large), "--out", str(out),
                              "--zero_id_to", str(free)]) == 0
  assert f"zero_id_to = {free}" in (out / "hf_import.gin").read_text()
  config = hf_import.config_from_hf(hf_import.read_hf_config(large))
  abstract = jax.eval_shape(lambda: Decoder(config).init(
      jax.random.PRNGKey(0), jnp.ones((1, 2), jnp.int32), enable_dropout=False))["params"]
  params, report = checkpoints.restore_matching_params(
      str(out), jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, x.dtype), abstract))
  assert report["initialised"] == [] and report["unused"] == []
  table = _torch_weight(large, "model.embed_tokens.weight")
  np.testing.assert_array_equal(params["stack"]["token_embedder"]["embedding"][free], table[0])
  np.testing.assert_array_equal(params["stack"]["logits_dense"]["kernel"][:, 0], 0.0)
