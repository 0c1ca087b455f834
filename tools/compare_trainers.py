"""Steps / second of T5X's trainer and decal_jax's on one network config, interleaved rounds.

  PYTHONPATH=/path/to/t5x-site python -m tools.compare_trainers \
      --rounds=3 --steps=60 --ratios 1 4 --dtypes float32 bfloat16 \
      --out=docs/results/compare_trainers_cpu.jsonl
  PYTHONPATH=/path/to/t5x-site python -m tools.compare_trainers --packing yes \
      --rounds=3 --steps=60 --ratios 1 4 --dtypes float32 \
      --out=docs/results/compare_trainers_packed_cpu.jsonl   # tokens/s, packed

Three trainers, each a fresh `python -m ...` process in an empty MODEL_DIR:
  t5x+t5x    `python -m t5x.train` with T5X's own network (t5x/examples/t5/t5_1_1/small.gin,
             resized; C = 1 only: it has no compression);
  t5x+ours   `python -m t5x.train` with decal_jax's network (gin/t5x/decal_t5_1_1_tiny.gin,
             resized);
  ours       `python -m decal_jax.train` (gin/runs/pretrain_builtin.gin, resized).
Every run reads the built-in span-corruption task (`decal_builtin_span_corruption`, built-in
vocabulary of 4,224 ids), batch --batch_size, --inputs / --targets tokens, no
dropout, Adafactor (T5X's in the T5X runs, decal_jax's optax one in ours), and sizes the
network as --emb_dim / --layers / --heads / --head_dim / --mlp_dim (default: the issue's
"reduced small": 256, 4 + 4, 4 x 64, 1024). A round runs every (ratio, dtype, trainer) once,
the trainers' order reversed every other round, so slow drift in the machine's load hits
them alike.

Packing (`--packing no yes`): each trainer packs as it does by default under T5X
(`DatasetConfig.pack=True`: seqio's EncDecFeatureConverter packs several examples into each
row, with segment ids and positions) or reads one example per row. Both trainers get their
batches from the same seqio task and feature converter, so a step holds the same number of
real tokens on average in either; that number (non-padding input + target tokens per batch)
is counted once from seqio itself, over the first --count_batches batches of the task at
the run's lengths, and tokens / s = steps / s x that count. Each run also records what the
trainer itself logged as a check: decal_jax's tokens / s over its steps / s, and T5X's
`non_padding_fraction/loss_weights` (real target tokens over target slots).

Steady-state steps / s of a run: the median over its logging windows (--log_period steps
each: T5X's `train.stats_period`, decal_jax's LOG_PERIOD) of the steps / s the trainer
itself writes to MODEL_DIR/train (T5X: `timing/steps_per_second`; decal_jax:
`steps_per_second`), the first window left out (it holds the first step's compilation in
decal_jax and warm-up in both). Printed per round, then the medians over rounds with their
range, and the ratios to `t5x+ours` (same network, other trainer). Each run appends a JSON
line to --out with the load average before it.

`--xla_costs` instead compiles, in this process, decal_jax's train step
(`trainer.make_train_step`) and T5X's (`t5x.trainer.train_with_lr`, state donated as
`t5x.train` does) for the same network, batch and lengths, and prints XLA's cost analysis
(FLOPs, bytes accessed, transcendentals) of each step and of its parts: forward + backward of
the loss, and the optimizer update alone. These counts are deterministic, so they show
where two steps differ even on a loaded machine. It then times each compiled program, the
two trainers' alternately (--steps repetitions after 2 warm-up calls; a train step runs on
its own donated state), and prints the medians and ours / T5X's: the steps alone, without
either trainer's host loop or input pipeline:

  PYTHONPATH=/path/to/t5x-site python -m tools.compare_trainers --xla_costs
"""
import argparse
import glob
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from decal_jax.runtime import gin_utils
from tools import benchmarking, results_files

TRAINERS = ("t5x+t5x", "t5x+ours", "ours")
TAGS = {"t5x+t5x": "timing/steps_per_second", "t5x+ours": "timing/steps_per_second",
        "ours": "steps_per_second"}
# What each trainer logs about the tokens of a step (a check on the seqio count).
TOKEN_TAGS = {"t5x+t5x": "non_padding_fraction/loss_weights",
              "t5x+ours": "non_padding_fraction/loss_weights", "ours": "tokens_per_second"}
