"""What the tests of tests/bad_inputs/ share: the tiny trainer runs they damage or
interrupt, file snapshots, a tool by name."""
import importlib
import importlib.util
import pathlib
import shutil

import seqio

import decal_jax.tasks  # noqa: F401  (registers the tasks)
from decal_jax import partitioning
from decal_jax.runtime import train_state, trainer

from test_trainer import _cfg, _model, _optimizer


def _load_tool(name):
  return importlib.import_module(f"decal_jax.commands.{name}")


def _files_under(folder):
  return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def _write(path, data: bytes):
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_bytes(data)
  return path


def _examples(task, lengths):
  ds = seqio.get_mixture_or_task(task).get_dataset(lengths, split="validation", shuffle=False,
                                                   num_epochs=1)
  return list(ds.as_numpy_iterator())


def _train(model_dir, train_cfg=None, **settings):
  kw = dict(total_steps=3, checkpoint_period=3, eval_period=3, log_period=3, eval_batches=1,
            keep_checkpoints=1, show_example=False)
  return trainer.train(model=_model(), train_dataset_cfg=train_cfg or _cfg(),
                       model_dir=str(model_dir), optimizer=_optimizer(), **dict(kw, **settings))


def _train_tiny(model_dir, steps, **kw):
  """The tiny test_trainer model, a checkpoint after every step."""
  return trainer.train(model=_model(), train_dataset_cfg=_cfg(), model_dir=str(model_dir),
                       total_steps=steps, optimizer=_optimizer(), checkpoint_period=1,
                       eval_period=1000, eval_batches=1, log_period=1, show_example=False,
                       **kw)


def _copy(source, tmp_path):
  return pathlib.Path(shutil.copytree(source, tmp_path / "run"))


def _files(directory):
  """{relative path: contents} of every file under `directory`."""
  return {str(p.relative_to(directory)): p.read_bytes()
          for p in sorted(pathlib.Path(directory).rglob("*")) if p.is_file()}


def _params(model_dir, step):
  return train_state.restore_params(_model(), str(model_dir), _cfg(),
                                    partitioning.Partitioner(), step)[0]
