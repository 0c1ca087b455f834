"""tools/smollm2_lm_train.py held to references made here, on a tiny random decoder in place
of SmolLM2 (the tool's functions take the imported tree as an argument): the settings'
configurations and sequence length worked out by hand, the batch layout written out, the
'full' row at its start equal to the plain `Decoder` (LoRA's B starts at 0) and its
continuation NLL re-derived in numpy from that decoder's logits, one optimizer step that
moves the scorer only where it learns and never the base, the kept tokens against a numpy
prefix-rank selection, paired differences worked by hand, a scorer started from a saved
compressor that scores as the compressor network does, and a resumed sweep that trains
nothing twice. The SmolLM2 run itself is in docs/results/smollm2_lm_trained_cpu.md.
"""
import json
import re
import types

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from decal_jax.networks import dodo, dodo_lm
from decal_jax.networks.decoder import Decoder
from tools import smollm2_lm_train as lt

from smollm2_stand_in import EOS, imported_stack, tiny_decoder

TINY = tiny_decoder(num_layers=4, max_length=128)


@pytest.fixture(scope="module")
def imported():
  return imported_stack(TINY)


def _model(imported, name, seed=0, window=4, length=31, lora_rank=4):
  model = lt.build(TINY, name, window, length, lora_rank, EOS)
  trainable, frozen = lt.ae.initial_params(model, imported, seed, length - 1)
  return model, trainable, frozen


def _params(trainable, frozen):
  return flax.traverse_util.unflatten_dict({**trainable, **frozen})


def _log_softmax(logits):
  top = logits.max(-1, keepdims=True)
  return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))


def test_settings_read_the_budget_they_name():
  cfg = lt.lm_config(TINY, "nuggets-10", window=8, length=100, lora_rank=4)
  assert (cfg.selection, cfg.window, cfg.history, cfg.compression_ratio) == \
      ("nuggets", 8, 80, 10)
  assert cfg.decoder.lora_rank == 4 and cfg.threshold is None
  cfg = lt.lm_config(TINY, "random-5", window=8, length=100, lora_rank=4)
  assert (cfg.selection, cfg.history, cfg.compression_ratio) == ("nuggets", 40, 5)
  cfg = lt.lm_config(TINY, "compressive-10", window=8, length=100, lora_rank=4)
  assert (cfg.selection, cfg.window, cfg.history) == ("compressive", 8, 80)
  cfg = lt.lm_config(TINY, "window-16", window=8, length=100, lora_rank=4)
  assert (cfg.selection, cfg.window) == ("window", 16)
  cfg = lt.lm_config(TINY, "full", window=8, length=100, lora_rank=4)
  assert (cfg.selection, cfg.window) == ("window", 100)  # every earlier token
  assert lt.lm_config(TINY, "nuggets-10", window=8, length=100, lora_rank=4, sink=1).sink == 1


@pytest.mark.parametrize("name,needle", [("window-32", "2 τ = 16"), ("nugget-10", "unknown"),
                                         ("full-3", "unknown"), ("nuggets-x", "unknown")])
def test_a_wrong_setting_is_refused_with_the_names_that_work(name, needle):
  with pytest.raises(ValueError, match=needle):
    lt.parse_setting(name, window=8)
  with pytest.raises(SystemExit):
    lt.parse(["--settings", name, "--window", "8"])


def test_the_sequence_covers_the_longest_compressed_history():
  args = lt.parse(["--settings", "window-8", "nuggets-3", "compressive-5", "--window", "4",
                   "--continuation", "6"])
  assert args.length == 4 * (5 + 1) + 6 + 1  # τ (r + 1) history + T scored + the first
  assert lt.parse(["--settings", "nuggets-3", "full", "nuggets-3"]).settings == ["nuggets-3",
                                                                                 "full"]
  names = {lt.run_name(lt.parse(argv)) for argv in (
      [], ["--lr", "1e-4"], ["--batch", "2"], ["--steps", "50"], ["--lora-rank", "4"],
      ["--window", "16", "--settings", "window-32", "nuggets-10"], ["--layers", "3"],
      ["--continuation", "32"], ["--scorer-lr-scale", "0.5"], ["--warmup", "3"],
      ["--sink", "1"])}
  assert len(names) == 11
  assert lt.run_name(lt.parse(["--seeds", "4"])) == lt.run_name(lt.parse([]))


def test_the_batch_predicts_each_next_token():
  batch = lt.lm_batch(np.array([[5, 6, 7, 8], [9, 10, 11, 12]], np.int32))
  np.testing.assert_array_equal(batch["decoder_input_tokens"], [[5, 6, 7], [9, 10, 11]])
  np.testing.assert_array_equal(batch["decoder_target_tokens"], [[6, 7, 8], [10, 11, 12]])