# T5X's own network, resized, reading decal_jax's built-in task (written to a temporary file:
# it is the tool's setting, not a config of the library).
T5X_NETWORK_GIN = """from __gin__ import dynamic_registration
from decal_jax.data import vocabularies
from t5x.examples.t5 import network
include 't5x/examples/t5/t5_1_1/small.gin'
VOCABULARY = @vocabularies.builtin_vocabulary()
vocabularies.task_vocabulary.vocabulary = %VOCABULARY
DROPOUT_RATE = 0.0
network.T5Config:
  vocab_size = 4224
  emb_dim = {emb_dim}
  num_heads = {heads}
  head_dim = {head_dim}
  mlp_dim = {mlp_dim}
  num_encoder_layers = {layers}
  num_decoder_layers = {layers}
  dtype = '{dtype}'
"""


def t5x_site() -> str:
  """The folder T5X is imported from (its gin files live under it: t5x/configs, t5x/examples)."""
  import importlib.util
  spec = importlib.util.find_spec("t5x.train") if importlib.util.find_spec("t5x") else None
  if spec is None or spec.origin is None:
    sys.exit("T5X is not importable: put its install on PYTHONPATH (docs/t5x.md), or run "
             "only decal_jax's trainer with --trainers ours.")
  return os.path.dirname(os.path.dirname(spec.origin))


def network_bindings(args, ratio: int, dtype: str) -> List[str]:
  """decal_jax's network at the compared size (gin/models/t5_1_1.gin's macros)."""
  sizes = dict(emb_dim=args.emb_dim, num_heads=args.heads, head_dim=args.head_dim,
               mlp_dim=args.mlp_dim, num_encoder_layers=args.layers,
               num_decoder_layers=args.layers)
  return ([f"--gin.t5.T5Config.{k}={v}" for k, v in sizes.items()] +
          [f"--gin.COMPRESSION_RATIO={ratio}", f"--gin.ACTIVATION_DTYPE='{dtype}'",
           "--gin.DROPOUT_RATE=0.0"])


def command(trainer: str, args, ratio: int, dtype: str, model_dir: str, tmp: str,
            pack: bool = False) -> List[str]:
  """The command line of one run."""
  steps, lengths = args.steps, f"{{'inputs': {args.inputs}, 'targets': {args.targets}}}"
  run = [f"--gin.MODEL_DIR='{model_dir}'", f"--gin.TRAIN_STEPS={steps}",
         f"--gin.BATCH_SIZE={args.batch_size}", f"--gin.TASK_FEATURE_LENGTHS={lengths}",
         f"--gin.MIXTURE_OR_TASK_NAME='{args.task}'"]
  if trainer == "ours":
    return [sys.executable, "-m", "decal_jax.train", "--gin_file=runs/pretrain_builtin.gin",
            *run, f"--gin.LOG_PERIOD={args.log_period}", f"--gin.EVAL_PERIOD={10 * steps}",
            "--gin.EVAL_BATCHES=1", f"--gin.CHECKPOINT_PERIOD={10 * steps}",
            f"--gin.train/pipeline.DatasetConfig.pack={pack}",
            *network_bindings(args, ratio, dtype)]
  if trainer == "t5x+ours":
    family = ["--gin_file=t5x/decal_t5_1_1_tiny.gin", *network_bindings(args, ratio, dtype)]
  else:
    network_gin = os.path.join(tmp, f"t5x_network_{dtype}.gin")
    with open(network_gin, "w") as f:
      f.write(T5X_NETWORK_GIN.format(emb_dim=args.emb_dim, heads=args.heads,
                                     head_dim=args.head_dim, mlp_dim=args.mlp_dim,
                                     layers=args.layers, dtype=dtype))
    family = [f"--gin_file={network_gin}"]
  return [sys.executable, "-m", "t5x.train",
          f"--gin_search_paths={gin_utils.GIN_DIR},{t5x_site()}", *family,
          "--gin_file=t5x/runs/pretrain.gin", *run,
          f"--gin.train.stats_period={args.log_period}", f"--gin.train.eval_period={steps}",
          "--gin.train.eval_steps=1", f"--gin.utils.SaveCheckpointConfig.period={10 * steps}",
          f"--gin.train/utils.DatasetConfig.pack={pack}",
          f"--gin.train_eval/utils.DatasetConfig.pack={pack}"]


