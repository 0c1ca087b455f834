"""The ablation harness: its gin files, its refusals, and one tiny end-to-end run."""
import dataclasses
import json

import matplotlib.figure
import matplotlib.image
import pytest

from tools import ablation


def test_every_budget_and_variant_file_loads_and_fits():
  assert set(ablation.known("budgets")) >= {"smoke", "gpu"}
  listed = set()
  for name in ablation.known("budgets"):
    budget = ablation.load_budget(name)
    variants = ablation.load_variants(budget.variants)
    ablation.check(budget, variants)
    listed |= {v.name for v in variants}
  assert listed == set(ablation.known("variants"))  # no variant file is left unused


def test_dependencies_come_first():
  order = [v.name for v in ablation.load_variants(["ccproxy_2x", "decal_2x_finetune_only"])]
  assert order[0] == "baseline"
  assert set(order) == {"baseline", "ccproxy_2x", "decal_2x_finetune_only"}


def test_unknown_names_list_the_known_ones():
  with pytest.raises(ValueError, match="Unknown variant 'decal_3x'; known: .*decal_2x.*"):
    ablation.load_variants(["decal_3x"])
  with pytest.raises(ValueError, match="Unknown budget 'huge'; known: cpu, gpu, smoke"):
    ablation.load_budget("huge")


@pytest.mark.parametrize("change,match", [
    (dict(finetune_lengths={"inputs": 100, "targets": 16}), "not divisible by 8"),
    (dict(pretrain_lengths={"inputs": 4, "targets": 32}), "ratio exceeds"),
    (dict(pretrain_lengths={"inputs": 128, "targets": 20}), "targets'] >= 29"),
    (dict(autoencode_lengths={"inputs": 128, "targets": 64}), "autoencoding needs")])
def test_budgets_that_cannot_fit_are_refused_before_training(change, match):
  budget = dataclasses.replace(ablation.load_budget("smoke"), **change)
  with pytest.raises(ValueError, match=match):
    ablation.check(budget, ablation.load_variants(budget.variants))


@pytest.mark.parametrize("name", ["ccproxy_2x", "decal_2x_autoencode"])
def test_autoencode_pretraining_continues_from_the_baseline(name, tmp_path):
  """CCProxy and the autoencode ablation (paper §4.2.5, §4.4): the baseline is trained
  first, and their autoencode + continuation stage restores its pretrained checkpoint."""
  budget = ablation.load_budget("smoke")
  order = [v.name for v in ablation.load_variants([name])]
  assert order == ["baseline", name]
  variant = ablation.load_variants([name])[1]
  stage, _, bindings = ablation.stage_configs(budget, variant, tmp_path)[0]
  assert stage == "pretrain"
  assert f"MIXTURE_OR_TASK_NAME = {budget.autoencode_task!r}" in bindings
  start = str(tmp_path / "baseline" / "pretrain")
  assert f"trainer.train.initial_checkpoint_path = {start!r}" in bindings


TINY_BUDGET = """
Budget.variants = ['ccproxy_2x', 'decal_2x_finetune_only']
Budget.model_gin = 'experiments/models/mini.gin'
Budget.pretrain_steps = 2
Budget.finetune_steps = 2
Budget.batch_size = 4
Budget.pretrain_lengths = {'inputs': 32, 'targets': 12}
Budget.autoencode_lengths = {'inputs': 32, 'targets': 32}
Budget.finetune_lengths = {'inputs': 64, 'targets': 8}
Budget.warmup_steps = 1
Budget.eval_batches = 1
Budget.max_predict_examples = 8
"""


