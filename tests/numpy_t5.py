"""A plain-numpy re-derivation of T5.1.1 and DeCAL, written from the definitions.

It shares no code with decal_jax: tests feed it the parameters of a decal_jax model and
compare outputs. Loops are per example and per token window where that is clearer.
"""
import math

import numpy as np

NEG = -1e10


def bucket(rel: int, bidirectional: bool, num_buckets: int, max_distance: int) -> int:
  """T5 relative-position bucket of one scalar `key_pos - query_pos`."""
  offset = 0
  n = -rel
  if bidirectional:
    num_buckets //= 2
    if n < 0:
      offset = num_buckets
    n = abs(n)
  else:
    n = max(n, 0)
  exact = num_buckets // 2
  if n < exact:
    return offset + n
  large = exact + int(math.log(n / exact) / math.log(max_distance / exact) * (num_buckets - exact))
  return offset + min(large, num_buckets - 1)


def relpos_bias(table, q_pos, k_pos, bidirectional, max_distance):
  """table [heads, buckets]; q_pos [q], k_pos [k] -> [heads, q, k]."""
  heads, num_buckets = table.shape
  out = np.zeros((heads, len(q_pos), len(k_pos)), np.float64)
  for i, qp in enumerate(q_pos):
    for j, kp in enumerate(k_pos):
      out[:, i, j] = table[:, bucket(int(kp) - int(qp), bidirectional, num_buckets, max_distance)]
  return out


def rms_norm(x, scale, eps=1e-6):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def gelu_tanh(x):
  return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def softmax(x):
  x = x - x.max(-1, keepdims=True)
  e = np.exp(x)
  return e / e.sum(-1, keepdims=True)


def attention(xq, xkv, p, bias):
  """One example: xq [q, e], xkv [k, e], p = {query,key,value: [e,h,d], out: [h,d,e]}."""
  q = np.einsum("qe,ehd->hqd", xq, p["query"]["kernel"])
  k = np.einsum("ke,ehd->hkd", xkv, p["key"]["kernel"])
  v = np.einsum("ke,ehd->hkd", xkv, p["value"]["kernel"])
  w = softmax(np.einsum("hqd,hkd->hqk", q, k) + bias)
  o = np.einsum("hqk,hkd->qhd", w, v)
  return np.einsum("qhd,hde->qe", o, p["out"]["kernel"])


def mlp(x, p):
  h = gelu_tanh(x @ p["wi_0"]["kernel"]) * (x @ p["wi_1"]["kernel"])
  return h @ p["wo"]["kernel"]