def read_scalars(model_dir: str, tag: str) -> List[float]:
  """The values of `tag` in MODEL_DIR/train's TensorBoard events, in step order."""
  import tensorflow as tf
  points = {}
  for path in glob.glob(os.path.join(model_dir, "train", "events.out.tfevents.*")):
    for event in tf.compat.v1.train.summary_iterator(path):
      for value in event.summary.value:
        if value.tag == tag:
          points[event.step] = float(tf.make_ndarray(value.tensor) if value.HasField("tensor")
                                     else value.simple_value)
  return [points[step] for step in sorted(points)]


def run_one(trainer: str, args, ratio: int, dtype: str, tmp: str, pack: bool = False) -> Dict:
  """Trains once in a fresh MODEL_DIR; its steady-state steps / s and what it took."""
  model_dir = tempfile.mkdtemp(prefix=f"{trainer.replace('+', '_')}_", dir=tmp)
  cmd = command(trainer, args, ratio, dtype, model_dir, tmp, pack)
  load = benchmarking.load_average()
  start = time.time()
  with open(os.path.join(model_dir, "log.txt"), "w") as log:
    proc = subprocess.run(cmd, cwd=benchmarking.REPO, stdout=log, stderr=subprocess.STDOUT,
                          check=False)
  wall = time.time() - start
  if proc.returncode:
    with open(os.path.join(model_dir, "log.txt")) as log:
      tail = log.read()[-3000:]
    sys.exit(f"{trainer} failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")
  windows = read_scalars(model_dir, TAGS[trainer])
  if len(windows) < 2:
    sys.exit(f"{trainer} wrote {len(windows)} steps/s windows in {model_dir}/train; "
             "need --steps >= 2 x --log_period.")
  logged = read_scalars(model_dir, TOKEN_TAGS[trainer])[1:]
  check = (statistics.median(t / s for t, s in zip(logged, windows[1:])) if trainer == "ours"
           else statistics.median(logged)) if logged else None
  return dict(trainer=trainer, ratio=ratio, dtype=dtype, pack=pack,
              steps_per_s=statistics.median(windows[1:]), windows=windows, wall_s=wall,
              load_before=load, logged_token_check=check, command=" ".join(cmd))


def real_tokens_per_batch(args, pack: bool) -> Dict[str, float]:
  """Mean non-padding input and target tokens per batch of the compared task, from seqio
  itself (the feature converter both trainers use) over the first --count_batches batches."""
  import gin
  import numpy as np
  import seqio
  # the vocabulary both trainers' gin files bind for the downstream tasks (gin may be
  # locked by an earlier parse in this process)
  with gin.unlock_config():
    import decal_jax.tasks  # noqa: F401  (registers the built-in tasks)
    from decal_jax.data import vocabularies
    gin.bind_parameter("vocabularies.task_vocabulary.vocabulary",
                       vocabularies.builtin_vocabulary())
  lengths = {"inputs": args.inputs, "targets": args.targets}
  ds = seqio.get_dataset(args.task, lengths, dataset_split="train", shuffle=False, num_epochs=None,
                         feature_converter=seqio.EncDecFeatureConverter(pack=pack),
                         verbose=False).batch(args.batch_size, drop_remainder=True)
  inputs, targets = [], []
  for batch in ds.take(args.count_batches).as_numpy_iterator():
    inputs.append(int(np.sum(batch["encoder_input_tokens"] > 0)))
    targets.append(int(np.sum(batch["decoder_target_tokens"] > 0)))
  return dict(inputs=float(np.mean(inputs)), targets=float(np.mean(targets)),
              tokens=float(np.mean(inputs) + np.mean(targets)),
              target_fraction=float(np.mean(targets)) / (args.batch_size * args.targets))


def check_tokens(row: Dict, count: Dict[str, float], tolerance: float = 0.25) -> bool:
  """Whether what the trainer logged agrees with the seqio count within `tolerance`
  (relative): decal_jax's real tokens per step, T5X's real share of the target slots. A
  check for a gross mistake (another task or other lengths), not a measurement: a trainer
  shuffles its examples, and a few logging windows of short QA answers vary by 10-15 %
  around the count. Prints a warning when it does not agree."""
  logged = row.get("logged_token_check")
  want = count["tokens"] if row["trainer"] == "ours" else count["target_fraction"]
  if logged is None or abs(logged - want) <= tolerance * want:
    return True
  print(f"  warning: {row['trainer']} logged {logged:.3g} "
        f"({'real tokens per step' if row['trainer'] == 'ours' else 'real target share'}), "
        f"the seqio count says {want:.3g}: is it reading another task or lengths?", flush=True)
  return False


