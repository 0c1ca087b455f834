"""tools/smollm2_autoencode.py held to references made here, on a tiny random decoder in
place of SmolLM2 (the tool's functions take the imported tree as an argument): segments cut
by hand from hand-made documents, the batch layout written out, a LoRA model at its start
equal to the same network without adapters, Adam's update ratio for the scorer, the
held-out NLL re-derived in numpy from the network's logits, greedy reconstruction against
the library's uncached decoding, and paired differences worked out by hand. The SmolLM2
run itself is in docs/results/smollm2_autoencode_cpu.md.
"""
import json
import types

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decal_jax.data import real_text_files
from decal_jax.networks.decoder import Decoder
from tools import smollm2_autoencode as ae

from smollm2_stand_in import EOS, WordTokenizer, imported_stack, tiny_decoder

TINY = tiny_decoder(num_layers=4, max_length=64)


@pytest.fixture(scope="module")
def imported():
  return imported_stack(TINY)


def _document(seed: int, n: int) -> str:
  rng = np.random.default_rng(seed)
  return " ".join(f"w{k}" for k in rng.integers(3, 40, n))


def test_segments_come_whole_from_their_split_and_round_robin(tmp_path):
  docs = [_document(i, 8 + 5 * i) for i in range(40)]  # 8 .. 203 words
  (tmp_path / "text").mkdir()
  (tmp_path / real_text_files.FILES["c4"]).write_text(
      "\n".join(json.dumps({"text": d}) for d in docs[:20]) + "\n")
  (tmp_path / real_text_files.FILES["wikitext2"]).write_text(
      "".join(f" = Title {i} = \n {d} \n" for i, d in enumerate(docs[20:])))
  data = ae.segments(WordTokenizer(), 16, tmp_path)
  read = (real_text_files.c4_documents(tmp_path / real_text_files.FILES["c4"])
          + real_text_files.wikitext_documents(tmp_path / real_text_files.FILES["wikitext2"]))
  want = {"train": [], "validation": []}
  per_doc = []
  for text in read:
    ids = WordTokenizer().encode(text).ids
    pieces = [ids[16 * i:16 * (i + 1)] for i in range(len(ids) // 16)]
    if real_text_files.split_of(text) == "train":
      want["train"] += pieces
    elif pieces:
      per_doc.append(pieces)
  for i in range(max(len(p) for p in per_doc)):  # first pieces, then second pieces, ...
    want["validation"] += [p[i] for p in per_doc if i < len(p)]
  assert want["validation"], "the hand-made documents should put some in validation"
  for split in ("train", "validation"):
    assert [list(s) for s in data[split]] == want[split]


def test_the_batch_rebuilds_the_context_then_stops():
  batch = ae.batch_of(np.array([[5, 6, 7], [8, 9, 10]], np.int32), EOS)
  np.testing.assert_array_equal(batch["encoder_input_tokens"], [[5, 6, 7], [8, 9, 10]])
  np.testing.assert_array_equal(batch["decoder_target_tokens"], [[5, 6, 7, 2], [8, 9, 10, 2]])
  np.testing.assert_array_equal(batch["decoder_input_tokens"], [[0, 5, 6, 7], [0, 8, 9, 10]])


@pytest.mark.parametrize("selection", ae.SELECTIONS)
def test_the_adapted_model_starts_as_the_frozen_base(imported, selection):
  model = ae.build(TINY, 4, selection, lora_rank=4, eos=EOS)
  trainable, frozen = ae.initial_params(model, imported, seed=0, length=12)
  base = flax.traverse_util.flatten_dict(imported)
  assert set(frozen) == set(base)
  assert all(np.array_equal(frozen[k], base[k]) for k in base)
  assert all(k[0] in ("scorer", "soft_prompt") or "lora" in k[-1] for k in trainable)
  plain = ae.build(TINY, 4, selection, lora_rank=0, eos=EOS)
  plain_trainable, _ = ae.initial_params(plain, imported, seed=0, length=12)
  batch = ae.batch_of(np.random.default_rng(1).integers(3, 40, (2, 12)).astype(np.int32), EOS)
  adapted = model._compute_logits(flax.traverse_util.unflatten_dict({**trainable, **frozen}),
                                  batch)
  without = plain._compute_logits(
      flax.traverse_util.unflatten_dict({**plain_trainable, **frozen}), batch)
  np.testing.assert_allclose(adapted, without, rtol=1e-5, atol=1e-5)  # LoRA's B starts at 0


def test_the_trainable_leaves_are_those_of_the_whole_models_init(imported):
  """initial_params draws only the trainable leaves: the values of the whole model's jitted
  init (the earlier runs' draws; an eager init differs in the last bit)."""
  model = ae.build(TINY, 4, "nuggets", lora_rank=4, eos=EOS)
  trainable, _ = ae.initial_params(model, imported, seed=5, length=12)
  shapes = {"encoder_input_tokens": (1, 12), "decoder_input_tokens": (1, 13)}
  full = flax.traverse_util.flatten_dict(jax.jit(
      lambda key: model.get_initial_variables(key, shapes))(jax.random.PRNGKey(5))["params"])
  assert trainable and all(np.array_equal(trainable[k], full[k]) for k in trainable)


def test_every_frozen_parameter_comes_from_the_import_or_the_run_is_refused(imported):
  """The frozen leaves are the imported base's, every one of the model's (the names seen
  while the initializer traced); a base without one is refused, naming how many lack."""
  model = ae.build(TINY, 4, "nuggets", lora_rank=4, eos=EOS)
  trainable, frozen = ae.initial_params(model, imported, seed=0, length=12)
  base = flax.traverse_util.flatten_dict(imported)
  assert frozen.keys() == base.keys() - trainable.keys()
  assert all(np.array_equal(frozen[k], base[k]) for k in frozen)
  gone = next(iter(sorted(frozen)))
  short = flax.traverse_util.unflatten_dict({k: v for k, v in base.items() if k != gone})
  with pytest.raises(ValueError, match=r"the imported SmolLM2 lacks 1 parameters, e\.g\. "):
    ae.initial_params(model, short, seed=0, length=12)


def test_the_optimizer_state_lets_the_step_compile_once(imported):
  """A fresh opt.init's counters are uncommitted, the step's outputs committed: without
  optimizer_state the second call compiles the step again."""
  model = ae.build(TINY, 4, "nuggets", lora_rank=4, eos=EOS)
  trainable, _ = ae.initial_params(model, imported, seed=0, length=12)
  args = types.SimpleNamespace(lr=1e-2, warmup=0, steps=10, scorer_lr_scale=0.25)
  opt = ae.optimizer(args, trainable, train_scorer=True)
  for state, compiles in ((opt.init(trainable), 2), (ae.optimizer_state(opt, trainable), 1)):
    update = jax.jit(lambda t, st: opt.update(t, st, t)[1])
    update(trainable, update(trainable, state))
    assert update._cache_size() == compiles


@pytest.mark.parametrize("selection,scale", [("nuggets", 0.25), ("random", 0.0)])
def test_the_scorer_moves_at_its_scale_or_not_at_all(imported, selection, scale):
  model = ae.build(TINY, 4, selection, lora_rank=4, eos=EOS)
  trainable, _ = ae.initial_params(model, imported, seed=0, length=12)
  args = types.SimpleNamespace(lr=1e-2, warmup=0, steps=10, scorer_lr_scale=0.25)
  opt = ae.optimizer(args, trainable, train_scorer=selection == "nuggets")
  grads = {k: jnp.ones_like(v) for k, v in trainable.items()}
  updates, _ = opt.update(grads, opt.init(trainable), trainable)
  lora = next(k for k in trainable if "lora" in k[-1])
  scorer = next(k for k in trainable if k[0] == "scorer")
  # Adam's first update of a constant gradient is -lr x clip factor in every entry
  assert float(jnp.abs(updates[lora]).max()) > 0
  np.testing.assert_allclose(updates[scorer], scale * updates[lora].ravel()[0], rtol=1e-6)


def test_held_out_nll_and_accuracy_are_those_of_the_logits(imported):
  model = ae.build(TINY, 4, "nuggets", lora_rank=4, eos=EOS)
  trainable, frozen = ae.initial_params(model, imported, seed=3, length=12)
  params = flax.traverse_util.unflatten_dict({**trainable, **frozen})
  held_out = np.random.default_rng(2).integers(3, 40, (5, 12)).astype(np.int32)
  got = ae.evaluate(jax.jit(lambda p, b: model.loss_fn(p, b, None)), params, held_out, EOS,
                    batch=2)  # batches of 2, 2 and 1
  batch = ae.batch_of(held_out, EOS)
  logits = np.asarray(model._compute_logits(params, batch), np.float64)  # [5, 13, v]
  targets = np.asarray(batch["decoder_target_tokens"])
  top = logits.max(-1, keepdims=True)
  logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
  nll = -np.take_along_axis(logp, targets[..., None], -1)[..., 0]
  assert got["nll"] == pytest.approx(nll.mean(), rel=1e-5)
  assert got["accuracy"] == pytest.approx((logits.argmax(-1) == targets).mean())


def test_greedy_reconstruction_is_the_uncached_decoders(imported):
  model = ae.build(TINY, 3, "compressive", lora_rank=4, eos=EOS)
  trainable, frozen = ae.initial_params(model, imported, seed=0, length=9)
  # move LoRA's B off zero so decoding differs from the base model's
  trainable = {k: v + 0.05 if k[-1].endswith("_b") else v for k, v in trainable.items()}
  params = flax.traverse_util.unflatten_dict({**trainable, **frozen})
  held_out = np.random.default_rng(4).integers(3, 40, (3, 9)).astype(np.int32)
  tokenizer = WordTokenizer()
  bleu, exact, examples = ae.reconstruct(model, params, held_out, tokenizer, EOS, batch=2)
  batch = ae.batch_of(held_out, EOS)
  want = np.asarray(model.predict_batch_uncached(params, batch))  # [3, 10]
  targets = np.asarray(batch["decoder_target_tokens"])
  assert exact == pytest.approx((want == targets).mean())
  first = list(want[0][:list(want[0]).index(EOS)] if EOS in want[0] else want[0])
  assert examples[0] == tokenizer.decode([t for t in first if t > 0])
  assert 0.0 <= bleu <= 100.0


def test_paired_rows_subtract_the_same_seed():
  def run(r, sel, seed, bleu, nll):
    return {"ratio": r, "selection": sel, "seed": seed, "bleu": bleu,
            "curve": [{"nll": 9.0}, {"nll": nll}]}
  runs = [run(10, "nuggets", 0, 50.0, 1.0), run(10, "nuggets", 1, 40.0, 2.0),
          run(10, "random", 0, 30.0, 1.5), run(10, "random", 1, 36.0, 2.1),
          run(10, "compressive", 1, 10.0, 3.0)]
  rows = ae.paired_rows(runs)
  # nuggets - random: BLEU 20 and 4 (mean 12, s.e. 8); NLL -0.5 and -0.1 (mean -0.3, s.e. 0.2)
  assert rows[0] == [10, "nuggets - random", 2, "12.0 ± 8.0", "-0.300 ± 0.200"]
  assert rows[1] == [10, "nuggets - compressive", 1, "30.0", "-1.000"]


def test_kept_summary_counts_by_hand():
  kept = np.array([5, 5, 5, 7, 7, 9])  # 5 x3, 7 x2, 9 x1; delimiter 7
  text = np.array([5, 6, 7, 8, 9, 10, 7, 11, 12, 13])  # 2 delimiters in 10
  got = ae.kept_summary(kept, text, delimiters=(7,), decode=lambda ids: f"t{ids[0]}", top=2)
  assert got == {"kept": 6, "top_share": pytest.approx(5 / 6), "top_types": ["t5", "t7"],
                 "delimiter_share": pytest.approx(2 / 6),
                 "delimiter_share_of_text": pytest.approx(0.2)}


def test_kept_tokens_are_the_selections_ids_without_the_last(imported):
  model = ae.build(TINY, 4, "nuggets", lora_rank=4, eos=EOS)
  trainable, frozen = ae.initial_params(model, imported, seed=5, length=12)
  params = flax.traverse_util.unflatten_dict({**trainable, **frozen})
  held_out = np.random.default_rng(6).integers(3, 40, (3, 12)).astype(np.int32)
  scores = np.asarray(model.module.apply({"params": params}, jnp.asarray(held_out),
                                         method=model.module.score))  # [3, 12]
  want = []
  for row, s in zip(held_out, scores):  # the last token forced, then the 2 best of the rest
    best = sorted(np.argsort(-s[:-1], kind="stable")[:2])
    want += [row[i] for i in best]
  np.testing.assert_array_equal(ae.kept_tokens(model, params, held_out), want)


def test_the_prior_is_the_base_model_reading_nothing(imported):
  held_out = np.random.default_rng(8).integers(3, 40, (3, 10)).astype(np.int32)
  got = ae.prior(TINY, imported, held_out, EOS, batch=2)
  inputs = np.concatenate([np.zeros((3, 1), np.int32), held_out], axis=1)  # [3, 11]
  targets = np.concatenate([held_out, np.full((3, 1), EOS, np.int32)], axis=1)
  logits = np.asarray(Decoder(TINY).apply({"params": imported}, jnp.asarray(inputs)),
                      np.float64)  # [3, 11, v]
  top = logits.max(-1, keepdims=True)
  logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
  nll = -np.take_along_axis(logp, targets[..., None], -1)[..., 0]
  assert got["nll"] == pytest.approx(nll.mean(), rel=1e-5)
  assert got["accuracy"] == pytest.approx((logits.argmax(-1) == targets).mean())


def test_runs_of_other_settings_go_to_other_files():
  base = ae.parse(["--steps", "200"])
  names = {ae.run_name(ae.parse(argv)) for argv in (
      ["--steps", "200"], ["--steps", "200", "--lr", "1e-3"], ["--steps", "200", "--batch", "8"],
      ["--steps", "200", "--lora-rank", "4"], ["--steps", "200", "--layers", "3"],
      ["--steps", "200", "--scorer-lr-scale", "0.1"], ["--steps", "200", "--warmup", "5"])}
  assert len(names) == 7
  assert ae.run_name(base) == "n64_steps200_b4_lr0.002_w20_rank8_scorer1"
  assert ae.run_name(ae.parse(["--steps", "200", "--ratios", "2", "--seeds", "1"])) == \
      ae.run_name(base)  # the grid is not part of the setting