def test_a_tiny_ablation_runs_resumes_and_reports(tmp_path, capsys):
  path = tmp_path / "tiny.gin"
  path.write_text(TINY_BUDGET)
  budget = ablation.load_budget(str(path))
  variants = ablation.load_variants(budget.variants)
  ablation.check(budget, variants)
  work = tmp_path / "work"
  ablation.claim(work, budget)
  results = [ablation.run_variant(budget, v, work) for v in variants]
  out = capsys.readouterr().out
  # CCProxy pretrains from the baseline: only its memory table is new.
  assert "Starting from" in out and "1 newly initialised" in out
  by_name = {r["name"]: r for r in results}
  assert set(by_name) == {"baseline", "ccproxy_2x", "decal_2x_finetune_only"}
  assert "pretrain" not in by_name["decal_2x_finetune_only"]["seconds"]
  for r in results:
    assert 0 <= r["metrics"]["em"] <= r["metrics"]["f1"] <= 100
    assert (work / r["name"] / "finetune" / "inference_eval").is_dir()
  # FLOPs against the baseline: the 2x variants read half as many keys in cross-attention.
  text = ablation.table(budget, results)
  rows = {line.split("|")[1].strip(): line for line in text.splitlines()[2:]}
  assert "| 1.00x | 1.00x |" in rows["Baseline"]
  assert " 1.00x" not in rows["CCProxy 2x"].split("|")[7]
  # A rerun skips finished variants; a variant without its result.json resumes its stages.
  (work / "ccproxy_2x" / "result.json").unlink()
  again = [ablation.run_variant(budget, v, work) for v in variants]
  out = capsys.readouterr().out
  assert out.count("done before") == 2 and "Resuming from step 2" in out
  assert json.loads((work / "ccproxy_2x" / "result.json").read_text())["metric"] == \
      again[1]["metric"]
  # The same folder under a different budget is refused, naming what changed.
  ablation.claim(work, budget)
  with pytest.raises(ValueError, match="another budget .*finetune_steps.*another --work"):
    ablation.claim(work, dataclasses.replace(budget, finetune_steps=3))


def _result(name, family, ratio, em, f1, encoder, cross, seconds, objective="span_corruption"):
  return {"name": name, "label": name.upper(), "family": family, "ratio": ratio,
          "pretrain_objective": objective, "pretrain_accuracy": 0.25 if objective else None,
          "finetune_from": None if objective else "baseline", "metric": em,
          "metrics": {"em": em, "f1": f1}, "flops": {"encoder": encoder,
                                                     "cross_attention": cross},
          "seconds": {"pretrain": seconds / 2, "finetune": seconds / 2}}


HAND_MADE = [_result("baseline", "baseline", 1, 40.0, 50.0, 8e9, 4e9, 100),
             _result("decal_2x", "decal", 2, 30.04, 45.06, 6e9, 2.5e9, 81),
             _result("decal_4x", "decal", 4, 20.0, 35.0, 5e9, 1.5e9, 60, objective=None)]


def test_table_shows_the_results_given(tmp_path):
  budget = ablation.load_budget("smoke")
  lines = ablation.table(budget, HAND_MADE).splitlines()
  cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
  assert cells == [
      ["BASELINE", "span corruption", "0.250", "40.0", "50.0", "1.00x", "1.00x", "100"],
      ["DECAL_2X", "span corruption", "0.250", "30.0", "45.1", "0.75x", "0.62x", "81"],
      ["DECAL_4X", "none (uses baseline's)", "-", "20.0", "35.0", "0.62x", "0.38x", "60"]]


def test_plot_draws_the_results_given(tmp_path, monkeypatch):
  figures, real_savefig = [], matplotlib.figure.Figure.savefig

  def keep_figure(figure, *args, **kwargs):
    figures.append(figure)
    return real_savefig(figure, *args, **kwargs)

  monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep_figure)
  ablation.plot(ablation.load_budget("smoke"), HAND_MADE, tmp_path / "plot.png")
  image = matplotlib.image.imread(tmp_path / "plot.png")  # decodes as a PNG: [h, w, RGBA]
  assert image.shape == (round(4.2 * 120), round(6.4 * 120), 4) and image.std() > 0
  ((ax,),) = [figure.axes for figure in figures]
  baseline, decal = ax.lines  # the baseline's level, then the DeCAL family's line
  assert list(baseline.get_ydata()) == [40.0, 40.0]
  assert list(decal.get_xdata()) == [2, 4] and list(decal.get_ydata()) == [30.04, 20.0]


def test_a_record_restores_finished_variants_but_reruns_a_needed_one_without_checkpoint(tmp_path):
  """save_record keeps WORK's results; restore_record puts them into a fresh WORK, except a
  finished variant that one still to run starts from while its checkpoint is not there."""
  budget = dataclasses.replace(ablation.load_budget("smoke"), variants=())
  old, record = tmp_path / "old", tmp_path / "record.json"
  ablation.claim(old, budget)
  for name in ("baseline", "decal_2x"):
    (old / name).mkdir()
    (old / name / "result.json").write_text(json.dumps({"name": name}))
  assert ablation.save_record(record, old) == 2
  variants = ablation.load_variants(["baseline", "decal_2x", "ccproxy_2x"])  # from baseline
  fresh = tmp_path / "fresh"
  assert ablation.restore_record(record, fresh, variants) == ["decal_2x"]
  ablation.claim(fresh, budget)  # the recorded budget is this one
  (fresh / "baseline" / "pretrain").mkdir(parents=True)  # its checkpoint is here now
  assert ablation.restore_record(record, fresh, variants) == ["baseline"]
  assert json.loads((fresh / "baseline" / "result.json").read_text()) == {"name": "baseline"}
  with pytest.raises(ValueError, match="another budget"):
    ablation.claim(fresh, dataclasses.replace(budget, seed=1))


