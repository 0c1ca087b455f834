"""T5X checkpoints, read and written without T5X.

T5X saves its train state `{'target': params, 'state': {'step', 'param_states'}}` in
`MODEL_DIR/checkpoint_<step>/` in one of two layouts (t5x/checkpoints.py):

- msgpack + TensorStore (`t5x.checkpoints.Checkpointer`; the public T5.1.1 checkpoints): a
  `checkpoint` msgpack file `{'version': 3, 'optimizer': state}` in which each array is
  inline or a TensorStore spec of a zarr array in the step folder, named by its path
  (`target.encoder.layers_0.attention.query.kernel/`). A spec written for GCS is read from
  the local copy of the folder, as T5X does.
- Orbax (`t5x.checkpoints.OrbaxCheckpointManagerInterface`, what `t5x.train` writes by
  default): an OCDBT PyTree item `state/` holding the same tree.

Only `target` (the params) is read; T5X's optimizer state is left. Names are those of
T5X's network (t5x/examples/t5/network.py), or ours for a T5X run of a decal_jax network
(gin/t5x/). `from_t5x_names` / `to_t5x_names` map T5X's T5.1.1 names to those of the T5
network (networks/t5.py, unrolled and unfused layout) and back:

  T5X network                                   decal_jax T5 network
  encoder/layers_i/attention/{query,key,value}  encoder/layers_i/attention_qkv/{...}
      kernel [embed, heads * kv]                    kernel [embed, heads, kv]
  encoder/layers_i/attention/out                encoder/layers_i/attention_out
      kernel [heads * kv, embed]                    kernel [heads, kv, embed]
  decoder/layers_i/<attention>/{query,key,value} decoder/layers_i/<attention>/qkv/{...}
  decoder/layers_i/<attention>/out              the same name, kernel [heads, kv, embed]
  every other parameter                         the same name and shape

(<attention>: self_attention or encoder_decoder_attention; `heads` is read from the
relative-position table, `[heads, buckets]`). `write_t5x_checkpoint` writes the msgpack +
TensorStore layout, which every T5X reader restores: `Checkpointer`, `load_t5x_checkpoint`
and the Orbax manager of `t5x.eval` / `t5x.infer` (which falls back to it).
"""
import pathlib
import re
from typing import Any, Dict, Iterator, Optional, Tuple

import flax
import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from flax import serialization

from decal_jax import fileio
from decal_jax.networks import param_layout

CHECKPOINT_FILE = "checkpoint"  # T5X's msgpack file in a step folder
VERSION = 3  # of T5X's msgpack layout (bfloat16 stored as bfloat16)
STEP_DIR = re.compile(r"checkpoint_(\d+)")
CHUNK_BYTES = 64 * 2**20  # T5X's target size of one zarr chunk
Flat = Dict[str, Any]  # '/'-joined parameter name -> array

# Attention kernels of T5X's T5 network, and of ours.
_T5X_ATTENTION = re.compile(
    r"(?P<stack>encoder|decoder)/(?P<layer>layers_\d+)/"
    r"(?P<attn>attention|self_attention|encoder_decoder_attention)/"
    r"(?P<proj>query|key|value|out)/kernel")
_OURS_ATTENTION = re.compile(
    r"(?P<stack>encoder|decoder)/(?P<layer>layers_\d+)/(?:attention_(?P<enc>qkv|out)/"
    r"(?:(?P<eproj>query|key|value)/)?|(?P<attn>self_attention|encoder_decoder_attention)/"
    r"(?:qkv/)?(?P<proj>query|key|value|out)/)kernel")
# Every other parameter of T5X's T5 network (the same name in ours).
_T5X_OTHER = re.compile(
    r"token_embedder/embedding|(encoder|decoder)/relpos_bias/rel_embedding|"
    r"encoder/encoder_norm/scale|decoder/decoder_norm/scale|decoder/logits_dense/kernel|"
    r"(encoder|decoder)/layers_\d+/(pre_attention_layer_norm|pre_self_attention_layer_norm|"
    r"pre_cross_attention_layer_norm|pre_mlp_layer_norm)/scale|"
    r"(encoder|decoder)/layers_\d+/mlp/(wi|wi_\d+|wo)/kernel")
T5X_RELPOS_BUCKETS = 32  # fixed in T5X's network


