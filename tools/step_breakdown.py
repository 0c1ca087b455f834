"""The parts of a T5 (DeCAL) train step timed on their own, each compiled alone: an encoder
and a decoder attention layer, the MLP, the compressor's own parts (`Compressor.cost_parts`:
DeCAL's latents, AttnPool's layer, CCProxy's memory), the relative-position biases, the
embedding + logits + loss head, and the optimizer update; for

  python -m tools.bench_train --breakdown ...

(`setup` is bench_train's: model, optimizer, partitioner, batch size and lengths, label)."""
from typing import Any, Dict

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from decal_jax import losses
from decal_jax.runtime import optimizers, train_state
from tools.benchmarking import median_seconds, xla_cost
from decal_jax.data import batches
from decal_jax.layers import attention as attn
from decal_jax.layers.core import DenseGeneral, Embed, MlpBlock, RMSNorm
from decal_jax.networks.t5 import T5Config


# The parts of a T5 train step, each a small module run alone at the step's shapes.
class _AttentionPart(nn.Module):
  """Pre-norm attention sublayer with its residual (kv None: self-attention)."""
  cfg: T5Config

  @nn.compact
  def __call__(self, x, kv, bias, mask):
    cfg = self.cfg
    h = RMSNorm(dtype=cfg.dtype)(x)
    return x + attn.MultiHeadAttention(cfg.num_heads, cfg.head_dim, 0.0, cfg.dtype,
                                       cfg.attention_kernel, cfg.fused_qkv)(
                                           h, h if kv is None else kv, bias, mask=mask)


class _MlpPart(nn.Module):
  cfg: T5Config

  @nn.compact
  def __call__(self, x):
    cfg = self.cfg
    return x + MlpBlock(cfg.mlp_dim, cfg.mlp_activations, 0.0, cfg.dtype)(
        RMSNorm(dtype=cfg.dtype)(x))


class _RelposPart(nn.Module):
  """The encoder's and the decoder's relative position bias tables -> [b, h, q, k]."""
  cfg: T5Config

  @nn.compact
  def __call__(self, enc_positions, dec_positions):
    cfg = self.cfg
    make = lambda: attn.RelativePositionBiases(
        cfg.relative_attention_num_buckets, cfg.relative_attention_max_distance,
        cfg.num_heads, cfg.dtype)
    return (make()(enc_positions, enc_positions, bidirectional=True),
            make()(dec_positions, dec_positions, bidirectional=False))


class _HeadPart(nn.Module):
  """Token embeddings of both stacks, the logits and the loss."""
  cfg: T5Config

  @nn.compact
  def __call__(self, y, enc_tokens, targets):
    cfg = self.cfg
    embed = Embed(cfg.vocab_size, cfg.emb_dim, cfg.dtype)
    logits = DenseGeneral(cfg.vocab_size, kernel_axes=("embed", "vocab"),
                          dtype=jnp.float32)(y)  # [batch, t, vocab]
    loss, _, _ = losses.compute_weighted_cross_entropy(logits, targets, None, 0.0, 1e-4)
    return embed(enc_tokens), embed(targets), loss


def _part_specs(setup, rng: np.random.RandomState):
  """(name, calls per step, module, inputs) of every part of this T5 step."""
  cfg = setup.model.module.config
  b, n, t = setup.batch_size, setup.lengths["inputs"], setup.lengths["targets"]
  m, length = cfg.compression.output_length(n), cfg.compression.encoder_length(n)
  floats = lambda *shape: jnp.asarray(rng.randn(*shape), cfg.dtype)
  tokens = lambda k: jnp.asarray(rng.randint(2, cfg.vocab_size, (b, k)), jnp.int32)
  ones = lambda q, k: jnp.ones((b, 1, q, k), jnp.float32)
  causal = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), jnp.float32)), (b, 1, t, t))
  enc_bias, enc_mask = attn.split_bias_and_mask(floats(b, cfg.num_heads, length, length),
                                                ones(length, length), cfg.attention_kernel,
                                                cfg.dtype)
  dec_bias, dec_mask = attn.split_bias_and_mask(floats(b, cfg.num_heads, t, t), causal,
                                                cfg.attention_kernel, cfg.dtype)
  cross_bias, cross_mask = attn.split_bias_and_mask(None, ones(t, m), cfg.attention_kernel,
                                                    cfg.dtype)
  positions = lambda k: jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, k))
  specs = [
      ("encoder self-attention", cfg.num_encoder_layers, _AttentionPart(cfg),
       (floats(b, length, cfg.emb_dim), None, enc_bias, enc_mask)),
      ("encoder MLP", cfg.num_encoder_layers, _MlpPart(cfg), (floats(b, length, cfg.emb_dim),)),
      ("decoder self-attention", cfg.num_decoder_layers, _AttentionPart(cfg),
       (floats(b, t, cfg.emb_dim), None, dec_bias, dec_mask)),
      ("cross-attention", cfg.num_decoder_layers, _AttentionPart(cfg),
       (floats(b, t, cfg.emb_dim), floats(b, m, cfg.emb_dim), cross_bias, cross_mask)),
      ("decoder MLP", cfg.num_decoder_layers, _MlpPart(cfg), (floats(b, t, cfg.emb_dim),)),
      ("relative position biases", 1, _RelposPart(cfg), (positions(length), positions(t))),
      ("embeddings, logits, loss", 1, _HeadPart(cfg),
       (floats(b, t, cfg.emb_dim), tokens(n), tokens(t)))]
  specs[2:2] = [tuple(part) for part in cfg.compression.cost_parts(
      cfg, floats(b, n, cfg.emb_dim), tokens(n), positions(n))]
  return specs