def variants(args) -> List[tuple]:
  """(ratio, dtype, pack, trainer) of one round; T5X's network only at ratio 1."""
  return [(r, d, p, t) for r in args.ratios for d in args.dtypes for p in args.packing
          for t in args.trainers if not (t == "t5x+t5x" and r != 1)]


def summarize(rows: Sequence[Dict], tokens: Optional[Dict[bool, float]] = None) -> List[Dict]:
  """Median, min and max steps / s over rounds of every (ratio, dtype, pack, trainer); tokens
  / s = steps / s x `tokens[pack]` (real tokens per batch); and the ratio of each median to
  t5x+ours's at the same ratio, dtype and packing."""
  def key(r):
    return (r["ratio"], r["dtype"], r.get("pack", False), r["trainer"])
  keys = sorted({key(r) for r in rows}, key=lambda k: (*k[:3], TRAINERS.index(k[3])))
  out = []
  for ratio, dtype, pack, trainer in keys:
    values = [r["steps_per_s"] for r in rows if key(r) == (ratio, dtype, pack, trainer)]
    median = statistics.median(values)
    out.append(dict(ratio=ratio, dtype=dtype, pack=pack, trainer=trainer, rounds=len(values),
                    median=median, low=min(values), high=max(values),
                    tokens_per_s=median * tokens[pack] if tokens else None))
  for row in out:
    base = [o["median"] for o in out if key(o) == (row["ratio"], row["dtype"], row["pack"],
                                                   "t5x+ours")]
    row["vs_t5x_trainer"] = row["median"] / base[0] if base else None
  return out


def print_summary(summary: Sequence[Dict]) -> None:
  print(f"\n{'C':>3} {'dtype':<9}{'packed':<7}{'trainer':<10}{'rounds':>7}{'steps/s':>9}"
        f"{'range':>14}{'tokens/s':>10}{'vs t5x+ours':>13}")
  for s in summary:
    ratio = f"{s['vs_t5x_trainer']:.2f}x" if s["vs_t5x_trainer"] else ""
    tokens = f"{s['tokens_per_s']:.0f}" if s["tokens_per_s"] else ""
    print(f"{s['ratio']:>3} {s['dtype']:<9}{'yes' if s['pack'] else 'no':<7}{s['trainer']:<10}"
          f"{s['rounds']:>7}{s['median']:>9.2f}{s['low']:>7.2f}-{s['high']:<6.2f}{tokens:>10}"
          f"{ratio:>13}")