# ------------------------------------------------------------------------------ finding
def find_t5x_checkpoint(path: str) -> Optional[pathlib.Path]:
  """The T5X step folder `path` names (a MODEL_DIR: its latest `checkpoint_<step>`; a step
  folder, whatever its name; its `checkpoint` file), or None when it is no T5X checkpoint."""
  p = pathlib.Path(path).expanduser().absolute()
  if p.is_file() and p.name == CHECKPOINT_FILE:
    p = p.parent
  if p.is_dir() and not STEP_DIR.fullmatch(p.name) and not t5x_format(p):
    steps = [d for d in p.iterdir() if STEP_DIR.fullmatch(d.name) and d.is_dir()]
    if not steps:
      return None
    p = max(steps, key=lambda d: int(STEP_DIR.fullmatch(d.name).group(1)))
  return p if p.is_dir() and t5x_format(p) else None


def t5x_format(step_dir: pathlib.Path) -> str:
  """'msgpack' or 'orbax' for a T5X step folder, '' for anything else (a decal_jax
  checkpoint has an `architecture` item and no `target` in its state)."""
  step_dir = pathlib.Path(step_dir).absolute()  # Orbax reads absolute paths only
  if (step_dir / CHECKPOINT_FILE).is_file():
    return "msgpack" if is_msgpack_map(step_dir / CHECKPOINT_FILE) else ""
  if (step_dir / "architecture").exists() or not (step_dir / "state" / "_METADATA").exists():
    return ""
  try:
    return "orbax" if "target" in _orbax_tree(step_dir / "state") else ""
  except (ValueError, OSError):  # not an Orbax PyTree item after all
    return ""


def is_msgpack_map(path: pathlib.Path) -> bool:
  """Whether the file starts like a msgpack map, as T5X's `checkpoint` file does (a
  TensorFlow checkpoint's `checkpoint` file, of the same name, is a text index)."""
  try:
    with open(path, "rb") as f:
      first = f.read(1)
  except OSError:
    return False
  return bool(first) and (0x80 <= first[0] <= 0x8f or first[0] in (0xde, 0xdf))


def _orbax_tree(state_dir: pathlib.Path) -> Dict[str, Any]:
  return ocp.PyTreeCheckpointHandler().metadata(state_dir).tree


# ------------------------------------------------------------------------------ reading
def step_of(step_dir: pathlib.Path) -> int:
  """The step in a `checkpoint_<step>` folder's name (0 for a renamed folder)."""
  match = STEP_DIR.fullmatch(step_dir.name)
  return int(match.group(1)) if match else 0


def read_t5x_params(step_dir: pathlib.Path) -> Flat:
  """The params (`target`) of a T5X step folder as numpy arrays, names as saved."""
  step_dir = pathlib.Path(step_dir).absolute()
  if t5x_format(step_dir) == "orbax":
    return _read_orbax_target(step_dir / "state")
  try:
    contents = serialization.msgpack_restore((step_dir / CHECKPOINT_FILE).read_bytes())
  except Exception as e:  # msgpack's errors (ExtraData, ...) name no file
    raise ValueError(f"{step_dir / CHECKPOINT_FILE} is not a readable T5X msgpack checkpoint "
                     f"({type(e).__name__}: {e}); it is damaged, or no T5X checkpoint: copy "
                     "it again from its source.") from None
  state = contents["optimizer"] if contents.get("version", 0) else contents  # 0: plain Flax
  if "target" not in state:
    raise ValueError(f"{step_dir / CHECKPOINT_FILE} holds no `target` (params): "
                     f"top-level keys {sorted(state)}.")
  return {name: _read_leaf(leaf, step_dir, name) for name, leaf in _leaves(state["target"])}


def _read_orbax_target(state_dir: pathlib.Path) -> Flat:
  target = _orbax_tree(state_dir)["target"]
  as_numpy = jax.tree_util.tree_map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), target)
  restored = ocp.Checkpointer(ocp.PyTreeCheckpointHandler()).restore(
      state_dir, args=ocp.args.PyTreeRestore(item={"target": target},
                                             restore_args={"target": as_numpy},
                                             partial_restore=True))
  return flax.traverse_util.flatten_dict(restored["target"], sep="/")


def _is_spec(leaf: Any) -> bool:
  return isinstance(leaf, dict) and "driver" in leaf and ("kvstore" in leaf or "path" in leaf)


def _leaves(tree: Dict[str, Any], prefix: str = "") -> Iterator[Tuple[str, Any]]:
  """('/'-joined name, array or TensorStore spec dict) of a msgpack state tree."""
  for key, value in tree.items():
    if isinstance(value, dict) and not _is_spec(value):
      yield from _leaves(value, f"{prefix}{key}/")
    else:
      yield f"{prefix}{key}", value


