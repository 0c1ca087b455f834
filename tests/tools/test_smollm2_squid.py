"""tools/smollm2_squid.py (and smollm2_squid_model.py) held to references made here, on a
tiny random decoder in place of SmolLM2 (the tool's functions take the imported tree as an
argument): the stage examples written out by hand, the segment-mean memory against a numpy
mean of the plain decoder's final states through a numpy projector, the ceiling and the
prior against a numpy NLL of the plain decoder reading [context; query; answer] and
[query; answer], greedy decoding against the library's uncached decoding, the trainable /
frozen split through a real training step, paired differences by hand, and a resumed sweep
that runs only what its --work file lacks. The SmolLM2 run is in
docs/results/smollm2_squid_cpu.md.
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
from tools import smollm2_squid as tool
from tools import smollm2_squid_model as sm

from smollm2_stand_in import EOS, WordTokenizer, imported_stack, tiny_decoder

TINY = tiny_decoder(num_layers=2, max_length=128)
PROMPT = [3, 4]


@pytest.fixture(scope="module")
def imported():
  return imported_stack(TINY)


def _tree(params):
  return flax.traverse_util.unflatten_dict(params)


def _numpy_nll(logits, targets):
  """Mean NLL and accuracy of `targets` `[b, t]` under `logits` `[b, t, v]`, in float64."""
  logits = np.asarray(logits, np.float64)
  top = logits.max(-1, keepdims=True)
  logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
  nll = -np.take_along_axis(logp, targets[..., None], -1)[..., 0]
  return nll.mean(), (logits.argmax(-1) == targets).mean()


def _evaluate(model, params, ex, batch=2):
  eval_fn = jax.jit(lambda p, b: model.loss_fn(p, b, None))
  return tool.ae.evaluate_batches(eval_fn, _tree(params), (
      sm.batch_of(ex, np.arange(i, min(i + batch, tool.size_of(ex))))
      for i in range(0, tool.size_of(ex), batch)))


def _random(seed, shape):
  return np.random.default_rng(seed).integers(5, 40, shape).astype(np.int32)


# ----------------------------------------------------------------------------- examples
def test_the_stage_examples_and_batches_by_hand():
  ex = sm.restore_examples(np.array([[5, 6, 7], [8, 9, 10]]), PROMPT, EOS)
  b = sm.batch_of(ex, np.array([1]))
  np.testing.assert_array_equal(b["encoder_input_tokens"], [[8, 9, 10]])
  np.testing.assert_array_equal(b["query_tokens"], [[3]])  # the prompt's last token starts
  np.testing.assert_array_equal(b["decoder_target_tokens"], [[8, 9, 10, 2]])
  np.testing.assert_array_equal(b["decoder_input_tokens"], [[4, 8, 9, 10]])
  ex = sm.continue_examples(np.array([[5, 6, 7, 8, 9]]), first=3)
  b = sm.batch_of(ex, np.array([0]))
  np.testing.assert_array_equal(b["encoder_input_tokens"], [[5, 6]])
  assert b["query_tokens"].shape == (1, 0)
  np.testing.assert_array_equal(b["decoder_target_tokens"], [[8, 9]])  # no EOS: text goes on
  np.testing.assert_array_equal(b["decoder_input_tokens"], [[7, 8]])


def test_qa_examples_pad_and_drop_what_does_not_fit(monkeypatch):
  monkeypatch.setattr(sm, "QA_PROMPT", "{} w9")
  records = [{"context": "w5 w6 w7", "question": "w8", "answers": ["w10 w11", "w12"]},
             {"context": "w5 w6 w7 w8 w9", "question": "w8", "answers": ["w10"]},  # too long
             {"context": "w5", "question": "w8 w8 w8", "answers": ["w10"]}]  # query too long
  # lengths: context 4, query 2 (the prompt but its last token), answer + EOS 3
  ex, answers = sm.qa_examples(records, WordTokenizer(), EOS, (4, 2, 3))
  np.testing.assert_array_equal(ex["encoder_input_tokens"], [[5, 6, 7, 0]])
  np.testing.assert_array_equal(ex["query_tokens"], [[8, 0]])
  np.testing.assert_array_equal(ex["start"], [9])
  np.testing.assert_array_equal(ex["decoder_target_tokens"], [[10, 11, 2]])
  assert answers == [["w10 w11", "w12"]]


def test_squad_records_split_by_paragraph(tmp_path):
  paragraphs = [{"context": f"paragraph {i}", "qas": [
      {"id": f"{i}-{j}", "question": f"q{j}?", "answers": [{"text": f"a{i}{j}"}]}
      for j in range(2)]} for i in range(60)]
  path = tmp_path / "squad.json"
  path.write_text(json.dumps({"data": [{"title": "t", "paragraphs": paragraphs}]}))
  got = sm.squad_records(str(path))
  for split in ("train", "validation"):
    want = [(p["context"], qa["question"], [qa["answers"][0]["text"]]) for p in paragraphs
            for qa in p["qas"] if real_text_files.split_of(p["context"]) == split]
    assert [(r["context"], r["question"], r["answers"]) for r in got[split]] == want
  assert got["validation"], "60 paragraphs should put some in validation"


# ----------------------------------------------------------------------------- memories
def test_segment_means_are_a_numpy_mean_through_the_projector(imported):
  model = sm.build(TINY, "means", 3, 8, EOS)
  params = sm.initial_params(model, imported, seed=1)
  tokens = _random(2, (2, 8))
  tokens[1, 5:] = 0  # a right-padded row: 5 real tokens, segments [0,3) [3,5) and none
  got = model.module.apply({"params": _tree(params)}, jnp.asarray(tokens),
                           method=model.module.compress)
  _, seen = Decoder(TINY).apply({"params": imported}, jnp.asarray(tokens),
                                capture_intermediates=lambda m, f: m.name == "decoder_norm")
  states = np.asarray(seen["intermediates"]["stack"]["decoder_norm"]["__call__"][0],
                      np.float64)  # [2, 8, d]: the plain decoder's final normed states
  means, valid = np.zeros((2, 3, TINY.emb_dim)), np.zeros((2, 3), bool)
  for b in range(2):
    for j in range(3):
      real = [i for i in range(3 * j, min(3 * j + 3, 8)) if tokens[b, i] > 0]
      if real:
        means[b, j], valid[b, j] = states[b, real].mean(0), True
  proj = {k[1:]: np.asarray(v, np.float64) for k, v in params.items() if k[0] == "projector"}
  x = means @ proj["dense_0", "kernel"] + proj["bias_0",]
  x = 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))  # tanh GELU
  x = x @ proj["dense_1", "kernel"] + proj["bias_1",]  # [2, 3, large d]
  np.testing.assert_array_equal(got.valid, valid)
  np.testing.assert_allclose(np.asarray(got.embeddings)[valid], x[valid], rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("memory", ["full", "none"])
def test_the_ceiling_and_the_prior_are_the_plain_decoder(imported, memory):
  """full: the plain decoder over [context; query; 0; targets]; none: over [query; 0;
  targets]: teacher-forced NLL / accuracy at the target positions, restoring and continuing."""
  model = sm.build(TINY, memory, 4, 8, EOS, start=PROMPT[-1])
  params = sm.initial_params(model, imported, seed=0)
  assert {k[0] for k in params} == {"large_decoder"}
  segments = _random(3, (3, 12))
  for ex in (sm.restore_examples(segments[:, :8], PROMPT, EOS),
             sm.continue_examples(segments, first=8)):
    got = _evaluate(model, params, ex)
    b = sm.batch_of(ex, np.arange(3))
    parts = ([b["encoder_input_tokens"]] if memory == "full" else []) + [
        b["query_tokens"], b["decoder_input_tokens"]]
    sequence = jnp.concatenate(parts, axis=1)  # [3, prefix + t]
    t = b["decoder_target_tokens"].shape[1]
    logits = Decoder(TINY).apply({"params": imported}, sequence)[:, -t:]  # [3, t, v]
    nll, acc = _numpy_nll(logits, np.asarray(b["decoder_target_tokens"]))
    assert got["nll"] == pytest.approx(nll, rel=1e-5)
    assert got["accuracy"] == pytest.approx(acc)


@pytest.mark.parametrize("memory", ["tokens", "means", "full"])
def test_greedy_restoration_is_the_uncached_decoders(imported, memory):
  model = sm.build(TINY, memory, 4, 8, EOS, start=PROMPT[-1])
  params = sm.initial_params(model, imported, seed=0)
  params = {k: v + 0.05 if k[0] == "projector" else v for k, v in params.items()}
  args = types.SimpleNamespace(bleu_segments=3, eval_batch=2)
  ex = sm.restore_examples(_random(4, (3, 8)), PROMPT, EOS)
  got = tool.finish_stage(args, model, params, {"validation": ex}, "restore",
                          WordTokenizer(), EOS, PROMPT)
  batch = sm.batch_of(ex, np.arange(3))
  want = np.asarray(model.predict_batch_uncached(_tree(params), batch))  # [3, 9]
  assert got["greedy_accuracy"] == pytest.approx(
      (want == np.asarray(batch["decoder_target_tokens"])).mean())
  assert got["examples"][0] == WordTokenizer().decode(sm.answers_of(want, EOS)[0])
  # decoding starts from the library's 0, read as the start token: the teacher-forced layout
  logits = model._compute_logits(_tree(params), batch)  # [3, 9, v]
  np.testing.assert_array_equal(want[:, 0], np.argmax(logits[:, 0], axis=-1))


def test_greedy_answers_are_scored_as_squad(imported):
  from decal_jax import text_metrics
  model = sm.build(TINY, "tokens", 4, 8, EOS, start=PROMPT[-1])
  params = _tree(sm.initial_params(model, imported, seed=3))
  ex = sm.examples(_random(5, (3, 8)), _random(6, (3, 2)), np.full(3, PROMPT[-1]),
                   _random(7, (3, 4)))
  answers = [["w5"], ["w6 w7", "w8"], ["w9"]]
  got = sm.answer_questions(model, params, ex, answers, WordTokenizer(), EOS, batch=2)
  want = np.asarray(model.predict_batch_uncached(params, sm.batch_of(ex, np.arange(3))))
  texts = [WordTokenizer().decode(ids) for ids in sm.answers_of(want, EOS)]
  assert got["examples"] == texts
  assert got["f1"] == pytest.approx(text_metrics.squad(answers, texts)["f1"])


# ----------------------------------------------------------------------------- training
@pytest.mark.parametrize("stage,large", [("restore", "trains"), ("continue", "frozen"),
                                         ("continue", "trains")])
def test_a_training_step_moves_only_the_stages_parts(imported, stage, large):
  model = sm.build(TINY, "tokens", 4, 8, EOS)
  params = sm.initial_params(model, imported, seed=0)
  args = types.SimpleNamespace(large=large, lr=1e-2, warmup=0, decoder_lr_scale=0.5,
                               eval_every=5, eval_batch=4, batch=2)
  segments = _random(8, (6, 12))
  ex = (sm.restore_examples(segments[:, :8], PROMPT, EOS) if stage == "restore"
        else sm.continue_examples(segments, first=8))
  after, record = tool.train_stage(args, model, params, {"train": ex, "validation": ex},
                                   stage, steps=1, seed=0, label="test")
  trains = {"small_decoder", "memory_tokens", "projector"} | (
      {"large_decoder"} if large == "trains" and stage != "restore" else set())
  assert set(record["trained"]) == trains
  for k, v in params.items():
    if k[0] in trains:
      assert np.any(np.asarray(after[k]) != np.asarray(v)), k
    else:
      assert np.array_equal(np.asarray(after[k]), np.asarray(v)), k  # bit-identical
  assert [p["step"] for p in record["curve"]] == [0, 1]


def test_the_decoders_learn_at_their_scale(imported):
  model = sm.build(TINY, "tokens", 4, 8, EOS)
  trainable, _ = sm.split(sm.initial_params(model, imported, 0), sm.stage_parts("qa", True))
  args = types.SimpleNamespace(lr=1e-2, warmup=0, decoder_lr_scale=0.1)
  opt = tool.optimizer(args, trainable, steps=10)
  grads = {k: jnp.ones_like(v) for k, v in trainable.items()}
  updates, _ = opt.update(grads, opt.init(trainable), trainable)
  # Adam's first update of a constant gradient is -lr x clip factor in every entry
  unit = float(updates["projector", "dense_0", "kernel"].ravel()[0])
  assert unit < 0
  for k, u in updates.items():
    scale = 0.1 if k[0] in sm.DECODERS else 1.0
    np.testing.assert_allclose(u, scale * unit, rtol=1e-5)


# ----------------------------------------------------------------------------- report
def _run(r, memory, seed, nll, bleu=0.0):
  return {"ratio": r, "memory": memory, "seed": seed, "stages": {"restore": {
      "curve": [{"step": 0, "nll": 9.0, "accuracy": 0.0},
                {"step": 2, "nll": nll, "accuracy": 0.5}], "bleu": bleu,
      "greedy_accuracy": 0.5, "seconds": 60.0}}}


def test_paired_rows_and_the_gap_closed_by_hand():
  runs = [_run(4, "tokens", 0, 2.0, 30.0), _run(4, "tokens", 1, 3.0, 20.0),
          _run(4, "means", 0, 2.5, 26.0), _run(4, "means", 1, 3.1, 20.0),
          _run(None, "full", 0, 1.0), _run(None, "none", 0, 5.0)]
  # tokens - means: BLEU 4 and 0 (mean 2, s.e. 2); NLL -0.5 and -0.1 (mean -0.3, s.e. 0.2)
  assert tool.paired_rows(runs, "restore") == [[4, "tokens - means", 2, "2.0 ± 2.0",
                                                "-0.300 ± 0.200"]]
  rows = {(r[0], r[1]): r for r in tool.stage_rows(runs, "restore")}
  assert rows[4, "tokens"][-3] == "0.62"  # (5 - 2.5) / (5 - 1)
  assert rows["-", "none"][-3] == "0.00" and rows["-", "full"][-3] == "1.00"


def test_the_speedup_of_answering_many_from_one_compression():
  row = {"compress": 2.0, "answer": 1.0, "full_answer": 3.0}
  assert sm.speedup(row, 1) == pytest.approx(3.0 / 3.0)
  assert sm.speedup(row, 10) == pytest.approx(30.0 / 12.0)


def test_the_references_run_once_unless_their_large_decoder_trains():
  args = tool.parse(["--ratios", "4", "8", "--seeds", "0", "1", "--memories", "tokens", "full"])
  assert tool.grid(args) == [(4, "tokens", 0), (8, "tokens", 0), (4, "tokens", 1),
                             (8, "tokens", 1), (None, "full", 0)]
  args = tool.parse(["--ratios", "4", "--seeds", "0", "1", "--memories", "none",
                     "--continue-steps", "5", "--large", "trains"])
  assert tool.grid(args) == [(None, "none", 0), (None, "none", 1)]


def test_runs_of_other_settings_go_to_other_files():
  base = ["--steps", "100"]
  names = {tool.run_name(tool.parse(base + extra)) for extra in (
      [], ["--lr", "1e-4"], ["--batch", "8"], ["--length", "32"], ["--layers", "3"],
      ["--continue-steps", "5"], ["--large", "trains"], ["--decoder-lr-scale", "1"],
      ["--warmup", "5"], ["--continue-length", "16"])}
  assert len(names) == 10
  assert tool.run_name(tool.parse(base)) == "n64_c32_steps100-40-0_b4_lr0.001_dec0.1_w20_large-frozen"
  assert tool.run_name(tool.parse(base + ["--ratios", "8", "--seeds", "1"])) == \
      tool.run_name(tool.parse(base))  # the grid is not part of the setting


def test_a_resumed_sweep_runs_only_what_its_work_file_lacks(tmp_path, monkeypatch, imported):
  argv = ["--ratios", "4", "--seeds", "0", "1", "--memories", "tokens", "none", "--steps", "2",
          "--latency-length", "0", "--work", str(tmp_path), "--out", str(tmp_path / "r.md")]
  log = tmp_path / f"{tool.run_name(tool.parse(argv))}.jsonl"
  log.write_text(json.dumps(_run(4, "tokens", 0, 2.0)) + "\n")
  ran = []
  monkeypatch.setattr(sm, "RESTORE_PROMPT", "w3 w4")  # words the tokenizer knows
  monkeypatch.setattr(sm, "QA_PROMPT", "{} w4")
  monkeypatch.setattr(tool, "load_smollm2", lambda layers=None: (TINY, imported, WordTokenizer()))
  ex = sm.restore_examples(_random(9, (70, 8)), PROMPT, EOS)
  monkeypatch.setattr(tool, "stage_data", lambda *a: {"restore": {"train": ex,
                                                                  "validation": ex}})
  monkeypatch.setattr(tool, "run_one", lambda *a: ran.append(a[-1]) or _run(*a[-1], 1.5))
  tool.main(argv)
  assert ran == [(4, "tokens", 1), (None, "none", 0)]
  assert [json.loads(x)["seed"] for x in log.read_text().splitlines()] == [0, 1, 0]
  assert "| 4 | tokens | 2 |" in (tmp_path / "r.md").read_text()


def test_the_restoration_prompt_is_the_librarys():
  """The tool writes out the library's stage-1 prompt (it must not import the seqio tasks)."""
  from decal_jax.tasks import squid_tasks
  assert sm.RESTORE_PROMPT == squid_tasks.RESTORE_PROMPT