def decal_latents(emb, valid, positions, v, norm_scale, ratio, use_pooling=True):
  """One example: emb [n, e] -> latents [m, e], latent valid [m], latent positions [m]."""
  n = emb.shape[0]
  m = -(-n // ratio)
  lat, lat_valid, lat_pos = [], [], []
  for j in range(m):
    idx = [i for i in range(j * ratio, min((j + 1) * ratio, n)) if valid[i]]
    pooled = emb[idx].mean(0) if idx else np.zeros(emb.shape[1])
    seed = v + pooled if use_pooling else v.copy()
    lat.append(rms_norm(seed, norm_scale))
    lat_valid.append(bool(idx))
    lat_pos.append(sum(int(positions[i]) for i in idx) // len(idx) if idx else 0)
  return np.stack(lat), np.array(lat_valid), np.array(lat_pos)


def encoder(params, tokens, cfg):
  """One example `tokens [n]` -> (encoded [m, e], valid [m]) for a decal_jax T5Config."""
  p = params["encoder"]
  emb = params["token_embedder"]["embedding"][tokens].astype(np.float64)
  valid = tokens > 0
  pos = np.arange(len(tokens))
  x, x_valid, x_pos = emb, valid, pos
  m = 0
  compressor = getattr(cfg, "compressor", "latents")
  causal = False
  if cfg.compression_ratio > 1 and compressor == "latents":
    lat, lat_valid, lat_pos = decal_latents(emb, valid, pos, p["latents"]["latent_vector"],
                                            p["latents"]["latent_norm"]["scale"],
                                            cfg.compression_ratio, cfg.use_pooling)
    m = len(lat)
    x = np.concatenate([lat, emb])
    x_valid = np.concatenate([lat_valid, valid])
    x_pos = np.concatenate([lat_pos, pos])
  elif cfg.compression_ratio > 1 and compressor == "memory_tokens":
    n, length = len(tokens), int(valid.sum())
    num_memory = -(-n // cfg.compression_ratio)
    x = np.concatenate([emb, p["memory"]["memory_embeddings"][:num_memory]])
    x_valid = np.concatenate([valid, np.arange(num_memory) < -(-length // cfg.compression_ratio)])
    x_pos = np.concatenate([pos, length + np.arange(num_memory)])
    causal = True
  bias = relpos_bias(p["relpos_bias"]["rel_embedding"], x_pos, x_pos, True,
                     cfg.relative_attention_max_distance)
  allowed = x_valid[:, None] & x_valid[None, :]
  if causal:
    allowed = allowed & (x_pos[None, :] <= x_pos[:, None])
  bias = bias + np.where(allowed, 0.0, NEG)[None]
  for i in range(cfg.num_encoder_layers):
    lp = p[f"layers_{i}"]
    h = rms_norm(x, lp["pre_attention_layer_norm"]["scale"])
    x = x + attention(h, h, {"query": lp["attention_qkv"]["query"],
                             "key": lp["attention_qkv"]["key"],
                             "value": lp["attention_qkv"]["value"],
                             "out": lp["attention_out"]}, bias)
    x = x + mlp(rms_norm(x, lp["pre_mlp_layer_norm"]["scale"]), lp["mlp"])
  x = rms_norm(x, p["encoder_norm"]["scale"])
  if m:
    return x[:m], x_valid[:m]
  if causal:
    return x[len(tokens):], x_valid[len(tokens):]
  if cfg.compression_ratio > 1 and compressor == "attn_pool":
    return attention_pool(x, valid, p["attn_pool"], cfg.compression_ratio)
  return x, x_valid


def attention_pool(h, valid, p, ratio):
  """One example: final states h [n, e] -> (pooled [m, e], valid [m]), AttnPool."""
  n = h.shape[0]
  windows = [[i for i in range(j * ratio, min((j + 1) * ratio, n)) if valid[i]]
             for j in range(-(-n // ratio))]
  q = np.stack([h[idx].mean(0) if idx else np.zeros(h.shape[1]) for idx in windows])
  q_valid = np.array([bool(idx) for idx in windows])
  bias = np.where(q_valid[:, None] & valid[None, :], 0.0, NEG)[None]
  a = p["pool_attention"]
  out = q + attention(rms_norm(q, p["pre_pool_norm"]["scale"]), h,
                      {**a["qkv"], "out": a["out"]}, bias)
  return rms_norm(out, p["pool_norm"]["scale"]), q_valid


def decoder_logits(params, encoded, encoded_valid, decoder_input_tokens, cfg):
  """One example: teacher-forced logits [t, vocab]."""
  p = params["decoder"]
  y = params["token_embedder"]["embedding"][decoder_input_tokens].astype(np.float64)
  t = len(decoder_input_tokens)
  pos = np.arange(t)
  self_bias = relpos_bias(p["relpos_bias"]["rel_embedding"], pos, pos, False,
                          cfg.relative_attention_max_distance)
  self_bias = self_bias + np.where(pos[None, :] <= pos[:, None], 0.0, NEG)[None]
  cross_bias = np.where(encoded_valid, 0.0, NEG)[None, None, :]
  for i in range(cfg.num_decoder_layers):
    lp = p[f"layers_{i}"]
    h = rms_norm(y, lp["pre_self_attention_layer_norm"]["scale"])
    sa = lp["self_attention"]
    y = y + attention(h, h, {**sa["qkv"], "out": sa["out"]}, self_bias)
    h = rms_norm(y, lp["pre_cross_attention_layer_norm"]["scale"])
    ca = lp["encoder_decoder_attention"]
    y = y + attention(h, encoded, {**ca["qkv"], "out": ca["out"]}, cross_bias)
    y = y + mlp(rms_norm(y, lp["pre_mlp_layer_norm"]["scale"]), lp["mlp"])
  y = rms_norm(y, p["decoder_norm"]["scale"])
  return y @ p["logits_dense"]["kernel"]


def to_numpy(tree):
  """Nested dict of jax arrays -> nested dict of float64 numpy arrays."""
  if isinstance(tree, dict) or hasattr(tree, "items"):
    return {k: to_numpy(v) for k, v in tree.items()}
  return np.asarray(tree, np.float64)
