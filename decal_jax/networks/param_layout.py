"""Conversions between the parameter layouts of the T5 network's performance options.

Two `T5Config` options change the checkpoint layout (the function stays the same):

- `scan_layers`: `encoder/layers_0 .. layers_{L-1}` (unrolled) <-> `encoder/layers` with
  every leaf stacked on a new leading axis of size L (`nn.scan`, logical axis 'layers');
  the same for `decoder`.
- `fused_qkv`: self-attention `{query, key, value}/kernel` `[embed, heads, kv]` <->
  `qkv_fused/kernel` `[embed, 3, heads, kv]`; cross-attention `{key, value}` <->
  `kv_fused/kernel` `[embed, 2, heads, kv]` (the query kernel stays).

`convert_params(params, src, dst)` maps a params tree (or anything shaped like it: a
gradient, an Adam moment) from the layout of config `src` to that of config `dst`, e.g. to
start a scanned run from an unrolled checkpoint. Works on numpy and jax arrays alike.
`layout_of` reads a layout from parameter names and `to_layout_of` converts flat
('/'-joined) params to another tree's layout: `checkpoints` uses them so that
INITIAL_CHECKPOINT_PATH and eval / infer load a checkpoint written in either layout.
"""
import re
from typing import Any, Dict, Iterable, NamedTuple, Optional, Union

import flax
import jax.numpy as jnp

from decal_jax.networks.t5 import T5Config

Tree = Dict[str, Any]
_UNROLLED = re.compile(r"layers_(\d+)$")
# q/k/v projections of self-attention (encoder layers, DeCAL's separate latent params,
# decoder self-attention) and of cross-attention, by their module names.
_SELF_QKV = ("attention_qkv", "latent_attention_qkv", "self_attention")
_CROSS_QKV = ("encoder_decoder_attention",)


class Layout(NamedTuple):
  """The layout options of a `T5Config`, alone (what `convert_params` reads)."""
  scan_layers: bool
  fused_qkv: bool


def convert_params(params: Tree, src: Union[T5Config, Layout],
                   dst: Union[T5Config, Layout]) -> Tree:
  """`params` in the layout of `src` -> the same values in the layout of `dst`."""
  tree = dict(params)
  if src.scan_layers:
    tree = _map_stacks(tree, unstack_layers)
  if src.fused_qkv:
    tree = _map_qkv(tree, unfuse_qkv)
  if dst.fused_qkv:
    tree = _map_qkv(tree, fuse_qkv)
  if dst.scan_layers:
    tree = _map_stacks(tree, stack_layers)
  return tree


# ----------------------------------------------------------------------------- detection
def layout_of(names: Iterable[str]) -> Optional[Layout]:
  """The `Layout` of a T5 network's params from their '/'-joined names: `encoder/layers/..`
  (scanned) or `encoder/layers_0/..`, `../qkv_fused/kernel` or `../query/kernel`. None
  when the names are not those of one T5 network's layers (no encoder and decoder stacks,
  or both stack layouts at once)."""
  paths = [name.split("/") for name in names]
  stacks = [p for p in paths if len(p) > 2 and p[0] in ("encoder", "decoder")]
  scanned = {p[0] for p in stacks if p[1] == "layers"}
  unrolled = {p[0] for p in stacks if _UNROLLED.match(p[1])}
  if scanned | unrolled != {"encoder", "decoder"} or (scanned and unrolled):
    return None
  fused = any("qkv_fused" in p or "kv_fused" in p for p in stacks)
  return Layout(scan_layers=bool(scanned), fused_qkv=fused)


def layout_change(names: Iterable[str], like: Iterable[str]) -> str:
  """'scan_layers: False -> True, fused_qkv: False -> True' (the options that differ) when
  `names` and `like` are both T5 params in different layouts; '' otherwise."""
  src, dst = layout_of(names), layout_of(like)
  if src is None or dst is None or src == dst:
    return ""
  return ", ".join(f"{field}: {a} -> {b}" for field, a, b in zip(Layout._fields, src, dst)
                   if a != b)


