"""A plain-numpy re-derivation of a LLaMA-style decoder and of Dodo, from the definitions.

It shares no code with decal_jax: tests feed it a decal_jax model's parameters and compare
outputs. Everything is per example, in float64, with explicit loops where that is clearer.
"""
import math

import numpy as np


def rms_norm(x, scale, eps):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def softmax(x):
  x = x - x.max(-1, keepdims=True)
  e = np.exp(x)
  return e / e.sum(-1, keepdims=True)


def rope(x, positions, theta):
  """x [t, h, d] rotated by position: channel i pairs with i + d/2 (rotate-half layout)."""
  d = x.shape[-1]
  out = np.empty_like(x)
  for t, pos in enumerate(positions):
    for i in range(d // 2):
      angle = pos / theta ** (2 * i / d)
      c, s = math.cos(angle), math.sin(angle)
      a, b = x[t, :, i], x[t, :, i + d // 2]
      out[t, :, i] = a * c - b * s
      out[t, :, i + d // 2] = b * c + a * s
  return out


def linear(x, p, adapter, alpha, contract=1):
  """x [t, *in] through kernel [*in, *out] (+ bias) (+ (alpha / rank) x A B of `adapter`)."""
  kernel = np.asarray(p["kernel"], np.float64)
  in_shape, out_shape = kernel.shape[:contract], kernel.shape[contract:]
  flat = x.reshape(x.shape[0], -1)
  y = flat @ kernel.reshape(int(np.prod(in_shape)), -1)
  if "bias" in p:
    y = y + np.asarray(p["bias"], np.float64).reshape(-1)
  if adapter is not None:
    a = np.asarray(p[f"lora_{adapter}_a"], np.float64)
    b = np.asarray(p[f"lora_{adapter}_b"], np.float64)
    y = y + alpha / a.shape[1] * (flat @ a @ b)
  return y.reshape((x.shape[0],) + out_shape)


class Llama:
  """cfg: the DecoderConfig; stack: params['stack'] of a decal_jax Decoder / Dodo."""

  def __init__(self, cfg, stack):
    self.cfg, self.p = cfg, stack

  def kv(self, layer, states, positions, adapter):
    """One layer's keys/values `[k, kv_heads, d]` of its input states `[k, e]`."""
    p = self.p[f"layers_{layer}"]
    h = rms_norm(states, p["attention_norm"]["scale"], self.cfg.norm_epsilon)
    a = p["attention"]
    keys = rope(linear(h, a["key"], adapter, self.cfg.lora_alpha), positions,
                self.cfg.rope_theta)
    return keys, linear(h, a["value"], adapter, self.cfg.lora_alpha)

  def block(self, layer, x, positions, allowed, adapter, memory=None):
    """x [t, e]; allowed [t, t] bool; memory = (keys, values, valid [k]) or None."""
    cfg, p = self.cfg, self.p[f"layers_{layer}"]
    h = rms_norm(x, p["attention_norm"]["scale"], cfg.norm_epsilon)
    q = rope(linear(h, p["attention"]["query"], adapter, cfg.lora_alpha), positions,
             cfg.rope_theta)
    keys, values = self.kv(layer, x, positions, adapter)
    mask = allowed
    if memory is not None:
      keys = np.concatenate([memory[0], keys])
      values = np.concatenate([memory[1], values])
      mask = np.concatenate([np.broadcast_to(memory[2], (len(x), len(memory[2]))), allowed], 1)
    groups = cfg.num_heads // (cfg.num_kv_heads or cfg.num_heads)
    out = np.zeros((len(x), cfg.num_heads, cfg.head_dim))
    for head in range(cfg.num_heads):
      kv_head = head // groups
      logits = q[:, head] @ keys[:, kv_head].T / math.sqrt(cfg.head_dim)
      logits = np.where(mask, logits, -1e30)
      out[:, head] = softmax(logits) @ values[:, kv_head]
    x = x + linear(out, p["attention"]["out"], adapter, cfg.lora_alpha, contract=2)
    h = rms_norm(x, p["mlp_norm"]["scale"], cfg.norm_epsilon)
    gate = h @ p["mlp"]["wi_0"]["kernel"]
    mlp = (gate / (1 + np.exp(-gate))) * (h @ p["mlp"]["wi_1"]["kernel"])
    return x + mlp @ p["mlp"]["wo"]["kernel"]

  def run(self, x, positions, adapter=None, upto=None, memories=None):
    """Causal pass; -> (output, [input of every layer run])."""
    allowed = np.tril(np.ones((len(x), len(x)), bool))
    inputs = []
    for layer in range(upto if upto is not None else self.cfg.num_layers):
      inputs.append(x)
      x = self.block(layer, x, positions, allowed, adapter,
                     None if memories is None else memories[layer])
    return x, inputs

  def logits(self, x):
    x = rms_norm(x, self.p["decoder_norm"]["scale"], self.cfg.norm_epsilon)
    if "logits_dense" in self.p:
      return x @ self.p["logits_dense"]["kernel"]
    return x @ self.p["token_embedder"]["embedding"].T

  def lm_logits(self, tokens):
    x = np.asarray(self.p["token_embedder"]["embedding"], np.float64)[tokens]
    return self.logits(self.run(x, np.arange(len(tokens)))[0])


def topk_nuggets(scores, ratio):
  """Indices (ascending) of the k = ceil(n / r) highest scores of one example's n real
  tokens, the last token always kept, ties to the earlier token."""
  n = len(scores)
  k = math.ceil(n / ratio)
  ranked = sorted(range(n), key=lambda i: (0 if i == n - 1 else 1, -scores[i], i))
  return sorted(ranked[:k])


def scorer(p, x):
  h = np.maximum(x @ p["hidden"]["kernel"], 0)
  return (h @ p["score"]["kernel"])[:, 0]


def dodo_logits(dodo_cfg, params, context, targets):
  """One example: real context tokens [n_b] and decoder input tokens [t] -> logits [t, V]."""
  cfg = dodo_cfg.decoder
  lora = cfg.lora_rank > 0
  model = Llama(cfg, params["stack"])
  emb = np.asarray(params["stack"]["token_embedder"]["embedding"], np.float64)
  n, r = len(context), dodo_cfg.compression_ratio
  layers = cfg.num_layers
  memories = None
  if n:
    out, states = model.run(emb[context], np.arange(n), "compress" if lora else None)
    if dodo_cfg.selection == "compressive":
      k = math.ceil(n / r)
      segments = [list(range(j * r, min(n, (j + 1) * r))) for j in range(k)]
      kept = [[states[l][seg].mean(0) for seg in segments] for l in range(layers)]
      positions = [seg[-1] for seg in segments]
    else:
      if lora:
        feats = model.run(emb[context], np.arange(n), None, upto=dodo_cfg.scorer_layer)[0]
      else:
        feats = states[dodo_cfg.scorer_layer] if dodo_cfg.scorer_layer < layers else out
      positions = topk_nuggets(scorer(params["scorer"], feats), r)
      kept = [[states[l][i] for i in positions] for l in range(layers)]
    memories = []
    for l in range(layers):
      keys, values = model.kv(l, np.stack(kept[l]), np.array(positions),
                              "decode" if lora else None)
      memories.append((keys, values, np.ones(len(positions), bool)))
  y = emb[targets]
  if dodo_cfg.soft_prompt:
    y[0] = params["soft_prompt"]
  out, _ = model.run(y, n + np.arange(len(targets)), "decode" if lora else None,
                     memories=memories)
  return model.logits(out)