def _read_leaf(leaf: Any, step_dir: pathlib.Path, name: str) -> np.ndarray:
  """An inline array as it is; a TensorStore spec read from its zarr array in `step_dir`."""
  if not _is_spec(leaf):
    return np.asarray(leaf)
  spec = dict(leaf, metadata={k: v for k, v in leaf.get("metadata", {}).items()
                              if k not in ("chunks", "compressor")})
  relative = spec.pop("path", None) or spec["kvstore"]["path"]  # tensorstore < 0.1.14: top
  spec["kvstore"] = {"driver": "file", "path": str(step_dir / relative)}
  if spec.get("dtype") == "uint16" or spec["metadata"].get("dtype") == "<u2":
    raise ValueError(f"{name} in {step_dir} is stored as uint16 (T5X checkpoints before "
                     "version 3); T5X itself refuses it: re-save it with a current T5X.")
  return ts.open(spec, open=True, read=True).result().read().result()


# ------------------------------------------------------------------------------ names
def from_t5x_names(flat: Flat) -> Flat:
  """T5X network names and 2-D attention kernels -> the T5 network's (table above); names
  that are already ours (a T5X run of a decal_jax network) are kept."""
  heads = _heads(flat)
  out = {}
  for name, value in flat.items():
    match = _T5X_ATTENTION.fullmatch(name)
    if match is None or value.ndim != 2:  # ours: decoder `.../out/kernel` is 3-D
      out[name] = value
      continue
    stack, layer, attention, projection = match.group("stack", "layer", "attn", "proj")
    if attention == "attention":  # the encoder's self-attention
      ours = (f"{stack}/{layer}/attention_out/kernel" if projection == "out" else
              f"{stack}/{layer}/attention_qkv/{projection}/kernel")
    else:
      ours = f"{stack}/{layer}/{attention}/{'' if projection == 'out' else 'qkv/'}" \
             f"{projection}/kernel"
    rows, cols = value.shape
    out[ours] = (value.reshape(heads, rows // heads, cols) if projection == "out"  # [h, kv, e]
                 else value.reshape(rows, heads, cols // heads))  # [embed, heads, kv]
  return out


def _heads(flat: Flat) -> int:
  tables = [v for k, v in flat.items() if k.endswith("relpos_bias/rel_embedding")]
  if not tables and any(_T5X_ATTENTION.fullmatch(k) and v.ndim == 2 for k, v in flat.items()):
    raise ValueError("A T5X checkpoint with T5X network attention kernels but no "
                     "relpos_bias/rel_embedding table: its number of heads is unknown.")
  return tables[0].shape[0] if tables else 1  # rel_embedding [heads, buckets]


def t5_sizes(flat: Flat) -> Dict[str, int]:
  """The `t5.T5Config` sizes that T5 network params (our names, unrolled layers, e.g. as
  `from_t5x_names` gives them) show: vocab_size, emb_dim, num_heads, head_dim, mlp_dim,
  the layer counts and the relative-position buckets; those the names do not show are
  left out."""
  sizes = {}
  shapes = {k: tuple(np.shape(v)) for k, v in flat.items()}
  if len(shapes.get("token_embedder/embedding", ())) == 2:
    sizes["vocab_size"], sizes["emb_dim"] = shapes["token_embedder/embedding"]
  table = shapes.get("encoder/relpos_bias/rel_embedding", ())
  if len(table) == 2:
    sizes["num_heads"] = table[0]
  query = shapes.get("encoder/layers_0/attention_qkv/query/kernel", ())
  if len(query) == 3:
    sizes["head_dim"] = query[2]
  wo = shapes.get("encoder/layers_0/mlp/wo/kernel", ())
  if len(wo) == 2:
    sizes["mlp_dim"] = wo[0]
  for stack in ("encoder", "decoder"):
    layers = {name.split("/")[1] for name in shapes
              if re.match(rf"{stack}/layers_\d+/", name)}
    if layers:
      sizes[f"num_{stack}_layers"] = len(layers)
  if len(table) == 2:
    sizes["relative_attention_num_buckets"] = table[1]
  return sizes


def to_t5x_names(flat: Flat) -> Flat:
  """The T5 network's params (any layout) -> T5X network names and 2-D kernels. Refuses
  params T5X's network has not (a compressor's, separate latent params) and a relative-
  position table of other than T5X's 32 buckets."""
  layout = param_layout.layout_of(flat)
  if layout is None:
    raise ValueError("These params are not a T5 encoder-decoder's (no encoder/decoder "
                     "layers): only the T5 network has T5X names; export with decal_jax names.")
  tree = param_layout.convert_params(flax.traverse_util.unflatten_dict(flat, sep="/"),
                                     layout, param_layout.Layout(False, False))
  out = {}
  for name, value in flax.traverse_util.flatten_dict(tree, sep="/").items():
    out.update(_to_t5x(name, np.asarray(value)))
  extra = sorted(k for k in out if not (_T5X_ATTENTION.fullmatch(k) or _T5X_OTHER.fullmatch(k)))
  if extra:
    raise ValueError(f"T5X's T5 network has no parameter for {len(extra)} of these: "
                     f"{', '.join(extra[:6])}{' ...' if len(extra) > 6 else ''}. Export "
                     "with decal_jax names (the default) for a T5X run of the decal_jax "
                     "network (gin/t5x/).")
  buckets = {v.shape[1] for k, v in out.items() if k.endswith("relpos_bias/rel_embedding")}
  if buckets - {T5X_RELPOS_BUCKETS}:
    raise ValueError(f"The relative-position tables have {sorted(buckets)} buckets; T5X's "
                     f"network has {T5X_RELPOS_BUCKETS}. Export with decal_jax names.")
  return out


def _to_t5x(name: str, value: np.ndarray) -> Flat:
  match = _OURS_ATTENTION.fullmatch(name)
  if match is None:
    return {name: value}
  stack, layer = match.group("stack", "layer")
  if match.group("enc"):
    projection = match.group("eproj") or "out"
    t5x = f"{stack}/{layer}/attention/{projection}/kernel"
  else:
    projection = match.group("proj")
    t5x = f"{stack}/{layer}/{match.group('attn')}/{projection}/kernel"
  if projection == "out":  # [heads, kv, embed] -> [heads * kv, embed]
    return {t5x: value.reshape(-1, value.shape[-1])}
  return {t5x: value.reshape(value.shape[0], -1)}  # [embed, heads, kv] -> [embed, heads * kv]


# ------------------------------------------------------------------------------ writing
def write_t5x_checkpoint(flat: Flat, model_dir: str, step: int) -> pathlib.Path:
  """Writes `flat` params as T5X's `checkpoint_<step>` (msgpack + TensorStore, state
  `{'target': params, 'state': {'step': step}}`, as `t5x.eval` / `t5x.infer` save and
  restore it) in `model_dir`, into a temporary folder renamed when complete
  (`fileio.atomic_directory`, which also removes one an export killed outright left).
  Refuses an existing step folder."""
  final = fileio.resolved(model_dir) / f"checkpoint_{step}"  # a URL: built here, uploaded
  if final.exists():
    raise FileExistsError(f"{final} exists already; export to another folder or step.")
  with fileio.atomic_directory(final, replace=False) as tmp:
    target = {}
    for name, value in flat.items():
      target[name] = _write_zarr(np.asarray(value), tmp, f"target.{name.replace('/', '.')}")
    state = {"target": flax.traverse_util.unflatten_dict(target, sep="/"),
             "state": {"step": np.asarray(step, np.int32)}}
    # msgpack_serialize keeps the specs' lists (to_bytes would turn them into dicts).
    (tmp / CHECKPOINT_FILE).write_bytes(serialization.msgpack_serialize(
        {"version": VERSION, "optimizer": state}))
  return final


def _write_zarr(value: np.ndarray, step_dir: pathlib.Path, relative: str) -> Dict[str, Any]:
  """Writes `value` as a gzip zarr array `step_dir/relative`; returns its spec with the
  path relative to the step folder (T5X's checkpoints move without rewriting)."""
  spec = {"driver": "zarr", "dtype": value.dtype.name,
          "kvstore": {"driver": "file", "path": relative},
          "metadata": {"compressor": {"id": "gzip"}, "shape": list(value.shape),
                       "chunks": chunk_shape(value.shape, CHUNK_BYTES // value.itemsize)}}
  absolute = dict(spec, kvstore={"driver": "file", "path": str(step_dir / relative)})
  ts.open(absolute, create=True, open=True).result().write(value).result()
  return ts.Spec(spec).to_json()


def chunk_shape(shape: Tuple[int, ...], max_elements: int) -> list:
  """A chunk shape dividing `shape` with at most `max_elements` elements: the largest
  dimension is cut to its next smaller divisor until it fits."""
  chunk = list(shape)
  while int(np.prod(chunk)) > max(max_elements, 1):
    axis = int(np.argmax(chunk))
    chunk[axis] = max(d for d in range(1, chunk[axis]) if shape[axis] % d == 0)
  return chunk