def _seed(result, seed, em, f1, accuracy, seconds):
  return dict(result, seed=seed, metric=em, metrics={"em": em, "f1": f1},
              pretrain_accuracy=accuracy, seconds={"pretrain": seconds})


def test_several_seeds_show_mean_and_standard_error_per_variant(tmp_path):
  """Two seeds of each variant: by hand, EM 40 and 30 -> mean 35, sample sd 7.071, s.e.
  7.071 / sqrt(2) = 5.0; F1 50, 44 -> 47 ± 3.0; accuracy 0.25, 0.35 -> 0.300 ± 0.050."""
  base, decal = HAND_MADE[0], HAND_MADE[1]
  results = [_seed(base, 0, 40.0, 50.0, 0.25, 100), _seed(decal, 0, 20.0, 30.0, 0.2, 60),
             _seed(base, 1, 30.0, 44.0, 0.35, 80), _seed(decal, 1, 20.0, 30.0, 0.2, 70)]
  lines = ablation.table(ablation.load_budget("smoke"), results).splitlines()
  cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
  assert cells == [
      ["BASELINE", "span corruption", "0.300 ± 0.050", "35.0 ± 5.0", "47.0 ± 3.0", "1.00x",
       "1.00x", "90"],
      ["DECAL_2X", "span corruption", "0.200 ± 0.000", "20.0 ± 0.0", "30.0 ± 0.0", "0.75x",
       "0.62x", "65"]]
  figures = []
  real_savefig = matplotlib.figure.Figure.savefig
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(matplotlib.figure.Figure, "savefig",
                  lambda f, *a, **k: (figures.append(f), real_savefig(f, *a, **k)))
    ablation.plot(ablation.load_budget("smoke"), results, tmp_path / "plot.png")
  ((ax,),) = [figure.axes for figure in figures]
  assert list(ax.lines[0].get_ydata()) == [35.0, 35.0]  # the baseline's mean
  (bars,) = ax.collections  # DeCAL's error bar: 20 ± 0
  assert [list(map(float, s[:, 1])) for s in bars.get_segments()] == [[20.0, 20.0]]


def test_ablate_seeds_runs_each_seed_in_its_own_folder(tmp_path, capsys):
  """`ablate --seeds 0 1` claims WORK/seed0 and WORK/seed1 under budgets that differ only
  in the seed, restores each seed's --record, skips the finished variants and writes the
  mean ± s.e. table (no training: every variant is in the records)."""
  from tools import ablate
  smoke = dataclasses.replace(ablation.load_budget("smoke"), variants=())
  for seed, em in ((0, 10.0), (1, 14.0)):  # 12 ± 2
    scratch = tmp_path / f"scratch{seed}"
    ablation.claim(scratch, dataclasses.replace(smoke, seed=seed))
    (scratch / "baseline").mkdir()
    (scratch / "baseline" / "result.json").write_text(json.dumps(
        _seed(HAND_MADE[0], seed, em, em, 0.25, 50), indent=1))
    ablation.save_record(tmp_path / f"rec_seed{seed}.json", scratch)
  out = tmp_path / "table.md"
  ablate.main(["--budget", "smoke", "--variants", "baseline", "--seeds", "0", "1",
               "--work", str(tmp_path / "w"), "--record", str(tmp_path / "rec.json"),
               "--out", str(out), "--no-plot"])
  assert capsys.readouterr().out.count("done before") == 2
  for seed in (0, 1):
    assert json.loads((tmp_path / "w" / f"seed{seed}" / "budget.json").read_text())["seed"] \
        == seed
  text = out.read_text()
  assert "--seeds 0 1" in text and "seeds 0, 1 (each cell: mean ± standard error" in text
  assert "| BASELINE | span corruption | 0.250 ± 0.000 | 12.0 ± 2.0 | 12.0 ± 2.0 |" in text