def to_layout_of(flat: Dict[str, Any], like: Iterable[str]) -> Dict[str, Any]:
  """Flat params ('/'-joined name -> array) converted to the layout of the names `like`
  (unchanged unless `layout_change(flat, like)`)."""
  if not layout_change(flat, like):
    return dict(flat)
  tree = convert_params(flax.traverse_util.unflatten_dict(flat, sep="/"), layout_of(flat),
                        layout_of(like))
  return flax.traverse_util.flatten_dict(tree, sep="/")


# ----------------------------------------------------------------------------- scan
def stack_layers(stack: Tree) -> Tree:
  """`{layers_0: t0, .., layers_{L-1}: t, other: o}` -> `{layers: stacked, other: o}`."""
  indices = sorted(int(_UNROLLED.match(k).group(1)) for k in stack if _UNROLLED.match(k))
  if indices != list(range(len(indices))) or not indices:
    raise ValueError(f"Expected unrolled layers layers_0 .. layers_N, got {sorted(stack)}.")
  layers = [stack[f"layers_{i}"] for i in indices]
  out = {k: v for k, v in stack.items() if not _UNROLLED.match(k)}
  out["layers"] = _tree_stack(layers)
  return out


def unstack_layers(stack: Tree) -> Tree:
  """`{layers: stacked, other: o}` -> `{layers_0: t0, .., other: o}` (inverse of
  `stack_layers`)."""
  if "layers" not in stack:
    raise ValueError(f"Expected a scanned 'layers' entry, got {sorted(stack)}.")
  out = {k: v for k, v in stack.items() if k != "layers"}
  count = _leading_size(stack["layers"])
  for i in range(count):
    out[f"layers_{i}"] = _tree_index(stack["layers"], i)
  return out


def _map_stacks(tree: Tree, fn) -> Tree:
  return {k: fn(dict(v)) if k in ("encoder", "decoder") else v for k, v in tree.items()}


def _tree_stack(trees):
  if isinstance(trees[0], dict):
    return {k: _tree_stack([t[k] for t in trees]) for k in trees[0]}
  return jnp.stack([jnp.asarray(t) for t in trees])  # [layers, ...]


def _tree_index(tree, i: int):
  if isinstance(tree, dict):
    return {k: _tree_index(v, i) for k, v in tree.items()}
  return tree[i]


def _leading_size(tree) -> int:
  while isinstance(tree, dict):
    tree = next(iter(tree.values()))
  return tree.shape[0]


# ----------------------------------------------------------------------------- fused q/k/v
def fuse_qkv(qkv: Tree, cross: bool) -> Tree:
  """One attention's `{query, key, value}` kernels -> `{qkv_fused}` (self-attention) or
  `{query, kv_fused}` (cross-attention); kernels `[embed, heads, kv]` stack on axis 1."""
  kernel = lambda name: jnp.asarray(qkv[name]["kernel"])
  if cross:
    return {"query": qkv["query"],
            "kv_fused": {"kernel": jnp.stack([kernel("key"), kernel("value")], axis=1)}}
  return {"qkv_fused": {"kernel": jnp.stack([kernel(n) for n in ("query", "key", "value")],
                                            axis=1)}}  # [embed, 3, heads, kv]


def unfuse_qkv(qkv: Tree, cross: bool) -> Tree:
  """Inverse of `fuse_qkv`."""
  if cross:
    kv = jnp.asarray(qkv["kv_fused"]["kernel"])  # [embed, 2, heads, kv]
    return {"query": qkv["query"], "key": {"kernel": kv[:, 0]}, "value": {"kernel": kv[:, 1]}}
  fused = jnp.asarray(qkv["qkv_fused"]["kernel"])  # [embed, 3, heads, kv]
  return {name: {"kernel": fused[:, i]} for i, name in enumerate(("query", "key", "value"))}


def _map_qkv(tree: Tree, fn) -> Tree:
  """Applies `fn(qkv, cross)` to every q/k/v projection of the unrolled T5 tree."""
  out = {}
  for name, value in tree.items():
    if not isinstance(value, dict):
      out[name] = value
    elif name in _SELF_QKV[:2]:  # the encoder layer's projection itself
      out[name] = fn(value, cross=False)
    elif name in _SELF_QKV[2:] + _CROSS_QKV:  # a MultiHeadAttention: its 'qkv' child
      out[name] = dict(value, qkv=fn(value["qkv"], cross=name in _CROSS_QKV))
    else:
      out[name] = _map_qkv(value, fn)
  return out