# ----------------------------------------------------------------------------- XLA costs
def xla_costs(args, ratio: int = 1, dtype: str = "float32") -> Dict[str, Dict[str, float]]:
  """XLA cost analysis of decal_jax's and T5X's train steps (and their parts) on one network."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from t5x import adafactor as t5x_adafactor
  from t5x import models as t5x_models
  from t5x import train_state as t5x_train_state
  from t5x import trainer as t5x_trainer
  from decal_jax import partitioning
  from decal_jax.runtime import optimizers, train_state, trainer
  from decal_jax.data import pipeline

  bindings = [b[len("--gin."):].replace("=", " = ", 1) for b in network_bindings(args, ratio, dtype)]
  model = gin_utils.load_model(["models/decal_tiny.gin"], bindings=bindings).model
  lengths = {"inputs": args.inputs, "targets": args.targets}
  rng = np.random.RandomState(0)
  targets = rng.randint(2, 4224, (args.batch_size, args.targets)).astype(np.int32)
  batch = {"encoder_input_tokens": rng.randint(2, 4224, (args.batch_size, args.inputs)).astype(
               np.int32), "decoder_target_tokens": targets,
           "decoder_input_tokens": np.pad(targets, ((0, 0), (1, 0)))[:, :-1],
           "decoder_loss_weights": np.ones(targets.shape, np.float32)}
  batch = {k: jnp.asarray(v) for k, v in batch.items()}
  key = jax.random.PRNGKey(0)
  ours_opt, part = optimizers.adafactor(), partitioning.Partitioner()
  state, shardings = train_state.init_state(model, ours_opt, part, pipeline.DatasetConfig(
      "synthetic", lengths, batch_size=args.batch_size), seed=0)
  theirs = t5x_models.EncoderDecoderModel(
      module=model.module, input_vocabulary=model.input_vocabulary,
      output_vocabulary=model.output_vocabulary, z_loss=1e-4,
      optimizer_def=t5x_adafactor.Adafactor(
          decay_rate=0.8, step_offset=0,
          logical_factor_rules=t5x_adafactor.standard_logical_factor_rules()))
  variables = theirs.get_initial_variables(key, {k: v.shape for k, v in batch.items()},
                                           {k: v.dtype for k, v in batch.items()})
  t5x_state = t5x_train_state.FlaxOptimTrainState.create(theirs.optimizer_def, variables)

  def t5x_step(t5x_state, batch):
    return t5x_trainer.train_with_lr(t5x_state, batch, learning_rate=jnp.float32(0.01),
                                     dropout_rng=key, model=theirs, num_microbatches=None)

  def ours_update(params, opt_state, grads):
    updates, opt_state = ours_opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  params, grads = state["params"], jax.tree_util.tree_map(lambda p: 1e-3 * p, state["params"])
  with part.activate():
    programs = {
        "ours: train step": trainer.make_train_step(model, ours_opt, part, shardings).jitted.lower(
            state, batch, key),
        "t5x: train step": jax.jit(t5x_step, donate_argnums=(0,)).lower(t5x_state, batch),
        "ours: forward + backward": jax.jit(jax.value_and_grad(model.loss_fn, has_aux=True)).lower(
            params, batch, key),
        "t5x: forward + backward": jax.jit(jax.value_and_grad(theirs.loss_fn, has_aux=True)).lower(
            params, batch, key),
        "ours: Adafactor update": jax.jit(ours_update).lower(params, state["opt_state"], grads),
        "t5x: Adafactor update": jax.jit(lambda s, g: s.apply_gradient(
            g, learning_rate=0.01)).lower(t5x_state, grads)}
  costs = {}
  print(f"\nXLA cost analysis, C={ratio} {dtype} (one step):")
  for name, lowered in programs.items():
    analysis = lowered.compile().cost_analysis()
    analysis = analysis[0] if isinstance(analysis, list) else analysis
    costs[name] = {k: float(analysis.get(k, 0.0)) for k in
                   ("flops", "bytes accessed", "transcendentals")}
    c = costs[name]
    print(f"  {name:<28}{c['flops'] / 1e9:9.2f} GFLOP{c['bytes accessed'] / 1e6:9.0f} MB"
          f"{c['transcendentals'] / 1e6:8.2f} M transcendentals", flush=True)
  inputs = {"ours: train step": (state, batch, key), "t5x: train step": (t5x_state, batch),
            "ours: forward + backward": (params, batch, key),
            "t5x: forward + backward": (params, batch, key),
            "ours: Adafactor update": (params, state["opt_state"], grads),
            "t5x: Adafactor update": (t5x_state, grads)}
  seconds = time_programs({n: lowered.compile() for n, lowered in programs.items()}, inputs,
                          args.steps)
  print(f"\nmedian seconds of {args.steps} calls, alternating (ours / T5X's):")
  for part in ("train step", "forward + backward", "Adafactor update"):
    a, b = seconds[f"ours: {part}"], seconds[f"t5x: {part}"]
    costs[f"ours: {part}"]["seconds"], costs[f"t5x: {part}"]["seconds"] = a, b
    print(f"  {part:<20}{1e3 * a:9.1f} ms {1e3 * b:9.1f} ms   x{a / b:.3f}", flush=True)
  return costs


def time_programs(compiled: Dict[str, Any], inputs: Dict[str, tuple], calls: int
                  ) -> Dict[str, float]:
  """Median wall seconds per program, each called `calls` times after 2 warm-up calls, the
  programs taking turns; a train step (its first input donated) is fed its own output state."""
  import jax
  import numpy as np
  inputs = {name: (jax.tree_util.tree_map(jax.numpy.copy, args[0]), *args[1:]) if
            name.endswith("train step") else args for name, args in inputs.items()}
  times: Dict[str, List[float]] = {name: [] for name in compiled}
  for call in range(calls + 2):
    for name, program in compiled.items():
      start = time.perf_counter()
      out = jax.block_until_ready(program(*inputs[name]))
      if name.endswith("train step"):
        inputs[name] = (out[0], *inputs[name][1:])
      if call >= 2:
        times[name].append(time.perf_counter() - start)
  return {name: float(np.median(t)) for name, t in times.items()}


def parse_args(argv: Optional[Sequence[str]]):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--steps", type=int, default=60, help="train steps of each run")
  p.add_argument("--log_period", type=int, default=10, help="steps per steps/s window")
  p.add_argument("--ratios", type=int, nargs="+", default=[1, 4])
  p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                 choices=["float32", "bfloat16"])
  p.add_argument("--trainers", nargs="+", default=list(TRAINERS), choices=TRAINERS)
  p.add_argument("--packing", nargs="+", default=["no"], choices=["no", "yes"],
                 help="read one example per row (no) and / or pack several (yes)")
  p.add_argument("--task", default="decal_builtin_span_corruption",
                 help="a built-in task (span corruption fills every row; the QA task's "
                 "examples are shorter than a row, so packing pays)")
  p.add_argument("--count_batches", type=int, default=200,
                 help="batches over which real tokens per batch are counted")
  p.add_argument("--batch_size", type=int, default=8)
  p.add_argument("--inputs", type=int, default=128)
  p.add_argument("--targets", type=int, default=32)
  p.add_argument("--emb_dim", type=int, default=256)
  p.add_argument("--layers", type=int, default=4, help="encoder layers = decoder layers")
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--head_dim", type=int, default=64)
  p.add_argument("--mlp_dim", type=int, default=1024)
  p.add_argument("--work", default=None, help="MODEL_DIRs go here (default: a temp folder)")
  p.add_argument("--out", default=None, help="JSON lines file to append each run to")
  p.add_argument("--xla_costs", action="store_true", help="print XLA's cost analysis of both "
                 "trainers' steps (in this process) instead of running the trainers")
  args = p.parse_args(argv)
  args.packing = [value == "yes" for value in args.packing]
  if args.steps < 2 * args.log_period:
    p.error("--steps must be >= 2 x --log_period (the first window is left out).")
  return args


def main(argv: Optional[Sequence[str]] = None) -> List[Dict]:
  args = parse_args(argv)
  if args.xla_costs:
    return [dict(ratio=r, dtype=d, costs=xla_costs(args, r, d)) for r in args.ratios
            for d in args.dtypes]
  tmp = args.work or tempfile.mkdtemp(prefix="compare_trainers_")
  os.makedirs(tmp, exist_ok=True)
  record = dict(date=time.strftime("%Y-%m-%dT%H:%M:%S%z"), cpu=benchmarking.cpu_name(),
                cpu_cores=benchmarking.cpu_cores(),
                tool=benchmarking.command("tools.compare_trainers", argv))
  print(f"{record['date']}  {record['cpu']}, {record['cpu_cores']} cores  work: {tmp}")
  counts = {pack: real_tokens_per_batch(args, pack) for pack in args.packing}
  for pack, count in counts.items():
    print(f"{'packed' if pack else 'unpacked'}: {count['inputs']:.0f} input + "
          f"{count['targets']:.0f} target real tokens per batch (seqio, first "
          f"{args.count_batches} batches)")
  rows = []
  for round_index in range(args.rounds):
    order = benchmarking.alternating(variants(args), round_index)
    for ratio, dtype, pack, trainer in order:
      row = dict(record, round=round_index, real_tokens_per_batch=counts[pack],
                 **run_one(trainer, args, ratio, dtype, tmp, pack))
      rows.append(row)
      print(f"round {round_index}  C={ratio} {dtype:<9}{'packed' if pack else 'unpacked':<9}"
            f"{trainer:<10}{row['steps_per_s']:7.2f} steps/s  (load {row['load_before']}, "
            f"{row['wall_s']:.0f} s)", flush=True)
      check_tokens(row, counts[pack])
      if args.out:
        results_files.write_jsonl(args.out, [row])
  summary = summarize(rows, {pack: c["tokens"] for pack, c in counts.items()})
  print_summary(summary)
  print(f"load average now: {benchmarking.load_average()}")
  return summary


if __name__ == "__main__":
  main()