def test_full_starts_as_the_plain_decoder_and_its_nll_is_the_logits(imported):
  model, trainable, frozen = _model(imported, "full")
  assert set(frozen) == set(flax.traverse_util.flatten_dict(imported))
  assert all("lora" in k[-1] for k in trainable)
  held_out = np.random.default_rng(1).integers(3, 40, (3, 32)).astype(np.int32)
  got = lt.continuation_nll(lt.nll_function(model.module, 24), _params(trainable, frozen),
                            held_out, batch=2)
  logits = np.asarray(Decoder(TINY).apply({"params": imported}, jnp.asarray(held_out[:, :-1])),
                      np.float64)  # [3, 31, v]
  logp = _log_softmax(logits)[:, 23:]  # the predictions of tokens 24..31
  nll = -np.take_along_axis(logp, held_out[:, 24:, None], -1)[..., 0]  # [3, 8]
  np.testing.assert_allclose(got, nll.mean(1), rtol=2e-5)


@pytest.mark.parametrize("name,scorer_moves", [("nuggets-3", True), ("random-3", False)])
def test_one_step_moves_adapters_and_the_scorer_only_where_it_learns(imported, name,
                                                                     scorer_moves):
  model, trainable, frozen = _model(imported, name)
  args = types.SimpleNamespace(lr=1e-2, warmup=0, steps=10, scorer_lr_scale=1.0)
  opt = lt.ae.optimizer(args, trainable, train_scorer=lt.parse_setting(name, 4)[0] == "nuggets")
  batch = lt.lm_batch(np.random.default_rng(2).integers(3, 40, (2, 31)).astype(np.int32))
  grads = jax.grad(lambda t: model.loss_fn(_params(t, frozen), batch, None)[0])(trainable)
  updates, _ = opt.update(grads, opt.init(trainable), trainable)
  scorer = [k for k in trainable if k[0] == "scorer"]
  lora_b = [k for k in trainable if k[-1].endswith("_b")]
  assert scorer and lora_b and not set(trainable) & set(frozen)
  assert all(float(jnp.abs(updates[k]).max()) > 0 for k in lora_b)
  assert all(bool(jnp.any(updates[k] != 0)) == scorer_moves for k in scorer)