def _time_part(module, inputs, seed: int, repeats: int):
  """(seconds, XLA FLOPs) of one forward + backward of `module` (gradients with respect to
  its params and its float inputs) against a fixed random cotangent."""
  params = jax.jit(module.init)(jax.random.PRNGKey(seed), *inputs)
  diff = [i for i, x in enumerate(inputs) if x is not None and
          jnp.issubdtype(x.dtype, jnp.floating)]
  outputs = jax.eval_shape(module.apply, params, *inputs)
  keys = jax.random.split(jax.random.PRNGKey(seed + 1), len(jax.tree_util.tree_leaves(outputs)))
  cotangents = jax.tree_util.tree_unflatten(
      jax.tree_util.tree_structure(outputs),
      [jax.random.normal(k, o.shape, jnp.float32) for k, o in
       zip(keys, jax.tree_util.tree_leaves(outputs))])

  fixed = [i for i, x in enumerate(inputs) if x is not None and i not in diff]

  def objective(params, floats, others, cotangents):  # arrays are arguments: nothing to fold
    args = list(inputs)
    for i, x in list(zip(diff, floats)) + list(zip(fixed, others)):
      args[i] = x
    out = module.apply(params, *args)
    return sum(jnp.sum(o.astype(jnp.float32) * c) for o, c in
               zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(cotangents)))

  grad = jax.jit(jax.grad(objective, argnums=(0, 1)))
  args = (params, [inputs[i] for i in diff], [inputs[i] for i in fixed], cotangents)
  compiled = grad.lower(*args).compile()
  return median_seconds(compiled, args, repeats), xla_cost(compiled)


def _time_optimizer(setup, seed: int, repeats: int):
  """(seconds, XLA FLOPs) of the optimizer update + apply on the model's parameters."""
  cfg = batches.DatasetConfig("synthetic", setup.lengths, batch_size=1)
  abstract, _ = train_state.abstract_params(setup.model, cfg, setup.partitioner)
  optimizers.set_param_axes(setup.optimizer,  # the run's factoring, as init_state gives it
                            train_state.abstract_variables(setup.model, cfg)["params_axes"])
  keys = iter(jax.random.split(jax.random.PRNGKey(seed), len(jax.tree_util.tree_leaves(abstract))))
  params = jax.tree_util.tree_map(
      lambda a: 0.05 * jax.random.normal(next(keys), a.shape, a.dtype), abstract)
  grads = jax.tree_util.tree_map(lambda p: 1e-3 * p, params)
  state = setup.optimizer.init(params)

  def update(params, state, grads):
    updates, state = setup.optimizer.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  compiled = jax.jit(update).lower(params, state, grads).compile()
  return (median_seconds(compiled, (params, state, grads), repeats),
          xla_cost(compiled))


def breakdown(setup, step_s: float, seed: int, repeats: int = 5) -> Dict[str, Any]:
  """Each part of the step timed alone (forward + backward), times its calls per step;
  what the parts do not add up to is fusion and scheduling across part boundaries."""
  cfg = getattr(setup.model.module, "config", None)
  if not isinstance(cfg, T5Config) or "inputs" not in setup.lengths:
    print("note: --breakdown knows the T5 encoder-decoder only; skipped.")
    return {}
  rows = {}
  for name, calls, module, inputs in _part_specs(setup, np.random.RandomState(seed)):
    seconds, part_flops = _time_part(module, inputs, seed, repeats)
    rows[name] = {"calls": calls, "ms_each": 1e3 * seconds, "ms": 1e3 * seconds * calls,
                  "xla_gflops": part_flops * calls / 1e9 if part_flops else None}
  seconds, opt_flops = _time_optimizer(setup, seed, repeats)
  rows["optimizer update"] = {"calls": 1, "ms_each": 1e3 * seconds, "ms": 1e3 * seconds,
                              "xla_gflops": opt_flops / 1e9 if opt_flops else None}
  total = sum(r["ms"] for r in rows.values())
  for r in rows.values():
    r["share_of_step"] = r["ms"] / (1e3 * step_s)
  rows["sum of parts"] = {"ms": total, "share_of_step": total / (1e3 * step_s)}
  _print_breakdown(setup.label, rows, step_s)
  return rows


def _print_breakdown(label: str, rows: Dict[str, Any], step_s: float) -> None:
  print(f"\nwhere the step goes ({label}; step {1e3 * step_s:.1f} ms; each part timed alone, "
        "forward + backward):")
  print(f"  {'part':<28}{'calls':>6}{'ms each':>10}{'ms':>10}{'of step':>9}{'XLA GF':>9}")
  for name, r in rows.items():
    gflops = f"{r['xla_gflops']:.2f}" if r.get("xla_gflops") is not None else ""
    calls = r.get("calls", "")
    each = f"{r['ms_each']:.2f}" if "ms_each" in r else ""
    print(f"  {name:<28}{calls:>6}{each:>10}{r['ms']:>10.1f}{100 * r['share_of_step']:>8.1f}%"
          f"{gflops:>9}")


# ----------------------------------------------------------------------------- main