def test_kept_tokens_follow_the_causal_prefix_rank_rule(imported):
  model, trainable, frozen = _model(imported, "nuggets-3", seed=5)
  params = _params(trainable, frozen)
  held_out = np.random.default_rng(6).integers(3, 40, (2, 31)).astype(np.int32)
  inputs = held_out[:, :-1]
  scores = np.asarray(model.module.apply({"params": params}, jnp.asarray(inputs),
                                         method=model.module.scores))  # [2, 30]
  first = 20  # the continuation's first scored token reads positions < 20 - τ compressed
  want = []
  for row, s in zip(inputs, scores):
    for i in range(first - 4):  # token i kept: among the ceil((i + 1) / 3) best of s_0..s_i
      rank = int((s[:i + 1] > s[i]).sum())
      if rank < -(-(i + 1) // 3):
        want.append(row[i])
  np.testing.assert_array_equal(lt.kept_tokens(model.module, params, held_out, first), want)


def test_paired_rows_subtract_the_same_seed():
  def run(name, seed, nll, docs):
    return {"setting": name, "seed": seed, "curve": [{"nll": 9.0}, {"nll": nll,
                                                                     "doc_nll": docs}]}
  runs = [run("nuggets-10", 0, 2.0, [1.0, 3.0]), run("nuggets-10", 1, 3.0, [2.0, 4.0]),
          run("window-64", 0, 2.5, [2.0, 3.0]), run("window-64", 1, 3.1, [2.2, 4.0]),
          run("compressive-10", 1, 4.0, [3.0, 5.0])]
  rows = {r[0]: r for r in lt.paired_rows(runs, "nuggets-10")}
  # by seed: -0.5 and -0.1 (mean -0.3, s.e. 0.2); by document: seeds averaged
  # nuggets (1.5, 3.5) - window (2.1, 3.5) = (-0.6, 0.0): mean -0.3, s.e. 0.3
  assert rows["nuggets-10 - window-64"] == ["nuggets-10 - window-64", 2, "-0.300 ± 0.200",
                                            "-0.300 ± 0.300", "-0.500, -0.100"]
  assert rows["nuggets-10 - compressive-10"][1:3] == [1, "-1.000"]


def _saved_compressor(imported, path, seed=5):
  """A compressor's trained leaves as smollm2_autoencode saves them (here: at init, seed 5)."""
  compressor = lt.ae.build(TINY, 3, "nuggets", 4, EOS)
  saved, base = lt.ae.initial_params(compressor, imported, seed, 12)
  lt.ae.save_trained(path, saved)
  return compressor, saved, base


def test_the_scorer_from_a_saved_compressor_scores_as_the_compressor_does(imported, tmp_path):
  compressor, saved, base = _saved_compressor(imported, tmp_path / "run" / "r3_nuggets_seed0.npz")
  model, trainable, frozen = _model(imported, "nuggets-3", seed=0, window=12)
  loaded = lt.scorer_from(str(tmp_path / "run" / "r3_nuggets_seed0.npz"), trainable)
  scorer = [k for k in trainable if k[0] == "scorer"]
  assert scorer and all(np.array_equal(loaded[k], saved[k]) for k in scorer)
  assert all(loaded[k] is trainable[k] for k in trainable if k[0] != "scorer")  # adapters fresh
  tokens = jnp.asarray(np.random.default_rng(3).integers(3, 40, (2, 12)), jnp.int32)
  want = compressor.module.apply({"params": _params(saved, base)}, tokens,
                                 method=dodo.Dodo.score)  # [2, 12]: the compressor network's

  def lm_scores(tr):
    return model.module.apply({"params": _params(tr, frozen)}, tokens,
                              method=dodo_lm.DodoLM.scores)
  assert not np.allclose(lm_scores(trainable), want, atol=1e-3)  # a fresh scorer differs
  np.testing.assert_allclose(lm_scores(loaded), want, rtol=1e-5, atol=1e-6)


def test_a_saved_file_without_this_models_scorer_is_refused(imported, tmp_path):
  np.savez(tmp_path / "other.npz", **{"scorer/dense_0/kernel": np.zeros((3, 3), np.float32)})
  _, trainable, _ = _model(imported, "nuggets-3")
  with pytest.raises(ValueError, match="has no scorer leaf .* smollm2_autoencode saved"):
    lt.scorer_from(str(tmp_path / "other.npz"), trainable)


@pytest.mark.parametrize("extra,needle", [
    (["--settings", "window-8"], "add a nuggets-R setting"),
    (["--settings", "nuggets-3"], "no file .*r3_nuggets_seed1.npz.*beside its --work")])
def test_scorer_from_without_a_nuggets_row_or_its_file_is_refused(tmp_path, capsys, extra,
                                                                   needle):
  (tmp_path / "r3_nuggets_seed0.npz").write_bytes(b"")
  with pytest.raises(SystemExit):
    lt.parse([*extra, "--window", "4", "--seeds", "0", "1",
              "--scorer-from", str(tmp_path / "r{r}_nuggets_seed{seed}.npz")])
  assert re.search(needle, capsys.readouterr().err)


def test_a_resumed_sweep_trains_nothing_twice(imported, tmp_path, monkeypatch):
  tokenizer = types.SimpleNamespace(token_to_id=lambda token: EOS,
                                    decode=lambda ids: " ".join(map(str, ids)))
  rng = np.random.default_rng(9)
  data = {"train": list(rng.integers(3, 40, (6, 27)).astype(np.int32)),
          "validation": list(rng.integers(3, 40, (3, 27)).astype(np.int32))}
  monkeypatch.setattr(lt, "load_smollm2", lambda layers=None: (TINY, imported, tokenizer))
  monkeypatch.setattr(lt.ae, "segments", lambda tok, length: data)
  monkeypatch.setattr(lt, "delimiter_ids", lambda tok: (5,))
  argv = ["--settings", "window-8", "nuggets-3", "--window", "4", "--continuation", "10",
          "--steps", "2", "--eval-every", "1", "--eval-documents", "3", "--seeds", "0",
          "--work", str(tmp_path / "work"), "--out", str(tmp_path / "out.md")]
  lt.main(argv)
  log = tmp_path / "work" / f"{lt.run_name(lt.parse(argv))}.jsonl"
  runs = [json.loads(x) for x in log.read_text().splitlines()]
  assert [(r["setting"], r["seed"], [p["step"] for p in r["curve"]]) for r in runs] == \
      [("window-8", 0, [0, 1, 2]), ("nuggets-3", 0, [0, 1, 2])]
  assert runs[0]["curve"][0]["nll"] == pytest.approx(np.mean(runs[0]["curve"][0]["doc_nll"]))
  # The same sweep with the scorer from a compressor adds its nuggets row, trains no other.
  _saved_compressor(imported, tmp_path / "ae" / "r3_nuggets_seed0.npz")
  from_ae = [*argv, "--scorer-from", str(tmp_path / "ae" / "r{r}_nuggets_seed{seed}.npz")]
  lt.main(from_ae)
  runs = [json.loads(x) for x in log.read_text().splitlines()]
  assert [(lt.label(r), r["scorer_from"]) for r in runs[2:]] == \
      [("nuggets-3 from AE", str(tmp_path / "ae" / "r3_nuggets_seed0.npz"))]
  monkeypatch.setattr(lt, "train_run", lambda *a, **k: pytest.fail("trained a finished run"))
  lt.main(argv)
  lt.main(from_ae)
  table = (tmp_path / "out.md").read_text()
  assert "| nuggets-3 from AE | 1 |" in table and "| nuggets-3 from AE - nuggets-3 | 1 |" in table
  assert f"| window-8 | 1 | {runs[0]['curve'][0]['nll']:.3f} | {runs[0]['curve'][-1]['nll']:.3f}" \
      in table
  assert (tmp_path / "out.png").exists()
